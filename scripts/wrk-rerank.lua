-- wrk -c 64 -d 20s -s scripts/wrk-rerank.lua http://127.0.0.1:8080
-- POST /rerank: one query and DOCS (default 8) corpus documents per request,
-- i.e. DOCS query/document pairs. DOCS comes from the environment.
local dir = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"
local docs = tonumber(os.getenv("DOCS") or "8")
dofile(dir .. "wrk-common.lua").install("/rerank", function(next_text)
  local texts = {}
  for i = 1, docs do
    texts[i] = '"' .. next_text() .. '"'
  end
  return '{"query": "' .. next_text() .. '", "texts": [' .. table.concat(texts, ", ") .. ']}'
end)
