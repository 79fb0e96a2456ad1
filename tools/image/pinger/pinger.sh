#!/bin/sh
# A managed workload for the test node (image localhost/pinger:1, busybox only): sends
# the manager's health ping, `POST $WORKLOAD_MANAGER_URL/v1/workloads/$WORKLOAD_NAME/health`
# with `Authorization: Bearer $WORKLOAD_MANAGER_PING_TOKEN` (when set) and a JSON body
# `{"status": ...}` (app/api/pings.py; the manager injects those three variables).
#
# Environment:
#   PING_INTERVAL=5           seconds between pings
#   PING_STATUS=healthy       healthy | degraded | unhealthy
#   PING_VERSION=             sent as "version" when set
#   STOP_PINGING_AFTER=N      stop pinging N seconds after start, keep running (-> stale)
#   EXIT_CODE=N               exit with code N at once (-> CrashLoopBackOff)
set -u

log() { echo "pinger: $*" >&2; }

if [ -n "${EXIT_CODE:-}" ]; then
  log "EXIT_CODE=$EXIT_CODE: exiting"
  exit "$EXIT_CODE"
fi

# PID 1 ignores signals it has no handler for: exit at once on TERM/INT.
trap 'log "terminated"; exit 0' TERM INT

interval=${PING_INTERVAL:-5}
status=${PING_STATUS:-healthy}
name=${WORKLOAD_NAME:-}
base=${WORKLOAD_MANAGER_URL:-}
token=${WORKLOAD_MANAGER_PING_TOKEN:-}
stop_after=${STOP_PINGING_AFTER:-}

body="{\"status\":\"$status\""
[ -n "${PING_VERSION:-}" ] && body="$body,\"version\":\"$PING_VERSION\""
body="$body}"

start=$(date +%s)
stopped=0
if [ -z "$base" ] || [ -z "$name" ]; then
  log "WORKLOAD_MANAGER_URL or WORKLOAD_NAME not set: not pinging"
  stopped=1
fi
url="${base%/}/v1/workloads/$name/health"
log "pinging $url every ${interval}s with $body${stop_after:+, for ${stop_after}s}"

while :; do
  if [ "$stopped" = 0 ] && [ -n "$stop_after" ] && [ $(($(date +%s) - start)) -ge "$stop_after" ]; then
    log "STOP_PINGING_AFTER=$stop_after reached: no more pings"
    stopped=1
  fi
  if [ "$stopped" = 0 ]; then
    if [ -n "$token" ]; then
      set -- --header "Authorization: Bearer $token"
    else
      set --
    fi
    # timeout(1), not wget -T: Debian's busybox 1.35 wget crashes with -T
    if ! timeout 10 wget -q -O /dev/null "$@" --header "Content-Type: application/json" \
        --post-data "$body" "$url"; then
      log "ping failed"
    fi
  fi
  # in the background, so that TERM is handled while sleeping
  sleep "$interval" &
  wait $!
done
