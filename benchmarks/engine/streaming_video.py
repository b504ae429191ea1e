"""Streaming video benchmark: a clip that grows turn by turn, streaming reuse vs re-encoding everything.

Run: python -m benchmarks.engine.streaming_video [--quick] [--rounds 3] [--turns 10]

Role: one Qwen2-VL checkpoint (the ~100M bench checkpoint built under `.bench/` by
`benchmarks/engine/offline.py`; `--quick`: the tiny one), one synthetic stream (`mmserve.demo.video.moving_shapes`,
--fps frames per second, --size px square): turn t sends the first t x --seconds-per-turn seconds of it
(frames[:fps x seconds x t]) with the same question, one request at a time, greedy, exactly
--output-tokens tokens. Two modes on the same frames:
- stream: the video part has no uuid, so each temporal group (2 frames) is keyed by its own pixels: a turn
  encodes only the groups the previous turn did not have (encoder cache) and prefills from the first
  KV block that differs (prefix cache);
- reencode: the video part carries `uuid` "turn-<t>-<round>", unique per turn and round, so every group
  of every turn is encoded and prefilled again (the baseline).
A round runs the whole stream in each mode, each on a fresh `LLM` (load off the clock) warmed up by one
short request on another clip (seed + 1, same size); the mode that goes first alternates per round.
Per turn: TTFT = wall time from just before `llm.chat` (so preprocessing — resizing and hashing every
frame — counts) to `metrics.first_token_time`; the split of it into preprocessing (`Engine.process_chat`,
timed by wrapping it on the instance), vision encoding (`runner.encoder.encode_fn`, wrapped likewise) and
the rest (scheduling, prefill, the first sample); the deltas of `get_stats()` (encoder tokens, prefix
cache hit tokens, prompt tokens computed); the greedy token ids, which must be identical in both modes
and every round. Medians over rounds; the ratio stream / reencode of median TTFTs per turn; target:
turn-N (the last turn) ratio <= 0.3.

Prints a card, a table and one JSON line last (`benchmarks/reports/streaming_video.py`).
What it does not know: mmserve internals beyond the offline API (`LLM.chat`, `get_stats`), and the two
instance attributes it wraps for timing (`engine.process_chat`, `engine.runner.encoder.encode_fn`; the
code is untouched).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.checkpoints import EAGER
from benchmarks.reports.streaming_video import json_line, print_card, print_table, summarize

MODES = ("stream", "reencode")
QUESTION = "What is happening now?"
STAT_KEYS = ("encoder_tokens_encoded", "encoder_items_encoded", "encoder_cache_hits", "encoder_cache_misses",
             "prefix_cache_hit_tokens", "prompt_tokens", "prompt_tokens_computed", "num_preemptions",
             "kv_cache_evictions", "encoder_cache_evictions")
END_STAT_KEYS = ("kv_blocks_total", "kv_blocks_free", "kv_capacity_tokens", "kv_cache_evictions", "num_preemptions",
                 "encoder_cache_bytes_used", "encoder_cache_bytes_total", "encoder_cache_evictions",
                 "budget_max_encoder_tokens_per_step", "budget_encoder_cache_bytes")


def _log(msg: str) -> None:
    print(f"[streaming_video] {msg}", file=sys.stderr, flush=True)


def _messages(frames: list[Any], uuid: str | None) -> list[dict[str, Any]]:
    video: dict[str, Any] = {"type": "video", "video": frames}
    if uuid is not None:
        video["uuid"] = uuid
    return [{"role": "user", "content": [video, {"type": "text", "text": QUESTION}]}]


class _Timer:
    """Seconds spent inside a wrapped callable since the last `take()`."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started
        return timed

    def take(self) -> float:
        s, self.seconds = self.seconds, 0.0
        return s


def _fresh_llm(model_dir: Path, engine_args: dict[str, Any]) -> tuple[Any, _Timer, _Timer]:
    from mmserve import LLM

    gc.collect()  # the previous LLM's KV pool goes back before the next one is allocated
    llm = LLM(str(model_dir), **{**EAGER, **engine_args})
    preprocess, encode = _Timer(), _Timer()
    engine = llm.engine
    engine.process_chat = preprocess.wrap(engine.process_chat)  # instance attributes: this LLM only
    engine.runner.encoder.encode_fn = encode.wrap(engine.runner.encoder.encode_fn)
    return llm, preprocess, encode


def _greedy(tokens: int) -> Any:
    from mmserve import SamplingParams

    return SamplingParams(temperature=0, max_tokens=tokens, min_tokens=tokens)


def run_stream(mode: str, round_index: int, model_dir: Path, engine_args: dict[str, Any], frames: list[Any],
               warmup_frames: list[Any], frames_per_turn: int, turns: int, output_tokens: int,
               fps: float) -> dict[str, Any]:
    """The whole stream in one mode on a fresh, warmed-up LLM: one record per turn, and the end stats."""
    load_started = time.perf_counter()
    llm, preprocess, encode = _fresh_llm(model_dir, engine_args)
    load_s = time.perf_counter() - load_started
    kwargs = {"fps": fps}
    warm_started = time.perf_counter()
    llm.chat(_messages(warmup_frames, None), _greedy(2), use_tqdm=False, mm_processor_kwargs=kwargs)
    warmup_s = time.perf_counter() - warm_started
    preprocess.take(), encode.take()
    records = []
    for t in range(1, turns + 1):
        clip = frames[:frames_per_turn * t]
        uuid = f"turn-{t}-{round_index}" if mode == "reencode" else None
        before = llm.get_stats()
        started = time.time()
        out = llm.chat(_messages(clip, uuid), _greedy(output_tokens), use_tqdm=False, mm_processor_kwargs=kwargs)[0]
        done = time.time()
        after = llm.get_stats()
        metrics = out.metrics
        records.append({
            "turn": t, "frames": len(clip), "prompt_len": len(out.prompt_token_ids),
            "ttft_ms": (metrics.first_token_time - started) * 1e3,
            "engine_ttft_ms": (metrics.first_token_time - metrics.arrival_time) * 1e3,
            "preprocess_ms": preprocess.take() * 1e3, "encode_ms": encode.take() * 1e3,
            "request_ms": (done - started) * 1e3, "num_cached_tokens": out.num_cached_tokens,
            "token_ids": list(out.outputs[0].token_ids), "finish_reason": out.outputs[0].finish_reason,
            **{k: after[k] - before[k] for k in STAT_KEYS}})
    end = llm.get_stats()
    llm.shutdown()
    del llm
    gc.collect()
    return {"mode": mode, "round": round_index, "load_s": load_s, "warmup_s": warmup_s, "turns": records,
            "end_stats": {k: end[k] for k in END_STAT_KEYS}}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 1 round: a smoke run")
    parser.add_argument("--model", default="100m", help="100m (default), tiny, or a checkpoint directory")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each mode once per round (default 3; >= 3 "
                        "for a verdict)")
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--seconds-per-turn", type=float, default=2.0, help="how much the stream grows per turn")
    parser.add_argument("--fps", type=float, default=2.0, help="the stream's frame rate (default 2)")
    parser.add_argument("--size", type=int, default=224, help="frame width and height in px (default 224)")
    parser.add_argument("--output-tokens", type=int, default=8, help="greedy tokens per turn (min = max)")
    parser.add_argument("--seed", type=int, default=0, help="the clip's seed (the warm-up uses seed + 1)")
    parser.add_argument("--max-video-frames", type=int, default=64, help="engine arg (the default 32 is too few)")
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.rounds = "tiny", 1
    frames_per_turn = args.fps * args.seconds_per_turn
    if frames_per_turn != int(frames_per_turn) or frames_per_turn < 1:
        parser.error("fps x seconds-per-turn must be a whole number of frames")
    if frames_per_turn * args.turns > args.max_video_frames:
        parser.error(f"the last turn has {int(frames_per_turn * args.turns)} frames, over --max-video-frames")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    run_started = time.perf_counter()
    from benchmarks.card import machine_info
    from benchmarks.checkpoints import ensure_checkpoint, parameter_count
    from mmserve.demo.video import moving_shapes

    model_dir = ensure_checkpoint(args.model) if args.model in ("tiny", "100m") else Path(args.model)
    frames_per_turn = int(args.fps * args.seconds_per_turn)
    num_frames = frames_per_turn * args.turns
    frames = moving_shapes(num_frames, fps=args.fps, seed=args.seed, width=args.size, height=args.size)
    warmup_frames = moving_shapes(frames_per_turn, fps=args.fps, seed=args.seed + 1, width=args.size,
                                  height=args.size)
    engine_args = {"max_video_frames": args.max_video_frames}
    settings = {"model": args.model, "rounds": args.rounds, "turns": args.turns,
                "seconds_per_turn": args.seconds_per_turn, "fps": args.fps, "frames_per_turn": frames_per_turn,
                "frame_size_px": [args.size, args.size], "output_tokens": args.output_tokens, "seed": args.seed,
                "question": QUESTION, "engine_args": engine_args, "dtype": "float32 (engine default)",
                "warmup": f"1 request per fresh LLM: {frames_per_turn} frames of clip seed {args.seed + 1}, 2 tokens",
                "reencode_uuid": "turn-<t>-<round>"}
    machine = machine_info(torch.get_num_threads())
    model = {"name": args.model, "dir": str(model_dir), "params": parameter_count(model_dir)}

    runs: list[dict[str, Any]] = []
    for r in range(args.rounds):
        order = MODES if r % 2 == 0 else MODES[::-1]
        for mode in order:
            _log(f"round {r + 1}/{args.rounds}: {mode}")
            run = run_stream(mode, r, model_dir, engine_args, frames, warmup_frames, frames_per_turn, args.turns,
                             args.output_tokens, args.fps)
            _log(f"  turn {args.turns} TTFT {run['turns'][-1]['ttft_ms']:.0f} ms, load {run['load_s']:.1f}s, "
                 f"warm-up {run['warmup_s']:.1f}s")
            runs.append(run)

    summary = summarize(runs, args.turns)
    print_card(machine, model, settings, summary)
    print_table(summary)
    sys.stderr.flush()
    sys.stdout.flush()
    print(json_line(machine, model, settings, summary, time.perf_counter() - run_started), flush=True)


if __name__ == "__main__":
    main()
