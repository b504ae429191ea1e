#!/usr/bin/env bash
# Create .venv (if needed) and install mmserve into it with the right torch build, saying what it does,
# one line per phase. Run by hand, or sourced by run.sh (what running needs: MMSERVE_EXTRAS=client) and
# test.sh (MMSERVE_EXTRAS=test,ray,otel,client).
#
#   bash scripts/setup.sh [--cuda | --cpu] [--dry-run]
#
# torch 2.13.0 (never torchvision): a CUDA build from PyTorch's wheel index where an NVIDIA GPU is found
# (`nvidia-smi` lists one) or `--cuda` is given, its CUDA version picked from what the driver supports
# (MMSERVE_TORCH_CUDA=cu126|cu128|cu130 overrides); otherwise the CPU build (`--cpu` forces it), from a
# local find-links folder where pip's configuration names one that holds it, else from PyTorch's CPU
# index. `--dry-run` prints the commands it would run and changes nothing.
# Installer: uv where it can be had (on PATH, or installed into the venv by pip: a fresh set-up takes
# seconds instead of most of a minute), fed the package sources pip is configured with
# (scripts/pip_sources.py); MMSERVE_INSTALLER=pip keeps to pip. One install call: torch, mmserve
# (editable) and its extras resolved together. Bytecode is compiled after the install, in parallel, for
# mmserve's sources and the installed packages a start imports: where PYTHONDONTWRITEBYTECODE is set (as
# on the project's machines) Python would otherwise compile every module it imports again on every start.
# Left out unless the test extras are installed: what only tests or client scripts import (transformers,
# openai, pygments) and the installers (pip, setuptools), about half of the files.
# Sourced, it reads no arguments (they are the caller's): the caller sets MMSERVE_TORCH=auto|cpu|cuda
# and MMSERVE_SETUP_DRY_RUN=1 instead. The stamp .venv/.mmserve-installed names what was installed
# (hash of pyproject.toml and this script, torch build, extras): a CPU venv is never taken for a CUDA one.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
MMSERVE_TORCH_VERSION=2.13.0
_mms_torch="${MMSERVE_TORCH:-auto}"
_mms_dry="${MMSERVE_SETUP_DRY_RUN:-0}"
if [ "${BASH_SOURCE[0]}" = "$0" ]; then  # run, not sourced: the arguments are ours
  for _mms_arg in "$@"; do
    case "$_mms_arg" in
      --cuda) _mms_torch=cuda ;;
      --cpu) _mms_torch=cpu ;;
      --dry-run) _mms_dry=1 ;;
      -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
      *) echo "setup.sh: unknown argument $_mms_arg (--cuda, --cpu, --dry-run, --help)" >&2; exit 2 ;;
    esac
  done
fi
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"
VENV=.venv
STAMP="$VENV/.mmserve-installed"
EXTRAS="${MMSERVE_EXTRAS:-}"
say() { echo "mmserve setup: $*" >&2; }

# the CUDA version the NVIDIA driver supports ("12.8"), empty when there is no NVIDIA GPU
_mms_driver_cuda() {
  command -v nvidia-smi >/dev/null 2>&1 || return 0
  nvidia-smi -L 2>/dev/null | grep -q '^GPU ' || return 0
  nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9][0-9.]*\).*/\1/p' | head -n 1
  nvidia-smi 2>/dev/null | grep -q 'CUDA Version' || echo unknown
}
# the newest of PyTorch's CUDA builds this driver runs
_mms_cuda_tag() {
  if [ -n "${MMSERVE_TORCH_CUDA:-}" ]; then echo "$MMSERVE_TORCH_CUDA"; return; fi
  local major=${1%%.*} minor=${1#*.}
  minor=${minor%%.*}
  if [ "$1" = unknown ] || [ -z "$1" ]; then echo cu128
  elif [ "$major" -ge 13 ]; then echo cu130
  elif [ "$major" -eq 12 ] && [ "$minor" -ge 8 ]; then echo cu128
  else echo cu126; fi
}
_mms_cuda="$(_mms_driver_cuda)"
case "$_mms_torch" in
  auto) if [ -n "$_mms_cuda" ]; then _mms_build="$(_mms_cuda_tag "$_mms_cuda")"; else _mms_build=cpu; fi ;;
  cuda) _mms_build="$(_mms_cuda_tag "${_mms_cuda:-unknown}")" ;;
  cpu) _mms_build=cpu ;;
  *) say "MMSERVE_TORCH=$_mms_torch: expected auto, cpu or cuda"; return 2 2>/dev/null || exit 2 ;;
esac

want="$(cat pyproject.toml scripts/setup.sh scripts/pip_sources.py \
  | "$PYTHON" -c 'import hashlib,sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())')"
# up to date: same hash, same torch build, and every extra asked for among those installed
_mms_up_to_date() {
  local hash build extras wanted
  [ -f "$STAMP" ] || return 1
  read -r hash build extras < "$STAMP" || return 1
  [ "$hash" = "$want" ] && [ "$build" = "$_mms_build" ] || return 1
  for wanted in ${EXTRAS//,/ }; do
    case ",${extras:-}," in *",$wanted,"*) ;; *) return 1 ;; esac
  done
}
if [ "$_mms_dry" != 1 ] && _mms_up_to_date; then
  return 0 2>/dev/null || exit 0
fi

# what to install: torch's build, then mmserve and its extras, in one call; the sources pip is configured
# with, as uv flags, and whether a local find-links folder holds the CPU build (its last line)
mapfile -t _mms_sources < <("$PYTHON" scripts/pip_sources.py --python "$PYTHON" \
  --has-wheel "torch-$MMSERVE_TORCH_VERSION+cpu-*.whl")
_mms_index=()
if [ "$_mms_build" = cpu ]; then
  if [ "$(uname -s)-$(uname -m)" = Linux-x86_64 ]; then
    _mms_torch_req="torch==$MMSERVE_TORCH_VERSION+cpu"  # `==2.13.0` would keep (or fetch) a CUDA build
    [ "${_mms_sources[-1]}" = "has-wheel: yes" ] || _mms_index=(--extra-index-url https://download.pytorch.org/whl/cpu)
  else
    _mms_torch_req="torch==$MMSERVE_TORCH_VERSION"  # PyPI's build for this platform is the CPU one
  fi
else
  _mms_torch_req="torch==$MMSERVE_TORCH_VERSION+$_mms_build"
  _mms_index=(--extra-index-url "https://download.pytorch.org/whl/$_mms_build")
fi
_mms_target="."
[ -n "$EXTRAS" ] && _mms_target=".[${EXTRAS}]"
_mms_installer="${MMSERVE_INSTALLER:-uv}"
_mms_uv=""
if [ "$_mms_installer" = uv ]; then
  if command -v uv >/dev/null 2>&1; then _mms_uv="$(command -v uv)"; else _mms_uv="$VENV/bin/uv"; fi
fi

_mms_run() {  # run a command, or print it under --dry-run
  if [ "$_mms_dry" = 1 ]; then printf '%q ' "$@" | sed 's/ $//'; echo; else "$@"; fi
}
if [ "$_mms_dry" = 1 ]; then
  if _mms_up_to_date; then say "dry run: $VENV is up to date; a fresh set-up would run:"
  else say "dry run: $VENV needs setting up; this would run:"; fi
  say "torch build: $_mms_build (GPU: ${_mms_cuda:-none found}); stamp: $want $_mms_build $EXTRAS"
fi
started=$SECONDS
if [ "$_mms_dry" = 1 ] || [ ! -x "$VENV/bin/python" ]; then
  [ "$_mms_dry" = 1 ] || say "creating $VENV with $("$PYTHON" --version) ..."
  _mms_run "$PYTHON" -m venv "$VENV"
fi
if [ "$_mms_uv" = "$VENV/bin/uv" ] && { [ "$_mms_dry" = 1 ] || [ ! -x "$VENV/bin/uv" ]; }; then
  [ "$_mms_dry" = 1 ] || say "installing uv into $VENV (a faster installer; MMSERVE_INSTALLER=pip skips it) ..."
  _mms_run "$VENV/bin/python" -m pip install --quiet uv || { say "no uv: installing with pip"; _mms_uv=""; }
fi
[ "$_mms_dry" = 1 ] || say "installing $_mms_torch_req and mmserve${EXTRAS:+ with $EXTRAS} ..."
if [ -n "$_mms_uv" ]; then
  _mms_run "$_mms_uv" pip install --python "$VENV/bin/python" "${_mms_sources[@]:0:${#_mms_sources[@]}-1}" \
    "${_mms_index[@]}" "$_mms_torch_req" -e "$_mms_target"
else
  _mms_run "$VENV/bin/python" -m pip install --no-compile "${_mms_index[@]}" "$_mms_torch_req" -e "$_mms_target"
fi
[ "$_mms_dry" = 1 ] || say "compiling bytecode ..."
_mms_skip=(-x '/site-packages/(transformers|openai|pygments|pip|setuptools)/')
case ",$EXTRAS," in *,test,*) _mms_skip=() ;; esac
# a file that does not compile (some packages ship such) is Python's to report when imported, not ours
_mms_run "$VENV/bin/python" -m compileall -qq -j 0 "${_mms_skip[@]}" "$VENV/lib" src/mmserve || true
if [ "$_mms_dry" = 1 ]; then
  return 0 2>/dev/null || exit 0
fi
echo "$want $_mms_build $EXTRAS" > "$STAMP"
say "ready in $((SECONDS - started)) s"
