"""The second scheduling surface through the real engine: sharing, budgets, eviction, chunking
through cached and uncached images, faults, rejection, lifecycle — outputs equal transformers'."""

import gc
import logging
import weakref

import numpy as np
import pytest
import torch
import transformers

from mmserve import LLM, SamplingParams
from mmserve.faults import FaultPlan
from mmserve.runner import batch as batch_module
from testkit.tiny_checkpoints import reference_inputs
from tests.models.helpers import REFERENCE_IMAGE_PART, image_part, random_image, text_part, user

N = 8
GREEDY = SamplingParams(temperature=0, max_tokens=N, min_tokens=N)
QUESTION = "What is in the picture?"


@pytest.fixture(scope="module")
def images():
    rng = np.random.default_rng(77)
    # two small images, then two at the checkpoint's max_pixels (256 rows each: one fills the smallest pool)
    return [random_image(rng, 224, 224), random_image(rng, 160, 96), random_image(rng, 448, 448),
            random_image(rng, 448, 448)]


def _conv(*imgs):
    return user(*[image_part(i) for i in imgs], text_part(QUESTION))


@pytest.fixture(scope="module")
def model_dir(checkpoint_dirs):
    return str(checkpoint_dirs["qwen2_vl"])


@pytest.fixture(scope="module")
def reference(model_dir, images):
    """transformers' greedy tokens for: image 0, image 1, both images."""
    model = transformers.Qwen2VLForConditionalGeneration.from_pretrained(model_dir).eval()
    out = {}
    for name, imgs in {"a": [images[0]], "b": [images[1]], "ab": images[:2], "c": [images[2]],
                       "d": [images[3]]}.items():
        inputs, _ = reference_inputs(model_dir, user(*[REFERENCE_IMAGE_PART] * len(imgs), text_part(QUESTION)), imgs)
        with torch.no_grad():
            gen = model.generate(**inputs, max_new_tokens=N, min_new_tokens=N, do_sample=False)
        out[name] = gen[0, inputs["input_ids"].shape[1]:].tolist()
    return out


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_eight_requests_two_images_encode_twice(model_dir, images, reference):
    llm = LLM(model_dir, enable_prefix_caching=False)
    outs = llm.chat([_conv(images[i % 2]) for i in range(8)], GREEDY, use_tqdm=False)
    assert _tokens(outs) == [reference["a"], reference["b"]] * 4
    stats = llm.get_stats()
    assert stats["encoder_items_encoded"] == 2 and stats["encoder_cache_hits"] == 6
    llm.check_integrity()


def test_one_item_per_step(model_dir, images, reference):
    llm = LLM(model_dir, max_encoder_items_per_step=1)
    outs = llm.chat([_conv(*images[:2]), _conv(images[1]), _conv(images[0])], GREEDY, use_tqdm=False)
    assert _tokens(outs) == [reference["ab"], reference["b"], reference["a"]]
    assert llm.get_stats()["encoder_items_encoded"] == 2


def test_token_budget_below_one_image_is_lifted(model_dir, images, reference, caplog):
    with caplog.at_level(logging.WARNING, logger="mmserve.budget"):
        llm = LLM(model_dir, max_encoder_tokens_per_step=16)
    lifted = [r.message for r in caplog.records if "encoder token budget lifted" in r.message]
    assert len(lifted) == 1 and "configured=16 effective=" in lifted[0] and "model_atomic_max=" in lifted[0]
    assert llm.get_stats()["budget_max_encoder_tokens_per_step"] > 256  # one 224x224 image is 256 patches
    assert _tokens(llm.chat([_conv(*images[:2])], GREEDY, use_tqdm=False)) == [reference["ab"]]


def test_small_cache_evicts_and_reencodes(model_dir, images, reference):
    llm = LLM(model_dir, enable_prefix_caching=False, encoder_output_budget_bytes=1024,
              encoder_cache_bytes=1024, max_video_frames=2)
    stats = llm.get_stats()
    big_image_bytes = 256 * stats["budget_bytes_per_embedding_row"]
    assert stats["budget_encoder_cache_bytes"] == big_image_bytes  # lifted to one largest item, no more
    got = []
    for name in ("c", "d", "c"):
        got += _tokens(llm.chat([_conv(images[2] if name == "c" else images[3])], GREEDY, use_tqdm=False))
        llm.check_integrity()  # cache bytes never above budget
    assert got == [reference["c"], reference["d"], reference["c"]]
    stats = llm.get_stats()
    assert stats["encoder_cache_evictions"] == 2 and stats["encoder_items_encoded"] == 3
    assert stats["encoder_cache_bytes_used"] <= stats["encoder_cache_bytes_total"]


@pytest.mark.parametrize("cached", [False, True])
def test_chunks_smaller_than_an_image_are_views(model_dir, images, reference, monkeypatch, cached):
    llm = LLM(model_dir, max_num_batched_tokens=24, enable_prefix_caching=False)
    if cached:  # the image's rows come from the encoder cache, filled by an earlier request
        llm.chat([_conv(images[0])], GREEDY, use_tqdm=False)
    store = llm.engine.inspect().encoder_outputs  # a live view
    seen = []
    original = batch_module.gather_chunk_rows

    def spy(pieces, outputs):
        rows = original(pieces, outputs)
        for piece, r in zip(pieces, rows):
            source = outputs[piece.item_index]
            seen.append((r.untyped_storage().data_ptr() == source.untyped_storage().data_ptr(),
                         any(source is t for t in store.values())))
        return rows

    monkeypatch.setattr(batch_module, "gather_chunk_rows", spy)
    assert _tokens(llm.chat([_conv(images[0])], GREEDY, use_tqdm=False)) == [reference["a"]]
    assert len(seen) >= 3 and all(view and from_store for view, from_store in seen)
    assert llm.get_stats()["encoder_items_encoded"] == 1


def test_batch_failure_fails_producer_consumer_completes(model_dir, images, reference):
    calls = []

    def flaky(real):
        def encode(payloads):
            calls.append(len(payloads))
            if len(calls) == 1:
                raise RuntimeError("device fell over")
            return real(payloads)
        return encode

    llm = LLM(model_dir, enable_prefix_caching=False, faults=FaultPlan(wrap_encode=flaky))
    outs = llm.chat([_conv(images[0]), _conv(images[0]), _conv(images[1])], GREEDY, use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error" and "device fell over" in outs[0].error
    assert outs[2].outputs[0].finish_reason == "error"  # also a producer of that batch
    assert outs[1].outputs[0].token_ids == reference["a"]  # the consumer got a new producer
    llm.check_integrity()
    assert _tokens(llm.chat([_conv(images[1])], GREEDY, use_tqdm=False)) == [reference["b"]]


def test_wrong_rows_for_one_key_fail_exactly_its_users(model_dir, images, reference):
    bad_rows = 64  # image 0 (224x224) has 64 rows; image 1 has 30

    def corrupt(real):
        return lambda payloads: [o[:, :-1] if o.shape[1] == bad_rows else o for o in real(payloads)]

    llm = LLM(model_dir, enable_prefix_caching=False, faults=FaultPlan(wrap_encode=corrupt))
    outs = llm.chat([_conv(images[0]), _conv(*images), _conv(images[1])], GREEDY, use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs[:2]] == ["error", "error"]
    assert all("expected (1, 64, 64) (streams, rows, width)" in o.error for o in outs[:2])
    assert outs[2].outputs[0].token_ids == reference["b"]
    # nothing half-written stays; the good outputs of the failed producer are kept for reuse
    store = llm.engine.inspect().encoder_outputs
    assert len(store) == 3 and all(t.shape[1] != bad_rows - 1 for t in store.values())
    llm.check_integrity()


def test_request_over_output_budget_rejected_others_finish(model_dir, images, reference):
    llm = LLM(model_dir, encoder_output_budget_bytes=1024, max_video_frames=2)
    outs = llm.chat([_conv(images[2], images[3]), _conv(images[1])], GREEDY, use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error"
    assert "encoder_output_budget_bytes is 65536" in outs[0].error and "131072 bytes" in outs[0].error
    assert outs[1].outputs[0].token_ids == reference["b"]
    assert llm.get_stats()["requests_rejected"] == 1
    llm.check_integrity()


def test_pixels_released_once_encoded_caller_prompt_untouched(model_dir, images):
    llm = LLM(model_dir)
    engine = llm.engine
    prompt = engine.process_chat(_conv(*images[:2]))
    engine.add_request("r", prompt, GREEDY)
    assert engine.inspect().payloads_held["r"] == 2
    engine.step()
    assert engine.inspect().payloads_held["r"] == 0  # encoded and held by the request: pixels released
    assert all(item.payload is not None for item in prompt.items)  # the caller's prompt is not mutated
    delta, patches = prompt.positions.decode_delta, [item.encoder_tokens for item in prompt.items]
    while engine.has_unfinished_requests():
        engine.step()
    assert delta != 0 and "r" not in engine.inspect().runner_requests
    stats = llm.get_stats()
    for key in ("encoder_items_encoded", "encoder_cache_hits", "encoder_cache_misses", "encoder_cache_bytes_used",
                "encoder_cache_bytes_total", "encoder_cache_evictions", "encoder_tokens_encoded",
                "requests_rejected", "budget_max_encoder_items_per_step", "budget_encoder_output_bytes"):
        assert key in stats
    assert patches[0] == 256 and stats["encoder_tokens_encoded"] == sum(patches)


def test_uuid_and_processor_kwargs_shape_the_key(model_dir, images):
    llm = LLM(model_dir, enable_prefix_caching=False)
    prompt = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Hi<|im_end|>\n<|im_start|>assistant\n"
    same_uuid = [{"prompt": prompt, "multi_modal_data": {"image": img}, "multi_modal_uuids": {"image": ["pic-1"]}}
                 for img in images[:1]] * 2
    llm.generate(same_uuid, GREEDY, use_tqdm=False)
    assert llm.get_stats()["encoder_items_encoded"] == 1
    llm.generate([{"prompt": prompt, "multi_modal_data": {"image": images[0]}}], GREEDY, use_tqdm=False,
                 mm_processor_kwargs={"max_pixels": 28 * 28 * 16})
    llm.generate([{"prompt": prompt, "multi_modal_data": {"image": images[0]}}], GREEDY, use_tqdm=False)
    assert llm.get_stats()["encoder_items_encoded"] == 3  # uuid, smaller max_pixels, content: three keys


def test_chat_part_uuid_replaces_content_hash(model_dir, images):
    llm = LLM(model_dir, enable_prefix_caching=False)
    convs = [user({"type": "image_pil", "image_pil": img, "uuid": "same-id"}, text_part(QUESTION))
             for img in images[:2]]
    llm.chat(convs, GREEDY, use_tqdm=False)
    assert llm.get_stats()["encoder_items_encoded"] == 1  # the caller said they are the same item


def test_pixels_are_freed_once_encoded_when_the_caller_lets_go(model_dir, images):
    """The engine keeps an item's payload only until it is encoded and held: a caller that drops its
    prompt after submitting (as LLM and the server do) frees the pixels before the request ends."""
    engine = LLM(model_dir).engine
    prompt = engine.process_chat(_conv(images[0]))
    payload = weakref.ref(prompt.items[0].payload)
    engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=20, min_tokens=20))
    del prompt
    gc.collect()
    assert payload() is not None  # not encoded yet: the engine still needs it
    engine.step()  # encodes and prefills
    gc.collect()
    assert payload() is None and engine.has_unfinished_requests()
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_integrity()
