#!/usr/bin/env bash
# Set everything up, then run the whole test suite (what CI runs). `--fast`: the unit tier only, without
# what is marked slow or kernels (under a minute, no C++ compiled; no browser needed). Other arguments go
# to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
MMSERVE_EXTRAS=test,ray,otel,client source scripts/setup.sh
if [ "${1:-}" = "--fast" ]; then
  shift
  .venv/bin/python -m ruff check src tests testkit benchmarks scripts
  exec .venv/bin/python -m pytest tests/unit -m "not slow and not kernels" -q "$@"
fi
# the web chat's browser test drives Debian's chromium (Playwright's own browser download cannot reach
# its host here): installed here, not in setup.sh, which run.sh shares; checked on every run, since the
# venv's stamp says nothing about the system
if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing chromium for the web UI test ..." >&2
  apt-get update -qq && apt-get install -y -qq chromium >/dev/null \
    || echo "could not install chromium: the web UI browser tests will be skipped" >&2
fi
.venv/bin/python -m ruff check src tests testkit benchmarks scripts
exec .venv/bin/python -m pytest "$@"
