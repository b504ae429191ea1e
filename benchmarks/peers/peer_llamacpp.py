"""`benchmarks/peers/compare.py`'s llama.cpp worker, run in its own venv (`.peers/llamacpp/bin/python`).

Run by the harness, one measurement per fresh process:
  .peers/llamacpp/bin/python -m benchmarks.peers.peer_llamacpp convert --model-dir M --gguf-dir G --out R
  .peers/llamacpp/bin/python -m benchmarks.peers.peer_llamacpp quantize --model-dir M --gguf-dir G --out R
  .peers/llamacpp/bin/python -m benchmarks.peers.peer_llamacpp --run-dir D --model-dir M --gguf-dir G [--dtype q8_0] --out R

Role:
- `convert`: the checkpoint to an f32 text GGUF (`model-f32.gguf`) and an f32 mmproj GGUF
  (`mmproj-f32.gguf`) with llama.cpp's own `convert_hf_to_gguf.py` (kept by
  `scripts/setup_peers.sh` under `.peers/llamacpp/llama.cpp/`); `quantize`: that text GGUF to Q8_0 and
  Q4_0 (`model-q8_0.gguf`, `model-q4_0.gguf`) with llama.cpp's quantizer. The bench checkpoints' tokenizer is
  a byte-level BPE trained here, whose fingerprint the converter does not know; it is written as
  llama.cpp's `gpt-2` pre-tokenizer, which is the regex that tokenizer's ByteLevel step uses.
- measure (`one` mode; f32, Q8_0 or Q4_0 text weights, the mmproj f32): llama-cpp-python's `Llama` (n_threads = n_threads_batch = --threads)
  with its multimodal chat handler (libmtmd; llama.cpp resizes and pads images to keep their
  aspect ratio, so its pixels, and its answers, differ from transformers'). The handler is given the
  exact prompt text mmserve renders, the image standing where `<|vision_start|><|image_pad|>
  <|vision_end|>` was (libmtmd writes those markers itself), no extra system message. It evaluates
  the image and the prompt; the harness then draws exactly the workload's output tokens with
  `Llama.generate` (greedy, no repeat penalty, end-of-text tokens banned by llama.cpp's native
  logit-bias sampler, the same as transformers' min_new_tokens), stamping every token. One short
  warm-up request on the warm-up image first (the cold call); then the requests one at a time:
  TTFT = from the call's start (image decode + encode + prompt) to the first token; decode tok/s
  from the first to the last token; per-token inter-token latencies.

What it does not know: llama.cpp internals beyond llama-cpp-python's public `Llama`, its chat
handler class and sampler helper. Stdlib, Pillow and llama-cpp-python only (plus the converter).
"""

from __future__ import annotations

import argparse
import base64
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.card import ROOT
from benchmarks.peers.common import (
    GGUF_TYPES,
    load_workload,
    run_worker,
    set_thread_env,
    summarize_one,
    write_result,
)

CONVERTER_DIR = ROOT / ".peers" / "llamacpp" / "llama.cpp"
PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
# the converter run with the unknown-tokenizer fallback (a patch of this process only)
CONVERT_SNIPPET = """
import sys
sys.path.insert(0, sys.argv[1])
import conversion.base as base
_orig = base.TextModel.get_vocab_base_pre
def _pre(self, tokenizer):
    try:
        return _orig(self, tokenizer)
    except NotImplementedError:
        return "gpt-2"
base.TextModel.get_vocab_base_pre = _pre
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[2:]
convert_hf_to_gguf.main()
"""


def convert(args: argparse.Namespace) -> dict:
    args.gguf_dir.mkdir(parents=True, exist_ok=True)
    timings = {}
    for name, extra in (("model-f32.gguf", []), ("mmproj-f32.gguf", ["--mmproj"])):
        target = args.gguf_dir / name
        if target.is_file():
            continue
        tmp = args.gguf_dir / (name + ".tmp")
        started = time.perf_counter()
        cmd = [sys.executable, "-c", CONVERT_SNIPPET, str(CONVERTER_DIR), str(args.model_dir), "--outtype", "f32",
               "--outfile", str(tmp), *extra]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        if proc.returncode != 0 or not tmp.is_file():
            raise RuntimeError(f"convert_hf_to_gguf {' '.join(extra) or '(text)'} failed: "
                               f"{(proc.stderr.strip().splitlines() or ['?'])[-1]}")
        tmp.rename(target)
        timings[name] = round(time.perf_counter() - started, 1)
    return {"system": "llamacpp", "mode": "convert", "gguf_dir": str(args.gguf_dir), "convert_s": timings}


def quantize(args: argparse.Namespace) -> dict:
    """The f32 text GGUF to Q8_0 and Q4_0 with llama.cpp's own quantizer and its default recipe (what
    `llama-quantize` writes: the output tensor kept wider in Q4_0); the mmproj stays f32."""
    import ctypes

    import llama_cpp

    timings = {}
    for name in GGUF_TYPES:
        target = args.gguf_dir / f"model-{name}.gguf"
        if target.is_file():
            continue
        tmp = args.gguf_dir / f"model-{name}.gguf.tmp"
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{name.upper()}")
        params.nthread = args.threads
        started = time.perf_counter()
        rc = llama_cpp.llama_model_quantize(str(args.gguf_dir / "model-f32.gguf").encode(), str(tmp).encode(),
                                            ctypes.byref(params))
        if rc != 0 or not tmp.is_file():
            raise RuntimeError(f"llama_model_quantize to {name} failed (return code {rc})")
        tmp.rename(target)
        timings[name] = round(time.perf_counter() - started, 1)
    return {"system": "llamacpp", "mode": "quantize", "gguf_dir": str(args.gguf_dir), "quantize_s": timings}


def _handler_class():
    from llama_cpp.llama_chat_format import Qwen25VLChatHandler

    class PromptHandler(Qwen25VLChatHandler):
        """The Qwen2-VL handler with the caller's prompt text as is (the image's data URI in place)."""

        DEFAULT_SYSTEM_MESSAGE = None
        CHAT_FORMAT = ("{% for content in messages[0]['content'] %}{% if content['type'] == 'text' %}"
                       "{{ content['text'] }}{% endif %}{% endfor %}")

    return PromptHandler


def _data_uri(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def measure(args: argparse.Namespace) -> dict:
    import llama_cpp
    from llama_cpp import Llama
    from llama_cpp._internals import LlamaSampler

    wl = load_workload(args.run_dir, args.num_requests)
    handler = _handler_class()(clip_model_path=str(args.gguf_dir / "mmproj-f32.gguf"), verbose=False)
    started = time.perf_counter()
    weights = "f32" if args.dtype == "float32" else args.dtype
    llm = Llama(model_path=str(args.gguf_dir / f"model-{weights}.gguf"), chat_handler=handler, n_ctx=args.n_ctx,
                n_batch=512, n_ubatch=512, n_threads=args.threads, n_threads_batch=args.threads, seed=0,
                verbose=False)
    load_s = time.perf_counter() - started
    eog = [t for t in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(llm._model.vocab, t)]

    def greedy_sampler(**_kwargs):
        sampler = LlamaSampler()
        sampler.add_logit_bias(llm.n_vocab(), {t: float("-inf") for t in eog})
        sampler.add_greedy()
        return sampler

    llm._init_sampler = greedy_sampler  # generate() builds its sampler chain through this
    captured: dict = {}

    def capture_prompt(prompt, **_kwargs):  # the handler's hand-off after it evaluated image + prompt
        captured["prompt"] = prompt
        return iter(())

    llm.create_completion = capture_prompt

    def one(req, n_out: int) -> dict:
        uri = _data_uri(req.image_path)
        text = req.prompt.replace(PLACEHOLDER, uri, 1)
        messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}},
                                                 {"type": "text", "text": text}]}]
        captured.clear()
        t0 = time.perf_counter()
        handler(llama=llm, messages=messages, stream=True, max_tokens=n_out, temperature=0.0)
        ids, stamps = [], []
        for token in llm.generate(captured["prompt"], top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
            stamps.append(time.perf_counter())
            ids.append(int(token))
            if len(ids) >= n_out:
                break
        return {"wall_s": stamps[-1] - t0, "ttft_s": stamps[0] - t0, "decode_s": stamps[-1] - stamps[0],
                "tokens": ids, "itl_s": [b - a for a, b in zip(stamps, stamps[1:])],
                "prompt_positions": len(captured["prompt"])}

    started = time.perf_counter()
    one(wl.warmup, 4)
    cold_s = time.perf_counter() - started
    records = [one(r, wl.output_tokens) for r in wl.requests]
    out = {"system": "llamacpp", "dtype": args.dtype, "mode": "one", "load_s": round(load_s, 3),
           "cold_call_s": round(cold_s, 3), "threads": args.threads, "gguf": str(args.gguf_dir),
           "versions": {"llama_cpp_python": llama_cpp.__version__}}
    out.update(summarize_one(records))
    out["tokens"] = [r["tokens"] for r in records]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("command", nargs="?", default="measure", choices=["measure", "convert", "quantize"])
    parser.add_argument("--run-dir", type=Path)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--gguf-dir", type=Path, required=True)
    parser.add_argument("--dtype", default="float32", choices=["float32", *GGUF_TYPES],
                        help="the text model's weights: f32, or its Q8_0 / Q4_0 file (the mmproj is f32)")
    parser.add_argument("--mode", default="one", choices=["one"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--n-ctx", type=int, default=2048)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    set_thread_env(args.threads)
    body = {"convert": convert, "quantize": quantize, "measure": measure}[args.command]
    run_worker(lambda: write_result(args.out, body(args)), args.out)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
