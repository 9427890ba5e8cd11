-- wrk -c 64 -d 20s -s scripts/wrk-embed.lua http://127.0.0.1:8080
-- POST /api/v1/embed with two texts per request, drawn from a fixed corpus.
local dir = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"
dofile(dir .. "wrk-common.lua").install("/api/v1/embed", function(next_text)
  return '{"texts": ["' .. next_text() .. '", "' .. next_text() .. '"]}'
end)
