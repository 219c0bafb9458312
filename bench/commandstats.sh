#!/usr/bin/env bash
# usage: bench/commandstats.sh [-c CONC] [-m MODEL] TREE ...
#
# Valkey's own time per command under load: for each TREE in turn (a checkout of Despina, a git worktree
# of another commit say, run with this checkout's venv), `despina serve` on core 0 with its embedded
# Valkey and bench/out/repo, perf_analyzer at CONC on core 1 (--measurement-interval 5000), then the
# embedded Valkey's INFO commandstats (calls, µs, µs a call: the statistics EVAL, the stream and reply
# commands), the model's statistics hash (its fields and encoding) and its executions. Give a tree twice
# (A B A B) to see how much the host moves between windows.
#
#   git worktree add /tmp/base HEAD~1
#   bench/commandstats.sh -c 64 /tmp/base . /tmp/base .     # then: git worktree remove /tmp/base
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=$ROOT/.venv/bin/python
PA=${PERF_ANALYZER:-$HOME/.cache/despina-peers/bin/perf_analyzer}
PORT=${BENCH_PORT:-18000}
CONC=8 MODEL=mlp
while getopts "c:m:" opt; do
  case $opt in
    c) CONC=$OPTARG ;;
    m) MODEL=$OPTARG ;;
    *) sed -n 2p "$0" >&2; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
[ $# -gt 0 ] || { sed -n 2p "$0" >&2; exit 2; }
[ -x "$PA" ] || { echo "no perf_analyzer at $PA: run /work/shared/peers/setup.sh" >&2; exit 1; }
[ -d "$ROOT/bench/out/repo" ] || { echo "no bench/out/repo: run $PY bench/models.py" >&2; exit 1; }

stop() {
  [ -n "${SERVE:-}" ] && kill -TERM "$SERVE" 2>/dev/null && wait "$SERVE" 2>/dev/null
  SERVE=
}
trap stop EXIT

for tree in "$@"; do
  tree=$(cd "$tree" && pwd)
  before=$(ls -d "${TMPDIR:-/tmp}"/despina-valkey-* 2>/dev/null)
  (cd "$tree" && PYTHONPATH=$tree exec taskset -c 0 env -u REDIS_URL "$PY" -m despina serve \
    --key-prefix bench --http-port "$PORT" --metrics-port $((PORT + 2)) \
    --model-repository "$ROOT/bench/out/repo" > /dev/null 2>&1) &
  SERVE=$!
  for _ in $(seq 300); do
    curl -sf "127.0.0.1:$PORT/v2/models/$MODEL/ready" > /dev/null && break
    sleep 1
  done
  folder=$(comm -13 <(echo "$before") <(ls -d "${TMPDIR:-/tmp}"/despina-valkey-* 2>/dev/null) | head -1)
  if [ -z "$folder" ]; then
    echo "$tree: its embedded Valkey was not found" >&2
    stop
    continue
  fi
  echo "== $tree c=$CONC"
  taskset -c 1 "$PA" -m "$MODEL" -u "127.0.0.1:$PORT" -i http --concurrency-range "$CONC:$CONC" \
    --measurement-interval 5000 2>&1 | grep -E "Throughput|p99 latency"
  cli() { redis-cli -s "$folder/valkey.sock" "$@"; }
  cli info commandstats | grep -E "^cmdstat_(eval|evalsha|xadd|xreadgroup|xread|hincrby|hset|xack|xdel|pexpire):" \
    | sed 's/,rejected_calls.*//'
  stats=bench:stats:$MODEL:1
  echo "statistics hash: $(cli hlen "$stats") fields, $(cli object encoding "$stats"); executions" \
    "$(cli hget "$stats" execution_count)"
  stop
  sleep 2
done
