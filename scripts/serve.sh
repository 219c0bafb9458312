#!/usr/bin/env bash
# Install Despina with ONNX Runtime into .venv, build the example models, serve them on :8000.
# Extra arguments go to `despina serve` (e.g. --workers 2, --redis-url redis://host:6379). PYTHON=path
# picks the interpreter .venv is made with (when there is no .venv yet; default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
.venv/bin/pip install -q --disable-pip-version-check -e '.[onnx,examples]'
.venv/bin/python -m despina.examples model_repository
# Only onnxruntime is installed here, so the example repository's PyTorch and TensorFlow models stay
# UNAVAILABLE (the index says why): ready (/v2/health/ready) once the rest serve, not Triton's strict rule
# that every model must load. A later --strict-readiness in "$@" wins.
exec .venv/bin/despina serve --model-repository model_repository --strict-readiness=false "$@"
