"""Streaming video: a video that grows turn by turn encodes only its new frames and reuses the KV of
the old ones, with output identical to a fresh engine and to transformers (Qwen2-VL, Qwen2.5-VL,
Qwen3-VL: their vision towers attend within a temporal group, so a video is one item per group)."""

from __future__ import annotations

import pytest
import torch

from mmserve import LLM, SamplingParams
from mmserve.demo.video import moving_shapes
from testkit.families import FAMILIES
from tests.models.helpers import load_processor

STREAMING = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
NUM_TOKENS = 8
FRAMES_PER_TURN = 8
TURNS = 3
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS)
# Qwen3-VL's video resize spreads one pixel budget over all frames: keep this stream inside it, so the
# frames keep their size as the video grows (past it, every frame is resized and nothing is reused)
KWARGS = {"qwen3_vl": {"max_pixels": 96 * 72 * FRAMES_PER_TURN * TURNS}}


@pytest.fixture(scope="module")
def frames():
    return moving_shapes(FRAMES_PER_TURN * TURNS, fps=2.0, seed=3, width=96, height=72)


def _messages(frames, num_frames):
    return [{"role": "system", "content": "You watch a live camera."},
            {"role": "user", "content": [{"type": "video", "video": frames[:num_frames]},
                                         {"type": "text", "text": "What is happening now?"}]}]


def _turns(llm, family, frames):
    """Per turn: (greedy tokens, stats delta, processed-prompt items of the turn)."""
    kwargs = KWARGS.get(family)
    out = []
    for turn in range(1, TURNS + 1):
        before = llm.get_stats()
        (result,) = llm.chat(_messages(frames, turn * FRAMES_PER_TURN), GREEDY, use_tqdm=False,
                             mm_processor_kwargs=kwargs)
        after = llm.get_stats()
        delta = {k: after[k] - before[k] for k in ("encoder_tokens_encoded", "prefix_cache_hit_tokens",
                                                   "prompt_tokens_computed")}
        out.append((result.outputs[0].token_ids, delta, result))
    llm.check_integrity()
    return out


def _reference_tokens(model_dir, family, frames):
    fixture = FAMILIES[family]
    processor = load_processor(model_dir)
    model = fixture.reference_class().from_pretrained(model_dir).eval()
    tokens = []
    for turn in range(1, TURNS + 1):
        messages = _messages(frames, turn * FRAMES_PER_TURN)
        chat = processor.render_chat(messages)
        prompt = processor.process(chat.prompt, videos=chat.videos, mm_processor_kwargs=KWARGS.get(family))
        inputs = fixture.reference_kwargs(model_dir, messages, prompt)
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=NUM_TOKENS, min_new_tokens=NUM_TOKENS, do_sample=False)
        tokens.append(out[0, inputs["input_ids"].shape[1]:].tolist())
    return tokens


def _video_items(model_dir, family, frames, num_frames):
    processor = load_processor(model_dir)
    chat = processor.render_chat(_messages(frames, num_frames))
    return processor.process(chat.prompt, videos=chat.videos, mm_processor_kwargs=KWARGS.get(family)).items


@pytest.mark.parametrize("family", STREAMING)
def test_growing_video_reuses_old_frames(all_checkpoints, family, frames):
    model_dir = all_checkpoints[family]
    streamed = _turns(LLM(str(model_dir)), family, frames)
    expected = _reference_tokens(model_dir, family, frames)
    block = 16
    groups_per_turn = FRAMES_PER_TURN // 2
    for turn, (tokens, delta, _) in enumerate(streamed, start=1):
        (fresh,) = LLM(str(model_dir)).chat(_messages(frames, turn * FRAMES_PER_TURN), GREEDY, use_tqdm=False,
                                            mm_processor_kwargs=KWARGS.get(family))
        assert tokens == fresh.outputs[0].token_ids == expected[turn - 1], f"turn {turn}"
        items = _video_items(model_dir, family, frames, turn * FRAMES_PER_TURN)
        assert len(items) == turn * groups_per_turn  # one item per temporal group
        new = [i for i in items if i.part >= (turn - 1) * groups_per_turn]
        # only the new frames are encoded ...
        assert delta["encoder_tokens_encoded"] == sum(i.encoder_tokens for i in new), f"turn {turn}"
        if turn > 1:  # ... and the KV of the old frames' rows is reused, down to the block they end in
            old_end = max(i.offset + i.length for i in items if i.part < (turn - 1) * groups_per_turn)
            assert delta["prefix_cache_hit_tokens"] >= old_end // block * block, f"turn {turn}"
            assert delta["prefix_cache_hit_tokens"] < min(i.offset for i in new) + block


@pytest.mark.parametrize("family", STREAMING)
def test_eviction_mid_stream_gives_identical_output(all_checkpoints, family, frames):
    """A tiny encoder cache and a tiny KV pool, with another video between the turns that pushes the
    stream's entries and blocks out: the same answers, with more encoding and less reuse."""
    model_dir = all_checkpoints[family]
    roomy = _turns(LLM(str(model_dir)), family, frames)
    other = moving_shapes(TURNS * FRAMES_PER_TURN, fps=2.0, seed=4, width=128, height=96)
    row_bytes = LLM(str(model_dir)).get_stats()["budget_bytes_per_embedding_row"]
    other_bytes = sum(i.output_rows for i in _video_items(model_dir, family, other, len(other))) * row_bytes
    last = _video_items(model_dir, family, other, len(other))[-1]
    longest = last.offset + last.length + 16  # the other video's prompt is the longest
    # room for the other video's outputs (or one encoder step, whichever is more), and KV for one request
    tiny = LLM(str(model_dir), encoder_output_budget_bytes=other_bytes, encoder_cache_bytes=other_bytes,
               num_kv_blocks=-(-(longest + NUM_TOKENS) // 16) + 1)
    kwargs = KWARGS.get(family)
    got = []
    for turn in range(1, TURNS + 1):
        (result,) = tiny.chat(_messages(frames, turn * FRAMES_PER_TURN), GREEDY, use_tqdm=False,
                              mm_processor_kwargs=kwargs)
        got.append(result.outputs[0].token_ids)
        tiny.chat(_messages(other, turn * FRAMES_PER_TURN), GREEDY, use_tqdm=False, mm_processor_kwargs=kwargs)
    tiny.check_integrity()
    assert got == [tokens for tokens, _, _ in roomy]
    stats = tiny.get_stats()
    assert stats["encoder_cache_evictions"] > 0 and stats["kv_cache_evictions"] > 0
    roomy_encoded = sum(d["encoder_tokens_encoded"] for _, d, _ in roomy)
    assert stats["encoder_tokens_encoded"] > 2 * roomy_encoded  # the stream's old frames were encoded again


def test_a_uuid_names_a_growing_stream(all_checkpoints, frames):
    """Under a caller's uuid, a longer video with the same uuid is the same stream grown: its complete
    old groups are reused; a padded last group (an odd frame count) is encoded again once it is full."""
    model_dir = all_checkpoints["qwen2_vl"]
    llm = LLM(str(model_dir))

    def ask(num_frames):
        messages = _messages(frames, num_frames)
        messages[1]["content"][0]["uuid"] = "camera-1"
        before = llm.get_stats()["encoder_tokens_encoded"]
        (result,) = llm.chat(messages, GREEDY, use_tqdm=False)
        return result.outputs[0].token_ids, llm.get_stats()["encoder_tokens_encoded"] - before

    ask(7)  # groups 0-2 full, group 3 = frame 6 twice
    tokens, encoded = ask(16)
    (fresh,) = LLM(str(model_dir)).chat(_messages(frames, 16), GREEDY, use_tqdm=False)
    assert tokens == fresh.outputs[0].token_ids
    items = _video_items(model_dir, "qwen2_vl", frames, 16)
    assert encoded == sum(i.encoder_tokens for i in items if i.part >= 3)
    llm.check_integrity()
