#!/usr/bin/env bash
# Set everything up, then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
.venv/bin/python -m ruff check src tests benchmarks scripts
exec .venv/bin/python -m pytest "$@"
