#!/usr/bin/env bash
# usage: bench/run.sh            (from anywhere; ~11 min; writes bench/out/<UTC time>/)
# Despina vs its peers on this machine, server processes on core 0, load on core 1:
#   1. despina serve (embedded Valkey) on core 0: W1 `mlp`, W2 `mlp_heavy` and `conv_heavy` from
#      bench/models.py
#   2. bench/loadgen.py on W1, JSON and binary; py-spy on the gateway and the worker at c=64
#   3. the peers kit against Despina (perf_analyzer binary + aiohttp JSON), then W2 at saturation;
#      3b. W2 again with the worker alone on core 0 (serve --worker-cpus 0; the rest of Despina and the
#      load generator on core 1), as peer "despina-pool"
#   4. Despina stopped; the peers kit runs the peers (Triton, LitServe, MLServer) the same way
#   5. the limit: each model in a loop on core 0 (W2's served / limit divides by its limit taken just
#      before and after its points in 3 and 3b); then tables.md and throughput.png of this run
#      (bench/plot.py RUN... --png bench/throughput.png combines runs)
# Knobs: BENCH_PEERS="triton litserve mlserver", BENCH_CONCS="1 8 32 64 128", BENCH_W2_CONCS="64 128 256",
# BENCH_DURATION=5 (s per point), BENCH_PORT=18000, BENCH_REDIS_URL (default: embedded Valkey, on core 0),
# BENCH_VENV (default .venv: the Python that runs Despina and bench/; `pip install -e '.[onnx,examples,bench]'`
# there), and PEERS_DIR, which the kit reads (a kit set up with PYTHON=... runs every peer on that Python).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 1
VENV=${BENCH_VENV:-$ROOT/.venv}
PY=$VENV/bin/python
PEERS_RUN=${PEERS_RUN:-/work/shared/peers/run.sh}
PEERS=${BENCH_PEERS:-triton litserve mlserver}
CONCS=${BENCH_CONCS:-1 8 32 64 128}
W2_CONCS=${BENCH_W2_CONCS:-64 128 256}
W2_MODELS="mlp_heavy conv_heavy"  # bench/models.py's W2 builds
DURATION=${BENCH_DURATION:-5}
PORT=${BENCH_PORT:-18000}
URL=http://127.0.0.1:$PORT
OUT=$ROOT/bench/out/$(date -u +%Y%m%dT%H%M%SZ)
RESULTS=$OUT/results.jsonl
mkdir -p "$OUT"
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1

MONITOR=
SERVE=  # pid of `despina serve`; its children each lead their own process group
descendants() { local c; for c in $(ps -o pid= --ppid "$1"); do echo "$c"; descendants "$c"; done; }
stop_despina() {
  [ -n "$SERVE" ] || return 0
  local pids alive p
  pids="$SERVE $(descendants "$SERVE")"
  kill -TERM "$SERVE" 2>/dev/null  # the supervisor drains: gateway, workers, control, Valkey
  for _ in $(seq 240); do
    alive=; for p in $pids; do kill -0 "$p" 2>/dev/null && alive="$alive $p"; done
    [ -z "$alive" ] && break
    sleep 0.25
  done
  [ -n "$alive" ] && { echo "killing$alive"; kill -KILL $alive 2>/dev/null; }
  echo "despina stopped"
  SERVE=
}
trap 'stop_despina; kill "$MONITOR" 2>/dev/null' EXIT
trap 'exit 130' INT TERM

phase() { echo "== $* (load average $(cut -d' ' -f1-3 /proc/loadavg))"; }
child_pid() { ps -o pid=,args= --ppid "$SERVE" | awk -v role="despina $1" '$0 ~ role {print $1; exit}'; }

peers() {  # ARGS...: run the peers kit, keep its log, add its JSON lines (Despina's as peer "despina")
  local log=$OUT/peers-$(echo "$*" | tr -c 'a-z0-9' '_').log file
  PEERS_CONCS="$CONCS" timeout 1200 "$PEERS_RUN" "$@" 2>&1 | tee "$log"
  file=$(sed -n 's/.*results: \(.*\.jsonl\)$/\1/p' "$log" | tail -1)
  [ -f "$file" ] && sed 's/"peer": "target"/"peer": "despina"/' "$file" >> "$RESULTS"
}

{ date -u; echo "nproc --all: $(nproc --all)"; lscpu | grep -E 'Model name|^CPU\(s\)|L3'; echo "git $(git rev-parse --short HEAD)"
  echo "despina/ sources sha1 (others edit the tree): $(find despina -name '*.py' | sort | xargs cat | sha1sum | cut -c1-12)"
  echo "python: $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])'); peers kit: ${PEERS_DIR:-default}"
  echo "conv_heavy (BENCH_W2_CONV): ${BENCH_W2_CONV:-64x3, the default}"
  git status --short despina | head -40; uptime; } > "$OUT/machine.txt"
cat "$OUT/machine.txt"
for _ in $(seq 1200); do echo "$(date -u +%T) $(cut -d' ' -f1-3 /proc/loadavg)"; sleep 5; done > "$OUT/loadavg.txt" &
MONITOR=$!  # load average every 5 s: the other users of this machine
"$PY" bench/models.py || exit 1

phase "1. despina serve on core 0, $URL"
if curl -s -m 1 -o /dev/null "$URL/v2/health/live"; then echo "something already answers at $URL" >&2; exit 1; fi
redis=(); [ -n "${BENCH_REDIS_URL:-}" ] && redis=(--redis-url "$BENCH_REDIS_URL")
ready() {  # MODEL...: whether every one answers ready
  local m
  for m in "$@"; do [ "$(curl -s -m 1 -o /dev/null -w '%{http_code}' "$URL/v2/models/$m/ready")" = 200 ] || return 1; done
}
start_despina() {  # CORES [ARGS...]: despina serve pinned to CORES, its pid in $SERVE, once its models are ready
  local cores=$1 t0=$SECONDS; shift
  setsid taskset -c "$cores" env -u REDIS_URL "$VENV/bin/despina" serve "${redis[@]}" --key-prefix bench \
    --http-port "$PORT" --model-repository bench/out/repo "$@" >> "$OUT/despina.log" 2>&1 &
  SERVE=$!
  until ready mlp $W2_MODELS; do
    if ! kill -0 "$SERVE" 2>/dev/null || [ $((SECONDS - t0)) -gt 120 ]; then
      echo "despina did not get ready; see $OUT/despina.log" >&2; tail -5 "$OUT/despina.log" >&2; exit 1
    fi
    sleep 0.25
  done
  echo "ready after $((SECONDS - t0)) s: serve $SERVE, gateway $(child_pid gateway), worker $(child_pid worker)"
}
start_despina 0

phase "2. bench/loadgen.py on W1, core 1"
timeout 600 "$PY" bench/loadgen.py "$URL" --cpu 1 --model mlp --format json binary --conc $CONCS \
  --duration "$DURATION" --out "$RESULTS"

phase "2b. binary load at c=64: CPU per process per inference, py-spy 10 s on the gateway and the worker, perf"
timeout 90 "$PY" bench/loadgen.py "$URL" --cpu 1 --model mlp --format binary --conc 64 --warmup 1 \
  --duration 45 --peer despina-profiled > "$OUT/profile-load.jsonl" &
load=$!
sleep 2
taskset -c 1 "$PY" bench/profile.py cpu "$SERVE" "$URL" --model mlp --seconds 8 --core 0 | tee "$OUT/cpu-split.txt"
for role in gateway worker; do
  timeout 30 taskset -c 1 "$VENV/bin/py-spy" record --pid "$(child_pid $role)" --duration 10 --rate 100 \
    --format raw --threads --nonblocking -o "$OUT/pyspy-$role.txt" 2>&1 | grep -v flamegraph
  for exclude in "" Resp.execute; do  # the hot loops' socket writes to Valkey: preempted, not busy
    "$PY" bench/profile.py summary "$OUT/pyspy-$role.txt" --rate 100 --seconds 10 ${exclude:+--exclude $exclude}
  done | tee "$OUT/pyspy-$role.summary.txt"
done
if command -v perf > /dev/null; then  # CPU samples (py-spy's include time spent preempted), by thread and library
  timeout 30 taskset -c 1 perf record -q -e cpu-clock -F 499 -p "$(ps -o pid= --ppid "$SERVE" | paste -sd,)" \
    -o "$OUT/perf.data" -- sleep 8
  for sort in pid pid,dso; do
    perf report -i "$OUT/perf.data" --sort $sort --stdio --no-children -g none 2>/dev/null | grep '%' | head -20
  done | tee "$OUT/perf-by-library.txt"
fi
wait "$load"; cat "$OUT/profile-load.jsonl"

# the model's own rate at max batch on core 0 (Despina idle), just before and after its W2 points: the
# host's speed drifts (W2's limit moved 39 % in ten minutes on 2026-12-04), so W2's served / limit divides
# by these (plot.py takes the better), not by step 5's
limit_beside() {  # model peer: limit-beside (beside step 3's points) or limit-beside-pool (3b's)
  timeout 60 "$PY" bench/limit.py --cpu 0 --model "$1" --batch 128 --seconds 3 --peer "$2" | tee -a "$RESULTS"
}

phase "3. the peers kit against Despina; W2 at saturation"
peers --target "$URL"
for w2 in $W2_MODELS; do  # replies checked against each model's own ONNX file (loadgen's default)
  limit_beside $w2 limit-beside
  timeout 300 "$PY" bench/loadgen.py "$URL" --cpu 1 --model $w2 --format binary json --conc $W2_CONCS \
    --duration $((DURATION * 2)) --out "$RESULTS"
  limit_beside $w2 limit-beside
done
stop_despina

phase "3b. W2 with the worker alone on core 0 (serve --worker-cpus 0, the rest on core 1)"
start_despina 0-1 --worker-cpus 0
for w2 in $W2_MODELS; do
  limit_beside $w2 limit-beside-pool
  timeout 300 "$PY" bench/loadgen.py "$URL" --cpu 1 --model $w2 --format binary --conc $W2_CONCS \
    --duration $((DURATION * 2)) --peer despina-pool --out "$RESULTS"
  limit_beside $w2 limit-beside-pool
done
stop_despina

phase "4. the peers: $PEERS"
for peer in $PEERS; do peers "$peer"; done

phase "5. the limit on core 0"
timeout 300 "$PY" bench/limit.py --cpu 0 | tee -a "$RESULTS"
"$PY" bench/plot.py "$RESULTS" --png "$OUT/throughput.png" | tee "$OUT/tables.md"
echo "results: $RESULTS"
