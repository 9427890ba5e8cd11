-- wrk -c 64 -d 20s -s scripts/wrk-openai.lua http://127.0.0.1:8080
-- POST /v1/embeddings (OpenAI shape) with one text per request from a fixed corpus.
local dir = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"
local common = dofile(dir .. "wrk-common.lua")

setup = common.setup
init = common.init
response = common.response
done = common.done

wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"

function request()
  local body = '{"model": "all-MiniLM-L6-v2", "input": "' .. common.next_text() .. '"}'
  return wrk.format(nil, "/v1/embeddings", nil, body)
end
