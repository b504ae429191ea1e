"""`benchmarks/peers/compare.py`'s mmserve worker (and its transformers reference), run in mmserve's own venv.

Run by the harness, one measurement per fresh process:
  .venv/bin/python -m benchmarks.peers.peer_mmserve --run-dir D --model-dir M --dtype float32 --mode batch --out R
  .venv/bin/python -m benchmarks.peers.peer_mmserve --run-dir D --model-dir M --reference 8 --out R

Role: load the workload saved in the run directory (`peers_common.load_workload`), build a fresh
`LLM(model_dir, dtype=..., compile_cpu_decode=..., quantization=...)`, warm it up with one short request on the workload's warm-up image (a
different image and question, so no timed request is in the prefix or encoder cache; where the
environment asks for a background compile (MMSERVE_COMPILE_CPU_DECODE=1) also wait until it replays,
reported as `compiled_after_s` from the start), then time
- `batch`: all requests in one `llm.chat` call; tokens/s = output tokens / the call's wall time;
  TTFT per request from the call's start (`RequestOutput.metrics`);
- `one`: one `llm.chat` call per request, in order; TTFT, decode tokens/s = (n - 1) / (finish -
  first token), end-to-end tokens/s.
Every request asks for exactly the workload's output tokens (min = max, ignore_eos), greedy; in a
structured workload (`peers.py --structured`) up to that many under its JSON schema (compact JSON, the
warm-up compiles the schema).
With `--reference N` it instead runs transformers' `generate` (float32, greedy, the PIL image
processor, the same prompt text) on the first N requests and writes their token ids.

What it does not know: mmserve internals; only `LLM`, `SamplingParams` and `RequestOutput.metrics`.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

from benchmarks.peers.common import (
    load_workload,
    run_worker,
    set_thread_env,
    summarize_batch,
    summarize_one,
    write_result,
)


def _messages(req, image) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                         {"type": "text", "text": req.question}]}]


def _params(json_schema: dict | None, n_out: int) -> tuple:
    """(timed, warm-up) sampling parameters: exactly n_out plain tokens, or up to n_out under the schema
    (the warm-up compiles it, so the timed call finds it compiled)."""
    from mmserve import SamplingParams, StructuredOutputsParams

    if json_schema is None:
        return (SamplingParams(temperature=0, max_tokens=n_out, min_tokens=n_out, ignore_eos=True),
                SamplingParams(temperature=0, max_tokens=4, min_tokens=4, ignore_eos=True))
    so = StructuredOutputsParams(json=json_schema)
    return (SamplingParams(temperature=0, max_tokens=n_out, structured_outputs=so),
            SamplingParams(temperature=0, max_tokens=4, structured_outputs=so))


# --compile-cpu-decode -> the engine argument (None: the engine's default, eager unless the environment asks)
COMPILE_SETTINGS = {"on": True, "off": False, "default": None}


def run_mmserve(args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    from mmserve import LLM

    wl = load_workload(args.run_dir, args.num_requests)
    images = [r.image() for r in wl.requests]
    n_out = wl.output_tokens
    params, warm_params = _params(wl.json_schema, n_out)
    started = time.perf_counter()
    engine_args: dict[str, Any] = dict(dtype=args.dtype, max_num_seqs=max(len(images), 1))
    if COMPILE_SETTINGS[args.compile_cpu_decode] is not None:  # only a setting that is not the default
        engine_args["compile_cpu_decode"] = COMPILE_SETTINGS[args.compile_cpu_decode]
    if args.quantization:
        engine_args["quantization"] = args.quantization
    llm = LLM(str(args.model_dir), **engine_args)
    load_s = time.perf_counter() - started
    started = time.perf_counter()  # cold call: first request of the process, on the warm-up image
    llm.chat([_messages(wl.warmup, wl.warmup.image())], warm_params, use_tqdm=False)
    cold_s = time.perf_counter() - started
    compiled_after_s = None
    if llm.engine.get_stats()["cpu_decode_compile"] == "compiling":  # the steady state: a background compile done
        if not llm.engine.wait_for_compiled_decode(timeout_s=1800):
            raise RuntimeError(f"the background compile ended {llm.engine.get_stats()['cpu_decode_compile']!r}")
        compiled_after_s = round(time.perf_counter() - started + load_s, 3)
    out = {"system": "mmserve", "dtype": args.quantization or args.dtype, "mode": args.mode, "load_s": round(load_s, 3),
           "cold_call_s": round(cold_s, 3), "compiled_after_s": compiled_after_s, "threads": torch.get_num_threads(),
           "versions": {"torch": torch.__version__}, "ld_preload": os.environ.get("LD_PRELOAD", ""),
           "engine_args": engine_args}
    if args.mode == "batch":
        convs = [_messages(r, im) for r, im in zip(wl.requests, images)]
        before = llm.get_stats()
        t_wall = time.time()
        started = time.perf_counter()
        outputs = llm.chat(convs, params, use_tqdm=False)
        wall_s = time.perf_counter() - started
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        out["texts"] = [o.outputs[0].text for o in outputs]
        out["finish_reasons"] = [o.outputs[0].finish_reason for o in outputs]
        out.update(summarize_batch(t_wall, wall_s, tokens, [o.metrics.first_token_time for o in outputs],
                                   [o.metrics.finish_time for o in outputs]))
        if args.dtype == "float32" and not args.quantization:  # the peak is float32's
            out["floor"] = batch_floor(llm, args.model_dir, convs, outputs, before, llm.get_stats())
    else:
        records, tokens = [], []
        for req, im in zip(wl.requests, images):
            t_wall = time.time()
            started = time.perf_counter()
            (o,) = llm.chat([_messages(req, im)], params, use_tqdm=False)
            wall_s = time.perf_counter() - started
            ids = list(o.outputs[0].token_ids)
            m = o.metrics
            records.append({"wall_s": wall_s, "ttft_s": m.first_token_time - t_wall,
                            "decode_s": m.finish_time - m.first_token_time, "tokens": ids})
            tokens.append(ids)
        out.update(summarize_one(records))
    out["tokens"] = tokens
    return out


FLOOR_STATS = ("prompt_tokens_computed", "generation_tokens", "encoder_items_encoded", "encoder_tokens_encoded")


def batch_floor(llm, model_dir: Path, convs: list[list[dict]], outputs: list, before: dict, after: dict) -> dict:
    """The FLOP floor (`benchmarks/engine/floor.py`) of the work the timed call did: the seconds no engine
    doing the same matmuls and attention could beat at this machine's peak float32 matmul rate."""
    from benchmarks.engine.floor import attention_work, compute_floor, matmul_peak_gflops

    stats = {k: after[k] - before[k] for k in FLOOR_STATS}  # the warm-up call's work is not the call's
    processed = [llm.engine.process_chat(c) for c in convs]
    return compute_floor(model_dir, stats, attention_work(processed, outputs), matmul_peak_gflops())


def run_reference(args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    from transformers import Qwen2VLForConditionalGeneration

    from testkit.tiny_checkpoints import reference_inputs

    wl = load_workload(args.run_dir, args.reference)
    model = Qwen2VLForConditionalGeneration.from_pretrained(str(args.model_dir), dtype=torch.float32).eval()
    pad_id = model.config.text_config.pad_token_id
    tokens = []
    started = time.perf_counter()
    for req in wl.requests:
        inputs, _ = reference_inputs(args.model_dir, req.prompt, images=[req.image()])
        with torch.no_grad():
            gen = model.generate(**inputs, max_new_tokens=wl.output_tokens, min_new_tokens=wl.output_tokens,
                                 do_sample=False, pad_token_id=pad_id)
        tokens.append(gen[0, inputs["input_ids"].shape[1]:].tolist())
    import transformers

    return {"system": "transformers", "dtype": "float32", "mode": "reference", "tokens": tokens,
            "wall_s": round(time.perf_counter() - started, 3),
            "prompt_tokens": [int(reference_inputs(args.model_dir, r.prompt, images=[r.image()])[0]["input_ids"]
                                  .shape[1]) for r in wl.requests],
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--mode", default="batch", choices=["batch", "one"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--reference", type=int, default=0, help="transformers reference on the first N requests")
    parser.add_argument("--quantization", default=None, choices=["int8", "int4", "w8a8", "w4a8", "int4_weight_only"],
                        help="the language model's weights quantized at load (float32 activations)")
    parser.add_argument("--compile-cpu-decode", nargs="?", const="on", default="default", choices=tuple(COMPILE_SETTINGS),
                        help="on: the engine compiles its decode step before serving (load takes longer); "
                             "default: the engine's default (eager); off: eager")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    set_thread_env(args.threads)

    def body() -> None:
        result = run_reference(args) if args.reference else run_mmserve(args)
        write_result(args.out, result)

    run_worker(body, args.out)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
