#!/usr/bin/env bash
# usage: bench/ab.sh [-i] [-r ROUNDS] [-c "1 8 32 64"] [-m "mlp ..."] [-l perf_analyzer|loadgen|aiohttp] [-x "PA ARGS"] LABEL=TREE[:ENV=V,...] ...
#
# A B B A: each round starts `despina serve` from each tree in turn, even rounds in reverse order (server
# on core 0, embedded Valkey, bench/out/repo), and drives each model (default W1 `mlp`; binary tensors)
# at each concurrency from core 1, with Triton's perf_analyzer (the peers kit's), bench/loadgen.py
# (W1 and W2 only), or the kit's aiohttp client (W1, JSON bodies: `aiohttp`). One line per point: label, round, model, concurrency, req/s, p50/p99 ms, mean
# batch and mean queue µs (from the statistics before and after the point; an @limit label's: 128.0 and the word
# limit, its p50/p99 a batch's), and how busy core 0 (the
# server's) and core 1 (the client's: a point where it is full measures the client) were. TREE is a checkout of
# Despina (a git worktree of another commit, say) run with this checkout's venv; ENV=V pairs are set
# for that tree's server. TREE `@triton` is real Triton instead (the peers kit's tritonserver, run as
# the kit runs it, on core 0) serving bench/out/triton: W1 as the kit's Python-backend `mlp`, W2 `mlp_heavy` and `conv_heavy` as the
# same model.py on W2's ONNX files, and W3's `classify_post` and `mlp_classify` unchanged from model_repository/.
# TREE `@limit` is no server: the model's own rate (bench/limit.py, onnxruntime in a loop on core 0, rows/s at
# max batch 128, 4 s) at each point, in the rounds' order like the servers, so that served / limit comes from
# one run even where the host's speed drifts (W2's limit moved 39 % within ten minutes on 2026-12-04).
# Pinning: the server on core 0 as a whole, unless the label's ENV has DESPINA_WORKER_CPUS=0 (Despina
# runs its workers on core 0 and everything else, with the load generator, on core 1) or, for
# @triton, STUB_CPUS=0 (tritonserver on core 1, each model's Python-backend stub moved to core 0 once
# ready): the model's core does nothing else, in both systems the same way.
# -x adds arguments to perf_analyzer's: -x "--shared-memory system --output-shared-memory-size 40" passes W1's
# tensors through system shared memory (a Despina label needs DESPINA_ALLOW_CLIENT_SHM=1 for it).
# The response cache: model `mlp_cached` is W1 with `response_cache { enable: true }`; a Despina label with
# DESPINA_RESPONSE_CACHE_BYTES=N and a @triton label with TRITON_CACHE=N (--cache-config local,size=N)
# serve it from their caches.
# W2's conv_heavy is built as bench/models.py says: BENCH_W2_CONV=CHANNELSxCONVS in ab.sh's own
# environment sizes it for this machine, for both systems alike.
# The interpreter: SERVER_PYTHON=PATH in a Despina label's ENV runs its server with that Python (a venv's,
# Despina's dependencies installed there; the tree still comes first on PYTHONPATH); PEERS_DIR=DIR in a
# @triton label's runs Triton from that peers kit (set up with its PYTHON=...: the model's stub embeds
# that venv's libpython and imports onnxruntime from it).
# -i interleaves by point instead of by server: every label's server starts once, each on its own port (the
# first on 18000, the next 10 ports up, ...), all on core 0, and at each model and concurrency the labels
# take their turns one after the other (A B, then B A in the next round), so that the two figures of a
# pair are seconds apart, not minutes: on a host whose speed drifts within minutes (the EPYC guests) this
# is the comparison to trust. The servers not being driven idle beside the one that is: what each uses of
# core 0 while all idle is measured first (10 s) and written at the top of ab.txt, and each point's line ends
# with what the others took meanwhile ("beside", in per cent of one core).
# Not a record by itself: bench/RESULTS.md says what each comparison was and quotes the command. At
# the end, bench/ab_summary.py's table (each label's rounds, and the ratio of its sum to the first
# label's) goes to the screen and summary.md.
#
#   git worktree add /tmp/base HEAD~1
#   bench/ab.sh -r 2 base=/tmp/base new=.            # then: git worktree remove /tmp/base
#   bench/ab.sh -m "mlp_classify mlp" despina=. triton=@triton     # W3 against Triton's ensemble
#   bench/ab.sh -l loadgen -c "64 128 256" -m conv_heavy limit=@limit despina=.   # W2: despina / limit
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=$ROOT/.venv/bin/python
PA=${PERF_ANALYZER:-$HOME/.cache/despina-peers/bin/perf_analyzer}
PORT=${BENCH_PORT:-18000}
URL=http://127.0.0.1:$PORT
PEERS_DIR=${PEERS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/despina-peers}
KIT=${PEERS_KIT:-$ROOT/../shared/peers}  # the kit's scripts (its aiohttp client)
ROUNDS=2 CONCS="1 8 32 64" CLIENT=perf_analyzer MODELS=mlp PA_ARGS="" INTERLEAVE=0
while getopts "ir:c:m:l:x:" opt; do
  case $opt in
    i) INTERLEAVE=1 ;;
    r) ROUNDS=$OPTARG ;;
    c) CONCS=$OPTARG ;;
    m) MODELS=$OPTARG ;;
    l) CLIENT=$OPTARG ;;
    x) PA_ARGS=$OPTARG ;;
    *) sed -n 2,3p "$0" >&2; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
[ $# -ge 1 ] || { sed -n 2,3p "$0" >&2; exit 2; }
case $CLIENT in
  perf_analyzer) [ -x "$PA" ] || { echo "no perf_analyzer at $PA: run /work/shared/peers/setup.sh" >&2; exit 1; } ;;
  loadgen) ;;
  aiohttp) [ -x "$PEERS_DIR/venv/loadgen/bin/python" ] || { echo "no peers kit in $PEERS_DIR: run /work/shared/peers/setup.sh" >&2; exit 1; } ;;
  *) echo "-l perf_analyzer, loadgen or aiohttp" >&2; exit 2 ;;
esac
OUT=$ROOT/bench/out/ab-$(date -u +%Y%m%dT%H%M%SZ)
mkdir -p "$OUT"
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
"$PY" "$ROOT/bench/models.py" > /dev/null || exit 1
if curl -s -m 1 -o /dev/null "$URL/v2/health/live"; then echo "something already answers at $URL" >&2; exit 1; fi

stats() { curl -s "$URL/v2/models/$1/stats"; }
env_value() { echo ",$2," | sed -n "s/.*,$1=\([^,]*\),.*/\1/p"; }  # KEY ENVS -> KEY's value in a label's ENV
batch_and_queue() {  # stats JSON before, after -> "mean_batch queue_us"
  "$PY" -c 'import json, sys
a, b = (json.loads(s)["model_stats"][0] for s in sys.argv[1:])
runs = b["execution_count"] - a["execution_count"]
q, q0 = b["inference_stats"]["queue"], a["inference_stats"]["queue"]
print("%.1f %.0f" % ((b["inference_count"] - a["inference_count"]) / max(runs, 1),
                     (q["ns"] - q0["ns"]) / max(q["count"] - q0["count"], 1) / 1000))' "$1" "$2"
}

cores() { awk '$1 == "cpu0" || $1 == "cpu1" {printf "%d %d ", $2 + $3 + $4 + $7 + $8, $5 + $6}' /proc/stat; }
busy() {  # cores before, after -> per cent of core 0's and core 1's time busy in between (anyone's work)
  echo "$1 $2" | awk '{for (c = 0; c < 2; c++) {b = $(5 + 2 * c) - $(1 + 2 * c); i = $(6 + 2 * c) - $(2 + 2 * c)
    printf "%s%.0f%%", (c ? " core1 " : ""), 100 * b / (b + i + (b + i == 0))}}'
}

point() {  # label round model conc -> one line; $tree is the label's (@limit: the model in a loop, no server)
  local before after line cpu
  before=$(stats "$3") cpu=$(cores)
  if [ "$tree" = @limit ]; then
    line=$("$PY" "$ROOT/bench/limit.py" --cpu 0 --model "$3" --batch 128 --seconds 4 2>&1 | "$PY" -c 'import json, sys
r = [json.loads(l) for l in sys.stdin if l.startswith("{")]
print("%.0f %.2f %.2f" % (r[-1]["rps"], r[-1]["p50_ms"], r[-1]["p99_ms"]) if r else "failed - -")')
  elif [ "$CLIENT" = perf_analyzer ]; then
    local out
    # shellcheck disable=SC2086  # PA_ARGS: words for perf_analyzer
    out=$(taskset -c 1 "$PA" -m "$3" -u "127.0.0.1:$PORT" -i http --concurrency-range "$4:$4" \
      --measurement-interval 3000 --max-trials 10 --stability-percentage 20 $PA_ARGS 2>&1)
    line=$(echo "$out" | awk '/Throughput:/ {t = $2} /p50 latency:/ {p50 = $3 / 1000} /p99 latency:/ {p99 = $3 / 1000}
      END {if (t == "") print "failed - -"; else printf "%.0f %.2f %.2f\n", t, p50, p99}')
  elif [ "$CLIENT" = aiohttp ]; then
    line=$(taskset -c 1 "$PEERS_DIR/venv/loadgen/bin/python" "$KIT/bench/loadgen.py" "$URL/v2/models/$3/infer" \
      --kind kserve --conc "$4" --duration 4 --triton-stats "$URL/v2/models/$3/stats" | "$PY" -c 'import json, sys
r = json.loads(sys.stdin.read())
if "error" in r: print("failed - -  %s" % r["error"]); sys.exit()
bad = "  errors %d output_ok %s" % (r["errors"], r["output_ok"]) if r["errors"] or not r["output_ok"] else ""
print("%.0f %.2f %.2f%s" % (r["rps"], r["p50_ms"], r["p99_ms"], bad))')
  else
    line=$("$PY" "$ROOT/bench/loadgen.py" "$URL" --cpu 1 --model "$3" --format binary --conc "$4" --duration 4 \
      --out /dev/null | "$PY" -c 'import json, sys
r = [json.loads(l) for l in sys.stdin if l.startswith("{")][-1]
bad = "  errors %d wrong %d/%d" % (r["errors"], r["wrong"], r["checked"]) if r["errors"] or r["wrong"] else ""
print("%.0f %.2f %.2f%s" % (r["rps"], r["p50_ms"], r["p99_ms"], bad))')
  fi
  cpu=$(busy "$cpu" "$(cores)") after=$(stats "$3")
  local bq="128.0 limit"  # the limit's batch, and the word limit for its queue: a batch's latency, no request's
  [ "$tree" = @limit ] || bq=$(batch_and_queue "$before" "$after")
  printf "%-10s round %s  %-12s c=%-4s %s  batch/queue_us %s  core0 %s  load %s\n" "$1" "$2" "$3" "$4" "$line" \
    "$bq" "$cpu" "$(cut -d' ' -f1 /proc/loadavg)"
}

triton_repo() {  # bench/out/triton: the kit's W1 for Triton, and W3's models as they are in model_repository/
  local repo=$ROOT/bench/out/triton
  [ -d "$PEERS_DIR/triton/models/mlp" ] || { echo "no Triton in $PEERS_DIR: run /work/shared/peers/setup.sh" >&2; return 1; }
  rm -rf "$repo" && mkdir -p "$repo/mlp_classify/1" || return 1  # Triton wants the ensemble's version folder
  cp -r "$PEERS_DIR/triton/models/mlp" "$repo/" && cp -r "$ROOT/model_repository/classify_post" "$repo/" &&
    cp "$ROOT/model_repository/mlp_classify/config.pbtxt" "$repo/mlp_classify/" || return 1
  # W1 with the response cache (served from it when tritonserver has one: TRITON_CACHE=BYTES in the label)
  cp -r "$repo/mlp" "$repo/mlp_cached" && sed -i 's/^name: "mlp"/name: "mlp_cached"/' "$repo/mlp_cached/config.pbtxt" &&
    printf '\nresponse_cache { enable: true }\n' >> "$repo/mlp_cached/config.pbtxt" || return 1
  # W2: the kit's Python-backend model (Triton's batcher, onnxruntime on one thread) on W2's ONNX files
  local w2
  for w2 in mlp_heavy conv_heavy; do
    cp -r "$repo/mlp" "$repo/$w2" && cp "$ROOT/bench/out/repo/$w2/1/model.onnx" "$repo/$w2/1/" &&
      sed -i "s/^name: \"mlp\"/name: \"$w2\"/" "$repo/$w2/config.pbtxt" || return 1
  done
}

start() {  # tree envs log: a server on core 0 in its own process group, its pid in $serve
  local cores=0
  case ",$2," in *,DESPINA_WORKER_CPUS=*|*,STUB_CPUS=*) cores=0-1 ;; esac
  [ "$1" = @triton ] && [ "$cores" = 0-1 ] && cores=1
  if [ "$1" = @triton ]; then
    local kit py site libdir ts cache
    kit=$(env_value PEERS_DIR "$2") cache=$(env_value TRITON_CACHE "$2")
    kit=${kit:-$PEERS_DIR} py=$kit/venv/triton/bin/python
    site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    libdir=$("$py" -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR"))')
    ts=$site/pytriton/tritonserver
    setsid taskset -c "$cores" env LD_LIBRARY_PATH="$libdir:$site/nvidia_pytriton.libs" PATH="$kit/venv/triton/bin:$PATH" \
      "$ts/bin/tritonserver" --model-repository "$ROOT/bench/out/triton" --backend-directory "$kit/triton/backends" \
      --cache-directory "$ts/caches" --http-address 127.0.0.1 --http-port "$PORT" --grpc-address 127.0.0.1 \
      --grpc-port $((PORT + 1)) --metrics-address 127.0.0.1 --metrics-port $((PORT + 2)) --allow-gpu-metrics false \
      ${cache:+--cache-config "local,size=$cache"} > "$3" 2>&1 &
  else
    local py
    py=$(env_value SERVER_PYTHON "$2")
    # shellcheck disable=SC2086
    (cd "$1" && exec setsid taskset -c "$cores" env -u REDIS_URL PYTHONPATH="$1" ${2//,/ } "${py:-$PY}" -m despina serve \
      --key-prefix bench --http-port "$PORT" --metrics-port $((PORT + 2)) --model-repository "$ROOT/bench/out/repo") > "$3" 2>&1 &
  fi
  serve=$!
}

parse() {  # LABEL=TREE[:ENV=V,...] -> $label $tree (absolute, or @triton / @limit) $envs
  label=${1%%=*}; local rest=${1#*=}; tree=${rest%%:*}; envs=""
  [ "$rest" != "$tree" ] && envs=${rest#*:}
  if [ "$tree" != @triton ] && [ "$tree" != @limit ]; then tree=$(cd "$tree" && pwd) || exit 1; fi
}

ready() {  # log: wait until $serve (at $URL) has every model ready; then Triton's stubs to their core
  local model stubs p
  for model in $MODELS; do
    for _ in $(seq 480); do
      [ "$(curl -s -m 1 -o /dev/null -w '%{http_code}' "$URL/v2/models/$model/ready")" = 200 ] && break
      kill -0 "$serve" 2>/dev/null || { tail -5 "$1" >&2; return 1; }
      sleep 0.25
    done
  done
  stubs=$(env_value STUB_CPUS "$envs")
  if [ -n "$stubs" ]; then  # each model's stub process (and its threads) onto the model's core
    for p in $(pgrep -f triton_python_backend_stub); do taskset -apc "$stubs" "$p" > /dev/null; done
  fi
}

group_ticks() {  # process group -> CPU time of its processes so far, in clock ticks
  local p t=0
  for p in $(ps -o pid= -g "$1"); do t=$((t + $(awk '{print $14 + $15}' "/proc/$p/stat" 2>/dev/null || echo 0))); done
  echo "$t"
}

others_ticks() {  # label -> CPU ticks so far of every other label's server
  local other t=0
  for other in "${!pid_of[@]}"; do
    [ "$other" = "$1" ] || t=$((t + $(group_ticks "${pid_of[$other]}")))
  done
  echo "$t"
}

labels=("$@") reversed=()
for ((i = $# - 1; i >= 0; i--)); do reversed+=("${labels[i]}"); done
BASE_PORT=$PORT
if [ "$INTERLEAVE" = 1 ]; then
  # every server up at once, each on its own port; then each point's turns back to back
  declare -A port_of pid_of
  i=0
  for spec in "${labels[@]}"; do
    parse "$spec"
    PORT=$((BASE_PORT + 10 * i)) URL=http://127.0.0.1:$PORT i=$((i + 1))
    port_of[$label]=$PORT
    [ "$tree" = @limit ] && continue
    if [ "$tree" = @triton ] && [ -z "${repo_made:-}" ]; then triton_repo && repo_made=1 || exit 1; fi
    if curl -s -m 1 -o /dev/null "$URL/v2/health/live"; then echo "something already answers at $URL" >&2; exit 1; fi
    start "$tree" "$envs" "$OUT/$label.log"
    pid_of[$label]=$serve
    trap 'for g in "${pid_of[@]}"; do kill -TERM -- -"$g" 2>/dev/null; done; wait' EXIT
    ready "$OUT/$label.log" || exit 1
  done
  sleep 2
  declare -A ticks_of
  for label in "${!pid_of[@]}"; do ticks_of[$label]=$(group_ticks "${pid_of[$label]}"); done
  sleep 10
  for label in "${!pid_of[@]}"; do
    printf "idle: %s uses %.1f%% of a core with every server idle (10 s)\n" "$label" \
      "$(($(group_ticks "${pid_of[$label]}") - ticks_of[$label]))e-1" | tee -a "$OUT/ab.txt"
  done
  for round in $(seq "$ROUNDS"); do
    order=("${labels[@]}")
    [ $((round % 2)) = 0 ] && order=("${reversed[@]}")
    for model in $MODELS; do
      for conc in $CONCS; do
        for spec in "${order[@]}"; do
          parse "$spec"
          PORT=${port_of[$label]} URL=http://127.0.0.1:${port_of[$label]}
          # what the idle servers beside it took of the cores meanwhile, in per cent of one core
          others_before=$(others_ticks "$label") t0=$(date +%s%N)
          line=$(point "$label" "$round" "$model" "$conc")
          ms=$((($(date +%s%N) - t0) / 1000000))
          beside=$(($(others_ticks "$label") - others_before))
          printf "%s  beside %.1f%%\n" "$line" "$((beside * 10000 / (ms + 1)))e-1" | tee -a "$OUT/ab.txt"
        done
      done
    done
  done
  for g in "${pid_of[@]}"; do kill -TERM -- -"$g" 2>/dev/null; done
  wait
  trap - EXIT
else
  for round in $(seq "$ROUNDS"); do
    order=("${labels[@]}")
    [ $((round % 2)) = 0 ] && order=("${reversed[@]}")  # A B, B A, A B: a drift or a slot's luck evens out
    for spec in "${order[@]}"; do
      parse "$spec"
      [ "$tree" = @triton ] && [ "$round" = 1 ] && { triton_repo || exit 1; }
      if [ "$tree" != @limit ]; then
        start "$tree" "$envs" "$OUT/$label-$round.log"
        ready "$OUT/$label-$round.log" || exit 1
      fi
      for model in $MODELS; do
        for conc in $CONCS; do
          point "$label" "$round" "$model" "$conc" | tee -a "$OUT/ab.txt"
        done
      done
      if [ "$tree" != @limit ]; then
        kill -TERM -- -"$serve" 2>/dev/null; wait "$serve" 2>/dev/null
        sleep 1
      fi
    done
  done
fi
echo "lines: $OUT/ab.txt"
"$PY" "$ROOT/bench/ab_summary.py" "$OUT/ab.txt" | tee "$OUT/summary.md"
