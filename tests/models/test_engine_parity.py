"""The engine's greedy output equals transformers' `generate`, run per request, whatever the
batching, chunking, preemption or prefix caching (DESIGN.md §3.9)."""

import numpy as np
import pytest
import torch

from mmserve import LLM, SamplingParams
from tests.fixtures.tiny_checkpoints import reference_inputs
from tests.models.helpers import (
    REFERENCE_IMAGE_PART,
    REFERENCE_VIDEO_PART,
    image_part,
    random_image,
    text_part,
)
from tests.models.test_model_parity import REFERENCE_CLASSES

NUM_TOKENS = 10
LONG_SYSTEM = ("You are a careful assistant that looks at pictures and answers questions about them. "
               "Describe colours, shapes and counts exactly, and say when you are not sure. ") * 2


def _workload():
    """16 mixed requests: (our messages, reference messages, images, video frames or None)."""
    rng = np.random.default_rng(2024)
    shared = random_image(rng, 150, 120)
    frames = [random_image(rng, 112, 84) for _ in range(4)]
    out = []

    def add(parts, system=None, images=(), frames=None):
        ours = [{"role": "user", "content": parts}]
        ref_parts = [REFERENCE_IMAGE_PART if p["type"] == "image_pil" else REFERENCE_VIDEO_PART
                     if p["type"] == "video" else p for p in parts]
        ref = [{"role": "user", "content": ref_parts}]
        if system:
            ours.insert(0, {"role": "system", "content": system})
            ref.insert(0, {"role": "system", "content": system})
        out.append((ours, ref, list(images), frames))

    add([text_part("Hello! Tell me a story.")])
    add([text_part("What is two plus two?")], system=LONG_SYSTEM)
    add([text_part("Count to ten.")], system=LONG_SYSTEM)
    for w, h in [(90, 60), (224, 224), (57, 311), (300, 100), (64, 64)]:
        img = random_image(rng, w, h)
        add([image_part(img), text_part("Describe the image.")], images=[img])
    a, b = random_image(rng, 200, 80), random_image(rng, 70, 140)
    add([image_part(a), text_part("versus"), image_part(b), text_part("Which is brighter?")], images=[a, b])
    c, d = random_image(rng, 120, 120), random_image(rng, 56, 200)
    add([text_part("First:"), image_part(c), text_part("second:"), image_part(d)], system=LONG_SYSTEM, images=[c, d])
    add([image_part(shared), text_part("What is in this picture?")], images=[shared])
    add([image_part(shared), text_part("What colour dominates?")], images=[shared])
    add([image_part(shared), text_part("What is in this picture?")], system=LONG_SYSTEM, images=[shared])
    add([{"type": "video", "video": frames}, text_part("What happens in the video?")], frames=frames)
    img = random_image(rng, 180, 90)
    add([image_part(img), text_part("Describe.")], system=LONG_SYSTEM, images=[img])
    add([text_part("Say something short.")], system=LONG_SYSTEM)
    assert len(out) == 16
    return out


@pytest.fixture(scope="module")
def expected(checkpoint_dirs):
    """transformers' greedy tokens per family, one request at a time."""
    result = {}
    for family, model_dir in checkpoint_dirs.items():
        llm = LLM(str(model_dir))  # only to produce the same video pixels transformers is fed
        ref_model = REFERENCE_CLASSES[family].from_pretrained(model_dir).eval()
        tokens = []
        for ours, ref_msgs, images, frames in _workload():
            kwargs = {}
            if frames is not None:
                item = llm.engine.process_chat(ours).items[0]
                kwargs = dict(videos_pixel_values=item.payload.pixel_values, video_grid_thw=[list(item.payload.grid_thw)])
            inputs, _ = reference_inputs(model_dir, ref_msgs, images, **kwargs)
            with torch.no_grad():
                out = ref_model.generate(**inputs, max_new_tokens=NUM_TOKENS, min_new_tokens=NUM_TOKENS,
                                         do_sample=False)
            tokens.append(out[0, inputs["input_ids"].shape[1]:].tolist())
        result[family] = tokens
    return result


GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS)


def _run(llm):
    outputs = llm.chat([ours for ours, *_ in _workload()], GREEDY, use_tqdm=False)
    llm.check_integrity()
    return [o.outputs[0].token_ids for o in outputs], outputs


def test_defaults(model_dir, family, expected):
    llm = LLM(str(model_dir))
    got, outputs = _run(llm)
    assert got == expected[family]
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    stats = llm.get_stats()
    assert stats["requests_finished"] == 16 and stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_chunked_prefill_through_images(model_dir, family, expected):
    llm = LLM(str(model_dir), max_num_batched_tokens=32)
    got, _ = _run(llm)
    assert got == expected[family]


def test_preemption(model_dir, family, expected):
    llm = LLM(str(model_dir), num_kv_blocks=24, max_num_batched_tokens=256)
    got, _ = _run(llm)
    assert llm.get_stats()["num_preemptions"] > 0
    assert got == expected[family]


def test_prefix_caching_second_run(model_dir, family, expected):
    llm = LLM(str(model_dir))
    first, _ = _run(llm)
    before = llm.get_stats()
    second, outputs = _run(llm)
    after = llm.get_stats()
    assert first == second == expected[family]
    prompt_tokens = after["prompt_tokens"] - before["prompt_tokens"]
    computed = after["prompt_tokens_computed"] - before["prompt_tokens_computed"]
    assert after["prefix_cache_hit_tokens"] > before["prefix_cache_hit_tokens"]
    assert computed < 0.2 * prompt_tokens, (computed, prompt_tokens)
    assert sum(o.num_cached_tokens for o in outputs) == prompt_tokens - computed
