#!/usr/bin/env bash
# Install Despina with its test extras into .venv, lint (ruff) and type-check (mypy) it, and run the whole
# test suite twice over: against a Redis server (REDIS_URL, default 127.0.0.1:6379, started here if it is
# installed and not running), then the end-to-end gateway tests against the embedded Valkey of `despina serve`.
# Arguments go to the first pytest run (and skip the lint: a chosen test runs at once, in one process).
# PYTHON=path picks the interpreter .venv is made with (when there is no .venv yet; default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
.venv/bin/pip install -q --disable-pip-version-check -e '.[test]'
# Debian's packages some tests need where the machine lacks them: headless chromium renders the status page
# (Playwright never downloads a browser); libfaketime gives one process a wrong clock (test_clock_skew.py)
missing=()
command -v chromium >/dev/null || missing+=(chromium)
[ -e /usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1 ] || [ -e /usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1 ] \
  || missing+=(libfaketime)
if [ ${#missing[@]} != 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "installing ${missing[*]} for the status page and clock tests"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}") >/dev/null 2>&1 \
    || echo "${missing[*]} could not be installed: the tests that need them will be skipped"
fi

export REDIS_URL=${REDIS_URL:-redis://127.0.0.1:6379/0}
if command -v redis-cli >/dev/null && ! redis-cli -u "$REDIS_URL" ping >/dev/null 2>&1; then
  if command -v redis-server >/dev/null && [[ $REDIS_URL == redis://127.0.0.1:6379* ]]; then
    echo "starting redis-server on 127.0.0.1:6379"
    redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no
    for _ in $(seq 50); do redis-cli -u "$REDIS_URL" ping >/dev/null 2>&1 && break; sleep 0.1; done
  fi
fi  # if no Redis answers, the fixtures fall back to an embedded Valkey

if [ $# = 0 ]; then  # the whole suite: lint and type-check first (pyproject.toml's settings)
  .venv/bin/ruff check despina bench tests
  .venv/bin/mypy despina
  # then the tests in DESPINA_TEST_PROCESSES processes (pytest-xdist), each running a test file at a time
  # (a module's shared server starts once): most tests wait on servers and timeouts more than they use a
  # core: on a 2-core machine 3 processes took a third of the time of one (2: under half)
  set -- -n "${DESPINA_TEST_PROCESSES:-3}" --dist loadfile
fi
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
DESPINA_TEST_REDIS=embedded .venv/bin/python -m pytest -q -p no:cacheprovider \
  tests/test_gateway_triton.py tests/test_gateway_errors.py
