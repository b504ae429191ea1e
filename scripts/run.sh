#!/usr/bin/env bash
# Set everything up (scripts/setup.sh), then do the main job: answer a question about an example image
# with the bundled demo model, then serve it, with its chat page, until Ctrl-C.
#
#   bash scripts/run.sh [--host HOST] [--port PORT] [--no-serve] [--cuda | --cpu]
#
#   --host HOST   the address the server listens on (default 127.0.0.1, this machine only;
#                 0.0.0.0 for every interface)
#   --port PORT   the server's port (default 8000)
#   --no-serve    stop after the answer
#   --cuda        install the CUDA build of torch (the default where `nvidia-smi` lists a GPU)
#   --cpu         install the CPU build of torch, even where there is a GPU
set -euo pipefail
cd "$(dirname "$0")/.."
example_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    --cuda) export MMSERVE_TORCH=cuda ;;
    --cpu) export MMSERVE_TORCH=cpu ;;
    --no-serve) example_args+=("$1") ;;
    --host|--port)
      [ $# -ge 2 ] || { echo "run.sh: $1 needs a value (--help lists the options)" >&2; exit 2; }
      example_args+=("$1" "$2"); shift ;;
    --host=*|--port=*) example_args+=("$1") ;;
    *) echo "run.sh: unknown option $1 (--help lists the options)" >&2; exit 2 ;;
  esac
  shift
done
# sourced, setup.sh reads no arguments: MMSERVE_TORCH (set above) and MMSERVE_EXTRAS say what it installs;
# `client` brings the official openai client the README's client example uses
MMSERVE_EXTRAS=client source scripts/setup.sh
exec .venv/bin/python scripts/run_example.py "${example_args[@]}"
