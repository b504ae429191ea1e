"""mllama's tile encoder and projector against transformers' `MllamaForConditionalGeneration` on tiny random
weights (float32, every gate non-zero): the cross-attention states its forward hands the language model,
for one-tile, wide (padded tiles), several-image, batched and padding-image inputs, on two tile geometries
(17 tokens a tile padded to 24; a 30 px tile whose conv drops a remainder, 10 tokens padded to 16); the
weight-name mapping; config parsing against transformers' MllamaConfig and malformed configs."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from transformers import MllamaConfig as HFMllamaConfig
from transformers import MllamaForConditionalGeneration

from mmserve.errors import ModelLoadError
from mmserve.models.mllama.config import MllamaConfig, MllamaVisionConfig, parse_config
from mmserve.models.mllama.image_processing import (
    Preprocessing,
    StackedImages,
    preprocess_image,
    stack_images,
)
from mmserve.models.mllama.vision import MllamaVisionEncoder, map_weight_name, padding_attention_bias
from testkit.conversations import random_image

MAX_TILES = 4
TEXT = {"vocab_size": 128, "hidden_size": 48, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 64, "num_hidden_layers": 2, "cross_attention_layers": [1],
        "max_position_embeddings": 64, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
# Llama-3.2-11B-Vision's preprocessor settings but for the tile size
PREPROCESSOR = {"do_convert_rgb": True, "do_normalize": True, "do_pad": True, "do_rescale": True, "do_resize": True,
                "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
                "max_image_tiles": MAX_TILES, "resample": 2, "rescale_factor": 0.00392156862745098}
ATOL, RTOL = 1e-5, 1e-4


def vision_section(tile_px: int, patch: int) -> dict:
    return {"model_type": "mllama_vision_model", "hidden_size": 32, "attention_heads": 4, "num_hidden_layers": 2,
            "num_global_layers": 1, "intermediate_size": 64, "intermediate_layers_indices": [0, 1],
            "vision_output_dim": 96, "patch_size": patch, "image_size": tile_px, "max_num_tiles": MAX_TILES,
            "num_channels": 3, "norm_eps": 1e-5, "hidden_act": "gelu"}


def raw_config(tile_px: int = 32, patch: int = 8) -> dict:
    return {"model_type": "mllama", "architectures": ["MllamaForConditionalGeneration"],
            "vision_config": vision_section(tile_px, patch), "text_config": dict(TEXT), "image_token_index": 127}


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random (LayerNorm scales near 1); the gates, zero in transformers, drawn well off zero
    with both signs so every gated path counts."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith(("gate", "gate_attn", "gate_ffn")):
                sign = torch.where(torch.rand(p.shape, generator=gen) < 0.5, -1.0, 1.0)
                p.copy_(sign * (0.4 + 0.8 * torch.rand(p.shape, generator=gen)))
            elif "norm" in name and name.endswith(".weight"):
                p.copy_(1 + 0.1 * noise)
            else:
                p.copy_(0.2 * noise)


@pytest.fixture(scope="module")
def models():
    """(reference, ours) per (tile_px, patch, attention implementation), built once."""
    cache = {}

    def get(tile_px: int, patch: int, attn: str = "sdpa"):
        if (tile_px, patch, attn) not in cache:
            raw = raw_config(tile_px, patch)
            hf_config = HFMllamaConfig(vision_config=raw["vision_config"], text_config=raw["text_config"],
                                       image_token_index=raw["image_token_index"])
            hf_config._attn_implementation = attn
            ref = MllamaForConditionalGeneration(hf_config).eval()
            randomize(ref, seed=tile_px * 100 + patch)
            ours = MllamaVisionEncoder(parse_config(raw)).eval()
            state = {map_weight_name(k): v for k, v in ref.state_dict().items() if map_weight_name(k) is not None}
            ours.load_state_dict(state, strict=True)  # every parameter of ours, nothing left over
            cache[tile_px, patch, attn] = ref, ours
        return cache[tile_px, patch, attn]
    return get


def stacked(tile_px: int, sizes: list[tuple[int, int]], seed: int = 0) -> StackedImages:
    """One prompt's images (width, height), through mmserve's own preprocessing."""
    prep = Preprocessing.from_dict({**PREPROCESSOR, "size": {"height": tile_px, "width": tile_px}})
    rng = np.random.default_rng(seed)
    return stack_images([preprocess_image(random_image(rng, w, h), prep) for w, h in sizes])


def batch_of(prompts: list[StackedImages]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Prompts batched as transformers' processor does: fewer images padded with an all-zero image of
    aspect-ratio id 0 whose first tile is unmasked."""
    most = max(p.pixel_values.shape[1] for p in prompts)
    pixels, ids, masks = [], [], []
    for p in prompts:
        missing = most - p.pixel_values.shape[1]
        pixels.append(np.concatenate([p.pixel_values, np.zeros((1, missing, *p.pixel_values.shape[2:]), np.float32)], 1))
        ids.append(np.concatenate([p.aspect_ratio_ids, np.zeros((1, missing), np.int64)], 1))
        pad_mask = np.zeros((1, missing, MAX_TILES), np.int64)
        pad_mask[:, :, 0] = 1
        masks.append(np.concatenate([p.aspect_ratio_mask, pad_mask], 1))
    return np.concatenate(pixels), np.concatenate(ids), np.concatenate(masks)


def reference_states(ref: MllamaForConditionalGeneration, pixels: torch.Tensor, ids: torch.Tensor,
                     mask: torch.Tensor) -> torch.Tensor:
    """The `cross_attention_states` transformers' forward passes to its language model."""
    seen = {}

    def hook(module, args, kwargs):
        seen["states"] = kwargs["cross_attention_states"]

    handle = ref.model.language_model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        input_ids = torch.tensor([[1, 127, 5, 6]] * pixels.shape[0])
        ref(input_ids=input_ids, pixel_values=pixels, aspect_ratio_ids=ids, aspect_ratio_mask=mask, use_cache=False)
    finally:
        handle.remove()
    return seen["states"]


def compare(models, tile_px: int, patch: int, prompts: list[StackedImages], attn: str = "sdpa") -> float:
    ref, ours = models(tile_px, patch, attn)
    pixels, ids, mask = (torch.from_numpy(a) for a in batch_of(prompts))
    with torch.no_grad():
        expected = reference_states(ref, pixels, ids, mask)
        got = ours(pixels, ids, mask)
    batch, images = ids.shape
    vision = ours.vision_model.cfg
    # transformers holds the rows as (batch * images * tiles, num_patches, hidden); ours per prompt
    assert expected.shape == (batch * images * MAX_TILES, vision.num_patches, TEXT["hidden_size"])
    assert got.shape == (batch, images * MAX_TILES * vision.num_patches, TEXT["hidden_size"])
    expected = expected.reshape(got.shape)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)
    assert expected.abs().max() > 1  # not a degenerate comparison of near-zeros
    return float((got - expected).abs().max())


# (tile_px, patch, per prompt the images' (width, height), the tiles each image must get)
CASES = {
    "one_tile": (32, 8, [[(32, 32)]], [[1]]),
    "wide_padded_tiles": (32, 8, [[(90, 30)]], [[3]]),
    "two_images_of_different_tiles": (32, 8, [[(64, 64), (30, 70)]], [[4, 3]]),
    "two_prompts_padding_image": (32, 8, [[(64, 64), (40, 20)], [(90, 30)]], [[4, 2], [3]]),
    "tile_not_multiple_of_8_patches": (30, 8, [[(100, 28)], [(20, 20)]], [[4], [1]]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_cross_attention_states_match_transformers(models, case):
    tile_px, patch, prompts, tiles = CASES[case]
    stacks = [stacked(tile_px, sizes, seed=i) for i, sizes in enumerate(prompts)]
    assert [list(s.num_tiles) for s in stacks] == tiles  # the case holds the padding it claims
    if case == "tile_not_multiple_of_8_patches":
        vision = models(tile_px, patch)[1].vision_model.cfg
        assert (vision.num_patches, vision.padded_patches) == (10, 16)
    diff = compare(models, tile_px, patch, stacks)
    assert diff <= ATOL


def test_matches_eager_attention_too(models):
    """transformers' eager attention (matmul, softmax) rounds apart from SDPA, within the tolerance."""
    compare(models, 32, 8, [stacked(32, [(64, 64), (30, 70)])], attn="eager")


def test_padding_bias_is_transformers_outer_product():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    bias = padding_attention_bias(mask, num_patches=3, padded_patches=4, dtype=torch.float32)
    # transformers' construction: (1 - padding-expanded mask) outer itself, times the dtype's minimum
    real = mask.float()[:, :, None].repeat(1, 1, 4)
    real[:, :, 3:] = 0
    pad = (1 - real).reshape(2, 12, 1)
    expected = (pad @ pad.transpose(1, 2) * torch.finfo(torch.float32).min).unsqueeze(1)
    assert bias.shape == (2, 1, 12, 12)
    assert torch.equal(bias, expected)
    assert bias[0, 0, 0].eq(0).all()  # a real token attends to every key, padding included


def test_weight_names_map_by_prefix():
    assert map_weight_name("model.vision_model.transformer.layers.0.self_attn.q_proj.weight") == \
        "vision_model.transformer.layers.0.self_attn.q_proj.weight"
    assert map_weight_name("vision_model.patch_embedding.weight") == "vision_model.patch_embedding.weight"
    assert map_weight_name("model.multi_modal_projector.bias") == "multi_modal_projector.bias"
    assert map_weight_name("multi_modal_projector.weight") == "multi_modal_projector.weight"
    for name in ("model.language_model.layers.0.mlp.up_proj.weight", "language_model.model.norm.weight",
                 "lm_head.weight", "language_model.lm_head.weight"):
        assert map_weight_name(name) is None


def _ours_as_hf(config: MllamaVisionConfig) -> dict:
    fields = dataclasses.asdict(config)
    fields["supported_aspect_ratios"] = [list(g) for g in fields["supported_aspect_ratios"]]
    fields["intermediate_layers_indices"] = list(fields["intermediate_layers_indices"])
    return fields


@pytest.mark.parametrize("raw", [
    {},  # every default: Llama 3.2 11B Vision's encoder
    raw_config(),
    {"vision_config": {"image_size": [560, 560], "patch_size": 14, "num_attention_heads": 8,
                       "supported_aspect_ratios": [[1, 1], [1, 2], [2, 1]], "max_num_tiles": 2},
     "text_config": {"hidden_size": 1024}, "image_token_id": 99},
], ids=["defaults", "tiny", "aliases"])
def test_config_matches_transformers(raw):
    ours = parse_config(raw)
    hf = HFMllamaConfig(**{k: v for k, v in raw.items() if k not in ("model_type", "architectures")})
    hf_vision = hf.vision_config
    for name, value in _ours_as_hf(ours.vision).items():
        expected = getattr(hf_vision, name)
        expected = expected[0] if isinstance(expected, (list, tuple)) and name in ("image_size", "patch_size") \
            else expected
        assert value == expected, name
    assert ours.vision.max_aspect_ratio_id == hf_vision.max_aspect_ratio_id
    assert ours.text_hidden_size == hf.text_config.hidden_size
    assert ours.image_token_index == hf.image_token_index
    assert isinstance(ours, MllamaConfig)


def _with_vision(**fields) -> dict:
    raw = raw_config()
    raw["vision_config"].update(fields)
    return raw


@pytest.mark.parametrize("raw,match", [
    ([], "not a JSON object"),
    ({"vision_config": [1, 2]}, "vision_config is not a JSON object"),
    ({"text_config": "big"}, "text_config is not a JSON object"),
    (_with_vision(hidden_size=30), "not divisible by attention_heads"),
    (_with_vision(hidden_size="32"), "hidden_size '32' is not an integer"),
    (_with_vision(num_hidden_layers=True), "not an integer"),
    (_with_vision(intermediate_size=64.0), "not an integer"),
    (_with_vision(num_hidden_layers=0, intermediate_layers_indices=[]), "must be positive"),
    (_with_vision(num_global_layers=-1), "num_global_layers"),
    (_with_vision(intermediate_layers_indices=[0, 2]), r"\[2\] are outside the 2 local layers"),
    (_with_vision(intermediate_layers_indices=[]), "is empty"),
    (_with_vision(intermediate_layers_indices=3), "not a list of integers"),
    (_with_vision(vision_output_dim=7680), "vision_output_dim 7680 is not"),
    (_with_vision(image_size=[32, 48]), "not square"),
    (_with_vision(patch_size=64), "larger than image_size"),
    (_with_vision(norm_eps=0), "norm_eps must be positive"),
    (_with_vision(norm_eps="tiny"), "bad Llama 3.2 Vision config"),
    (_with_vision(supported_aspect_ratios=[[1, 1], [1, 5]]), "at most max_num_tiles 4"),
    (_with_vision(supported_aspect_ratios=[[1]]), "grids"),
    (_with_vision(supported_aspect_ratios=[]), "is empty"),
    (_with_vision(supported_aspect_ratios="1x1"), "not a list"),
    (_with_vision(max_num_tiles=2), "must be 4 for the default"),
    (_with_vision(model_type="clip_vision_model"), "model_type"),
    ({**raw_config(), "text_config": {"hidden_size": 0}}, "text_config hidden_size must be positive"),
    ({**raw_config(), "image_token_index": "127"}, "image_token_index"),
])
def test_malformed_configs_raise(raw, match):
    with pytest.raises(ModelLoadError, match=match):
        parse_config(raw)


def test_unsupported_activation_raises():
    with pytest.raises(ModelLoadError, match="unsupported activation"):
        MllamaVisionEncoder(parse_config(_with_vision(hidden_act="relu6_plus")))


def test_rejects_misshapen_inputs(models):
    _, ours = models(32, 8)
    pixels = torch.zeros(1, 1, 3, 3, 32, 32)  # 3 tiles, not max_num_tiles
    with pytest.raises(ValueError, match="pixel_values must be"):
        ours(pixels, torch.ones(1, 1, dtype=torch.long), torch.ones(1, 1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="aspect_ratio_mask must be"):
        ours(torch.zeros(1, 1, 4, 3, 32, 32), torch.ones(1, 1, dtype=torch.long), torch.ones(1, 4, dtype=torch.long))
