-- Shared by wrk-embed.lua and wrk-openai.lua: a fixed corpus so requests differ,
-- and a done() summary that counts non-2xx responses across all threads.
local common = {}

local subjects = {
  "the quarterly revenue report", "a graph database of customer orders", "the new vector index",
  "photosynthesis in desert plants", "the history of the printing press", "a Rust async runtime",
  "ocean currents near Antarctica", "the committee's budget decision", "a recipe for sourdough bread",
  "the election results in the northern districts", "a knowledge graph of drug interactions",
  "the migration of arctic terns", "an outage in the payment service", "the tennis final last night",
}
local verbs = {
  "summarises", "questions", "explains", "criticises", "describes", "compares", "celebrates", "documents",
}
local tails = {
  ".", " in detail.", " for new readers.", " with many examples and long digressions about related topics.",
  " and what it means for the team.", " over three short paragraphs written for an executive audience.",
}

-- 14 x 8 x 6 = 672 distinct sentences of mixed length.
common.corpus = {}
for i, s in ipairs(subjects) do
  for j, v in ipairs(verbs) do
    for k, t in ipairs(tails) do
      common.corpus[#common.corpus + 1] = "Document " .. i .. "-" .. j .. "-" .. k .. " " .. v .. " " .. s .. t
    end
  end
end

local threads = {}
local thread_count = 0

function common.setup(thread)
  thread_count = thread_count + 1
  thread:set("thread_id", thread_count)
  threads[#threads + 1] = thread
end

function common.init()
  responses, non2xx = 0, 0
  -- Threads start at different places so concurrent requests carry different texts.
  cursor = ((thread_id or 1) * 97) % #common.corpus
end

function common.next_text()
  cursor = cursor % #common.corpus + 1
  return common.corpus[cursor]
end

function common.response(status)
  responses = responses + 1
  if status < 200 or status > 299 then non2xx = non2xx + 1 end
end

function common.done(summary, latency, requests)
  local total, bad = 0, 0
  for _, t in ipairs(threads) do
    total = total + (t:get("responses") or 0)
    bad = bad + (t:get("non2xx") or 0)
  end
  io.write(string.format("responses: %d\nnon_2xx: %d\n", total, bad))
  io.write(string.format("socket_errors: %d\n", summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.timeout))
  for _, p in ipairs({ 50, 95, 99 }) do
    io.write(string.format("p%d_ms: %.3f\n", p, latency:percentile(p) / 1000.0))
  end
end

-- Installs wrk's hooks for a POST to `path` whose body `make_body(next_text)` builds.
function common.install(path, make_body)
  setup, init, response, done = common.setup, common.init, common.response, common.done
  wrk.method = "POST"
  wrk.headers["Content-Type"] = "application/json"
  request = function()
    return wrk.format(nil, path, nil, make_body(common.next_text))
  end
end

return common
