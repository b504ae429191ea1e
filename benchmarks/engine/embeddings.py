"""Embeddings (the pooling runner): throughput at batch 64 against transformers, and the encoder cache reused
across embedding requests.

Run: python -m benchmarks.engine.embeddings [--rounds 3]

Role: the measured answer to the embedding targets, on a random-weight Qwen3-VL checkpoint shaped like a small
Qwen3-VL-Embedding (built here under `.bench/`: text hidden 512, 8 layers; vision tower depth 6, hidden 384;
images up to 512x512 pixels, so a 224x224 image is 49 tokens). Every measurement is a fresh subprocess of this
module (`--worker SIDE --round R`); the sides alternate order by round and medians are reported.
- throughput: 64 distinct texts (~60-130 tokens) in one call, then 64 prompts of one new 224x224 image each,
  after a warm-up batch of other texts and images (so the encoder cache never helps the measured batch).
  mmserve: `LLM(dir, runner="pooling", dtype="float32").embed(...)` at its defaults (last token, normalized).
  transformers: `Qwen3VLProcessor` (left padding) then `model.model(**batch).last_hidden_state[:, -1]`,
  L2-normalized: the same math; timed from the strings and PIL images to the vectors, like `embed` (its
  forward alone is reported too). Target: mmserve's items/s >= 3x transformers', texts and images. Also
  reported: the FLOP floor of each batch at this machine's peak matmul rate (the most items/s any engine
  could reach), and the CPU seconds per wall second each side used while measured (contention shows there).
- correctness: the cosine of mmserve's and transformers' embeddings of four texts and four images per round
  (the reported minimum must be >= 0.9999).
- repeated image: in the mmserve worker, a new image embedded in one call, then the same image behind other
  text in a second call (so no prefix is shared): the encoder items each call encodes (get_stats), and each
  call's time. Target: the second call encodes 0 items.
Prints a card, a table and one JSON line last.

What it does not know: mmserve internals beyond `LLM.embed` and `LLM.get_stats`; other families; vLLM.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.card import BENCH_DIR, json_line, machine_info, machine_line, print_card

BATCH = 64
WARMUP = 16
SIDE = 224  # image width and height: a multiple of 32 (patch 16, merge 2), kept as is by the processor
CHECKED = (0, 21, 42, 63)  # the items whose embeddings are compared across the two sides
TARGET_RATIO = 3.0
COSINE_GOAL = 0.9999
IMAGE_PROMPT = "<|vision_start|><|image_pad|><|vision_end|>Represent this image for retrieval."
REPEAT_PROMPT = "Find documents like <|vision_start|><|image_pad|><|vision_end|> this picture."
TEXT = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
            num_key_value_heads=4, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            # M-RoPE sections that sum to half the head width, as the hub's [24, 20, 20] do for 128
            rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [12, 10, 10],
                             "mrope_interleaved": True})
VISION = dict(depth=6, hidden_size=384, intermediate_size=1536, num_heads=6, out_hidden_size=512, patch_size=16,
              temporal_patch_size=2, spatial_merge_size=2, in_channels=3, num_position_embeddings=2304,
              deepstack_visual_indexes=[1, 2, 4], hidden_act="gelu_pytorch_tanh")
SHAPE = "Qwen3-VL random weights: text hidden 512, 8 layers, 8 heads (4 KV), head_dim 64; vision depth 6, hidden 384"


def _log(msg: str) -> None:
    print(f"[embeddings] {msg}", file=sys.stderr, flush=True)


def checkpoint() -> Path:
    """The benchmark's Qwen3-VL (Qwen3VLForConditionalGeneration, float32), built on first use."""
    out = BENCH_DIR / "bench-qwen3_vl-embed-r1"
    if (out / "model.safetensors").is_file() and (out / "preprocessor_config.json").is_file():
        return out
    _log(f"building the checkpoint in {out} ...")
    import torch
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from benchmarks.checkpoints import _randomize_scaled
    from testkit.tiny_qwen3_vl import media_token_ids, write_processor_files, write_tokenizer

    vocab_size, ids = write_tokenizer(out)
    text = TEXT | dict(vocab_size=vocab_size, bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                       pad_token_id=ids["<|endoftext|>"])
    config = Qwen3VLConfig(text_config=text, vision_config=VISION, tie_word_embeddings=True, **media_token_ids(ids))
    torch.manual_seed(0)
    model = Qwen3VLForConditionalGeneration(config)
    _randomize_scaled(model, 0)
    model.save_pretrained(out, safe_serialization=True)
    write_processor_files(out, ids)
    # an embedding model's image budget: up to 512x512 pixels (the tiny test budget would shrink 224x224)
    Qwen2VLImageProcessorPil(size={"shortest_edge": 64 * 64, "longest_edge": 512 * 512}, patch_size=16,
                             temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3,
                             image_std=[0.5] * 3).save_pretrained(out)
    return out


# ---- the workload: fixed by seed, so both sides of a round embed the same items ------------------------------
def _texts(seed: int, n: int) -> list[str]:
    import numpy as np

    vocab = ("red", "blue", "green", "square", "circle", "large", "small", "left", "right", "above", "below",
             "the", "a", "photo", "of", "with", "near", "bright", "dark", "river", "city", "tree", "road")
    rng = np.random.default_rng(seed)
    return [f"{i}: " + " ".join(vocab[int(k)] for k in rng.integers(0, len(vocab), int(rng.integers(22, 34))))
            for i in range(n)]


def _images(seed: int, n: int) -> list[Any]:
    import numpy as np

    from benchmarks.workload import synthetic_image

    rng = np.random.default_rng(seed)
    return [synthetic_image(rng, SIDE, SIDE) for _ in range(n)]


def _workload(round_index: int) -> dict[str, Any]:
    """Warm-up items and measured items of different content; new content every round."""
    return {"warm_texts": _texts(10_000 + round_index, WARMUP), "warm_images": _images(20_000 + round_index, WARMUP),
            "texts": _texts(1_000 + round_index, BATCH), "images": _images(2_000 + round_index, BATCH),
            "repeat_image": _images(30_000 + round_index, 1)[0]}


def _timed(fn: Any, *args: Any, cores: list[float] | None = None) -> tuple[Any, float]:
    """`fn(*args)` and its wall seconds; `cores` gets the process's CPU seconds over the wall (the torch
    threads when nothing else competes for the cores)."""
    started, cpu = time.perf_counter(), time.process_time()
    result = fn(*args)
    wall = time.perf_counter() - started
    if cores is not None:
        cores.append((time.process_time() - cpu) / wall)
    return result, wall


def _floor_s(model_dir: Path, prompts: list[int], patches: int, items: int, peak_gflops: float) -> float:
    """The FLOP floor of one batch at the machine's peak matmul rate (benchmarks/engine/floor.py's idea):
    weight-matrix FLOPs (vision blocks per patch, the mergers and deepstack mergers per merged row, the
    decoder layers per prompt token; embedding tables and the unused lm_head do none) plus attention's
    (full within each image, causal over each prompt). No engine doing this work can be faster."""
    import math

    from safetensors import safe_open

    per = {"patch": 0, "row": 0, "token": 0}
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        for key in f.keys():
            shape = f.get_slice(key).get_shape()
            if len(shape) < 2 or "embed_tokens" in key or "pos_embed" in key or "lm_head" in key:
                continue
            kind = "row" if "merger" in key else "patch" if "visual." in key else "token"
            per[kind] += math.prod(shape)
    config = json.loads((model_dir / "config.json").read_text())
    text, vision = config["text_config"], config["vision_config"]
    rows = patches // vision["spatial_merge_size"] ** 2
    flops = 2 * (patches * per["patch"] + rows * per["row"] + sum(prompts) * per["token"])
    flops += 4 * vision["depth"] * vision["hidden_size"] * items * (patches // max(items, 1)) ** 2
    flops += 4 * text["num_hidden_layers"] * text["num_attention_heads"] * text["head_dim"] * sum(
        p * (p + 1) // 2 for p in prompts)
    return flops / (peak_gflops * 1e9)


# ---- the workers -------------------------------------------------------------------------------------------
def worker_mmserve(round_index: int) -> dict[str, Any]:
    import torch

    from benchmarks.engine.floor import matmul_peak_gflops
    from mmserve import LLM

    work, cores = _workload(round_index), []

    def prompts(images: list[Any], text: str = IMAGE_PROMPT) -> list[dict[str, Any]]:
        return [{"prompt": text, "multi_modal_data": {"image": image}} for image in images]

    with LLM(str(checkpoint()), runner="pooling", dtype="float32") as llm:
        embed = lambda batch: llm.embed(batch, use_tqdm=False)  # noqa: E731
        embed(work["warm_texts"])
        embed(prompts(work["warm_images"]))
        texts, texts_s = _timed(embed, work["texts"], cores=cores)
        stats = [_encoder_stats(llm)]
        images, images_s = _timed(embed, prompts(work["images"]), cores=cores)
        stats.append(_encoder_stats(llm))
        _, first_s = _timed(embed, prompts([work["repeat_image"]]))
        stats.append(_encoder_stats(llm))
        _, repeat_s = _timed(embed, prompts([work["repeat_image"]], REPEAT_PROMPT))
        stats.append(_encoder_stats(llm))
    delta = [{k: after[k] - before[k] for k in after} for before, after in zip(stats, stats[1:])]
    peak = matmul_peak_gflops()
    text_lengths, image_lengths = [len(o.prompt_token_ids) for o in texts], [len(o.prompt_token_ids) for o in images]
    return {"texts_s": texts_s, "images_s": images_s, "texts_cores": cores[0], "images_cores": cores[1],
            "threads": torch.get_num_threads(), "peak_gflops": peak,
            "texts_floor_s": _floor_s(checkpoint(), text_lengths, 0, 0, peak),
            "images_floor_s": _floor_s(checkpoint(), image_lengths, delta[0]["encoder_tokens_encoded"], BATCH, peak),
            "text_tokens": float(statistics.mean(text_lengths)), "image_prompt_tokens": float(statistics.mean(
                image_lengths)), "image_patches": delta[0]["encoder_tokens_encoded"] / BATCH,
            "text_vectors": [texts[i].outputs.embedding for i in CHECKED],
            "image_vectors": [images[i].outputs.embedding for i in CHECKED],
            "first_image_s": first_s, "repeat_image_s": repeat_s,
            "first_encoder_items": delta[1]["encoder_items_encoded"],
            "repeat_encoder_items": delta[2]["encoder_items_encoded"],
            "repeat_cache_hits": delta[2]["encoder_cache_hits"],
            "encoder_items_trace": [x["encoder_items_encoded"] for x in stats[1:]]}


def _encoder_stats(llm: Any) -> dict[str, int]:
    stats = llm.get_stats()
    return {k: int(stats[k]) for k in ("encoder_items_encoded", "encoder_tokens_encoded", "encoder_cache_hits")}


def _hf_processor(model_dir: Path) -> Any:
    """transformers' Qwen3VLProcessor on its PIL image processor (AutoProcessor wants torchvision for the
    video processor, which this environment lacks; images never reach it)."""
    from transformers import AutoTokenizer, Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    class Processor(Qwen3VLProcessor):
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if argument_name == "video_processor":  # its registry needs torchvision
                return type(argument)
            return super().check_argument_for_proper_class(argument_name, argument)

    return Processor(image_processor=Qwen2VLImageProcessorPil.from_pretrained(model_dir),
                     tokenizer=AutoTokenizer.from_pretrained(model_dir),
                     video_processor=Qwen3VLVideoProcessor.from_pretrained(model_dir))


def worker_transformers(round_index: int) -> dict[str, Any]:
    import torch
    from transformers import Qwen3VLForConditionalGeneration

    work, cores = _workload(round_index), []
    model = Qwen3VLForConditionalGeneration.from_pretrained(checkpoint(), dtype=torch.float32).eval()
    processor = _hf_processor(checkpoint())
    forward_s: list[float] = []

    def embed(texts: list[str], images: list[Any] | None = None) -> list[list[float]]:
        batch = processor(text=texts, images=images, padding=True, padding_side="left", return_tensors="pt")
        started = time.perf_counter()
        with torch.inference_mode():
            last = model.model(**batch).last_hidden_state[:, -1]  # left padding: every prompt ends there
        forward_s.append(time.perf_counter() - started)
        return torch.nn.functional.normalize(last.float(), dim=-1).tolist()

    embed(work["warm_texts"])
    embed([IMAGE_PROMPT] * WARMUP, work["warm_images"])
    texts, texts_s = _timed(embed, work["texts"], cores=cores)
    images, images_s = _timed(embed, [IMAGE_PROMPT] * BATCH, work["images"], cores=cores)
    return {"texts_s": texts_s, "images_s": images_s, "texts_cores": cores[0], "images_cores": cores[1],
            "texts_forward_s": forward_s[-2],
            "images_forward_s": forward_s[-1], "threads": torch.get_num_threads(),
            "text_vectors": [texts[i] for i in CHECKED], "image_vectors": [images[i] for i in CHECKED]}


WORKERS = {"mmserve": worker_mmserve, "transformers": worker_transformers}


def _run_worker(name: str, round_index: int) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.engine.embeddings", "--worker", name,
                           "--round", str(round_index)], capture_output=True, text=True, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        raise RuntimeError(f"worker {name} failed: {proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def _cosine(a: list[float], b: list[float]) -> float:
    import math

    dot = math.fsum(x * y for x, y in zip(a, b))
    return dot / max(math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(y * y for y in b)), 1e-12)


def _summary(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Medians over rounds of each side's items/s, times and CPU use; the repeated-image counts at their
    worst; the lowest cosine."""
    def med(side: str, key: str) -> float:
        return statistics.median(r[side][key] for r in rounds)

    def rate(side: str, key: str) -> float:
        return statistics.median(BATCH / r[side][key] for r in rounds)

    out = {"texts_per_s": rate("mmserve", "texts_s"), "images_per_s": rate("mmserve", "images_s"),
           "transformers_texts_per_s": rate("transformers", "texts_s"),
           "transformers_images_per_s": rate("transformers", "images_s"),
           "transformers_forward_texts_per_s": rate("transformers", "texts_forward_s"),
           "transformers_forward_images_per_s": rate("transformers", "images_forward_s"),
           "floor_texts_per_s": rate("mmserve", "texts_floor_s"), "floor_images_per_s": rate("mmserve", "images_floor_s"),
           "peak_matmul_gflops": med("mmserve", "peak_gflops")}
    out |= {"text_ratio": out["texts_per_s"] / out["transformers_texts_per_s"],
            "image_ratio": out["images_per_s"] / out["transformers_images_per_s"], "target_ratio": TARGET_RATIO,
            "floor_text_ratio": out["floor_texts_per_s"] / out["transformers_texts_per_s"],
            "floor_image_ratio": out["floor_images_per_s"] / out["transformers_images_per_s"],
            "first_image_encoder_items": min(r["mmserve"]["first_encoder_items"] for r in rounds),
            "repeated_image_encoder_items": max(r["mmserve"]["repeat_encoder_items"] for r in rounds),
            "repeated_image_cache_hits": min(r["mmserve"]["repeat_cache_hits"] for r in rounds),
            "first_image_s": med("mmserve", "first_image_s"), "repeated_image_s": med("mmserve", "repeat_image_s"),
            "cosine_min": min(_cosine(a, b) for r in rounds for kind in ("text_vectors", "image_vectors")
                              for a, b in zip(r["mmserve"][kind], r["transformers"][kind])),
            "text_tokens": med("mmserve", "text_tokens"), "image_prompt_tokens": med("mmserve", "image_prompt_tokens"),
            "image_patches": med("mmserve", "image_patches"),
            "cores_used": {side: round(statistics.median(r[side][k] for r in rounds for k in ("texts_cores",
                                                                                           "images_cores")), 2)
                           for side in WORKERS},
            "threads": {side: rounds[-1][side]["threads"] for side in WORKERS},
            "encoder_items_trace": rounds[-1]["mmserve"]["encoder_items_trace"]}
    out["met"] = bool(out["text_ratio"] >= TARGET_RATIO and out["image_ratio"] >= TARGET_RATIO
                      and out["repeated_image_encoder_items"] == 0 and out["cosine_min"] >= COSINE_GOAL)
    return out


def _print_report(s: dict[str, Any], rounds: int, machine: dict[str, Any]) -> None:
    contended = any(s["cores_used"][side] < 0.9 * s["threads"][side] for side in WORKERS)
    print_card("mmserve embeddings benchmark", {
        "machine": machine_line(machine) + f", torch {machine['torch']}, transformers {machine['transformers']}",
        "model": f"{SHAPE} (.bench/bench-qwen3_vl-embed-r1), float32, last-token pooling, normalized",
        "workload": f"batch {BATCH}: texts of {s['text_tokens']:.0f} tokens (mean); one new {SIDE}x{SIDE} image "
                    f"each ({s['image_patches']:.0f} patches, {s['image_prompt_tokens']:.0f} prompt tokens); "
                    "a warm-up batch of other items first",
        "method": f"{rounds} rounds, fresh process per side, alternating order, medians; mmserve at defaults "
                  "(runner=pooling, dtype=float32); transformers: processor + model.model, left padding",
        "threads": f"torch threads {s['threads']}; CPU seconds per wall second while measured {s['cores_used']}"
                   + (" (fewer than the threads: other work shared the cores)" if contended else ""),
        "agreement": f"cosine min {s['cosine_min']:.8f} (1 - cos {1 - s['cosine_min']:.1e}) over {len(CHECKED)} texts + {len(CHECKED)} images a round "
                     f"(goal >= {COSINE_GOAL})"})
    print(f"{'side':<44} {'texts/s':>9} {'images/s':>9}")
    for label, t, i in (("mmserve embed", s["texts_per_s"], s["images_per_s"]),
                        ("transformers (processor + forward)", s["transformers_texts_per_s"],
                         s["transformers_images_per_s"]),
                        ("transformers forward alone", s["transformers_forward_texts_per_s"],
                         s["transformers_forward_images_per_s"]),
                        (f"FLOP floor (matmul peak {s['peak_matmul_gflops']:.0f} GFLOP/s)", s["floor_texts_per_s"],
                         s["floor_images_per_s"])):
        print(f"{label:<44} {t:>9.1f} {i:>9.1f}")
    met = lambda ok: "yes" if ok else "NO"  # noqa: E731
    print(f"{'ratio mmserve / transformers':<44} {s['text_ratio']:>8.2f}x {s['image_ratio']:>8.2f}x  "
          f"(target >= {TARGET_RATIO:.0f}x: texts {met(s['text_ratio'] >= TARGET_RATIO)}, "
          f"images {met(s['image_ratio'] >= TARGET_RATIO)})")
    print(f"{'ratio FLOP floor / transformers (the most)':<44} {s['floor_text_ratio']:>8.2f}x "
          f"{s['floor_image_ratio']:>8.2f}x")
    before, after_first, after_repeat = s["encoder_items_trace"]
    print(f"\nrepeated image (same image, other text before it, a second embed call; encoder_items_encoded "
          f"{before} -> {after_first} -> {after_repeat}, last round):")
    print(f"  first call : {s['first_image_encoder_items']} encoder item(s) encoded, {s['first_image_s'] * 1e3:.1f} ms")
    print(f"  second call: {s['repeated_image_encoder_items']} encoder item(s) encoded, "
          f"{s['repeated_image_cache_hits']} cache hit(s), {s['repeated_image_s'] * 1e3:.1f} ms  "
          f"(target 0 encoded: {met(s['repeated_image_encoder_items'] == 0)})")
    print()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(WORKERS[args.worker](args.round)), flush=True)
        return
    checkpoint()
    sides = list(WORKERS)
    rounds: list[dict[str, dict[str, Any]]] = []
    for r in range(args.rounds):
        result = {}
        for side in (sides if r % 2 == 0 else sides[::-1]):
            _log(f"round {r + 1}/{args.rounds}: {side}")
            result[side] = _run_worker(side, r)
        rounds.append(result)
    summary, machine = _summary(rounds), machine_info()
    _print_report(summary, args.rounds, machine)
    json_line({"bench": "embeddings", **{k: (round(v, 8 if k == "cosine_min" else 4) if isinstance(v, float) else v)
                                            for k, v in summary.items()},
               "rounds": args.rounds, "machine": machine}, compact=True)


if __name__ == "__main__":
    main()
