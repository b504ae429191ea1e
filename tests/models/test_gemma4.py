"""Gemma 4 against transformers where the family-wide suites do not reach: audio.

The family-wide suites (engine parity, logprobs, templates, ... over `testkit.families.FAMILIES`) run Gemma 4
on text, images and video. Here: transformers' own `Gemma4Processor` makes the same prompt ids, pixels and
log-mel features as mmserve's for images, clips and both in one turn; the greedy tokens and float32 logprobs
of conversations with audio equal transformers' — one at a time, in one batch (two different clips of the
same length among them), in small prefill chunks and with the prefix cache hit; a repeated clip is encoded
once; the KV-shared layers own no cache and the sliding layers only their window's blocks (a 4k-token
request's blocks counted); n-gram speculation over the window pool keeps the greedy tokens; the assistant
drafter's config reads.
"""

from __future__ import annotations

import base64
import io
import json
import wave

import numpy as np
import pytest
import torch

from mmserve import LLM, SamplingParams
from mmserve.errors import InvalidInputError, ModelLoadError
from mmserve.inputs.items import AUDIO, IMAGE
from mmserve.models.registry import resolve
from testkit.conversations import image_part, random_image, text_part
from testkit.families import FAMILIES
from testkit.tiny_gemma4 import build_gemma4_assistant_config, gemma4_reference_inputs
from tests.models.helpers import load_processor, reference_inputs

RATE = 16_000
NUM_TOKENS = 6
TOP = 3


def pcm_clip(seconds: float, seed: int) -> np.ndarray:
    """A clip as 16-bit PCM would hold it: a tone under noise, float32 in [-1, 1)."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * RATE)) / RATE
    wave_ = 0.3 * np.sin(2 * np.pi * (220 + 110 * seed) * t) + 0.05 * rng.standard_normal(t.shape)
    return np.round(np.clip(wave_, -1, 1) * 32767).astype(np.int16).astype(np.float32) / 32768


def wav_bytes(clip: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(RATE)
        out.writeframes(np.round(clip * 32768).astype("<i2").tobytes())
    return buffer.getvalue()


def audio_part(clip: np.ndarray) -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav_bytes(clip)).decode(),
                                                   "format": "wav"}}


CLIP_A, CLIP_B, CLIP_LONG = pcm_clip(1.0, 1), pcm_clip(1.0, 2), pcm_clip(1.7, 3)
IMAGE_ = random_image(np.random.default_rng(5), 50, 30)


def conversations() -> list[list[dict]]:
    """A clip; an image and a clip in one turn; another clip of the first's length; a longer clip after a
    system prompt and an earlier turn."""
    return [
        [{"role": "user", "content": [audio_part(CLIP_A), text_part("What do you hear?")]}],
        [{"role": "user", "content": [image_part(IMAGE_), audio_part(CLIP_B), text_part("Describe both.")]}],
        [{"role": "user", "content": [audio_part(CLIP_B), text_part("What do you hear?")]}],
        [{"role": "system", "content": "Answer in one word."},
         {"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Hi."},
         {"role": "user", "content": [text_part("And this:"), audio_part(CLIP_LONG)]}],
    ]


@pytest.fixture(scope="module")
def model_dir(all_checkpoints):
    return all_checkpoints["gemma4"]


@pytest.fixture(scope="module")
def expected(model_dir):
    """transformers' greedy ids and per-step log-softmax for each conversation, run alone."""
    model = FAMILIES["gemma4"].reference_class().from_pretrained(model_dir).eval()
    out = []
    for messages in conversations():
        inputs = reference_inputs(model_dir, "gemma4", messages)
        with torch.no_grad():
            gen = model.generate(**inputs, max_new_tokens=NUM_TOKENS, min_new_tokens=NUM_TOKENS, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True)
        out.append((gen.sequences[0, inputs["input_ids"].shape[1]:].tolist(),
                    [step[0].float().log_softmax(-1) for step in gen.logits]))
    return out


PARAMS = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS, logprobs=TOP)


def assert_matches(outputs, expected) -> None:
    for output, (ids, logprobs) in zip(outputs, expected, strict=True):
        completion = output.outputs[0]
        assert completion.token_ids == ids
        for token, entry, ref in zip(ids, completion.logprobs, logprobs):
            assert entry[token].rank == 1
            assert entry[token].logprob == pytest.approx(ref[token].item(), abs=1e-4)
            got = torch.tensor(sorted((lp.logprob for lp in entry.values()), reverse=True)[:TOP])
            torch.testing.assert_close(got, ref.topk(TOP).values, rtol=0, atol=1e-4)


def test_the_processor_makes_transformers_prompt_ids_pixels_and_features(model_dir):
    processor = load_processor(model_dir)
    cases = [([image_part(IMAGE_), text_part("Describe.")], [IMAGE_], None),
             ([audio_part(CLIP_A), text_part("Listen.")], None, [CLIP_A]),
             ([audio_part(CLIP_A), audio_part(CLIP_LONG)], None, [CLIP_A, CLIP_LONG]),
             ([image_part(IMAGE_), audio_part(CLIP_B), text_part("Both.")], [IMAGE_], [CLIP_B])]
    for parts, images, audios in cases:
        chat = processor.render_chat([{"role": "user", "content": parts}])
        prompt = processor.process(chat.prompt, None, chat.images, chat.videos, audios=chat.audios,
                                   item_params=chat.params)
        ref = gemma4_reference_inputs(model_dir, chat.prompt, images=images, audios=audios)
        assert prompt.prompt_token_ids == ref["input_ids"][0].tolist()
        ours = {m: [i.payload for i in prompt.items if i.modality == m] for m in (IMAGE, AUDIO)}
        for k, payload in enumerate(ours[IMAGE]):
            real = (ref["image_position_ids"][k] != -1).all(-1)
            np.testing.assert_array_equal(payload.pixel_values, ref["pixel_values"][k][real].numpy())
        for k, payload in enumerate(ours[AUDIO]):  # transformers pads the batch's clips to the longest
            frames = payload.features.shape[0]
            np.testing.assert_array_equal(payload.features, ref["input_features"][k][:frames].numpy())
            np.testing.assert_array_equal(payload.frame_mask, ref["input_features_mask"][k][:frames].numpy())


def test_audio_answers_equal_transformers_alone_and_in_one_batch(model_dir, expected):
    llm = LLM(str(model_dir))
    alone = [llm.chat([c], PARAMS, use_tqdm=False)[0] for c in conversations()]
    assert_matches(alone, expected)
    assert_matches(llm.chat(conversations(), PARAMS, use_tqdm=False), expected)
    llm.check_integrity()


def test_audio_answers_equal_transformers_in_small_chunks_and_from_the_prefix_cache(model_dir, expected):
    llm = LLM(str(model_dir), max_num_batched_tokens=16)
    assert_matches(llm.chat(conversations(), PARAMS, use_tqdm=False), expected)
    before = llm.get_stats()
    second = llm.chat(conversations(), PARAMS, use_tqdm=False)
    assert llm.get_stats()["prefix_cache_hit_tokens"] > before["prefix_cache_hit_tokens"]
    assert sum(o.num_cached_tokens for o in second) > 0
    assert_matches(second, expected)
    llm.check_integrity()


def test_a_repeated_clip_is_encoded_once_and_a_different_clip_of_its_length_is_not_taken_for_it(model_dir):
    llm = LLM(str(model_dir), enable_prefix_caching=False)
    ask = lambda clip, q: [{"role": "user", "content": [audio_part(clip), text_part(q)]}]  # noqa: E731
    llm.chat([ask(CLIP_A, "What?")], PARAMS, use_tqdm=False)
    first = llm.get_stats()
    llm.chat([ask(CLIP_A, "And now?")], PARAMS, use_tqdm=False)
    second = llm.get_stats()
    assert second["encoder_items_encoded"] == first["encoder_items_encoded"]
    llm.chat([ask(CLIP_B, "What?")], PARAMS, use_tqdm=False)
    assert llm.get_stats()["encoder_items_encoded"] == second["encoder_items_encoded"] + 1


def test_a_clip_too_short_for_one_audio_token_is_refused_naming_its_part(model_dir):
    llm = LLM(str(model_dir))
    chat = [{"role": "user", "content": [text_part("Hm?"), audio_part(pcm_clip(0.005, 4))]}]
    with pytest.raises(InvalidInputError, match="too short") as err:
        llm.chat(chat, PARAMS, use_tqdm=False)
    assert err.value.param.startswith("messages[0].content[1]")
    assert llm.chat([conversations()[0]], PARAMS, use_tqdm=False)[0].outputs[0].token_ids  # still serving


def test_a_4k_request_holds_its_full_layers_context_and_only_the_sliding_layers_window(model_dir):
    """Memory that follows the model: KV-shared layers own no cache, full layers keep every block of a request,
    sliding layers only the blocks of their window (a pool of their own, freed as the window moves). A budget
    of the full layers' 4k tokens plus the window pool serves a 4k-token request, which one pool of every
    owner layer's blocks could not hold; while it decodes it holds 256 full blocks and 2 window blocks."""
    config = json.loads((model_dir / "config.json").read_text())["text_config"]
    heads, window, bs = config["num_key_value_heads"], config["sliding_window"], 16
    owned = config["layer_types"][:config["num_hidden_layers"] - config["num_kv_shared_layers"]]
    full = sum(2 * heads * config["global_head_dim"] * 4 for t in owned if t == "full_attention")  # float32
    sliding = sum(2 * heads * config["head_dim"] * 4 for t in owned if t == "sliding_attention")
    every_layer = sum(2 * heads * (config["global_head_dim"] if t == "full_attention" else config["head_dim"]) * 4
                      for t in config["layer_types"])
    assert full + sliding < every_layer  # the shared layers cost nothing
    window_pool = 2 * (-(-(window - 1) // bs) + 2) + 256 // bs  # 2 requests' windows and one 256-token step
    budget = (4096 // bs) * bs * full + window_pool * bs * sliding
    assert budget // (bs * (full + sliding)) < 4096 // bs  # one pool of every owner's blocks: under 4k tokens
    llm = LLM(str(model_dir), kv_cache_bytes=budget, max_model_len=4096, max_num_seqs=2, max_num_batched_tokens=256)
    kv, storage = llm.engine.scheduler.kv, llm.engine.kv_storage
    stats = llm.get_stats()
    assert stats["kv_blocks_total"] == 4096 // bs and stats["kv_window_blocks_total"] == window_pool
    stored = sum(t.numel() * t.element_size() for group in storage._groups for t in group)
    assert stored == (4096 // bs) * bs * full + (window_pool + 1) * bs * sliding  # the window pool's null block
    engine = llm.engine
    engine.add_request("long", engine.process({"prompt_token_ids": [2] + [100] * 4090}),
                       SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    held, tokens = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.outputs[0].token_ids
        if "long" in kv.req_blocks:
            held.append((len(kv.req_blocks["long"]), kv.num_window_blocks_held("long")))
    assert len(tokens) == 4
    decoding = held[-2:]  # the decodes before the last (which ends it): 4092 and 4093 tokens
    assert all(num_full == 4096 // bs for num_full, _ in decoding)
    assert held[0] == (256 // bs, 256 // bs)  # a prompt's first chunk: its blocks in both pools
    window_blocks = -(-(window - 1) // bs) + 1  # the window (15 keys before a query) and the query's block
    assert all(num_window <= window_blocks for _, num_window in decoding)
    bound = 4096 * full + window_blocks * bs * sliding  # bytes: the full layers' 4k, the window rounded to blocks
    assert max(f * bs * full + w * bs * sliding for f, w in decoding) <= bound
    assert llm.get_stats()["kv_window_blocks_free"] == window_pool  # every window block back
    llm.check_integrity()


def test_speculative_decoding_over_the_window_pool_leaves_greedy_tokens_unchanged(model_dir):
    """n-gram drafts verified over sliding layers that keep only their window: the tokens of speculation off,
    in 16-token prefill chunks with the prefix cache hit, drafts accepted, every block back after."""
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
             "disable_by_batch_size": None}
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["a b c a b c a b c a b c a b c a b", "one two three one two three one two three one"] * 2
    results = []
    for extra in ({}, {"speculative_config": ngram}):
        with LLM(str(model_dir), max_num_batched_tokens=16, **extra) as llm:
            outputs = llm.generate(prompts, params, use_tqdm=False) + llm.chat(conversations()[:3], params,
                                                                               use_tqdm=False)
            results.append([list(o.outputs[0].token_ids) for o in outputs])
            stats = llm.get_stats()
            llm.check_integrity()
            assert stats["kv_window_blocks_free"] == stats["kv_window_blocks_total"] > 0
    assert results[1] == results[0]
    assert stats["spec_decode_num_accepted_tokens"] > 0 and stats["prefix_cache_hit_tokens"] > 0


def test_the_assistant_drafters_config_reads_and_is_refused_as_a_model_to_serve(tmp_path):
    directory = build_gemma4_assistant_config(tmp_path / "assistant")
    with pytest.raises(ModelLoadError, match="assistant drafter .*2 layers.*not a model to serve"):
        resolve(json.loads((directory / "config.json").read_text()))
