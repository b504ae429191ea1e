"""The second scheduling surface for every served family: shared images are encoded once, the
encoder cache counts the bytes of every embedding stream (Qwen3-VL's deepstack included), and the
encoder budgets are lifted to the family's own largest item."""

import logging

import numpy as np
import pytest
import torch

from mmserve import LLM, SamplingParams
from testkit.families import FAMILIES
from tests.models.helpers import image_part, load_processor, random_image, text_part, user

N = 6
GREEDY = SamplingParams(temperature=0, max_tokens=N, min_tokens=N)


@pytest.fixture(scope="module")
def two_images():
    rng = np.random.default_rng(5)
    return random_image(rng, 120, 90), random_image(rng, 64, 150)


def _reference_tokens(model_dir, family, conv):
    processor = load_processor(model_dir)
    chat = processor.render_chat(conv)
    inputs = FAMILIES[family].reference_kwargs(model_dir, conv, processor.process(chat.prompt, images=chat.images))
    model = FAMILIES[family].reference_class().from_pretrained(model_dir).eval()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=N, min_new_tokens=N, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def test_eight_requests_sharing_two_images_encode_two_items(served_model_dir, served_family, two_images):
    convs = [user(image_part(two_images[i % 2]), text_part(f"Question {i}: what is it?")) for i in range(8)]
    llm = LLM(str(served_model_dir), enable_prefix_caching=False)
    outputs = llm.chat(convs, GREEDY, use_tqdm=False)
    llm.check_integrity()
    stats = llm.get_stats()
    assert stats["encoder_items_encoded"] == 2
    assert stats["encoder_cache_misses"] == 2 and stats["encoder_cache_hits"] == 6
    for i in (0, 1):  # a consumer of a shared item answers exactly as transformers does alone
        assert outputs[i].outputs[0].token_ids == _reference_tokens(served_model_dir, served_family, convs[i])


def test_cache_bytes_count_every_embedding_stream(served_model_dir, two_images):
    llm = LLM(str(served_model_dir))
    spec = llm.engine.spec
    llm.chat([user(image_part(img), text_part("Describe.")) for img in two_images], GREEDY, use_tqdm=False)
    store = llm.engine.inspect().encoder_outputs
    assert len(store) == 2
    assert all(t.shape[0] == spec.num_embedding_streams and t.shape[2] == spec.embed_dim for t in store.values())
    rows = sum(t.shape[1] for t in store.values())
    stats = llm.get_stats()
    assert stats["budget_bytes_per_embedding_row"] == spec.embed_dim * spec.num_embedding_streams * 4  # float32
    assert stats["encoder_cache_bytes_used"] == rows * stats["budget_bytes_per_embedding_row"]
    assert stats["encoder_cache_bytes_used"] == sum(t.numel() * t.element_size() for t in store.values())


def test_budgets_lift_to_the_familys_largest_item(served_model_dir, two_images, caplog):
    with caplog.at_level(logging.WARNING, logger="mmserve.budget"):
        llm = LLM(str(served_model_dir), max_encoder_tokens_per_step=1, encoder_output_budget_bytes=1)
    spec, stats = llm.engine.spec, llm.get_stats()
    assert stats["budget_max_encoder_tokens_per_step"] == spec.max_item_encoder_tokens
    assert stats["budget_encoder_output_bytes"] == spec.max_item_rows * stats["budget_bytes_per_embedding_row"]
    lines = [r.getMessage() for r in caplog.records]
    assert any(f"configured=1 effective={spec.max_item_encoder_tokens}" in line for line in lines)
    # the largest image the processor can make fits one encoder step, so every image can run
    outs = llm.chat([user(image_part(img), text_part("Describe.")) for img in two_images], GREEDY, use_tqdm=False)
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    llm.check_integrity()
