"""A tiny random Gemma 4 checkpoint built at test time with transformers, laid out as google/gemma-4-E2B-it.

Role: give the Gemma 4 tests a real Hugging Face checkpoint directory without network access:
config.json (a `Gemma4Config` in the hub's own layout), model.safetensors (transformers'
`Gemma4ForConditionalGeneration` with seeded random weights), the tokenizer files and chat template of
testkit/tiny_gemma4_tokenizer.py, processor_config.json (image processor, feature extractor and video
processor nested in one file, as `Gemma4Processor.save_pretrained` writes it and the hub ships it; no
preprocessor_config.json) and generation_config.json (several eos ids). `gemma4_reference_inputs` runs
transformers' own processor on a prompt: the fidelity oracle's `generate` inputs.

The decoder is E2B's in miniature: 5 layers, sliding (window 16, head_dim 16, default rope) and full
(global_head_dim 32, proportional rope over a quarter of the head) mixed, the last one full; one kv
head; the last 2 layers (a sliding and a full) reuse the cache of the last earlier layer of their type
(so one sliding layer keeps a cache no later layer reads), with double-wide MLPs; per-layer embeddings
(PLE) 16 wide; final logit softcapping 30; tied
embeddings. `moe=True` adds Gemma 4 26B-A4B's mixture-of-experts block (4 experts, top 2) to every layer.
The vision tower (4-pixel patches pooled 3x3) and the audio tower (2 conformer layers) use clipped
linears whose bounds are finite and calibrated to clip the tails of typical activations; every
decoder layer's `layer_scalar` is random in [0.5, 1.5].

Hub quirks reproduced (transformers 5 writes none of them itself, so config.json is rewritten after
`save_pretrained`): text_config's `global_head_dim` and `num_global_key_value_heads: null` (transformers
writes a `per_layer_config`), the vision tower's rope type "default" (transformers reads it as
"axial"), both `eoa_token_index` and `eoa_token_id`, a list of eos ids, `vision_soft_tokens_per_image`
and vision_config's `default_output_length`.

Where transformers forces the fixture off the brief: the image and video processors accept only
`max_soft_tokens` in {70, 140, 280, 560, 1120}, so images and video frames take up to 70 soft tokens
(the smallest allowed; the hub's images take 280, its frames 70). transformers' video processor needs
torchvision, and so does `AutoProcessor.from_pretrained` on any hub-layout Gemma 4 directory; without
torchvision `gemma4_processor` assembles the same `Gemma4Processor` from the same files, videos aside.

What it does not know: anything about mmserve; it only writes files the way Hugging Face does.
"""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

from testkit.tiny_checkpoints import _randomize
from testkit.tiny_gemma4_tokenizer import build_tokenizer, save_tokenizer, token_ids

SLIDING, FULL = "sliding_attention", "full_attention"
LAYER_TYPES = [SLIDING, FULL, SLIDING, SLIDING, FULL]
NUM_KV_SHARED_LAYERS = 2  # layers 3 (sliding) and 4 (full) read the caches of layers 2 and 1
SLIDING_WINDOW = 16
PATCH_SIZE = 4
POOLING_KERNEL_SIZE = 3
MAX_SOFT_TOKENS = 70  # transformers' smallest allowed value
VIDEO_NUM_FRAMES = 4
SAMPLING_RATE = 16_000
CLIP_TAIL = 0.05  # each clipped linear's bounds cut this share of its calibration range off either end
ROPE = {SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
        FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}


def _text_config(vocab_size: int, ids: dict[str, int], moe: bool) -> dict:
    text = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, global_head_dim=32,
        num_global_key_value_heads=None, attention_k_eq_v=False, layer_types=list(LAYER_TYPES),
        num_kv_shared_layers=NUM_KV_SHARED_LAYERS, hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=vocab_size, use_double_wide_mlp=True, sliding_window=SLIDING_WINDOW,
        rope_parameters=copy.deepcopy(ROPE), final_logit_softcapping=30.0,
        hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131_072, rms_norm_eps=1e-6,
        attention_bias=False, attention_dropout=0.0, use_bidirectional_attention=None,
        tie_word_embeddings=True, initializer_range=0.02, use_cache=True,
        enable_moe_block=False, num_experts=None, top_k_experts=None, moe_intermediate_size=None,
        pad_token_id=ids["<pad>"], bos_token_id=ids["<bos>"], eos_token_id=ids["<eos>"])
    if moe:
        text.update(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)
    return text


def _vision_config() -> dict:
    return dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=2, head_dim=16, global_head_dim=16, hidden_activation="gelu_pytorch_tanh",
                rms_norm_eps=1e-6, max_position_embeddings=131_072, attention_bias=False,
                attention_dropout=0.0,
                rope_parameters={"rope_type": "default", "rope_theta": 100.0}, patch_size=PATCH_SIZE,
                pooling_kernel_size=POOLING_KERNEL_SIZE, position_embedding_size=256,
                default_output_length=MAX_SOFT_TOKENS, use_clipped_linears=True, standardize=False,
                initializer_range=0.02)


def _audio_config() -> dict:
    # transformers sizes the subsampler's projection as channels[0] // 4 * channels[1], which holds only
    # while channels[0] equals the 128 mel bins (the hub's [128, 32])
    return dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, hidden_act="silu",
                subsampling_conv_channels=[128, 8], conv_kernel_size=5, residual_weight=0.5,
                attention_chunk_size=12, attention_context_left=13, attention_context_right=0,
                attention_logit_cap=50.0, attention_invalid_logits_value=-1.0e9, use_clipped_linears=True,
                rms_norm_eps=1e-6, gradient_clipping=1e10, output_proj_dims=24, initializer_range=0.02)


def _hub_config(tok, audio: bool, moe: bool) -> dict:
    """config.json as the hub writes it (sub-configs with their model types, ids matching the tokenizer)."""
    ids = token_ids(tok)
    config = {
        "architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4",
        "text_config": {"model_type": "gemma4_text", **_text_config(len(tok), ids, moe)},
        "vision_config": {"model_type": "gemma4_vision", **_vision_config()},
        "audio_config": {"model_type": "gemma4_audio", **_audio_config()} if audio else None,
        "image_token_id": ids["<|image|>"], "video_token_id": ids["<|video|>"],
        "audio_token_id": ids["<|audio|>"],
        "boi_token_id": ids["<|image>"], "eoi_token_id": ids["<image|>"], "boa_token_id": ids["<|audio>"],
        "eoa_token_index": ids["<audio|>"], "eoa_token_id": ids["<audio|>"],
        "eos_token_id": [ids["<eos>"], ids["<turn|>"]], "vision_soft_tokens_per_image": MAX_SOFT_TOKENS,
        "initializer_range": 0.02, "tie_word_embeddings": True, "dtype": "float32",
    }
    return config


def _randomize_gemma4(model, seed: int) -> None:
    """Seeded random weights (`_randomize`: norms near 1, the rest small), the MoE router's scales near 1
    like norms, and every decoder layer's `layer_scalar` in [0.5, 1.5]."""
    import torch

    _randomize(model, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("router.scale", "router.per_expert_scale")):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.copy_(0.5 + torch.rand(buffer.shape, generator=gen))


def _calibration_image(seed: int):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(40, 56, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _calibrate_clipping(model, seed: int, audio: bool) -> None:
    """Run the vision (and audio) tower on a seeded random image (and clip), record every clipped linear's
    input and output range, and clip `CLIP_TAIL` of that range off each end: finite bounds that bite."""
    import numpy as np
    import torch
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil
    from transformers.models.gemma4.modeling_gemma4 import Gemma4ClippableLinear

    seen: dict[str, list[torch.Tensor]] = {}

    def hook(name):
        def record(module, args, output):
            ranges = seen.setdefault(name, [torch.tensor(np.inf), torch.tensor(-np.inf)] * 2)
            for i, t in ((0, args[0]), (2, output)):
                ranges[i] = torch.minimum(ranges[i], t.min())
                ranges[i + 1] = torch.maximum(ranges[i + 1], t.max())
        return record

    clipped = {n: m for n, m in model.named_modules() if isinstance(m, Gemma4ClippableLinear)}
    handles = [m.register_forward_hook(hook(n)) for n, m in clipped.items()]
    with torch.no_grad():
        image_processor = Gemma4ImageProcessorPil(**_image_settings())
        image = image_processor(images=[_calibration_image(seed)], return_tensors="pt")
        model.model.get_image_features(image["pixel_values"], image["image_position_ids"])
        if audio:
            clip = np.random.default_rng(seed).standard_normal(SAMPLING_RATE).astype(np.float32) * 0.3
            features = Gemma4AudioFeatureExtractor()([clip], return_tensors="pt")
            model.model.get_audio_features(features["input_features"], features["input_features_mask"])
    for handle in handles:
        handle.remove()
    with torch.no_grad():
        for name, module in clipped.items():
            in_lo, in_hi, out_lo, out_hi = seen[name]
            for lo, hi, low_name, high_name in ((in_lo, in_hi, "input_min", "input_max"),
                                                (out_lo, out_hi, "output_min", "output_max")):
                margin = CLIP_TAIL * (hi - lo)
                getattr(module, low_name).fill_(float(lo + margin))
                getattr(module, high_name).fill_(float(hi - margin))


def _add_shared_layer_kv(out_dir: Path, text: dict, seed: int) -> None:
    """The hub's checkpoints keep k_proj, v_proj and k_norm weights in the KV-shared layers, which never use
    them (transformers builds none and lists them as keys to ignore on load); write such weights too."""
    import torch
    from safetensors.torch import load_file, save_file

    path = out_dir / "model.safetensors"
    tensors = load_file(path)
    gen = torch.Generator().manual_seed(seed + 2)
    first_shared = text["num_hidden_layers"] - text["num_kv_shared_layers"]
    for i in range(first_shared, text["num_hidden_layers"]):
        head_dim = text["global_head_dim"] if text["layer_types"][i] == FULL else text["head_dim"]
        prefix = f"model.language_model.layers.{i}.self_attn."
        for name in ("k_proj", "v_proj"):
            shape = (text["num_key_value_heads"] * head_dim, text["hidden_size"])
            tensors[prefix + name + ".weight"] = 0.08 * torch.randn(shape, generator=gen)
        tensors[prefix + "k_norm.weight"] = 1.0 + 0.1 * torch.randn(head_dim, generator=gen)
    save_file(tensors, path, metadata={"format": "pt"})


def _image_settings() -> dict:
    return dict(patch_size=PATCH_SIZE, max_soft_tokens=MAX_SOFT_TOKENS,
                pooling_kernel_size=POOLING_KERNEL_SIZE)


def _processor_config() -> dict:
    """processor_config.json as `Gemma4Processor.save_pretrained` writes it and the hub ships it (with the
    image processor's own `image_seq_length`; the feature extractor too where the model has no audio tower,
    as on the 31B)."""
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor

    common = dict(do_convert_rgb=True, do_rescale=True, do_resize=True, image_mean=[0.0, 0.0, 0.0],
                  image_std=[1.0, 1.0, 1.0], resample=3, rescale_factor=1 / 255, **_image_settings())
    image = dict(common, do_normalize=False, image_processor_type="Gemma4ImageProcessor",
                 image_seq_length=MAX_SOFT_TOKENS)
    video = dict(common, do_normalize=True, do_sample_frames=True, num_frames=VIDEO_NUM_FRAMES,
                 return_metadata=False, video_processor_type="Gemma4VideoProcessor")
    features = json.loads(Gemma4AudioFeatureExtractor().to_json_string())  # the hub's section, key for key
    config = {"audio_ms_per_token": 40, "audio_seq_length": 750, "feature_extractor": features,
              "image_processor": dict(sorted(image.items())), "image_seq_length": MAX_SOFT_TOKENS,
              "processor_class": "Gemma4Processor", "video_processor": dict(sorted(video.items()))}
    return config


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def build_gemma4_checkpoint(out_dir: Path, seed: int = 0, *, audio: bool = True, moe: bool = False) -> Path:
    """Write a tiny random Gemma 4 checkpoint (E2B's layout) into out_dir; `audio=False`: no audio tower (as
    the larger Gemma 4 models ship); `moe=True`: 26B-A4B's expert block in every decoder layer."""
    import torch
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    hub = _hub_config(tok, audio, moe)
    _write_json(out_dir / "config.json", hub)
    config = Gemma4Config.from_pretrained(out_dir)  # transformers reads the hub's layout
    torch.manual_seed(seed)
    model = Gemma4ForConditionalGeneration(config).eval()
    _randomize_gemma4(model, seed)
    _calibrate_clipping(model, seed, audio)
    model.save_pretrained(out_dir, safe_serialization=True)
    _write_json(out_dir / "config.json", hub)  # save_pretrained wrote transformers' own layout
    _add_shared_layer_kv(out_dir, hub["text_config"], seed)
    save_tokenizer(tok, out_dir)
    _write_json(out_dir / "processor_config.json", _processor_config())
    ids = token_ids(tok)
    _write_json(out_dir / "generation_config.json", {
        "bos_token_id": ids["<bos>"], "pad_token_id": ids["<pad>"],
        "eos_token_id": [ids["<eos>"], ids["<turn|>"], ids["<|tool_response>"]]})
    return out_dir


def build_gemma4_assistant_config(out_dir: Path) -> Path:
    """A `gemma4_assistant` config.json (the hub's Gemma 4 drafter, "-assistant") for the tiny checkpoint: a
    2-layer decoder with no key/value projections of its own (every layer reads the target's last sliding
    and full caches, so its head sizes are the target's), fed the target's hidden state (64 wide), its
    logits from centroid-ordered embeddings (16 centroids of 27 tokens)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    ids = token_ids(tok)
    text = _text_config(len(tok), ids, moe=False)
    text.update(hidden_size=32, intermediate_size=64, num_hidden_layers=2, layer_types=[SLIDING, FULL],
                num_kv_shared_layers=2, hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
                use_double_wide_mlp=False, final_logit_softcapping=None)
    config = {"architectures": ["Gemma4AssistantForCausalLM"], "model_type": "gemma4_assistant",
              "text_config": {"model_type": "gemma4_text", **text}, "backbone_hidden_size": 64,
              "use_ordered_embeddings": True, "num_centroids": 16, "centroid_intermediate_top_k": 4,
              "tie_word_embeddings": True, "dtype": "float32"}
    _write_json(out_dir / "config.json", config)
    return out_dir


def has_torchvision() -> bool:
    return importlib.util.find_spec("torchvision") is not None


def gemma4_processor(model_dir: Path):
    """transformers' processor for the checkpoint: `AutoProcessor.from_pretrained` where torchvision is
    installed; without it (transformers' video processors need it, and `AutoProcessor` loads one) the same
    `Gemma4Processor` built from the same files, with no video processor."""
    from transformers import (
        AutoFeatureExtractor,
        AutoImageProcessor,
        AutoProcessor,
        AutoTokenizer,
        Gemma4Processor,
    )

    if has_torchvision():
        return AutoProcessor.from_pretrained(model_dir)

    class Gemma4ProcessorWithoutVideo(Gemma4Processor):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    settings = json.loads((Path(model_dir) / "processor_config.json").read_text())
    tok = AutoTokenizer.from_pretrained(model_dir)
    return Gemma4ProcessorWithoutVideo(
        feature_extractor=AutoFeatureExtractor.from_pretrained(model_dir),
        image_processor=AutoImageProcessor.from_pretrained(model_dir), tokenizer=tok, video_processor=None,
        chat_template=tok.chat_template, image_seq_length=settings["image_seq_length"],
        audio_seq_length=settings["audio_seq_length"], audio_ms_per_token=settings["audio_ms_per_token"])


def gemma4_reference_inputs(model_dir: Path, text: str, images=None, videos=None, audios=None,
                            **processor_kwargs) -> dict:
    """The inputs of transformers' `Gemma4ForConditionalGeneration.generate` for one prompt, made by
    transformers' own processor (`gemma4_processor`): `text` is the prompt as the chat template renders it
    (`<bos>` included, so it is tokenized without special tokens), with one `<|image|>`, `<|video|>` or
    `<|audio|>` per item; `images` PIL images, `videos` lists of frames (PIL images or HWC uint8 arrays),
    `audios` 16 kHz mono float32 arrays; `processor_kwargs` go to the processor's call (`video_metadata`,
    without which transformers assumes 24 fps for the frames' timestamps). Returns input_ids,
    attention_mask, mm_token_type_ids and each modality's tensors (pixel_values + image_position_ids,
    pixel_values_videos + video_position_ids + num_frames_per_video, input_features + input_features_mask)."""
    processor = gemma4_processor(model_dir)
    kwargs: dict = {"text": [text], "add_special_tokens": False, "return_tensors": "pt", **processor_kwargs}
    if images:
        kwargs["images"] = [list(images)]
    if videos:
        if not has_torchvision():
            raise RuntimeError("transformers' Gemma 4 video processor needs torchvision, not installed here")
        kwargs["videos"] = [list(v) for v in videos]
    if audios:
        kwargs["audio"] = list(audios)
    out = dict(processor(**kwargs))
    for unused in ("num_soft_tokens_per_image", "num_soft_tokens_per_video"):
        out.pop(unused, None)
    return out
