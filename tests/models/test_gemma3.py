"""Gemma 3 against transformers on a tiny random checkpoint (float32): prompt ids and pixels against
transformers' Gemma3Processor (with and without pan-and-scan), vision rows against its
`get_image_features`, logits and greedy generation against its model on prompts that run past the
sliding window (image tokens attending bidirectionally), content keys, bad kwargs, weight loading
from every name layout, config parsing against transformers' Gemma3Config, and the spec's largest item."""

import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import Gemma3Config as HFGemma3Config
from transformers import Gemma3ForConditionalGeneration

from mmserve import InvalidInputError, ModelLoadError
from mmserve.inputs.media import MediaLimits
from mmserve.models.gemma3.config import FULL, SLIDING, RopeConfig, parse_config
from mmserve.models.gemma3.model import Gemma3ForConditionalGeneration as OurGemma3
from mmserve.models.gemma3.processor import Gemma3Processor
from mmserve.models.generation import generate, prefill_inputs, prompt_positions
from mmserve.models.layers.attention import AttentionMetadata, ContiguousKVCache
from testkit.tiny_gemma3 import (
    MM_TOKENS_PER_IMAGE,
    SLIDING_WINDOW,
    build_checkpoint,
    gemma3_reference_kwargs,
    reference_processor,
)
from tests.models.helpers import (
    REFERENCE_IMAGE_PART,
    full_logits,
    image_part,
    load_family,
    random_image,
    text_part,
)

PAS = {"do_pan_and_scan": True}
PAS_SMALL = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 24, "pan_and_scan_max_num_crops": 3,
             "pan_and_scan_min_ratio_to_activate": 1.5}


@pytest.fixture(scope="module")
def g3_dir(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("gemma3"))


@pytest.fixture(scope="module")
def ours(g3_dir):
    return load_family(g3_dir)


@pytest.fixture(scope="module")
def ref_processor(g3_dir):
    return reference_processor(g3_dir)


@pytest.fixture(scope="module")
def ref_model(g3_dir):
    return Gemma3ForConditionalGeneration.from_pretrained(g3_dir).eval()


def _cases(seed):
    """name -> (messages, mm_processor_kwargs). Images of several sizes and modes; 900x260 gets 3 crops
    under the default pan-and-scan, 40x130 (portrait) 3 crops under PAS_SMALL."""
    rng = np.random.default_rng(seed)
    small, rgba, gray = random_image(rng, 90, 60), random_image(rng, 70, 50, "RGBA"), random_image(rng, 33, 47, "L")
    wide, tall = random_image(rng, 900, 260), random_image(rng, 40, 130)
    system = {"role": "system", "content": "You are a helpful assistant.\n"}
    turns = [system, {"role": "user", "content": [image_part(small), text_part("What is this?")]},
             {"role": "assistant", "content": [text_part("A red square.")]},
             {"role": "user", "content": [text_part("\nAnd the colour of"), image_part(gray), text_part("this?")]}]
    return {
        "text": ([system, {"role": "user", "content": "Hello, who are you? Tell me about the quick brown fox and the lazy dog."}], {}),
        "one_image": ([{"role": "user", "content": [image_part(small), text_part("Describe the image.")]}], {}),
        "two_images": ([system, {"role": "user", "content": [text_part("First:"), image_part(rgba), text_part("and"),
                                                             image_part(wide), text_part("Which has more?")]}], {}),
        "multi_turn": (turns, {}),
        "pan_and_scan": ([{"role": "user", "content": [image_part(wide), text_part("Describe."),
                                                       image_part(small)]}], PAS),
        "pan_and_scan_knobs": ([system, {"role": "user", "content": [image_part(tall), image_part(wide),
                                                                     text_part("Compare.")]}], PAS_SMALL),
    }


def _images(messages):
    return [p["image_pil"] for m in messages if isinstance(m["content"], list)
            for p in m["content"] if p["type"] == "image_pil"]


def _reference_messages(messages):
    return [{**m, "content": [REFERENCE_IMAGE_PART if p["type"] == "image_pil" else p for p in m["content"]]}
            if isinstance(m["content"], list) else m for m in messages]


def _both_inputs(processor, ref_proc, case):
    """Our ProcessedPrompt and transformers' processor outputs for one chat: prompt, ids, bidirectional
    blocks and pixels must agree."""
    messages, kwargs = case
    chat = processor.render_chat(messages)
    assert chat.prompt == ref_proc.apply_chat_template(_reference_messages(messages), add_generation_prompt=True,
                                                       tokenize=False)
    mine = processor.process(chat.prompt, images=chat.images, mm_processor_kwargs=kwargs)
    # the chat path of transformers' processor: the template wrote <bos>, so no special tokens are added
    ref = ref_proc(text=chat.prompt, images=_images(messages) or None, add_special_tokens=False,
                   return_tensors="pt", **kwargs)
    assert mine.prompt_token_ids == ref["input_ids"][0].tolist()
    assert mine.embed_mask.tolist() == ref["token_type_ids"][0].bool().tolist()
    if mine.items:
        ours = np.concatenate([i.payload.pixel_values for i in mine.items])
        assert np.array_equal(ours, ref["pixel_values"].numpy())  # the same float32 pixels, bit for bit
    return mine, ref


@pytest.mark.parametrize("case", list(_cases(0)))
def test_prompt_and_pixels_match_reference(ours, ref_processor, case):
    _, processor, spec = ours
    mine, _ = _both_inputs(processor, ref_processor, _cases(3)[case])
    for item in mine.items:
        assert item.output_rows == int(mine.embed_mask[item.offset:item.offset + item.length].sum())
        assert mine.prompt_token_ids[item.offset] == processor.embed_ids["image"]  # span: first to last soft token
        assert mine.prompt_token_ids[item.offset + item.length - 1] == processor.embed_ids["image"]
        assert item.length <= spec.largest_item["image"].span
    if case in ("pan_and_scan", "pan_and_scan_knobs"):
        assert max(len(i.payload.pixel_values) for i in mine.items) > 1  # crops were made


def test_chat_template_path_of_reference_gives_the_same_ids(ours, ref_processor):
    """transformers' apply_chat_template(tokenize=True), images inside the messages, as its users call it."""
    _, processor, _ = ours
    messages, _ = _cases(4)["two_images"]
    chat = processor.render_chat(messages)
    mine = processor.process(chat.prompt, images=chat.images)
    hf_messages = [{**m, "content": [{"type": "image", "image": p["image_pil"]} if p["type"] == "image_pil" else p
                                     for p in m["content"]]} if isinstance(m["content"], list) else m
                   for m in messages]
    ref = ref_processor.apply_chat_template(hf_messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert mine.prompt_token_ids == list(ref["input_ids"][0])


def test_newlines_around_an_image_merge_with_the_prompts_own(ours):
    """transformers tokenizes "\\n\\n<start_of_image>" together with the text before it: after the
    prompt's own newline the three newlines are one token, not "\\n" + "\\n\\n" tokenized apart."""
    _, processor, _ = ours
    tok = processor.tokenizer
    img = random_image(np.random.default_rng(1), 30, 30)
    prompt = processor.process("Look:\n<start_of_image>Hi", images=[img])
    merged = tok.encode("Look:\n\n\n<start_of_image>")
    assert prompt.prompt_token_ids[:len(merged)] == merged
    assert tok.encode("Look:\n") + tok.encode("\n\n") != merged  # the merge changes the ids


def test_vision_rows_match_reference(ours, ref_model):
    model, processor, spec = ours
    rng = np.random.default_rng(5)
    sizes = [(64, 64), (90, 60), (600, 200), (40, 130), (1000, 3), (7, 7)]
    expansions = [processor.expand_image(random_image(rng, w, h), kw, 1) for w, h in sizes for kw in ({}, PAS_SMALL)]
    payloads = [e.payload for e in expansions]
    with torch.no_grad():
        rows = model.encode_items(payloads)  # one batched call
        pixels = torch.from_numpy(np.concatenate([p.pixel_values for p in payloads]))
        ref = ref_model.get_image_features(pixels).pooler_output  # (crops, mm_tokens, hidden)
    for exp, out in zip(expansions, rows):
        assert out.shape == (1, exp.rows, spec.embed_dim)
        assert exp.rows == len(exp.payload.pixel_values) * MM_TOKENS_PER_IMAGE
    batched = torch.cat([r[0] for r in rows])
    assert (batched - ref.reshape(-1, ref.shape[-1])).abs().max().item() <= 1e-5
    with torch.no_grad():
        single = torch.cat([model.encode_items([p])[0][0] for p in payloads])
    assert (batched - single).abs().max().item() <= 1e-5


@pytest.mark.parametrize("case", ["text", "one_image", "two_images", "multi_turn", "pan_and_scan_knobs"])
def test_logits_match_reference(ours, ref_processor, ref_model, g3_dir, case):
    model, processor, spec = ours
    messages, _ = case_ = _cases(11)[case]
    mine, _ = _both_inputs(processor, ref_processor, case_)
    assert mine.num_tokens > 2 * SLIDING_WINDOW  # sliding layers drop keys, also inside image spans
    with torch.no_grad():
        ref_logits = ref_model(**gemma3_reference_kwargs(g3_dir, messages, mine)).logits[0]
    our_logits = full_logits(model, mine, spec)
    assert our_logits.shape == ref_logits.shape
    assert (our_logits - ref_logits).abs().max().item() <= 1e-4


@pytest.mark.parametrize("case", ["one_image", "two_images", "pan_and_scan"])
def test_greedy_generation_matches_reference(ours, ref_processor, ref_model, g3_dir, case):
    model, processor, spec = ours
    messages, _ = case_ = _cases(12)[case]
    mine, _ = _both_inputs(processor, ref_processor, case_)
    inputs = gemma3_reference_kwargs(g3_dir, messages, mine)
    with torch.no_grad():
        out = ref_model.generate(**inputs, max_new_tokens=24, min_new_tokens=24, do_sample=False)
    expected = out[0, inputs["input_ids"].shape[1]:].tolist()
    got = list(generate(model, spec, mine, 24, min_new_tokens=24, stop_token_ids=model.config.eos_token_ids))
    assert got == expected


@torch.inference_mode()
def test_image_tokens_attend_bidirectionally(ours, ref_processor):
    """Dropping the spans (plain causal attention) changes the logits: the parity tests above bite."""
    model, processor, spec = ours
    mine, _ = _both_inputs(processor, ref_processor, _cases(11)["one_image"])
    n, cpu = mine.num_tokens, torch.device("cpu")
    embeds, _ = prefill_inputs(model, mine, cpu)
    cache = ContiguousKVCache(spec.num_layers, 1, n, spec.num_kv_heads, spec.head_dim, torch.float32)
    causal = model.compute_logits(model(embeds, prompt_positions(mine, 0, n, cpu), cache, AttentionMetadata([n], [0])))
    assert (causal - full_logits(model, mine, spec)).abs().max().item() > 1e-3


def test_pan_and_scan_changes_the_content_key(ours):
    _, processor, _ = ours
    wide = random_image(np.random.default_rng(6), 900, 260)
    prompt = "<start_of_image>Describe."

    def key(kwargs):
        return processor.process(prompt, images=[wide], mm_processor_kwargs=kwargs).items[0].content_hash

    plain, pas, knobs = key({}), key(PAS), key(PAS_SMALL)
    assert len({plain, pas, knobs}) == 3
    assert key({"do_pan_and_scan": False}) == plain == key({"do_pan_and_scan": False, "pan_and_scan_max_num_crops": 2})
    assert key(dict(PAS)) == pas
    with_crops = processor.process(prompt, images=[wide], mm_processor_kwargs=PAS)
    assert len(with_crops.items[0].payload.pixel_values) == 4  # 900/260: 3 crops of 300x260
    assert with_crops.prompt_token_ids[:len(processor.tokenizer.encode("Here is the original image"))] == \
        processor.tokenizer.encode("Here is the original image")


@pytest.mark.parametrize("kwargs", [{"foo": 1}, {"do_pan_and_scan": "yes"}, {"do_pan_and_scan": True, "bar": 2},
                                    {"pan_and_scan_min_crop_size": 0}, {"pan_and_scan_max_num_crops": 99},
                                    {"pan_and_scan_min_ratio_to_activate": "x"}, {"pan_and_scan_max_num_crops": 2.5}])
def test_bad_mm_processor_kwargs_raise(ours, kwargs):
    _, processor, _ = ours
    img = random_image(np.random.default_rng(7), 40, 40)
    with pytest.raises(InvalidInputError):
        processor.process("<start_of_image>Hi", images=[img], mm_processor_kwargs=kwargs)


def test_videos_are_refused(ours):
    _, processor, _ = ours
    frames = [random_image(np.random.default_rng(8), 32, 32) for _ in range(2)]
    with pytest.raises(InvalidInputError):
        processor.process("Hi", videos=[frames])


def test_token_id_prompts(ours):
    """One <start_of_image> id per image expands with its surrounding text tokenized alone; a run of soft
    ids already expanded to the span is kept as given."""
    _, processor, _ = ours
    tok, soft = processor.tokenizer, processor.embed_ids["image"]
    img = random_image(np.random.default_rng(9), 50, 80)
    head, tail = tok.encode("<bos><start_of_turn>user\n"), tok.encode("Describe.<end_of_turn>\n")
    boi = processor.pad_ids["image"]
    got = processor.process(prompt_token_ids=head + [boi] + tail, images=[img])
    span = [soft] * MM_TOKENS_PER_IMAGE
    assert got.prompt_token_ids == (head + tok.encode("\n\n<start_of_image>") + span
                                    + tok.encode("<end_of_image>\n\n") + tail)
    given = head + span + tail
    kept = processor.process(prompt_token_ids=given, images=[img])
    assert kept.prompt_token_ids == given and kept.items[0].offset == len(head)
    with pytest.raises(InvalidInputError):  # a run that is not one image's rows
        processor.process(prompt_token_ids=head + span[:-1] + tail, images=[img])


def test_spec_declares_the_largest_item(ours):
    model, processor, spec = ours
    assert spec.bidirectional_media and spec.num_embedding_streams == 1
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (4, 2, 32)
    largest = processor.expand_image(random_image(np.random.default_rng(10), 2000, 300),
                                     {**PAS, "pan_and_scan_min_crop_size": 8}, 1)
    item = spec.largest_item["image"]
    assert (largest.encoder_tokens, largest.rows, len(largest.token_ids)) == (item.encoder_tokens, item.rows, item.span)
    assert item.rows == 5 * MM_TOKENS_PER_IMAGE  # the image and transformers' default of at most 4 crops
    assert spec.eos_token_ids == (processor.tokenizer.token_to_id("<eos>"),)


def _layouts(state):
    """The checkpoint's tensors under transformers 5's names and under the hub's older names."""
    v5, hub = {}, {}
    for name, tensor in state.items():
        v5["model." + name.replace("language_model.model.", "language_model.")] = tensor
        hub[name.replace("vision_tower.", "vision_tower.vision_model.")] = tensor
    return v5, hub


def test_weights_load_completely_from_every_layout(ours, g3_dir):
    model, _, _ = ours
    state = load_file(str(g3_dir / "model.safetensors"))
    lm_head = state["language_model.model.embed_tokens.weight"]
    for layout in (state, *_layouts(state)):
        fresh = OurGemma3(model.config)
        loaded, unexpected = fresh.load_weights([*layout.items(), ("lm_head.weight", lm_head)])
        assert unexpected == [] and loaded == fresh.expected_weight_names()
        for (name, a), b in zip(fresh.named_parameters(), model.parameters()):
            assert torch.equal(a, b), name


def test_processor_reads_transformers5_processor_config(ours, g3_dir, tmp_path):
    """transformers 5 saves the image processor's settings inside processor_config.json."""
    _, processor, _ = ours
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(g3_dir / name, tmp_path / name)
    settings = json.loads((g3_dir / "preprocessor_config.json").read_text())
    settings["image_mean"] = [0.25, 0.5, 0.75]
    (tmp_path / "processor_config.json").write_text(json.dumps(
        {"image_processor": settings, "image_seq_length": MM_TOKENS_PER_IMAGE, "processor_class": "Gemma3Processor"}))
    other = Gemma3Processor(tmp_path, processor.config, MediaLimits())
    assert other.prep.mean == (0.25, 0.5, 0.75) and other.prep.edge_pixels == processor.prep.edge_pixels
    settings["size"] = {"height": 32, "width": 32}
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_processor": settings}))
    with pytest.raises(ModelLoadError):
        Gemma3Processor(tmp_path, processor.config, MediaLimits())


def _legacy_config(g3_dir):
    """The checkpoint's config.json as the hub's Gemma 3 checkpoints write it (transformers 4.50)."""
    raw = json.loads((g3_dir / "config.json").read_text())
    t = raw["text_config"]
    for key in ("rope_parameters", "layer_types", "_sliding_window_pattern"):
        t.pop(key)
    t.update(rope_theta=500_000.0, rope_local_base_freq=20_000.0, sliding_window_pattern=2,
             rope_scaling={"rope_type": "linear", "factor": 8.0})
    return raw


def test_config_parsing_matches_transformers(g3_dir):
    for raw in (json.loads((g3_dir / "config.json").read_text()), _legacy_config(g3_dir)):
        ours = parse_config(raw).text
        hf = HFGemma3Config(**{k: v for k, v in raw.items() if k != "architectures"}).text_config
        assert list(ours.layer_types) == list(hf.layer_types)
        for layer_type, rope in ((SLIDING, ours.local_rope), (FULL, ours.global_rope)):
            params = hf.rope_parameters[layer_type]
            assert rope == RopeConfig(params["rope_type"], params["rope_theta"], params.get("factor", 1.0))
        assert ours.query_pre_attn_scalar == hf.query_pre_attn_scalar and ours.sliding_window == hf.sliding_window
    assert parse_config(_legacy_config(g3_dir)).text.global_rope == RopeConfig("linear", 500_000.0, 8.0)


@pytest.mark.parametrize("change", [{"attn_logit_softcapping": 50.0}, {"use_bidirectional_attention": True},
                                    {"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 2.0}}},
                                    {"rope_parameters": {"rope_type": "default", "rope_theta": 10.0}},
                                    {"layer_types": ["sliding_attention"]}])
def test_unsupported_configs_fail_clearly(g3_dir, change):
    raw = json.loads((g3_dir / "config.json").read_text())
    raw["text_config"].update(change)
    with pytest.raises(ModelLoadError):
        parse_config(raw)


def test_final_logit_softcapping(ours):
    """Applied when configured (Gemma 2's cap; Gemma 3 checkpoints leave it null, and transformers 5.24's
    Gemma3ForConditionalGeneration ignores it, so no reference to compare with)."""
    model, _, _ = ours
    cfg = model.config
    capped = OurGemma3(dataclasses.replace(cfg, text=dataclasses.replace(cfg.text, final_logit_softcapping=2.0)))
    capped.load_state_dict(model.state_dict())
    hidden = torch.randn(3, cfg.text.hidden_size)
    with torch.no_grad():
        plain = model.compute_logits(hidden)
        assert torch.allclose(capped.compute_logits(hidden), 2.0 * torch.tanh(plain / 2.0))


def test_bfloat16_logits_match_reference(g3_dir, ref_processor):
    model, processor, spec = load_family(g3_dir, "bfloat16")
    messages, _ = case = _cases(13)["two_images"]
    mine, _ = _both_inputs(processor, ref_processor, case)
    inputs = gemma3_reference_kwargs(g3_dir, messages, mine)
    inputs["pixel_values"] = inputs["pixel_values"].to(torch.bfloat16)
    ref_model = Gemma3ForConditionalGeneration.from_pretrained(g3_dir, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        ref_logits = ref_model(**inputs).logits[0].float()
    assert (full_logits(model, mine, spec).float() - ref_logits).abs().max().item() <= 1e-2
