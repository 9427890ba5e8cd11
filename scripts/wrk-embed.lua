-- wrk -c 64 -d 20s -s scripts/wrk-embed.lua http://127.0.0.1:8080
-- POST /api/v1/embed with two texts per request, drawn from a fixed corpus.
local dir = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"
local common = dofile(dir .. "wrk-common.lua")

setup = common.setup
init = common.init
response = common.response
done = common.done

wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"

function request()
  local body = '{"texts": ["' .. common.next_text() .. '", "' .. common.next_text() .. '"]}'
  return wrk.format(nil, "/api/v1/embed", nil, body)
end
