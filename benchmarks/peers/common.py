"""What `benchmarks/peers/compare.py` and its per-system workers share: the saved workload and the result file.

Role: the orchestrator (`peers.py`, in mmserve's venv) writes one workload into a run directory
(`workload.json` + one PNG per request + a warm-up PNG); each worker (`peer_mmserve.py` in mmserve's
venv, `peer_vllm.py` and `peer_llamacpp.py` in the peers' own venvs under `.peers/`) reads it back
with `load_workload`, measures one (system, dtype, mode) and writes one JSON result with
`write_result`. The timing summaries (`summarize_batch`, `summarize_one`) are shared so every system
is reduced the same way.

Stdlib and Pillow only: this file is imported inside every peer's venv, which has neither mmserve
nor its dependencies. What it does not know: any engine.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WORKLOAD_FILE = "workload.json"
# llama.cpp's quantized GGUFs of a bench model, named as its file types (llama_cpp.LLAMA_FTYPE_MOSTLY_<NAME>)
GGUF_TYPES = ("q8_0", "q4_0")
# The extraction schema of the structured-output benchmarks (`peers.py --structured`,
# `structured_outputs.py`): a list of at least 8 labelled scores, long enough that a batch decodes its
# full token budget rather than closing the object early.
EXTRACTION_SCHEMA: dict[str, Any] = {
    "type": "object", "properties": {"items": {"type": "array", "items": {
        "type": "object", "properties": {"label": {"type": "string"}, "score": {"type": "number"}},
        "required": ["label", "score"], "additionalProperties": False}, "minItems": 8}},
    "required": ["items"], "additionalProperties": False}


@dataclass
class Request:
    index: int
    image_path: Path
    question: str
    prompt: str  # mmserve's chat-template rendering, one <|vision_start|><|image_pad|><|vision_end|>
    width: int
    height: int

    def image(self):
        from PIL import Image

        with Image.open(self.image_path) as im:
            return im.convert("RGB")


@dataclass
class Workload:
    requests: list[Request]
    warmup: Request  # a distinct image and question, so warm-up never primes a timed request's caches
    output_tokens: int
    meta: dict[str, Any]
    # `peers.py --structured`: every request (the warm-up too) is held to this JSON schema, compact JSON,
    # on each system's xgrammar backend, up to `output_tokens` tokens (no min_tokens: a grammar decides
    # where the output may end); None: plain requests of exactly `output_tokens` tokens
    json_schema: dict[str, Any] | None = None


def _request(run_dir: Path, raw: dict[str, Any]) -> Request:
    return Request(raw["index"], run_dir / raw["image"], raw["question"], raw["prompt"], raw["width"],
                   raw["height"])


def load_workload(run_dir: Path, num_requests: int | None = None) -> Workload:
    raw = json.loads((run_dir / WORKLOAD_FILE).read_text())
    reqs = [_request(run_dir, r) for r in raw["requests"]]
    if num_requests:
        reqs = reqs[:num_requests]
    return Workload(reqs, _request(run_dir, raw["warmup"]), raw["output_tokens"], raw.get("meta", {}),
                    raw.get("json_schema"))


def set_thread_env(threads: int) -> None:
    """Before any numeric library is imported: every OpenMP/BLAS pool sized to `threads`."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(threads)


def summarize_batch(started_wall: float, wall_s: float, tokens: list[list[int]],
                    first_token_times: list[float | None], finish_times: list[float | None]) -> dict[str, Any]:
    """One call with every request. Times are time.time() stamps; TTFT from the call's start."""
    total = sum(len(t) for t in tokens)
    ttft = [round((f - started_wall) * 1000, 2) for f in first_token_times if f is not None]
    itl = [round((e - f) * 1000 / (len(t) - 1), 3) for f, e, t in zip(first_token_times, finish_times, tokens)
           if f is not None and e is not None and len(t) > 1]
    return {"wall_s": round(wall_s, 4), "output_tokens": total, "tokens_per_s": round(total / wall_s, 2),
            "ttft_ms": ttft, "ttft_ms_median": round(statistics.median(ttft), 2) if ttft else None,
            "itl_ms": itl}


def summarize_one(records: list[dict[str, Any]]) -> dict[str, Any]:
    """One request at a time. Each record: wall_s (the call), ttft_s, decode_s (first token to last),
    tokens, itl_s (per-token gaps when the system streams them, else absent)."""
    total = sum(len(r["tokens"]) for r in records)
    wall = sum(r["wall_s"] for r in records)
    decode_tokens = sum(len(r["tokens"]) - 1 for r in records)
    decode_s = sum(r["decode_s"] for r in records)
    ttft = [round(r["ttft_s"] * 1000, 2) for r in records]
    itl: list[float] = []
    for r in records:
        if r.get("itl_s"):
            itl.extend(round(x * 1000, 3) for x in r["itl_s"])
        elif len(r["tokens"]) > 1:
            itl.append(round(r["decode_s"] * 1000 / (len(r["tokens"]) - 1), 3))
    return {"wall_s": round(wall, 4), "output_tokens": total, "tokens_per_s": round(total / wall, 2),
            "decode_tokens_per_s": round(decode_tokens / decode_s, 2) if decode_s > 0 else None,
            "ttft_ms": ttft, "ttft_ms_median": round(statistics.median(ttft), 2),
            "itl_ms": itl, "itl_per_token": any(r.get("itl_s") for r in records)}


def write_result(path: Path, result: dict[str, Any]) -> None:
    result.setdefault("python", platform.python_version())
    path.write_text(json.dumps(result))


def run_worker(main, out_path: Path) -> None:
    """Run a worker's main; on any exception write an error result (the harness reports it) and exit 1."""
    try:
        main()
    except Exception as exc:  # noqa: BLE001 - every failure becomes a reported result
        tb = traceback.format_exc()
        print(tb, file=sys.stderr)
        write_result(out_path, {"error": f"{type(exc).__name__}: {exc}"[:2000], "traceback": tb[-4000:],
                                "finished_at": time.time()})
        sys.exit(1)
