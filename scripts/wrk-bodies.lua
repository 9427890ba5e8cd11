-- wrk -t 4 -c 64 -d 10s -s scripts/wrk-bodies.lua http://127.0.0.1:8080/v1/embeddings -- bodies.jsonl
-- POSTs the lines of a file (one JSON body per line) to the URL's path, each thread going through
-- them in turn from its own starting line, and prints one JSON line of figures at the end
-- (scripts/http_load.py's run_wrk reads it). No response() hook: wrk then reads answers in C
-- alone, and counts the ones of 400 and over in summary.errors.status.
local bodies = {}
local threads = {}

function setup(thread)
  threads[#threads + 1] = thread
  thread:set("thread_index", #threads)
end

function init(args)
  local path = args[1] or error("usage: ... -s wrk-bodies.lua URL -- BODIES_FILE")
  for line in io.lines(path) do
    if line:match("%S") then bodies[#bodies + 1] = line end
  end
  if #bodies == 0 then error(path .. " holds no bodies") end
  wrk.method = "POST"
  wrk.headers["Content-Type"] = "application/json"
  -- Threads start apart so that concurrent requests carry different bodies.
  cursor = ((thread_index or 1) - 1) * math.floor(#bodies / 16)
end

function request()
  cursor = cursor % #bodies + 1
  return wrk.format(nil, nil, nil, bodies[cursor])
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '{"requests": %d, "duration_us": %d, "connect_errors": %d, "read_errors": %d, ' ..
    '"write_errors": %d, "timeouts": %d, "status_errors": %d, "latency_us": ' ..
    '{"mean": %.1f, "p50": %d, "p99": %d, "max": %d}}\n',
    summary.requests, summary.duration, e.connect, e.read, e.write, e.timeout, e.status,
    latency.mean, latency:percentile(50), latency:percentile(99), latency.max))
end
