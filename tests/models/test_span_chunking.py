"""Chunked prefill through the two shapes of image span, at the engine level, against transformers.

Gemma 3: an image's tokens attend to each other in both directions, so no prefill chunk may end
inside an image span; a `max_num_batched_tokens` below the longest span is lifted at start with one
warning line, and every span is prefilled whole. Mistral 3: `[IMG_BREAK]` / `[IMG_END]` sit inside
the span; chunks end on embed rows and on those special rows, and each chunk fuses exactly its
embed rows. Greedy tokens equal transformers' either way."""

import logging

import numpy as np
import pytest
import torch

from mmserve import LLM, SamplingParams
from testkit.families import FAMILIES
from tests.models.helpers import image_part, load_processor, random_image, text_part

NUM_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS)


def _messages(seed=7):
    rng = np.random.default_rng(seed)
    # a prompt longer than Gemma 3's largest span (pan-and-scan's worst case), so it is really chunked
    return [{"role": "system", "content": "Answer briefly, and say which picture you mean. " * 12},
            {"role": "user", "content": [text_part("Compare"), image_part(random_image(rng, 96, 64)),
                                         text_part("with"), image_part(random_image(rng, 50, 120)),
                                         text_part("please.")]}]


def _reference(family, model_dir, messages):
    fixture = FAMILIES[family]
    processor = load_processor(model_dir)
    chat = processor.render_chat(messages)
    prompt = processor.process(chat.prompt, images=chat.images, videos=chat.videos)
    model = fixture.reference_class().from_pretrained(model_dir).eval()
    inputs = fixture.reference_kwargs(model_dir, messages, prompt)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NUM_TOKENS, min_new_tokens=NUM_TOKENS, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist(), prompt


def _chat_chunks(llm, messages):
    """Answer one chat step by step through the engine; (its output, the [start, end) of every chunk of
    it the runner computed), read from the runner's view of the request after each step (the chat is
    the engine's only request and has no prefix-cache hit, so its first chunk starts at 0)."""
    engine = llm.engine
    engine.add_request("chat", engine.process_chat(messages), GREEDY)
    chunks, computed, out = [], 0, None
    while engine.has_unfinished_requests():
        outputs = engine.step()
        view = engine.inspect().runner_requests.get("chat")
        if view is not None and view.num_computed_tokens > computed:
            chunks.append((computed, view.num_computed_tokens))
            computed = view.num_computed_tokens
        out = next((o for o in outputs if o.finished), out)
    assert out.num_cached_tokens == 0
    return out, {"chat": chunks}


def _prompt_chunks(chunks, num_prompt_tokens):
    return [c for cs in chunks.values() for c in cs if c[0] < num_prompt_tokens]


def test_gemma3_image_spans_are_prefilled_whole(all_checkpoints, caplog):
    model_dir = all_checkpoints["gemma3"]
    messages = _messages()
    expected, prompt = _reference("gemma3", model_dir, messages)
    with caplog.at_level(logging.WARNING, logger="mmserve.budget"):
        llm = LLM(str(model_dir), max_num_batched_tokens=4)
    lifted = [r.getMessage() for r in caplog.records if "max_num_batched_tokens lifted" in r.getMessage()]
    assert len(lifted) == 1 and "configured=4 effective=" in lifted[0] and "largest_span=" in lifted[0]
    out, chunks = _chat_chunks(llm, messages)
    assert list(out.outputs[0].token_ids) == expected
    prefill = _prompt_chunks(chunks, prompt.num_tokens)
    assert len(prefill) > 2  # really chunked
    for item in prompt.items:
        assert not any(item.offset < end < item.offset + item.length for _, end in prefill)
        assert any(start <= item.offset and item.offset + item.length <= end for start, end in prefill)
    # the same images again with another question: a prefix-cache hit, the same answers as transformers
    again = _messages()
    again[1]["content"][-1] = text_part("which is darker?")
    expected_again, _ = _reference("gemma3", model_dir, again)
    out = llm.chat([again], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens > 0 and list(out.outputs[0].token_ids) == expected_again
    llm.check_integrity()


def test_mistral3_chunks_end_on_embed_and_special_rows(all_checkpoints):
    model_dir = all_checkpoints["mistral3"]
    messages = _messages()
    expected, prompt = _reference("mistral3", model_dir, messages)
    special = prompt.mm_mask & ~prompt.embed_mask
    assert special.any(), "the spans hold [IMG_BREAK]/[IMG_END] rows"
    seen = set()
    for budget in (5, 7, 9, 11, 13):
        llm = LLM(str(model_dir), max_num_batched_tokens=budget)
        out, chunks = _chat_chunks(llm, messages)
        assert list(out.outputs[0].token_ids) == expected, f"max_num_batched_tokens={budget}"
        llm.check_integrity()
        for _, end in _prompt_chunks(chunks, prompt.num_tokens):
            last = end - 1  # the chunk's last token
            if end < prompt.num_tokens and prompt.mm_mask[last] and prompt.mm_mask[end]:
                seen.add("special" if special[last] else "embed")
    assert seen == {"special", "embed"}, seen


@pytest.mark.parametrize("family", ["gemma3", "mistral3"])
def test_videos_are_refused_clearly(all_checkpoints, family):
    from mmserve import InvalidInputError

    llm = LLM(str(all_checkpoints[family]))
    rng = np.random.default_rng(0)
    with pytest.raises(InvalidInputError, match="video"):
        llm.chat([{"role": "user", "content": [{"type": "video", "video": [random_image(rng, 64, 64)] * 2},
                                               text_part("What happens?")]}], GREEDY, use_tqdm=False)
    llm.check_integrity()
