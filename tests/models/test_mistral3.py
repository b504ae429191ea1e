"""Mistral 3 against transformers on a tiny random checkpoint (float32): prompt ids and pixels against
transformers' `PixtralProcessor` (PIL image processor), image features, logits and greedy generation
against its model; the span of an image holding `[IMG_BREAK]` / `[IMG_END]` rows that are in the
multimodal mask but not the embed mask; config defaults against transformers' `Mistral3Config`."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import Mistral3Config as HFMistral3Config
from transformers import Mistral3ForConditionalGeneration as HFMistral3

from mmserve.errors import InvalidInputError, ModelLoadError
from mmserve.models.generation import generate, prefill_inputs
from mmserve.models.layers.attention import LayerAttention
from mmserve.models.loader import iter_tensors, safetensors_files
from mmserve.models.mistral3.config import parse_config
from mmserve.models.mistral3.model import Mistral3ForConditionalGeneration
from testkit.tiny_mistral3 import (
    LONGEST_EDGE,
    SLIDING_WINDOW,
    build_checkpoint,
    mistral3_reference_kwargs,
    reference_processor,
)
from tests.models.helpers import full_logits, image_part, load_family, random_image, text_part, user

IMG, BREAK, END = 10, 12, 13  # the fixture's tokenizer puts them at tekken's ids


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("mistral3"))


@pytest.fixture(scope="module")
def ours(ckpt):
    return load_family(ckpt)


@pytest.fixture(scope="module")
def ref_processor(ckpt):
    return reference_processor(ckpt)


@pytest.fixture(scope="module")
def ref_model(ckpt):
    return HFMistral3.from_pretrained(ckpt).eval()


def _cases(seed):
    rng = np.random.default_rng(seed)
    small, wide, tall = random_image(rng, 90, 60), random_image(rng, 600, 40), random_image(rng, 48, 130)
    big, tiny = random_image(rng, 300, 500, "RGBA"), random_image(rng, 7, 7, "L")
    turns = [{"role": "system", "content": "You are terse."},
             {"role": "user", "content": [image_part(small), text_part("What is this?")]},
             {"role": "assistant", "content": "A red square."},
             {"role": "user", "content": [text_part("And here?"), image_part(tall), text_part("Compare.")]}]
    return {
        "text": user(text_part("Hello, who are you?")),
        "one_image": user(image_part(small), text_part("Describe the image.")),
        "two_images": user(image_part(wide), text_part("and"), image_part(tall), text_part("Which has more?")),
        "big_and_tiny": user(text_part("First:"), image_part(big), text_part("second:"), image_part(tiny)),
        "multi_turn": turns,
    }


def _reference_messages(messages):
    return [m if isinstance(m["content"], str) else
            {**m, "content": [{"type": "image"} if p["type"] == "image_pil" else p for p in m["content"]]}
            for m in messages]


def _both(processor, ref_proc, messages):
    """Our ProcessedPrompt and transformers' processor outputs for one chat; prompts must agree."""
    chat = processor.render_chat(messages)
    mine = processor.process(chat.prompt, images=chat.images)
    prompt = ref_proc.apply_chat_template(_reference_messages(messages), add_generation_prompt=True, tokenize=False)
    assert chat.prompt == prompt
    ref = dict(ref_proc(text=prompt, images=chat.images or None, return_tensors="pt"))
    return mine, ref


@pytest.mark.parametrize("case", ["text", "one_image", "two_images", "big_and_tiny", "multi_turn"])
def test_prompt_and_pixels_match_reference(ours, ref_processor, ckpt, case):
    _, processor, _ = ours
    messages = _cases(3)[case]
    mine, ref = _both(processor, ref_processor, messages)
    assert mine.prompt_token_ids == ref["input_ids"][0].tolist()
    kwargs = mistral3_reference_kwargs(ckpt, messages, mine)  # what the engine-level tests feed transformers
    assert torch.equal(kwargs["input_ids"], ref["input_ids"])
    if mine.items:
        assert torch.equal(kwargs["image_sizes"], ref["image_sizes"])
        assert kwargs["pixel_values"].shape == ref["pixel_values"].shape
        assert (kwargs["pixel_values"] - ref["pixel_values"]).abs().max().item() <= 1e-6
    else:
        assert "pixel_values" not in kwargs and "pixel_values" not in ref


def test_span_has_break_rows_in_mm_mask_but_not_embed_mask(ours):
    model, processor, _ = ours
    chat = processor.render_chat(_cases(4)["two_images"])
    prompt = processor.process(chat.prompt, images=chat.images)
    ids = np.asarray(prompt.prompt_token_ids)
    assert not np.array_equal(prompt.mm_mask, prompt.embed_mask)
    inside = np.zeros(len(ids), dtype=bool)
    for item in prompt.items:
        span = slice(item.offset, item.offset + item.length)
        inside[span] = True
        (h, w), merge = item.payload.grid_hw, model.config.spatial_merge_size
        rows, cols = h // merge, w // merge
        expected = np.asarray(([IMG] * cols + [BREAK]) * rows)
        expected[-1] = END
        assert np.array_equal(ids[span], expected)
        assert prompt.mm_mask[span].all()
        assert np.array_equal(prompt.embed_mask[span], ids[span] == IMG)
        assert item.output_rows == rows * cols == prompt.embed_mask[span].sum() < item.length == rows * (cols + 1)
        assert item.encoder_tokens == h * w
    assert np.array_equal(prompt.mm_mask, inside)  # nothing outside the spans is multimodal
    assert not prompt.embed_mask[~inside].any()


def test_special_rows_keep_text_embedding_and_embed_rows_take_encoder_rows_in_order(ours):
    model, processor, _ = ours
    chat = processor.render_chat(_cases(5)["two_images"])
    prompt = processor.process(chat.prompt, images=chat.images)
    ids = torch.tensor(prompt.prompt_token_ids)
    with torch.no_grad():
        fused, extra = prefill_inputs(model, prompt, torch.device("cpu"))
        text = model.embed(ids)
        rows = torch.cat([r[0] for r in model.encode_items([i.payload for i in prompt.items])])
    assert extra is None
    embed = torch.from_numpy(prompt.embed_mask)
    assert torch.equal(fused[~embed], text[~embed])  # text, [IMG_BREAK] and [IMG_END] rows
    assert torch.equal(fused[embed], rows)


def test_image_features_match_reference(ours, ref_processor, ref_model):
    model, processor, _ = ours
    rng = np.random.default_rng(6)
    images = [random_image(rng, w, h) for w, h in ((90, 60), (600, 40), (48, 130), (500, 300), (16, 16))]
    ref = ref_processor.image_processor(images, patch_size=ref_processor.patch_size * ref_processor.spatial_merge_size,
                                        return_tensors="pt")
    payloads = [processor.expand_image(img, {}, len(images)).payload for img in images]
    with torch.no_grad():
        expected = ref_model.model.get_image_features(pixel_values=ref["pixel_values"],
                                                      image_sizes=ref["image_sizes"]).pooler_output
        batched = model.encode_items(payloads)
        single = [model.encode_items([p])[0] for p in payloads]
    for want, got, alone in zip(expected, batched, single):
        assert got.shape == (1, *want.shape)
        assert (got[0] - want).abs().max().item() <= 1e-5
        assert (got - alone).abs().max().item() <= 1e-5


@pytest.mark.parametrize("case", ["text", "one_image", "two_images", "multi_turn"])
def test_logits_match_reference(ours, ref_processor, ref_model, case):
    model, processor, spec = ours
    mine, ref = _both(processor, ref_processor, _cases(11)[case])
    with torch.no_grad():
        ref_logits = ref_model(**ref).logits[0]
    our_logits = full_logits(model, mine, spec)
    assert our_logits.shape == ref_logits.shape
    assert (our_logits - ref_logits).abs().max().item() <= 1e-4


def test_sliding_window_bites(ours, ref_processor):
    """The prompts above run past the 32-token window: without it the logits would differ."""
    model, processor, spec = ours
    mine, _ = _both(processor, ref_processor, _cases(11)["two_images"])
    assert mine.num_tokens > SLIDING_WINDOW and spec.num_layers == len(model.language_model.layers)
    windowed = full_logits(model, mine, spec)
    attns = [layer.self_attn for layer in model.language_model.layers]
    try:
        for attn in attns:
            attn.options = LayerAttention()
        full = full_logits(model, mine, spec)
    finally:
        for attn in attns:
            attn.options = LayerAttention(sliding_window=SLIDING_WINDOW)
    assert (windowed - full).abs().max().item() > 1e-3


@pytest.mark.parametrize("case", ["one_image", "two_images", "multi_turn"])
def test_greedy_generation_matches_reference(ours, ref_model, ckpt, case):
    model, processor, spec = ours
    messages = _cases(12)[case]
    chat = processor.render_chat(messages)
    mine = processor.process(chat.prompt, images=chat.images)
    ref = mistral3_reference_kwargs(ckpt, messages, mine)
    with torch.no_grad():
        out = ref_model.generate(**ref, max_new_tokens=24, min_new_tokens=24, do_sample=False)
    expected = out[0, ref["input_ids"].shape[1]:].tolist()
    got = list(generate(model, spec, mine, 24, min_new_tokens=24, stop_token_ids=model.config.eos_token_ids))
    assert got == expected


SIZES = [(96, 96), (90, 60), (600, 40), (48, 130), (500, 300), (7, 7), (97, 95), (1000, 17), (16, 200), (200, 200)]


def test_spans_rows_and_largest_item(ours, ref_processor):
    model, processor, spec = ours
    rng = np.random.default_rng(7)
    expansions = [processor.expand_image(random_image(rng, w, h), {}, 1) for w, h in SIZES]
    counted = ref_processor._get_num_multimodal_tokens(image_sizes=[(h, w) for w, h in SIZES]).num_image_tokens
    with torch.no_grad():
        rows = model.encode_items([e.payload for e in expansions])
    largest = spec.largest_item["image"]
    for exp, out, span in zip(expansions, rows, counted):
        assert len(exp.token_ids) == span  # transformers counts the same span from the sizes
        assert out.shape == (1, exp.rows, spec.embed_dim) and exp.rows == exp.token_ids.count(IMG)
        assert exp.rows <= largest.rows and len(exp.token_ids) <= largest.span
        assert exp.encoder_tokens <= largest.encoder_tokens
    square = expansions[0]  # fills the bound on both axes: the largest item
    assert (square.encoder_tokens, square.rows, len(square.token_ids)) == \
        (largest.encoder_tokens, largest.rows, largest.span) == ((LONGEST_EDGE // 8) ** 2, 36, 42)


def test_an_image_too_thin_for_transformers_gets_one_row(ours):
    """transformers floors a 3-pixel side to 0 and fails; here it keeps one merged patch."""
    model, processor, _ = ours
    exp = processor.expand_image(random_image(np.random.default_rng(8), 1000, 3), {}, 1)
    assert exp.token_ids == [IMG] * 6 + [END] and exp.rows == 6
    with torch.no_grad():
        assert model.encode_items([exp.payload])[0].shape == (1, 6, 64)


def test_token_id_prompts_and_bad_inputs(ours):
    _, processor, _ = ours
    images = [random_image(np.random.default_rng(9), w, h) for w, h in ((90, 60), (40, 70))]
    chat = processor.render_chat(user(image_part(images[0]), text_part("vs"), image_part(images[1])))
    from_text = processor.process(chat.prompt, images=images)
    from_ids = processor.process(prompt_token_ids=processor.tokenizer.encode(chat.prompt), images=images)
    assert from_ids.prompt_token_ids == from_text.prompt_token_ids
    assert [i.content_hash for i in from_ids.items] == [i.content_hash for i in from_text.items]
    with pytest.raises(InvalidInputError):  # an expanded span holds breaks: not a run of placeholders
        processor.process(prompt_token_ids=from_text.prompt_token_ids, images=images)
    with pytest.raises(InvalidInputError, match="mm_processor_kwargs"):
        processor.process(chat.prompt, images=images, mm_processor_kwargs={"longest_edge": 32})
    with pytest.raises(InvalidInputError):
        processor.process("[INST]Look: [IMG][/INST]", videos=[[images[0]]])
    with pytest.raises(InvalidInputError, match="video"):  # before Mistral's template refuses it unclearly
        processor.render_chat(user({"type": "video", "video": [images[0]] * 2}, text_part("What happens?")))


def test_bfloat16_runs_close_to_float32(ours, ckpt):
    model, processor, spec = ours
    half, _, _ = load_family(ckpt, "bfloat16")
    chat = processor.render_chat(_cases(14)["two_images"])
    prompt = processor.process(chat.prompt, images=chat.images)
    assert half.encode_items([i.payload for i in prompt.items])[0].dtype == torch.bfloat16
    assert (full_logits(half, prompt, spec).float() - full_logits(model, prompt, spec)).abs().max().item() < 0.1


def test_checkpoint_loads_completely(ckpt):
    """config.json leaves tie_word_embeddings out (transformers reads True) and the checkpoint carries its
    own head: the model starts tied and takes the checkpoint's head, as transformers does."""
    assert "tie_word_embeddings" not in json.loads((ckpt / "config.json").read_text())
    model = Mistral3ForConditionalGeneration(parse_config(json.loads((ckpt / "config.json").read_text())))
    assert model.language_model.lm_head is None
    loaded, unexpected = model.load_weights(iter_tensors(safetensors_files(ckpt), torch.float32))
    assert unexpected == [] and loaded == model.expected_weight_names()
    head = dict(iter_tensors(safetensors_files(ckpt), torch.float32))["language_model.lm_head.weight"]
    assert torch.equal(model.language_model.lm_head.weight, head)
    assert not torch.equal(head, model.language_model.embed_tokens.weight)


def test_tied_checkpoint_matches_reference(tmp_path):
    ckpt = build_checkpoint(tmp_path / "tied", seed=1, tie=True, sliding_window=None)
    assert not any("lm_head" in k for k in safetensors_keys(ckpt))
    model, processor, spec = load_family(ckpt)
    assert model.language_model.lm_head is None and model.config.text.sliding_window is None
    reference = HFMistral3.from_pretrained(ckpt).eval()
    mine, ref = _both(processor, reference_processor(ckpt), _cases(13)["one_image"])
    with torch.no_grad():
        want = reference(**ref).logits[0]
    assert (full_logits(model, mine, spec) - want).abs().max().item() <= 1e-4


def safetensors_keys(model_dir):
    from safetensors import safe_open

    keys = []
    for file in safetensors_files(model_dir):
        with safe_open(str(file), framework="pt") as f:
            keys.extend(f.keys())
    return keys


# ---- config -------------------------------------------------------------------------------------
CONFIGS = {
    "all_defaults": {},
    "text_defaults": {"text_config": {}, "vision_config": {}},
    "legacy_rope_theta": {"text_config": {"rope_theta": 5e5, "sliding_window": None, "head_dim": None,
                                          "num_key_value_heads": 4, "hidden_size": 1024},
                          "vision_config": {"rope_theta": 2e4, "patch_size": 14}, "spatial_merge_size": 1,
                          "vision_feature_layer": -3, "tie_word_embeddings": False, "image_token_index": 7},
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_config_defaults_follow_transformers(name):
    raw = {"architectures": ["Mistral3ForConditionalGeneration"], **CONFIGS[name]}
    ref = HFMistral3Config(**json.loads(json.dumps(CONFIGS[name])))
    cfg = parse_config(raw)
    t, rt = cfg.text, ref.text_config
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "rms_norm_eps", "sliding_window", "hidden_act",
                  "max_position_embeddings"):
        assert getattr(t, field) == getattr(rt, field), field
    assert t.rope_theta == rt.rope_parameters["rope_theta"]
    assert t.tie_word_embeddings == ref.tie_word_embeddings
    assert cfg.eos_token_ids == (rt.eos_token_id,)
    v, rv = cfg.vision, ref.vision_config
    for field in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_channels",
                  "image_size", "patch_size", "hidden_act", "head_dim"):
        assert getattr(v, field) == getattr(rv, field), field
    assert v.rope_theta == rv.rope_parameters["rope_theta"]
    assert cfg.image_token_id == ref.image_token_id and cfg.spatial_merge_size == ref.spatial_merge_size
    assert cfg.projector_hidden_act == ref.projector_hidden_act
    assert cfg.multimodal_projector_bias == ref.multimodal_projector_bias
    assert cfg.vision_feature_layer == ref.vision_feature_layer % (rv.num_hidden_layers + 1)


@pytest.mark.parametrize("change, message", [
    ({"text_config": {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}}, "rope_type"),
    ({"text_config": {"model_type": "ministral3"}}, "text model"),
    ({"vision_feature_layer": [-1, -2]}, "single feature layer"),
    ({"vision_feature_layer": -30}, "outside"),
    ({"text_config": {"num_attention_heads": 6, "num_key_value_heads": 4}}, "multiple"),
])
def test_unsupported_configs_are_refused(change, message):
    with pytest.raises(ModelLoadError, match=message):
        parse_config({"architectures": ["Mistral3ForConditionalGeneration"], **change})
