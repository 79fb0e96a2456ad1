-- wrk script for bench/pings.py: POST /v1/workloads/<name>/health, each workload with its
-- own ping token, the workloads in turn; at the end one JSON line with the summary.
--   wrk ... -s bench/load/pings.lua URL -- BODY NAME=TOKEN [NAME=TOKEN ...]
local encoded, at = {}, 0

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
