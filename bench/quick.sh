#!/usr/bin/env bash
# usage: bench/quick.sh [CONC...]      (default 1 8 64; ~1 min; writes bench/out/quick-<UTC time>/)
# A quick A/B check while working on the hot path, not a result for RESULTS.md: despina serve on
# core 0 (embedded Valkey), bench/loadgen.py binary on core 1, then the CPU per inference by process
# at c=64. Compare two trees by running this on each, back to back; bench/run.sh makes the records.
# BENCH_MODEL=NAME drives another of bench/out/repo's models (W2: conv_heavy, sized by BENCH_W2_CONV as
# bench/models.py says) and BENCH_SPLIT_CONC=N takes the CPU split at concurrency N instead of 64:
#   BENCH_W2_CONV=96x2 BENCH_MODEL=conv_heavy BENCH_SPLIT_CONC=256 bench/quick.sh 256
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 1
VENV=${BENCH_VENV:-$ROOT/.venv}  # another tree (a git worktree of an older commit) can borrow this one's
PY=$VENV/bin/python
export PYTHONPATH=$ROOT
PORT=${BENCH_PORT:-18000}
URL=http://127.0.0.1:$PORT
MODEL=${BENCH_MODEL:-mlp} SPLIT=${BENCH_SPLIT_CONC:-64}
OUT=$ROOT/bench/out/quick-$(date -u +%Y%m%dT%H%M%SZ)
mkdir -p "$OUT"
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
"$PY" bench/models.py > /dev/null || exit 1
if curl -s -m 1 -o /dev/null "$URL/v2/health/live"; then echo "something already answers at $URL" >&2; exit 1; fi
setsid taskset -c 0 env -u REDIS_URL "$PY" -m despina serve --key-prefix bench --http-port "$PORT" \
  --model-repository bench/out/repo > "$OUT/despina.log" 2>&1 &
SERVE=$!
trap 'kill -TERM $SERVE 2>/dev/null; wait $SERVE 2>/dev/null' EXIT
for _ in $(seq 480); do
  [ "$(curl -s -m 1 -o /dev/null -w '%{http_code}' "$URL/v2/models/$MODEL/ready")" = 200 ] && break
  kill -0 "$SERVE" 2>/dev/null || { tail -5 "$OUT/despina.log" >&2; exit 1; }
  sleep 0.25
done
echo "git $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- despina || echo ' + changes'); load $(cut -d' ' -f1-3 /proc/loadavg)"
"$PY" bench/loadgen.py "$URL" --cpu 1 --model "$MODEL" --format binary --conc ${*:-1 8 64} --duration 4 \
  --out "$OUT/results.jsonl" | grep -v '^{'
"$PY" bench/loadgen.py "$URL" --cpu 1 --model "$MODEL" --format binary --conc "$SPLIT" --warmup 1 --duration 12 \
  --peer despina-profiled > /dev/null &
LOAD=$!
sleep 2
taskset -c 1 "$PY" bench/profile.py cpu "$SERVE" "$URL" --model "$MODEL" --seconds 8 --core 0 | tee "$OUT/cpu-split.txt"
wait $LOAD  # not a bare wait: serve is a child too
