-- wrk script for bench/pings.py: POST /v1/workloads/<name>/health, each workload with its
-- own ping token, the workloads in turn; at the end one JSON line with the summary.
--   wrk ... -s bench/load/pings.lua URL -- BODY NAME=TOKEN [NAME=TOKEN ...]
-- With PINGS_DELAY_MS set, each connection waits that long after a response before it
-- sends again (wrk's `delay` hook): about connections x 1000 / PINGS_DELAY_MS pings a
-- second, a steady load for the real node's memory reading (tests/node) rather than a
-- saturation. Unset, wrk sends again at once.
local encoded, at = {}, 0
local pause = tonumber(os.getenv("PINGS_DELAY_MS") or "")
if pause then
  function delay()
    return pause
  end
end

function init(args)
  local body = args[1]
  for i = 2, #args do
    local name, token = args[i]:match("^([^=]+)=(.+)$")
    encoded[#encoded + 1] = wrk.format("POST", "/v1/workloads/" .. name .. "/health", {
      ["Authorization"] = "Bearer " .. token,
      ["Content-Type"] = "application/json",
    }, body)
  end
  at = math.random(#encoded) -- threads start at different workloads
end

function request()
  at = at % #encoded + 1
  return encoded[at]
end

function done(summary, latency, _)
  local e = summary.errors
  io.write(string.format(
    '{"completed":%d,"duration_us":%d,"status_errors":%d,"connect":%d,"read":%d,' ..
    '"write":%d,"timeout":%d,"latency_us":{"p50":%d,"p90":%d,"p99":%d,"p99.9":%d,"max":%d}}\n',
    summary.requests, summary.duration, e.status, e.connect, e.read, e.write, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99),
    latency:percentile(99.9), latency.max))
end
