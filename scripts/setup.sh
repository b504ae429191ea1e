#!/usr/bin/env bash
# Create .venv (if needed) and install mmserve into it, saying what it does, one line per phase, with pip's
# own progress. Sourced by run.sh (what running needs: MMSERVE_EXTRAS unset) and test.sh
# (MMSERVE_EXTRAS=test,ray,otel). torch is installed first and pinned: on the project's CPU machines a CPU build
# of 2.13.0 is on pip's find-links, and any other version would pull a multi-GB CUDA build. Never
# torchvision.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"
VENV=.venv
STAMP="$VENV/.mmserve-installed"
EXTRAS="${MMSERVE_EXTRAS:-}"
want="$(cat pyproject.toml scripts/setup.sh | "$PYTHON" -c 'import hashlib,sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())')"
say() { echo "mmserve setup: $*" >&2; }
# the stamp holds the hash of what was installed and its extras; a venv with the test extras also runs
installed="$(cat "$STAMP" 2>/dev/null || true)"
if [ "$installed" = "$want ${EXTRAS}" ] || { [ -z "$EXTRAS" ] && [ "${installed%% *}" = "$want" ]; }; then
  return 0
fi
started=$SECONDS
if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV with $("$PYTHON" --version) ..."
  "$PYTHON" -m venv "$VENV"
fi
say "updating pip ..."
"$VENV/bin/python" -m pip install --quiet --upgrade pip
say "installing torch 2.13.0 (the CPU build on this machine; see the README for CUDA) ..."
"$VENV/bin/python" -m pip install "torch==2.13.0"
if [ -n "$EXTRAS" ]; then
  say "installing mmserve with the extras it is tested with ($EXTRAS) ..."
  target=".[${EXTRAS}]"
else
  say "installing mmserve and what it needs to run ..."
  target="."
fi
"$VENV/bin/python" -m pip install -e "$target"
echo "$want ${EXTRAS}" > "$STAMP"
say "ready in $((SECONDS - started)) s"
