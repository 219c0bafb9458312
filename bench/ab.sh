#!/usr/bin/env bash
# usage: bench/ab.sh [-r ROUNDS] [-c "1 8 32 64"] [-l perf_analyzer|loadgen] LABEL=TREE[:ENV=V,...] ...
#
# A B A B: each round starts `despina serve` from each tree in turn (server on core 0, embedded Valkey,
# bench/out/repo) and drives W1 (`mlp`, binary tensors) at each concurrency from core 1, with Triton's
# perf_analyzer (the peers kit's) or bench/loadgen.py. One line per point: label, round, concurrency,
# req/s, p50/p99 ms, mean batch and mean queue µs (from the statistics before and after the point).
# TREE is a checkout of Despina (a git worktree of another commit, say) run with this checkout's venv;
# ENV=V pairs are set for that tree's server. Not a record by itself: bench/RESULTS.md says what
# each comparison was and quotes the command.
#
#   git worktree add /tmp/base HEAD~1
#   bench/ab.sh -r 2 base=/tmp/base new=.            # then: git worktree remove /tmp/base
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=$ROOT/.venv/bin/python
PA=${PERF_ANALYZER:-$HOME/.cache/despina-peers/bin/perf_analyzer}
PORT=${BENCH_PORT:-18000}
URL=http://127.0.0.1:$PORT
ROUNDS=2 CONCS="1 8 32 64" CLIENT=perf_analyzer
while getopts "r:c:l:" opt; do
  case $opt in
    r) ROUNDS=$OPTARG ;;
    c) CONCS=$OPTARG ;;
    l) CLIENT=$OPTARG ;;
    *) sed -n 2,3p "$0" >&2; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
[ $# -ge 1 ] || { sed -n 2,3p "$0" >&2; exit 2; }
case $CLIENT in
  perf_analyzer) [ -x "$PA" ] || { echo "no perf_analyzer at $PA: run /work/shared/peers/setup.sh" >&2; exit 1; } ;;
  loadgen) ;;
  *) echo "-l perf_analyzer or loadgen" >&2; exit 2 ;;
esac
OUT=$ROOT/bench/out/ab-$(date -u +%Y%m%dT%H%M%SZ)
mkdir -p "$OUT"
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
"$PY" "$ROOT/bench/models.py" > /dev/null || exit 1
if curl -s -m 1 -o /dev/null "$URL/v2/health/live"; then echo "something already answers at $URL" >&2; exit 1; fi

stats() { curl -s "$URL/v2/models/mlp/stats"; }
batch_and_queue() {  # stats JSON before, after -> "mean_batch queue_us"
  "$PY" -c 'import json, sys
a, b = (json.loads(s)["model_stats"][0] for s in sys.argv[1:])
runs = b["execution_count"] - a["execution_count"]
q, q0 = b["inference_stats"]["queue"], a["inference_stats"]["queue"]
print("%.1f %.0f" % ((b["inference_count"] - a["inference_count"]) / max(runs, 1),
                     (q["ns"] - q0["ns"]) / max(q["count"] - q0["count"], 1) / 1000))' "$1" "$2"
}

point() {  # label round conc -> one line
  local before after line
  before=$(stats)
  if [ "$CLIENT" = perf_analyzer ]; then
    local out
    out=$(taskset -c 1 "$PA" -m mlp -u "127.0.0.1:$PORT" -i http --concurrency-range "$3:$3" \
      --measurement-interval 3000 --max-trials 10 --stability-percentage 20 2>&1)
    line=$(echo "$out" | awk '/Throughput:/ {t = $2} /p50 latency:/ {p50 = $3 / 1000} /p99 latency:/ {p99 = $3 / 1000}
      END {if (t == "") print "failed - -"; else printf "%.0f %.2f %.2f\n", t, p50, p99}')
  else
    line=$("$PY" "$ROOT/bench/loadgen.py" "$URL" --cpu 1 --model mlp --format binary --conc "$3" --duration 4 \
      --out /dev/null | "$PY" -c 'import json, sys
r = [json.loads(l) for l in sys.stdin if l.startswith("{")][-1]
print("%.0f %.2f %.2f" % (r["rps"], r["p50_ms"], r["p99_ms"]))')
  fi
  after=$(stats)
  printf "%-10s round %s  c=%-4s %s  batch/queue_us %s  load %s\n" "$1" "$2" "$3" "$line" \
    "$(batch_and_queue "$before" "$after")" "$(cut -d' ' -f1 /proc/loadavg)"
}

for round in $(seq "$ROUNDS"); do
  for spec in "$@"; do
    label=${spec%%=*}; rest=${spec#*=}; tree=${rest%%:*}; envs=""
    [ "$rest" != "$tree" ] && envs=${rest#*:}
    tree=$(cd "$tree" && pwd) || exit 1
    # shellcheck disable=SC2086
    (cd "$tree" && exec setsid taskset -c 0 env -u REDIS_URL PYTHONPATH="$tree" ${envs//,/ } "$PY" -m despina serve \
      --key-prefix bench --http-port "$PORT" --model-repository "$ROOT/bench/out/repo") \
      > "$OUT/$label-$round.log" 2>&1 &
    serve=$!
    for _ in $(seq 480); do
      [ "$(curl -s -m 1 -o /dev/null -w '%{http_code}' "$URL/v2/models/mlp/ready")" = 200 ] && break
      kill -0 "$serve" 2>/dev/null || { tail -5 "$OUT/$label-$round.log" >&2; exit 1; }
      sleep 0.25
    done
    for conc in $CONCS; do
      point "$label" "$round" "$conc" | tee -a "$OUT/ab.txt"
    done
    kill -TERM -- -"$serve" 2>/dev/null; wait "$serve" 2>/dev/null
    sleep 1
  done
done
echo "lines: $OUT/ab.txt"
