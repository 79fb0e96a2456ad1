-- wrk script: POST /v1/workloads/<name>/health, each workload with its own ping token, the
-- workloads in turn; at the end one JSON line with the summary.
--   wrk ... -s bench/load/pings.lua URL -- BODY NAME=TOKEN [NAME=TOKEN ...]
-- With PINGS_DELAY_MS set, each connection waits that long after a response before it
-- sends again (wrk's `delay` hook): about connections x 1000 / PINGS_DELAY_MS pings a
-- second, a steady load (the real node's memory reading in tests/node, the soak) rather
-- than a saturation. Unset, wrk sends again at once. For the soak also:
--   PINGS_VERSIONS=FILE  the body is {"status", "version"} with the workload's version from
--                        FILE ("NAME VERSION" lines, read again every second); BODY unused
--   PINGS_DEGRADED=0.02  that share of pings says "degraded", the rest "healthy"
--   PINGS_CLOSE=1        "Connection: close": each ping on a connection of its own
--   PINGS_STATUSES=1     count the answers by status ("statuses" in the JSON line)
local encoded, names, paths, headers, at = {}, {}, {}, {}, 0
local pause = tonumber(os.getenv("PINGS_DELAY_MS") or "")
local versions_file = os.getenv("PINGS_VERSIONS")
local degraded = tonumber(os.getenv("PINGS_DEGRADED") or "0")
local versions, loaded = {}, -1
if pause then
  function delay()
    return pause
  end
end

function init(args)
  local body = args[1]
  for i = 2, #args do
    local name, token = args[i]:match("^([^=]+)=(.+)$")
    names[#names + 1] = name
    paths[#paths + 1] = "/v1/workloads/" .. name .. "/health"
    headers[#headers + 1] = {
      ["Authorization"] = "Bearer " .. token,
      ["Content-Type"] = "application/json",
      ["Connection"] = os.getenv("PINGS_CLOSE") and "close" or nil,
    }
    encoded[#encoded + 1] = wrk.format("POST", paths[#paths], headers[#headers], body)
  end
  at = math.random(#encoded) -- threads start at different workloads
end

local function read_versions()
  local file = io.open(versions_file)
  if file then
    for line in file:lines() do
      local name, version = line:match("^(%S+) (%S+)$")
      if name then versions[name] = version end
    end
    file:close()
  end
end

function request()
  at = at % #encoded + 1
  if not versions_file then
    return encoded[at]
  end
  if os.time() ~= loaded then
    read_versions()
    loaded = os.time()
  end
  local status = math.random() < degraded and "degraded" or "healthy"
  local body = '{"status":"' .. status .. '","version":"' .. (versions[names[at]] or "") .. '"}'
  return wrk.format("POST", paths[at], headers[at], body)
end

local threads = {}
function setup(thread)
  threads[#threads + 1] = thread
end

if os.getenv("PINGS_STATUSES") then
  statuses = {}
  function response(status)
    statuses[status] = (statuses[status] or 0) + 1
  end
end

function done(summary, latency, _)
  local counted = {}
  for _, thread in ipairs(threads) do
    for status, n in pairs(thread:get("statuses") or {}) do
      counted[#counted + 1] = string.format('"%d":%d', status, n)
    end
  end
  local e = summary.errors
  io.write(string.format(
    '{"completed":%d,"duration_us":%d,"status_errors":%d,"connect":%d,"read":%d,' ..
    '"write":%d,"timeout":%d,"latency_us":{"p50":%d,"p90":%d,"p99":%d,"p99.9":%d,"max":%d},' ..
    '"statuses":{%s}}\n',
    summary.requests, summary.duration, e.status, e.connect, e.read, e.write, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99),
    latency:percentile(99.9), latency.max, table.concat(counted, ",")))
end
