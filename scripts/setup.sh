#!/usr/bin/env bash
# Create .venv (if needed) and install mmserve with its test extra. Sourced by run.sh and test.sh.
# torch is installed first and pinned: on the project's CPU machines a CPU build of 2.13.0 is on
# pip's find-links, and any other version would pull a multi-GB CUDA build. Never torchvision.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"
VENV=.venv
STAMP="$VENV/.mmserve-installed"
want="$(cat pyproject.toml scripts/setup.sh | "$PYTHON" -c 'import hashlib,sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())')"
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$want" ]; then
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  "$VENV/bin/python" -m pip install --quiet "torch==2.13.0"
  "$VENV/bin/python" -m pip install --quiet -e ".[test,ray]"
  echo "$want" > "$STAMP"
fi
