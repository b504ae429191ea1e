#!/usr/bin/env bash
# Set everything up, then do the main job: answer a question about an example image.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
exec .venv/bin/python scripts/run_example.py "$@"
