"""Prefill on one engine, decode on another (core/handoff.py, Engine.send_kv / admit_transferred /
receive_kv, cluster/kv_connector.py), in one process: the same tokens and logprobs as one colocated
engine for every family, with quantized KV; only the blocks the decode side lacks move; the KV arrives
bit for bit; nothing is held afterwards on either side."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmserve import SamplingParams
from mmserve.cluster.kv_connector import SharedMemoryConnector
from mmserve.config import EngineConfig
from mmserve.engine.llm_engine import Engine
from testkit.conversations import LONG_SYSTEM, parity_workload
from tests.models.helpers import image_part, random_image, text_part

GREEDY = SamplingParams(temperature=0, max_tokens=8)
ENGINE_ARGS = {"num_kv_blocks": 512, "max_num_batched_tokens": 256}


def _engine(model_dir, **kwargs) -> Engine:
    return Engine(EngineConfig.from_kwargs(str(model_dir), **{**ENGINE_ARGS, **kwargs}))


def _run(engine: Engine, request_id: str):
    final = None
    while final is None:
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                final = out
    return final


def _handed_off(prefill: Engine, decode: Engine, request_id: str, messages, params: SamplingParams,
                connector=None):
    """One request through both engines, as replicas would pass it; returns (final output, blocks sent)."""
    connector = connector or SharedMemoryConnector()
    prompt = prefill.process_chat(messages)
    prefill.add_request(request_id, prompt, params, hand_off=True)
    first = None
    while first is None:
        first = next((o for o in prefill.step() if o.request_id == request_id), None)
    if first.finished:  # its first token ended it: nothing to hand off
        return first, 0
    if any(item.cross_attention is not None for item in prompt.items) or prefill.spec.linear_state is not None:
        # images read by cross-attention, or a hybrid model's recurrent state: neither is in the blocks a
        # hand-off moves, so the request decodes here
        assert not first.kv_parked and prefill.get_stats()["requests_parked"] == 0
        return _run(prefill, request_id), 0
    assert first.kv_parked and prefill.get_stats()["requests_parked"] == 1
    needed = decode.admit_transferred(request_id, prompt.without_payloads(), params, first.outputs[0])
    assert needed is not None
    transfer = prefill.send_kv(request_id, needed, connector)
    handoff = prefill.step()  # the prefill side's last output of it
    assert [o.outputs[0].finish_reason for o in handoff if o.request_id == request_id] == ["handoff"]
    connector.receive(transfer, lambda parts: decode.receive_kv(request_id, parts))
    final = _run(decode, request_id)
    final.prompt_logprobs = first.prompt_logprobs  # the server takes them from the first output
    return final, len(needed)


def _colocated(engine: Engine, request_id: str, messages, params: SamplingParams):
    engine.add_request(request_id, engine.process_chat(messages), params)
    return _run(engine, request_id)


def _workload(family: str) -> list:
    conversations = parity_workload(family)
    return [conversations[i] for i in (0, 1, 3, 8, 9, 12)] + conversations[-1:]  # text, images, two, video


def test_every_family_decodes_on_another_engine_as_on_one(all_checkpoints, served_family):
    model_dir = all_checkpoints[served_family]
    colocated, prefill, decode = _engine(model_dir), _engine(model_dir), _engine(model_dir)
    for n, messages in enumerate(_workload(served_family)):
        expected = _colocated(colocated, f"c{n}", messages, GREEDY)
        got, _ = _handed_off(prefill, decode, f"r{n}", messages, GREEDY)
        assert got.outputs[0].token_ids == expected.outputs[0].token_ids, n
        assert got.outputs[0].text == expected.outputs[0].text, n
        assert got.outputs[0].finish_reason == expected.outputs[0].finish_reason
    for engine in (colocated, prefill, decode):
        engine.check_integrity()
        stats = engine.get_stats()
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["encoder_cache_bytes_referenced"] == 0
    assert decode.get_stats()["encoder_items_encoded"] == 0  # the decode side never sees a pixel
    handed_off = prefill.get_stats()["requests_handed_off"]
    assert decode.get_stats()["requests_received"] == handed_off
    assert handed_off == 0 if prefill.spec.linear_state is not None else handed_off > 0


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_quantized_kv_moves_as_stored_codes_and_scales(checkpoint_dirs, kv_cache_dtype):
    model_dir = checkpoint_dirs["qwen2_vl"]
    colocated, prefill, decode = (_engine(model_dir, kv_cache_dtype=kv_cache_dtype) for _ in range(3))
    image = random_image(np.random.default_rng(3), 120, 90)
    messages = [{"role": "user", "content": [image_part(image), text_part("Describe the image.")]}]
    expected = _colocated(colocated, "c", messages, GREEDY)

    read: dict[str, list[torch.Tensor]] = {}

    class Recording(SharedMemoryConnector):
        def send(self, request_id, part_shapes, num_blocks, fill):
            def keep(outs):
                fill(outs)
                read["sent"] = [o.clone() for o in outs]
            return super().send(request_id, part_shapes, num_blocks, keep)

    receive = decode.receive_kv

    def receive_and_read_back(request_id, parts):
        read["received"] = [p.clone() for p in parts]
        receive(request_id, parts)
        owned = decode.scheduler.block_ids(request_id)
        stored = [torch.empty_like(p) for p in parts]
        decode.kv_storage.read_blocks([owned[i] for i in decode.inputs.transfer_indices(request_id)], stored)
        read["stored"] = stored

    decode.receive_kv = receive_and_read_back
    got, num_sent = _handed_off(prefill, decode, "r", messages, GREEDY, Recording())
    assert got.outputs[0].token_ids == expected.outputs[0].token_ids
    assert num_sent > 0 and len(read["sent"]) == 4  # keys, values and both scales, as bytes
    assert read["sent"][0].shape[1] == num_sent and decode.kv_storage.key_scale is not None
    for name in ("received", "stored"):  # through the segment, and into the decode side's storage: bit for bit
        assert all(torch.equal(a, b) for a, b in zip(read["sent"], read[name], strict=True)), name
    for engine in (prefill, decode):
        engine.check_integrity()


def test_only_blocks_the_decode_side_lacks_move(checkpoint_dirs):
    model_dir = checkpoint_dirs["qwen2_vl"]
    prefill, decode, colocated = _engine(model_dir), _engine(model_dir), _engine(model_dir)
    image = random_image(np.random.default_rng(5), 160, 120)

    def asking(question: str) -> list:
        return [{"role": "system", "content": LONG_SYSTEM},
                {"role": "user", "content": [image_part(image), text_part(question)]}]

    first, sent_first = _handed_off(prefill, decode, "a", asking("What is in the picture?"), GREEDY)
    second, sent_second = _handed_off(prefill, decode, "b", asking("Which colour is the sky?"), GREEDY)
    num_prompt_blocks = -(-len(second.prompt_token_ids) // decode.scheduler.kv.block_size)
    assert sent_first == -(-len(first.prompt_token_ids) // decode.scheduler.kv.block_size)
    assert 0 < sent_second < num_prompt_blocks - 2  # the system prompt and the image were there already
    stats = decode.get_stats()
    assert stats["kv_blocks_deduplicated"] == num_prompt_blocks - sent_second
    assert stats["kv_blocks_transferred"] == sent_first + sent_second
    assert stats["kv_bytes_transferred"] == stats["kv_blocks_transferred"] * decode.kv_bytes_per_token * 16
    for rid, messages in (("a", asking("What is in the picture?")), ("b", asking("Which colour is the sky?"))):
        assert (first if rid == "a" else second).outputs[0].token_ids == \
            _colocated(colocated, rid, messages, GREEDY).outputs[0].token_ids


def test_logprobs_and_seeded_sampling_continue_across_the_hand_off(checkpoint_dirs):
    model_dir = checkpoint_dirs["qwen2_vl"]
    colocated, prefill, decode = _engine(model_dir), _engine(model_dir), _engine(model_dir)
    messages = [{"role": "user", "content": [text_part("Tell me a story.")]}]
    for n, params in enumerate([SamplingParams(temperature=0, max_tokens=6, logprobs=3, prompt_logprobs=2),
                                SamplingParams(temperature=1.0, seed=7, max_tokens=6, presence_penalty=0.5)]):
        expected = _colocated(colocated, f"c{n}", messages, params).outputs[0]
        got, _ = _handed_off(prefill, decode, f"r{n}", messages, params)
        assert got.outputs[0].token_ids == expected.token_ids
        if params.logprobs is not None:
            assert got.outputs[0].logprobs == expected.logprobs
            assert got.outputs[0].cumulative_logprob == pytest.approx(expected.cumulative_logprob)
            assert got.prompt_logprobs is not None and len(got.prompt_logprobs) == len(got.prompt_token_ids)


def test_a_parked_or_receiving_request_is_released_when_aborted(checkpoint_dirs):
    model_dir = checkpoint_dirs["qwen2_vl"]
    prefill, decode = _engine(model_dir), _engine(model_dir)
    messages = [{"role": "user", "content": [text_part("Hello there.")]}]
    prompt = prefill.process_chat(messages)
    prefill.add_request("p", prompt, GREEDY, hand_off=True)
    first = next(o for o in iter(prefill.step, None) if o)
    assert first[0].kv_parked and not prefill.has_unfinished_requests()  # parked: no step computes it
    needed = decode.admit_transferred("p", prompt.without_payloads(), GREEDY, first[0].outputs[0])
    assert needed and decode.get_stats()["requests_receiving_kv"] == 1
    for engine in (prefill, decode):
        assert [o.outputs[0].finish_reason for o in engine.abort_request(["p"])] == ["abort"]
        engine.step()
        engine.check_integrity()
        stats = engine.get_stats()
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["requests_parked"] == 0


def test_the_decode_side_refuses_what_does_not_fit_and_takes_it_later(checkpoint_dirs):
    model_dir = checkpoint_dirs["qwen2_vl"]
    prefill, decode = _engine(model_dir), _engine(model_dir, num_kv_blocks=8, max_num_batched_tokens=128)
    messages = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": [text_part("Hi.")]}]
    prompt = prefill.process_chat(messages)
    assert prompt.num_tokens > 8 * 16  # more than the decode side's whole KV
    prefill.add_request("big", prompt, GREEDY, hand_off=True)
    first = next(o for o in iter(prefill.step, None) if o)[0]
    assert decode.admit_transferred("big", prompt.without_payloads(), GREEDY, first.outputs[0]) is None
    decode.check_integrity()
    assert decode.get_stats()["kv_blocks_free"] == 8  # refused: nothing held
    assert prefill.get_stats()["requests_parked"] == 1  # the prefill side still holds it
    prefill.abort_request(["big"])
    prefill.check_integrity()
