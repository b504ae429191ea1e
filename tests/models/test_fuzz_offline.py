"""Fuzzing the offline API (seeded, bounded): hostile image bytes, data URIs, chat message structures
(text from every code point), sampling parameters and processor kwargs through `LLM.chat`. Property, case by case: an answer or an
`InvalidInputError` — never another exception, never a hang — and the engine idle and intact after.
"""

from __future__ import annotations

import base64
import dataclasses

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from mmserve import LLM, InvalidInputError, SamplingParams
from tests.fixtures.fuzz import (
    chat_messages,
    data_uris,
    fuzz_settings,
    hostile_images,
    processor_kwargs,
    sampling_fields,
    within,
)

CASE_DEADLINE_S = 60.0  # one case on the tiny model takes well under a second
SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}
GREEDY = SamplingParams(temperature=0, max_tokens=3)


@pytest.fixture(scope="module")
def llm(checkpoint_dirs):
    # a short context bounds every case's generation, whatever max_tokens the fuzzer asks for
    with LLM(str(checkpoint_dirs["qwen2_vl"]), max_model_len=160, num_kv_blocks=64) as engine:
        yield engine


def _answer_or_refusal(llm: LLM, call) -> object:
    """The call's result or its InvalidInputError; anything else fails the case. Then: idle and intact."""
    try:
        result = within(CASE_DEADLINE_S, call)
    except InvalidInputError as exc:
        assert str(exc), "an InvalidInputError must say what is wrong"
        assert " at 0x" not in str(exc), exc  # no Python object reprs in what a user reads
        result = exc
    event("refused" if isinstance(result, InvalidInputError) else "answered")
    stats = llm.get_stats()
    assert stats["requests_running"] == 0 and stats["requests_waiting"] == 0, stats
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"], stats
    assert stats["encoder_cache_bytes_referenced"] == 0, stats
    llm.check_integrity()
    return result


def _png() -> bytes:
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (40, 30), (200, 30, 90)).save(buffer, "PNG")
    return buffer.getvalue()


_PNG = _png()


def _ask(image_url: str) -> list:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url}},
                                         {"type": "text", "text": "What is it?"}]}]


@fuzz_settings(150)
@given(data=hostile_images())
def test_hostile_image_bytes(llm, data):
    uri = "data:image/png;base64," + base64.b64encode(data).decode()
    result = _answer_or_refusal(llm, lambda: llm.chat(_ask(uri), GREEDY, use_tqdm=False))
    if not isinstance(result, InvalidInputError):
        assert result[0].outputs[0].finish_reason in ("stop", "length")


@fuzz_settings(100)
@given(uri=data_uris())
def test_data_uris(llm, uri):
    _answer_or_refusal(llm, lambda: llm.chat(_ask(uri), GREEDY, use_tqdm=False))


@fuzz_settings(200)
@given(messages=chat_messages(data_uris() | st.text(max_size=20)))
def test_chat_message_structures(llm, messages):
    _answer_or_refusal(llm, lambda: llm.chat(messages, GREEDY, use_tqdm=False))


@fuzz_settings(120)
@given(kwargs=processor_kwargs)
def test_processor_kwargs(llm, kwargs):
    """Checked against the media limits before anything is resized; a refusal names the key."""
    uri = "data:image/png;base64," + base64.b64encode(_PNG).decode()
    result = _answer_or_refusal(llm, lambda: llm.chat(_ask(uri), GREEDY, use_tqdm=False, mm_processor_kwargs=kwargs))
    if isinstance(result, InvalidInputError) and isinstance(kwargs, dict) and kwargs:
        assert result.param is None or result.param.startswith("mm_processor_kwargs"), result.param


@fuzz_settings(200)
@given(fields=sampling_fields())
def test_sampling_params(llm, fields):
    known = {k: v for k, v in fields.items() if k in SAMPLING_FIELDS}

    def run():
        params = SamplingParams(**known)  # the documented error for a bad value is InvalidInputError
        return llm.chat([{"role": "user", "content": "Count to three."}], params, use_tqdm=False)

    result = _answer_or_refusal(llm, run)
    if not isinstance(result, InvalidInputError):
        completion = result[0].outputs[0]
        assert completion.finish_reason in ("stop", "length")
        assert len(completion.token_ids) <= known.get("max_tokens", 16)
        assert len(completion.token_ids) >= known.get("min_tokens", 0)
