"""Llama 3.2 Vision (mllama) against transformers, and its cross-attention K/V in the engine.

Processor: mmserve's prompt ids equal transformers' `MllamaProcessor`'s, and the text positions that see
each image (and which of its tiles) equal its `cross_attention_mask`, for text-only, one-image, wide,
two-image, consecutive-image and multi-turn conversations and token-id prompts. Model: logits equal
transformers' on the tiny checkpoint, tokens before the first image included (transformers lets them
attend unmasked to every vision row). Engine: greedy tokens equal transformers' for the issue's cases
under default settings, small chunks, preemption and prefix caching run twice; a request's
cross-attention K/V is built once (counted), again only after a preemption, and is gone after finish,
abort or preemption; its byte budget makes requests wait, or refuses one that can never fit; two
prompts with the same text and different images never share a prefix block.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from transformers import MllamaForConditionalGeneration

from mmserve import LLM, InvalidInputError, SamplingParams
from testkit.conversations import random_image
from testkit.tiny_mllama import (
    MAX_IMAGE_TILES,
    mllama_reference_inputs,
    mllama_reference_kwargs,
    reference_processor,
)
from tests.models.helpers import full_logits, load_family

DATE = "26 Jul 2024"
GREEDY = SamplingParams(temperature=0, max_tokens=10, min_tokens=10)
RNG = np.random.default_rng(7)
SMALL, WIDE, TALL, SQUARE = (random_image(RNG, 30, 26), random_image(RNG, 130, 30), random_image(RNG, 24, 70),
                             random_image(RNG, 64, 64))


def image(img):
    return {"type": "image_pil", "image_pil": img}


def text(t):
    return {"type": "text", "text": t}


def user(*parts):
    return {"role": "user", "content": list(parts)}


# the cases: text only, one image, a wide image (several tiles), two images, multi-turn, a system
# prompt (Llama 3.2 Vision's template takes a system message only without images)
CONVERSATIONS = {
    "text_only": [user(text("What colour is the circle?"))],
    "one_image": [user(image(SMALL), text("Describe the image."))],
    "wide_image": [user(image(WIDE), text("What is on the left?"))],
    "two_images": [user(text("Which has more shapes, the first"), image(SQUARE), text("or the second"), image(TALL),
                        text("?"))],
    "consecutive_images": [user(image(TALL), image(WIDE), text("Compare them."))],
    "multi_turn": [user(image(SMALL), text("Describe.")), {"role": "assistant", "content": "Two shapes on grey."},
                   user(text("And now this one?"), image(SQUARE))],
    "system_prompt": [{"role": "system", "content": "Answer in one word."}, user(text("Is the sky blue?"))],
}


@pytest.fixture(scope="module")
def model_dir(all_checkpoints):
    return all_checkpoints["mllama"]


@pytest.fixture(scope="module")
def family(model_dir):
    return load_family(model_dir)


@pytest.fixture(scope="module")
def reference(model_dir):
    return MllamaForConditionalGeneration.from_pretrained(model_dir).eval()


def _ours(processor, messages):
    chat = processor.render_chat(messages, date_string=DATE)
    return processor.process(chat.prompt, images=chat.images)


def _dense_mask(prompt) -> np.ndarray:
    """mmserve's cross-attention spans as transformers' dense (tokens, images, tiles) mask."""
    out = np.zeros((prompt.num_tokens, len(prompt.items), MAX_IMAGE_TILES), dtype=np.int64)
    for i, item in enumerate(prompt.items):
        span = item.cross_attention
        end = prompt.num_tokens if span.visible_until is None else span.visible_until
        out[span.visible_from:end, i, :item.payload.num_tiles] = 1
    return out


@pytest.fixture(scope="module")
def expected(model_dir, reference):
    """transformers' greedy tokens per conversation (its own processor's inputs)."""
    out = {}
    for name, messages in CONVERSATIONS.items():
        inputs = mllama_reference_inputs(model_dir, messages, date_string=DATE)
        with torch.no_grad():
            tokens = reference.generate(**inputs, max_new_tokens=10, min_new_tokens=10, do_sample=False)
        out[name] = tokens[0, inputs["input_ids"].shape[1]:].tolist()
    return out


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_prompt_ids_pixels_and_cross_attention_mask_equal_transformers(model_dir, family, name):
    _, processor, _ = family
    messages = CONVERSATIONS[name]
    want = mllama_reference_inputs(model_dir, messages, date_string=DATE)
    ours = _ours(processor, messages)
    assert ours.prompt_token_ids == want["input_ids"][0].tolist()
    assert not ours.embed_mask.any()  # no prompt row is an encoder row: <|image|> keeps its embedding
    if not ours.items:
        assert "pixel_values" not in want
        return
    np.testing.assert_array_equal(_dense_mask(ours), want["cross_attention_mask"][0].numpy())
    for j, item in enumerate(ours.items):
        np.testing.assert_array_equal(item.payload.pixel_values, want["pixel_values"][0, j].numpy())
        assert item.payload.aspect_ratio_id == int(want["aspect_ratio_ids"][0, j])
        assert item.length == 1 and item.output_rows == MAX_IMAGE_TILES * 17  # 16 patches + class token a tile


def test_token_id_prompts_take_each_image_token_as_one_image(family):
    _, processor, _ = family
    chat = _ours(processor, CONVERSATIONS["consecutive_images"])
    again = processor.process(prompt_token_ids=chat.prompt_token_ids, images=[TALL, WIDE])
    assert again.prompt_token_ids == chat.prompt_token_ids
    assert [i.cross_attention for i in again.items] == [i.cross_attention for i in chat.items]
    with pytest.raises(InvalidInputError, match="placeholder"):
        processor.process(prompt_token_ids=chat.prompt_token_ids, images=[TALL])


@pytest.mark.parametrize("name", ["text_only", "one_image", "two_images", "consecutive_images", "multi_turn"])
def test_logits_equal_transformers(model_dir, family, reference, name):
    model, processor, spec = family
    inputs = mllama_reference_inputs(model_dir, CONVERSATIONS[name], date_string=DATE)
    with torch.no_grad():
        want = reference(**inputs).logits[0]
    got = full_logits(model, _ours(processor, CONVERSATIONS[name]), spec)
    assert (got - want).abs().max().item() <= 1e-5


def test_tokens_before_the_first_image_see_every_vision_row(model_dir, family, reference):
    """transformers' rule, which Meta's reference and vLLM do not share: a token before any image attends
    unmasked to all vision rows (padded tiles included) and keeps the gated attention output; only the MLP
    branch of the cross-attention layer is dropped. Changing only a padded tile's pixels changes them."""
    model, processor, spec = family
    prompt = _ours(processor, [user(text("Before the image comes a long sentence:"), image(SMALL), text("After it."))])
    first = prompt.items[0].offset
    base = full_logits(model, prompt, spec)
    padded = prompt.items[0].payload
    assert padded.num_tiles < MAX_IMAGE_TILES
    noisy = padded.pixel_values.copy()
    noisy[padded.num_tiles:] = RNG.normal(size=noisy[padded.num_tiles:].shape)
    item = dataclasses.replace(prompt.items[0], payload=dataclasses.replace(padded, pixel_values=noisy))
    changed = dataclasses.replace(prompt, items=[item])
    moved = full_logits(model, changed, spec)
    assert (moved[:first] - base[:first]).abs().max() > 1e-3  # before the image, padded tiles are seen
    inputs = mllama_reference_kwargs(model_dir, [], changed)
    with torch.no_grad():
        want = reference(**inputs).logits[0]
    assert (moved - want).abs().max().item() <= 1e-5  # as transformers computes it


def _chat(llm, names, params=GREEDY):
    outputs = llm.chat([CONVERSATIONS[n] for n in names], params, use_tqdm=False,
                       chat_template_kwargs={"date_string": DATE})
    return {n: list(o.outputs[0].token_ids) for n, o in zip(names, outputs)}, outputs


ENGINES = {
    "defaults": {},
    "small_chunks": {"max_num_batched_tokens": 8},
    "preemption": {"num_kv_blocks": 8, "max_num_batched_tokens": 64},
}


@pytest.mark.parametrize("setting", list(ENGINES))
def test_engine_greedy_equals_transformers(model_dir, expected, setting):
    llm = LLM(str(model_dir), **ENGINES[setting])
    names = list(CONVERSATIONS)
    got, _ = _chat(llm, names)
    assert got == {n: expected[n] for n in names}
    stats = llm.get_stats()
    if setting == "preemption":
        assert stats["num_preemptions"] > 0
        assert stats["cross_kv_builds"] >= 5  # rebuilt after a preemption dropped it
    else:
        assert stats["cross_kv_builds"] == 5  # once per request with images, however many chunks
    assert stats["cross_kv_bytes_used"] == 0 and stats["encoder_cache_bytes_referenced"] == 0
    llm.check_integrity()


def test_prefix_caching_run_twice(model_dir, expected):
    llm = LLM(str(model_dir))
    names = list(CONVERSATIONS)
    first, _ = _chat(llm, names)
    second, outputs = _chat(llm, names)
    assert first == second == {n: expected[n] for n in names}
    # every full block of every prompt is found again (an image keys them, it does not stop them)
    assert all(o.num_cached_tokens >= (len(o.prompt_token_ids) - 1) // 16 * 16 for o in outputs)
    stats = llm.get_stats()
    assert stats["cross_kv_builds"] == 10  # a prefix-cache hit still builds the request's image K/V
    assert stats["encoder_cache_hits"] >= 6  # ... from the cached encoder outputs
    llm.check_integrity()


def test_same_text_different_images_never_share_a_block(model_dir):
    """Every block of a request with images is keyed on them, those before the image too (they attend to
    it): the same token ids with another image hit nothing, with the same image everything but the last."""
    llm = LLM(str(model_dir))
    long_text = "Look closely at the picture and describe every shape, its colour and its place. " * 3
    ask = lambda img: [{"role": "user", "content": [text(long_text), image(img), text("Now answer.")]}]  # noqa: E731
    params = SamplingParams(temperature=0, max_tokens=2)
    first = llm.chat(ask(SMALL), params, use_tqdm=False)[0]
    other = llm.chat(ask(SQUARE), params, use_tqdm=False)[0]
    same = llm.chat(ask(SMALL), params, use_tqdm=False)[0]
    assert first.prompt_token_ids == other.prompt_token_ids == same.prompt_token_ids
    assert len(first.prompt_token_ids) > 3 * 16
    assert other.num_cached_tokens == 0
    assert same.num_cached_tokens >= len(first.prompt_token_ids) - 16
    llm.check_integrity()


def test_a_text_only_request_is_the_same_beside_image_requests(model_dir, expected):
    """Text-only sequences skip the cross-attention layers per sequence in a batch that mixes both."""
    llm = LLM(str(model_dir))
    alone, _ = _chat(llm, ["text_only"])
    mixed, _ = _chat(LLM(str(model_dir)), ["one_image", "text_only", "two_images"])
    assert alone["text_only"] == mixed["text_only"] == expected["text_only"]


def test_abort_frees_cross_attention_kv(model_dir):
    llm = LLM(str(model_dir))
    engine = llm.engine
    for i, name in enumerate(["one_image", "wide_image", "two_images"]):
        engine.add_request(f"r{i}", engine.process_chat(CONVERSATIONS[name], date_string=DATE),
                           SamplingParams(temperature=0, max_tokens=50))
    engine.step()
    engine.step()
    stats = engine.get_stats()
    assert stats["cross_kv_builds"] == 3 and stats["cross_kv_bytes_used"] > 0
    per_row = engine.cross_kv_bytes_per_row
    assert stats["cross_kv_bytes_used"] == per_row * MAX_IMAGE_TILES * 17 * 4  # four images' rows
    engine.abort_request(["r0", "r1", "r2"])
    engine.step()
    assert engine.get_stats()["cross_kv_bytes_used"] == 0
    engine.check_integrity()
    assert not engine.runner.cross_kv_holders()


def test_the_budget_makes_requests_wait_and_refuses_one_that_never_fits(model_dir, expected):
    one_image = LLM(str(model_dir)).engine.cross_kv_bytes_per_row * MAX_IMAGE_TILES * 17
    # room for two images at a time: the two-image request runs alone, the others wait their turn
    llm = LLM(str(model_dir), cross_kv_cache_bytes=2 * one_image)
    names = ["one_image", "two_images", "wide_image", "consecutive_images", "multi_turn"]
    got, _ = _chat(llm, names)
    assert got == {n: expected[n] for n in names}
    llm.check_integrity()
    three = [user(image(SMALL), image(TALL), image(WIDE), text("All three?"))]
    out = llm.chat(three, GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "error"
    assert "cross_kv_cache_bytes" in out.error and str(3 * one_image) in out.error
    assert _chat(llm, ["one_image"])[0]["one_image"] == expected["one_image"]  # and it keeps serving
    llm.check_integrity()


def test_encoder_workers_and_int8_kv(model_dir, expected):
    names = ["one_image", "two_images", "text_only"]
    llm = LLM(str(model_dir), encoder_workers=1)
    try:
        got, _ = _chat(llm, names)
        assert got == {n: expected[n] for n in names}
        stats = llm.get_stats()
        assert stats["encoder_workers_alive"] == 1 and stats["encoder_items_encoded"] == 3
        llm.check_integrity()
    finally:
        llm.shutdown()
    quantized = LLM(str(model_dir), kv_cache_dtype="int8")
    got, _ = _chat(quantized, names)
    assert all(len(tokens) == 10 for tokens in got.values())
    quantized.check_integrity()


def test_reference_processor_agrees_on_a_raw_prompt(model_dir, family):
    """A raw prompt is tokenized as written (as for every family): with `<|begin_of_text|>` written out it is
    transformers' processor's prompt for the same text without special tokens added."""
    _, processor, _ = family
    raw = "<|begin_of_text|><|image|>If I had to write a haiku for this one"
    ours = processor.process(raw, images=[SMALL])
    want = reference_processor(model_dir)(text=raw, images=[[SMALL]], add_special_tokens=False, return_tensors="pt")
    assert ours.prompt_token_ids == want["input_ids"][0].tolist()
    np.testing.assert_array_equal(_dense_mask(ours), want["cross_attention_mask"][0].numpy())


def test_bfloat16_logits_stay_near_transformers_bfloat16(model_dir):
    """In bfloat16 (how the 11B model is served) the logits stay within bfloat16's rounding of transformers'
    own bfloat16 run, images and tokens before them included."""
    model, processor, spec = load_family(model_dir, dtype="bfloat16")
    reference = MllamaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    messages = CONVERSATIONS["two_images"]
    inputs = mllama_reference_inputs(model_dir, messages, date_string=DATE)
    inputs["pixel_values"] = inputs["pixel_values"].to(torch.bfloat16)
    with torch.no_grad():
        want = reference(**inputs).logits[0].float()
    got = full_logits(model, _ours(processor, messages), spec).float()
    assert (got - want).abs().max().item() <= 5e-2
