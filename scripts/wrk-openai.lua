-- wrk -c 64 -d 20s -s scripts/wrk-openai.lua http://127.0.0.1:8080
-- POST /v1/embeddings (OpenAI shape) with one text per request from a fixed corpus.
local dir = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"
dofile(dir .. "wrk-common.lua").install("/v1/embeddings", function(next_text)
  return '{"model": "all-MiniLM-L6-v2", "input": "' .. next_text() .. '"}'
end)
