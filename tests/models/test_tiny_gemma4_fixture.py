"""The tiny Gemma 4 checkpoint (testkit/tiny_gemma4.py) as transformers sees it: its weights load strictly
into `Gemma4ForConditionalGeneration`, its config has the hub's layout (KV sharing over both layer types,
two head sizes, several eos ids, both end-of-audio keys), its clipped linears clip, its tokenizer and chat
template speak Gemma 4, transformers' processor expands images, audio (and, with torchvision, videos), and
greedy generation runs for text, image, audio and both; the MoE variant and the assistant config load."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from transformers import AutoConfig, AutoTokenizer, Gemma4ForConditionalGeneration

from testkit.tiny_gemma4 import (
    FULL,
    LAYER_TYPES,
    MAX_SOFT_TOKENS,
    NUM_KV_SHARED_LAYERS,
    SLIDING,
    build_gemma4_assistant_config,
    build_gemma4_checkpoint,
    gemma4_processor,
    gemma4_reference_inputs,
    has_torchvision,
)
from testkit.tiny_gemma4_tokenizer import NAMED_TOKENS

NO_TORCHVISION = ("transformers' Gemma 4 video processor (and so AutoProcessor on a Gemma 4 directory) needs "
                  "torchvision")
IMAGE_AND_AUDIO = [{"type": "image"}, {"type": "text", "text": "Describe the picture."}, {"type": "audio"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_gemma4_checkpoint(tmp_path_factory.mktemp("gemma4"), seed=0)


def load_strictly(model_dir):
    """transformers' model for the checkpoint, asserting no weight was missing, unexpected or mis-shaped."""
    model, info = Gemma4ForConditionalGeneration.from_pretrained(model_dir, output_loading_info=True)
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    return model.eval()


@pytest.fixture(scope="module")
def model(model_dir):
    return load_strictly(model_dir)


def config_of(model_dir) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def image(seed=0, size=(30, 50)):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8))


def audio_clip(seconds=1.0, seed=1):
    return (np.random.default_rng(seed).standard_normal(int(16_000 * seconds)) * 0.1).astype(np.float32)


def render(model_dir, content, **kwargs) -> str:
    processor = gemma4_processor(model_dir)
    return processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True, **kwargs)


def test_files_are_laid_out_as_the_hub_ships_them(model_dir):
    names = {p.name for p in model_dir.iterdir()}
    assert names == {"config.json", "model.safetensors", "generation_config.json", "processor_config.json",
                     "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}
    processor = json.loads((model_dir / "processor_config.json").read_text())
    assert processor["processor_class"] == "Gemma4Processor"
    assert processor["image_processor"]["image_processor_type"] == "Gemma4ImageProcessor"
    assert processor["video_processor"]["video_processor_type"] == "Gemma4VideoProcessor"
    assert processor["feature_extractor"]["feature_extractor_type"] == "Gemma4AudioFeatureExtractor"
    assert processor["image_seq_length"] == processor["image_processor"]["max_soft_tokens"] == MAX_SOFT_TOKENS
    assert {"audio_seq_length", "audio_ms_per_token"} <= processor.keys()
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert len(generation["eos_token_id"]) == 3


def test_config_has_the_hubs_quirks_and_kv_sharing_over_both_layer_types(model_dir, model):
    config = config_of(model_dir)
    text, tok = config["text_config"], AutoTokenizer.from_pretrained(model_dir)
    assert config["model_type"] == "gemma4" and config["architectures"] == ["Gemma4ForConditionalGeneration"]
    assert text["layer_types"] == LAYER_TYPES and LAYER_TYPES[-1] == FULL
    shared, own = LAYER_TYPES[-NUM_KV_SHARED_LAYERS:], LAYER_TYPES[:-NUM_KV_SHARED_LAYERS]
    assert {SLIDING, FULL} <= set(shared) and {SLIDING, FULL} <= set(own)
    assert (text["head_dim"], text["global_head_dim"]) == (16, 32) and "per_layer_config" not in text
    assert "num_global_key_value_heads" in text and text["num_global_key_value_heads"] is None
    assert text["use_bidirectional_attention"] is None and text["use_double_wide_mlp"]
    assert text["vocab_size"] == text["vocab_size_per_layer_input"] == len(tok)
    assert config["vision_config"]["rope_parameters"]["rope_type"] == "default"
    assert config["eoa_token_index"] == config["eoa_token_id"] == tok.convert_tokens_to_ids("<audio|>")
    assert len(config["eos_token_id"]) > 1
    for key, token in (("image_token_id", "<|image|>"), ("video_token_id", "<|video|>"),
                       ("boi_token_id", "<|image>"), ("eoi_token_id", "<image|>"),
                       ("audio_token_id", "<|audio|>"), ("boa_token_id", "<|audio>")):
        assert config[key] == tok.convert_tokens_to_ids(token), key
    layers = model.model.language_model.layers
    assert [layer.self_attn.head_dim for layer in layers] == [32 if t == FULL else 16 for t in LAYER_TYPES]
    first_shared = len(LAYER_TYPES) - NUM_KV_SHARED_LAYERS
    assert [layer.self_attn.is_kv_shared_layer for layer in layers] == [
        i >= first_shared for i in range(len(LAYER_TYPES))]
    assert layers[-1].mlp.down_proj.in_features == 2 * layers[0].mlp.down_proj.in_features


def test_layer_scalars_and_clip_bounds_are_saved_and_not_trivial(model_dir):
    tensors = load_file(model_dir / "model.safetensors")
    scalars = [float(t) for name, t in tensors.items() if name.endswith("layer_scalar")]
    assert len(scalars) == len(LAYER_TYPES) and all(0.5 <= s <= 1.5 for s in scalars)
    assert len(set(scalars)) > 1
    bounds = {name: float(t) for name, t in tensors.items() if name.endswith(("_min", "_max"))}
    assert len(bounds) > 40 and all(math.isfinite(b) for b in bounds.values())
    for name, low in bounds.items():
        if name.endswith("_min"):
            assert low < bounds[name[:-4] + "_max"], name
    # the hub's checkpoints keep unused k/v weights in the KV-shared layers
    assert f"model.language_model.layers.{len(LAYER_TYPES) - 1}.self_attn.k_proj.weight" in tensors


def test_every_weight_and_buffer_loads_as_saved(model_dir, model):
    saved = load_file(model_dir / "model.safetensors")
    state = model.state_dict()
    for name, tensor in state.items():
        if name in saved:
            assert torch.equal(tensor, saved[name]), name
    persistent = {n for n, _ in model.named_parameters()} | {n for n in state if n.endswith(("_min", "_max"))}
    assert persistent <= saved.keys() and any(n.endswith("layer_scalar") for n in saved)


def test_clipped_linears_clip_an_image_and_a_clip(model_dir, model):
    from transformers.models.gemma4.modeling_gemma4 import Gemma4ClippableLinear

    clipped = {"vision": 0, "audio": 0}

    def counter(tower):
        def count(module, args, output):
            outside = (args[0] < module.input_min) | (args[0] > module.input_max)
            clipped[tower] += int(outside.sum())
        return count

    handles = [module.register_forward_hook(counter("vision" if "vision_tower" in name else "audio"))
               for name, module in model.named_modules() if isinstance(module, Gemma4ClippableLinear)]
    inputs = gemma4_reference_inputs(model_dir, render(model_dir, IMAGE_AND_AUDIO), images=[image(seed=5)],
                                     audios=[audio_clip(seed=6)])
    with torch.no_grad():
        model(**inputs)
    for handle in handles:
        handle.remove()
    assert clipped["vision"] > 0 and clipped["audio"] > 0


def test_tokenizer_speaks_gemma_4(model_dir):
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert [tok.convert_ids_to_tokens(i) for i in range(5)] == ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
    for attribute, token in NAMED_TOKENS.items():
        assert getattr(tok, attribute) == token, attribute
    assert tok.image_token_id == tok.convert_tokens_to_ids("<|image|>")
    assert tok.audio_token_id == tok.convert_tokens_to_ids("<|audio|>")
    assert tok.convert_tokens_to_ids("<|video|>") != tok.unk_token_id
    assert tok("hello").input_ids[0] == tok.bos_token_id
    assert tok.decode(tok('call:f{a:<|"|>x<|"|>}').input_ids, skip_special_tokens=True) == "call:f{a:x}"


def test_chat_template_turns_thinking_and_tools(model_dir):
    tok = AutoTokenizer.from_pretrained(model_dir)
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "required": ["city"],
                       "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
                {"role": "assistant", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
                {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "Thanks"}]
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<bos><|turn>system\nBe brief.<|tool>declaration:get_weather{")
    assert "<turn|>\n<|turn>user\nWeather?<turn|>\n<|turn>model\n" in text
    assert '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>' in text
    assert '<|tool_response>response:get_weather{value:<|"|>sunny<|"|>}<tool_response|>Sunny.<turn|>' in text
    assert text.endswith("<|turn>user\nThanks<turn|>\n<|turn>model\n<|channel>thought\n<channel|>")
    thinking = tok.apply_chat_template(messages[1:2], tokenize=False, add_generation_prompt=True,
                                       enable_thinking=True)
    assert thinking == "<bos><|turn>system\n<|think|>\n<turn|>\n<|turn>user\nWeather?<turn|>\n<|turn>model\n"


def test_processor_expands_an_image_and_an_audio_clip(model_dir):
    text = render(model_dir, IMAGE_AND_AUDIO)
    assert text == ("<bos><|turn>user\n<|image|>Describe the picture.<|audio|><turn|>\n"
                    "<|turn>model\n<|channel>thought\n<channel|>")
    inputs = gemma4_reference_inputs(model_dir, text, images=[image(size=(30, 50))], audios=[audio_clip(1.0)])
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = inputs["input_ids"][0].tolist()
    # 30x50 pixels resized to 72x120 (the largest multiples of 4 * 3 within 70 * 9 patches of 4 pixels):
    # 18x30 patches pooled 3x3
    image_tokens = ids.count(tok.convert_tokens_to_ids("<|image|>"))
    assert image_tokens == 60
    assert ids.count(tok.convert_tokens_to_ids("<|audio|>")) == 25  # 1 s: 99 mel frames, two stride-2 convs
    for token in ("<|image>", "<image|>", "<|audio>", "<audio|>"):
        assert ids.count(tok.convert_tokens_to_ids(token)) == 1, token
    assert inputs["pixel_values"].shape == (1, MAX_SOFT_TOKENS * 9, 3 * 4 * 4)
    assert int((inputs["mm_token_type_ids"] == 1).sum()) == image_tokens


@pytest.mark.skipif(not has_torchvision(), reason=NO_TORCHVISION)
def test_auto_processor_expands_a_video(model_dir):
    from transformers import AutoProcessor

    assert type(gemma4_processor(model_dir)) is type(AutoProcessor.from_pretrained(model_dir))
    frames = [np.random.default_rng(i).integers(0, 256, (48, 64, 3), dtype=np.uint8) for i in range(6)]
    inputs = gemma4_reference_inputs(model_dir, render(model_dir, [{"type": "video"}]), videos=[frames])
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = inputs["input_ids"][0].tolist()
    assert ids.count(tok.convert_tokens_to_ids("<|image>")) == 4  # num_frames frames, each boi ... eoi
    assert ids.count(tok.convert_tokens_to_ids("<|video|>")) == inputs["pixel_values_videos"].shape[0] * 63


@pytest.mark.parametrize("content", [
    [{"type": "text", "text": "The quick brown fox jumps over the lazy dog. " * 3}],
    [{"type": "image"}, {"type": "text", "text": "What color is the circle?"}],
    [{"type": "audio"}, {"type": "text", "text": "What is said?"}],
    IMAGE_AND_AUDIO,
], ids=["text", "image", "audio", "image_audio"])
def test_greedy_generation_runs(model_dir, model, content):
    kinds = [part["type"] for part in content]
    inputs = gemma4_reference_inputs(
        model_dir, render(model_dir, content), images=[image()] if "image" in kinds else None,
        audios=[audio_clip(0.5)] if "audio" in kinds else None)
    assert inputs["input_ids"].shape[1] > 16  # past the sliding window
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 5


def test_moe_variant_without_audio_loads_and_generates(tmp_path):
    model_dir = build_gemma4_checkpoint(tmp_path / "moe", seed=1, audio=False, moe=True)
    config = config_of(model_dir)
    assert config["audio_config"] is None
    assert config["text_config"]["enable_moe_block"] and config["text_config"]["num_experts"] == 4
    moe = load_strictly(model_dir)
    inputs = gemma4_reference_inputs(model_dir, render(model_dir, [{"type": "text", "text": "Hello world!"}]))
    with torch.no_grad():
        out = moe.generate(**inputs, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 5


def test_assistant_config_loads(tmp_path):
    from transformers import Gemma4AssistantForCausalLM

    config = AutoConfig.from_pretrained(build_gemma4_assistant_config(tmp_path / "assistant"))
    assert config.model_type == "gemma4_assistant" and config.backbone_hidden_size == 64
    text = config.get_text_config()
    assert text.num_kv_shared_layers == text.num_hidden_layers == 2
    assert text.vocab_size % config.num_centroids == 0
    Gemma4AssistantForCausalLM(config)  # a consistent architecture
