"""The engine's greedy output equals transformers' `generate`, run per request, whatever the
batching, chunking, preemption or prefix caching — for every family the engine serves
(docs/architecture.md, invariant 9), on every device (`devices()`: the CPU, and CUDA where one exists,
each against transformers on the same device)."""

import numpy as np
import pytest
import torch

from mmserve import LLM, SamplingParams
from tests.fixtures.families import FAMILIES as SERVED_FAMILIES
from tests.models.helpers import devices, image_part, load_processor, random_image, text_part, to_device

NUM_TOKENS = 10
LONG_SYSTEM = ("You are a careful assistant that looks at pictures and answers questions about them. "
               "Describe colours, shapes and counts exactly, and say when you are not sure. ") * 2


def _workload(family=None):
    """16 mixed conversations: text only, one and two images of different sizes and aspect ratios (one
    very wide), a shared image, a video (an image-only family gets a third image question instead),
    multi-turn."""
    videos = family is None or SERVED_FAMILIES[family].takes_video
    rng = np.random.default_rng(2024)
    shared = random_image(rng, 150, 120)
    frames = [random_image(rng, 112, 84) for _ in range(4)]
    out = []

    def add(parts, system=None, history=()):
        messages = [*history, {"role": "user", "content": parts}]
        if system:
            messages.insert(0, {"role": "system", "content": system})
        out.append(messages)

    add([text_part("Hello! Tell me a story.")])
    add([text_part("What is two plus two?")], system=LONG_SYSTEM)
    add([text_part("Count to ten.")], system=LONG_SYSTEM)
    for w, h in [(90, 60), (224, 224), (57, 311), (600, 40), (64, 64)]:
        add([image_part(random_image(rng, w, h)), text_part("Describe the image.")])
    a, b = random_image(rng, 200, 80), random_image(rng, 70, 140)
    add([image_part(a), text_part("versus"), image_part(b), text_part("Which is brighter?")])
    c, d = random_image(rng, 120, 120), random_image(rng, 56, 200)
    add([text_part("First:"), image_part(c), text_part("second:"), image_part(d)], system=LONG_SYSTEM)
    add([image_part(shared), text_part("What is in this picture?")])
    add([image_part(shared), text_part("What colour dominates?")])
    add([image_part(shared), text_part("What is in this picture?")], system=LONG_SYSTEM)
    if videos:
        add([{"type": "video", "video": frames}, text_part("What happens in the video?")])
    else:
        add([image_part(frames[0]), text_part("What happens in the picture?")])
    turn = [{"role": "user", "content": [image_part(random_image(rng, 180, 90)), text_part("Describe.")]},
            {"role": "assistant", "content": "A picture with two shapes."}]
    add([image_part(random_image(rng, 100, 150)), text_part("And this one?")], history=turn)
    add([text_part("Say something short.")], system=LONG_SYSTEM)
    assert len(out) == 16
    return out


@pytest.fixture(scope="module")
def expected_tokens(all_checkpoints):
    """transformers' greedy tokens per family, one request at a time (computed once per family)."""
    cache = {}

    def get(family, device="cpu"):
        if (family, device) not in cache:
            model_dir = all_checkpoints[family]
            fixture = SERVED_FAMILIES[family]
            processor = load_processor(model_dir)
            ref_model = fixture.reference_class().from_pretrained(model_dir).eval().to(device)
            tokens = []
            for ours in _workload(family):
                chat = processor.render_chat(ours)
                prompt = processor.process(chat.prompt, images=chat.images, videos=chat.videos)
                inputs = to_device(fixture.reference_kwargs(model_dir, ours, prompt), device)
                with torch.no_grad():
                    out = ref_model.generate(**inputs, max_new_tokens=NUM_TOKENS, min_new_tokens=NUM_TOKENS,
                                             do_sample=False)
                tokens.append(out[0, inputs["input_ids"].shape[1]:].tolist())
            cache[family, device] = tokens
        return cache[family, device]
    return get


@pytest.fixture(params=devices())
def device(request):
    return request.param


@pytest.fixture
def expected(expected_tokens, served_family, device):
    return expected_tokens(served_family, device)


GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS)


def _run(llm, family):
    outputs = llm.chat(_workload(family), GREEDY, use_tqdm=False)
    llm.check_integrity()
    return [o.outputs[0].token_ids for o in outputs], outputs


def test_defaults(served_family, served_model_dir, expected, device):
    llm = LLM(str(served_model_dir), device=device)
    got, outputs = _run(llm, served_family)
    assert got == expected
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    stats = llm.get_stats()
    assert stats["requests_finished"] == 16 and stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_chunked_prefill_through_images(served_family, served_model_dir, expected, device):
    llm = LLM(str(served_model_dir), max_num_batched_tokens=32, device=device)
    got, _ = _run(llm, served_family)
    assert got == expected


def test_preemption(served_family, served_model_dir, expected, device):
    llm = LLM(str(served_model_dir), num_kv_blocks=24, max_num_batched_tokens=256, device=device)
    got, _ = _run(llm, served_family)
    assert llm.get_stats()["num_preemptions"] > 0
    assert got == expected


def test_prefix_caching_second_run(served_family, served_model_dir, expected, device):
    llm = LLM(str(served_model_dir), device=device)
    first, _ = _run(llm, served_family)
    before = llm.get_stats()
    second, outputs = _run(llm, served_family)
    after = llm.get_stats()
    assert first == second == expected
    prompt_tokens = after["prompt_tokens"] - before["prompt_tokens"]
    computed = after["prompt_tokens_computed"] - before["prompt_tokens_computed"]
    assert after["prefix_cache_hit_tokens"] > before["prefix_cache_hit_tokens"]
    assert computed < 0.2 * prompt_tokens, (computed, prompt_tokens)
    assert sum(o.num_cached_tokens for o in outputs) == prompt_tokens - computed
