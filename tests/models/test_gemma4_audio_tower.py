"""Gemma 4's audio tower and projector against transformers' `Gemma4AudioModel` + `Gemma4MultimodalEmbedder`.

A tiny random tower (hidden 32, 2 layers, 2 heads, text hidden 16, clipped linears with finite random
bounds) is built in transformers and its weights loaded into ours through `audio_weight_name`. The
reference runs as `Gemma4Model.get_audio_features` and `Gemma4Model.forward` do: the tower on the
extractor's (padded) batch, the embedder on its last hidden state, padding rows stripped with the
tower's output mask. The subsampling's first conv has 128 channels because transformers sizes the input
projection as (channels[0] // 4) * channels[1], which fits 128 mel bins only then (see audio_config).
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from transformers.models.gemma4.configuration_gemma4 import Gemma4AudioConfig as HFAudioConfig
from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
from transformers.models.gemma4.modeling_gemma4 import Gemma4AudioModel, Gemma4MultimodalEmbedder
from transformers.models.gemma4.processing_gemma4 import Gemma4Processor

from mmserve.errors import ModelLoadError
from mmserve.models.gemma4.audio_config import Gemma4AudioConfig, parse_audio_config
from mmserve.models.gemma4.audio_features import Gemma4AudioFeatureConfig, Gemma4AudioFeatures
from mmserve.models.gemma4.audio_input import AUDIO_SEQ_LENGTH, audio_input, audio_seq_length
from mmserve.models.gemma4.audio_tower import Gemma4AudioEncoder, audio_soft_tokens, audio_weight_name

RATE = 16_000
TEXT_HIDDEN = 16
TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, subsampling_conv_channels=[128, 8],
            output_proj_dims=24, use_clipped_linears=True)
TOL = dict(atol=1e-5, rtol=1e-5)


def _randomize(module: torch.nn.Module, generator: torch.Generator) -> None:
    """Random weights of a scale that keeps activations O(1), finite clip bounds that do clip."""
    for name, param in module.named_parameters():
        noise = torch.randn(param.shape, generator=generator)
        if name.endswith("norm.weight"):
            param.data = 1.0 + 0.1 * noise
        elif param.ndim == 1:
            param.data = 0.3 * noise
        else:
            param.data = noise * param.shape[-1] ** -0.5 * (0.5 if param.ndim == 4 else 1.0)
    for name, buffer in module.named_buffers():
        if name.endswith(("input_min", "output_min", "input_max", "output_max")):
            bound = 0.5 + torch.rand((), generator=generator).item()
            buffer.fill_(-bound if name.endswith("min") else bound)


@pytest.fixture(scope="module")
def reference() -> tuple[Gemma4AudioModel, Gemma4MultimodalEmbedder]:
    config = HFAudioConfig(**TINY)
    tower = Gemma4AudioModel(config).eval()
    embedder = Gemma4MultimodalEmbedder(config, types.SimpleNamespace(hidden_size=TEXT_HIDDEN)).eval()
    generator = torch.Generator().manual_seed(0)
    _randomize(tower, generator)
    _randomize(embedder, generator)
    return tower, embedder


@pytest.fixture(scope="module")
def ours(reference) -> Gemma4AudioEncoder:
    tower, embedder = reference
    checkpoint = {f"model.audio_tower.{k}": v for k, v in tower.state_dict().items()}
    checkpoint |= {f"model.embed_audio.{k}": v for k, v in embedder.state_dict().items()}
    encoder = Gemma4AudioEncoder(parse_audio_config(tower.config.to_dict()), TEXT_HIDDEN).eval()
    renamed = {audio_weight_name(name): value for name, value in checkpoint.items()}
    assert None not in renamed and set(renamed) == set(encoder.state_dict())
    encoder.load_state_dict(renamed, strict=True)
    return encoder


@pytest.fixture(scope="module")
def features() -> Gemma4AudioFeatures:
    return Gemma4AudioFeatures(Gemma4AudioFeatureConfig())


@pytest.fixture(scope="module")
def extractor() -> Gemma4AudioFeatureExtractor:
    return Gemma4AudioFeatureExtractor()


def noise(num_samples: int, seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(num_samples) * 0.1).astype(np.float32)


def reference_rows(reference, extractor, clips: list[np.ndarray]) -> list[torch.Tensor]:
    """transformers' soft tokens per clip: the extractor pads the batch, the tower and embedder run on
    it, each row's padding stripped with the tower's output mask."""
    tower, embedder = reference
    batch = extractor(clips, return_tensors="pt")
    with torch.no_grad():
        out = tower(batch["input_features"], batch["input_features_mask"], return_dict=True)
        embedded = embedder(out.last_hidden_state)
    return [embedded[i][out.attention_mask[i]] for i in range(len(clips))]


def test_weight_names():
    assert audio_weight_name("model.audio_tower.layers.0.self_attn.q_proj.input_min") == \
        "tower.layers.0.self_attn.q_proj.input_min"
    assert audio_weight_name("audio_tower.output_proj.bias") == "tower.output_proj.bias"
    assert audio_weight_name("model.embed_audio.embedding_projection.weight") == \
        "embedder.embedding_projection.weight"
    assert audio_weight_name("model.language_model.embed_tokens.weight") is None
    assert audio_weight_name("model.vision_tower.patch_embedder.input_proj.weight") is None


def test_one_clip_matches_transformers(ours, reference, features, extractor):
    clip = noise(20_800, seed=1)  # 1.3 s: 33 rows, three attention blocks
    payload = audio_input(clip, features, ours.config)
    (rows,) = ours.encode([payload])
    (want,) = reference_rows(reference, extractor, [clip])
    assert rows.shape == (payload.num_soft_tokens, TEXT_HIDDEN) == want.shape
    torch.testing.assert_close(rows, want, **TOL)


@pytest.mark.parametrize("lengths", [(20_800, 12_345, 3_001), (17_000, 17_000)],
                         ids=["ragged", "same_length"])
def test_batch_matches_transformers_and_each_clip_alone(ours, reference, features, extractor, lengths):
    clips = [noise(n, seed=10 + i) for i, n in enumerate(lengths)]
    payloads = [audio_input(clip, features, ours.config) for clip in clips]
    batched = ours.encode(payloads)
    for rows, want, payload in zip(batched, reference_rows(reference, extractor, clips), payloads):
        torch.testing.assert_close(rows, want, **TOL)
        (alone,) = ours.encode([payload])
        torch.testing.assert_close(rows, alone, **TOL)
    assert not torch.equal(batched[0][:4], batched[1][:4])  # different clips, different rows


def test_empty_clip_batched_with_a_real_one(ours, features):
    empty, real = (audio_input(noise(n, seed=n), features, ours.config) for n in (0, 8_000))
    assert empty.num_frames == 0 and empty.num_soft_tokens == 0
    rows_empty, rows_real = ours.encode([empty, real])
    assert rows_empty.shape == (0, TEXT_HIDDEN)
    torch.testing.assert_close(rows_real, ours.encode([real])[0], **TOL)
    assert ours.encode([empty])[0].shape == (0, TEXT_HIDDEN)


def _processor(audio_seq_length: int = AUDIO_SEQ_LENGTH) -> types.SimpleNamespace:
    """What `replace_audio_token` / `_compute_audio_num_tokens` read of a Gemma4Processor."""
    return types.SimpleNamespace(feature_extractor=Gemma4AudioFeatureExtractor(), boa_token="", eoa_token="",
                                 audio_seq_length=audio_seq_length, audio_token="A")


@pytest.mark.parametrize("num_samples", [
    0, 160, 161, 320, 321, 480, 481, 800, 801, 1_440, 1_441, 15_999, 16_000, 16_001, 16_160, 16_161,
    20_800, 479_840, 479_841, 479_999, 480_000, 520_000, 640_000,
])
def test_soft_tokens_match_the_processor(features, num_samples):
    """Lengths where the count steps (a 4k+1-th real frame: 161, 801, 1441 samples), around 1 s, and at,
    above (truncated) and far above 30 s, where the processor's 750 cap and the truncation agree."""
    processor = _processor()
    clip = np.zeros(num_samples, dtype=np.float32)
    placeholders = len(Gemma4Processor.replace_audio_token(processor, processor.feature_extractor([clip]), 0))
    budget = Gemma4Processor._compute_audio_num_tokens(processor, clip, RATE)
    _, mask = features(clip)
    assert audio_soft_tokens(mask) == placeholders == budget
    assert audio_soft_tokens(int(mask.sum())) == budget  # the real-frame count gives the same


def test_cap_below_the_clip(ours, features):
    """A processor cap under a clip's count: transformers budgets the capped count (its placeholders,
    from replace_audio_token, are not capped); ours keeps the clip's first rows."""
    clip = noise(20_800, seed=2)
    processor = _processor(audio_seq_length=20)
    assert Gemma4Processor._compute_audio_num_tokens(processor, clip, RATE) == 20
    capped = audio_input(clip, features, ours.config, max_soft_tokens=20)
    full = audio_input(clip, features, ours.config)
    assert (capped.num_soft_tokens, full.num_soft_tokens) == (20, 33)
    torch.testing.assert_close(ours.encode([capped])[0], ours.encode([full])[0][:20], **TOL)


def test_thirty_seconds(ours, reference, features, extractor):
    """The extractor's longest clip (anything longer is truncated to it) gives exactly the cap."""
    clip = noise(30 * RATE + 5_000, seed=3)
    payload = audio_input(clip, features, ours.config)
    assert payload.num_frames == 2999 and payload.num_soft_tokens == AUDIO_SEQ_LENGTH
    (rows,) = ours.encode([payload])
    assert rows.shape == (AUDIO_SEQ_LENGTH, TEXT_HIDDEN)
    torch.testing.assert_close(rows, reference_rows(reference, extractor, [clip])[0], **TOL)


def test_config_defaults_are_transformers():
    default = HFAudioConfig()
    parsed = parse_audio_config({})
    assert parsed == parse_audio_config(default.to_dict()) == Gemma4AudioConfig()
    for field in ("hidden_size", "num_hidden_layers", "num_attention_heads", "hidden_act",
                  "conv_kernel_size", "residual_weight", "attention_chunk_size", "attention_context_left",
                  "attention_context_right", "attention_logit_cap", "attention_invalid_logits_value",
                  "use_clipped_linears", "rms_norm_eps", "gradient_clipping", "output_proj_dims"):
        assert getattr(parsed, field) == getattr(default, field), field
    assert list(parsed.subsampling_conv_channels) == list(default.subsampling_conv_channels)
    assert parsed.accepts_mel_bins(128) and not parsed.accepts_mel_bins(80)
    assert audio_seq_length({}) == 750 and audio_seq_length({"audio_seq_length": 188}) == 188


@pytest.mark.parametrize("raw", [
    {"hidden_size": 30, "num_attention_heads": 4}, {"hidden_size": 9, "num_attention_heads": 3},
    {"subsampling_conv_channels": [128]}, {"attention_context_left": 0}, {"attention_context_right": -1},
    {"hidden_act": "mish"}, {"num_hidden_layers": "twelve"}, {"hidden_size": 12.5},
    {"use_clipped_linears": "yes"}, {"attention_logit_cap": 0.0}, {"rms_norm_eps": -1.0},
])
def test_bad_config_values(raw):
    with pytest.raises(ModelLoadError):
        parse_audio_config(raw)


def test_mel_bins_that_do_not_fit_the_projection(ours):
    with pytest.raises(ModelLoadError, match="mel bins"):
        audio_input(noise(1_600, seed=4), Gemma4AudioFeatures(Gemma4AudioFeatureConfig(mel_bins=80)),
                    ours.config)
