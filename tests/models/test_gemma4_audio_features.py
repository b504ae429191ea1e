"""Gemma 4's audio features against transformers' `Gemma4AudioFeatureExtractor`, built from its constructor.

The reference is called on a batch of one clip (`extractor([clip])`): transformers 5.24 fails on a bare
1-D array (it frames the (1, samples) array along the wrong axis). Every comparison is exact: the
module repeats transformers' numpy operations on the same dtypes and shapes.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor

from mmserve.errors import InvalidInputError, ModelLoadError
from mmserve.models.gemma4.audio_features import Gemma4AudioFeatureConfig, Gemma4AudioFeatures

RATE = 16_000


@pytest.fixture(scope="module")
def reference() -> Gemma4AudioFeatureExtractor:
    return Gemma4AudioFeatureExtractor()


@pytest.fixture(scope="module")
def ours() -> Gemma4AudioFeatures:
    return Gemma4AudioFeatures(Gemma4AudioFeatureConfig())


def noise(num_samples: int, seed: int = 0, scale: float = 0.1) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(num_samples) * scale).astype(np.float32)


def tone(num_samples: int, hz: float = 440.0, amplitude: float = 0.5) -> np.ndarray:
    t = np.arange(num_samples) / RATE
    return (amplitude * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def assert_same(ours: Gemma4AudioFeatures, reference: Gemma4AudioFeatureExtractor, clip: np.ndarray) -> None:
    expected = reference([clip])
    want_features, want_mask = expected["input_features"][0], expected["input_features_mask"][0]
    features, mask = ours(clip)
    assert features.dtype == np.float32 and mask.dtype == np.bool_
    assert features.shape == want_features.shape and mask.shape == want_mask.shape
    assert np.array_equal(mask, want_mask)
    assert np.array_equal(features, want_features), np.abs(features - want_features).max()
    assert ours.num_frames(len(clip)) == features.shape[0]


@pytest.mark.parametrize("num_samples", [
    0, 100, 128, 129, 161, 321, 16_000, 16_037, 59_200, 479_999, 480_000, 480_001, 520_000,
], ids=lambda n: f"{n}_samples")
def test_lengths_match_transformers(ours, reference, num_samples):
    """Clips from empty and shorter than a frame, through 1 s, a hop-misaligned one, 3.7 s, to 30 s
    (480,000 samples, transformers' max_length) and beyond it (truncated)."""
    assert_same(ours, reference, noise(num_samples, seed=num_samples) + tone(num_samples))


def test_truncation_keeps_the_first_30_seconds(ours):
    clip = noise(520_000, seed=3)
    features, mask = ours(clip)
    head_features, head_mask = ours(clip[:480_000])
    assert np.array_equal(features, head_features) and np.array_equal(mask, head_mask)
    assert features.shape == (2999, 128) and mask.all()


def test_silence_is_the_log_of_the_mel_floor(ours, reference):
    clip = np.zeros(40_960, dtype=np.float32)  # a multiple of 128: no padding frames
    assert_same(ours, reference, clip)
    features, mask = ours(clip)
    assert mask.all()
    assert np.array_equal(features, np.full_like(features, np.float32(np.log(1e-3))))


def test_loud_clipped_clip(ours, reference):
    clip = np.clip(tone(48_000, hz=997.0, amplitude=8.0) + noise(48_000, seed=7, scale=2.0), -1.0, 1.0)
    assert_same(ours, reference, clip)


def test_noise_from_a_fixed_seed(ours, reference):
    assert_same(ours, reference, noise(33_333, seed=1234, scale=1.0))


def test_float64_samples_are_read_as_float32(ours, reference):
    clip = noise(20_000, seed=5).astype(np.float64) + 1e-9  # the float32 cast drops the 1e-9
    assert_same(ours, reference, clip)


def test_padding_frames_are_zero_and_masked(ours):
    features, mask = ours(noise(16_129, seed=2))
    # 16,129 samples pad to 16,256 (101 frames); frame i is real while sample 160 i + 160 is (100 frames)
    assert mask.shape == (101,) and mask.sum() == 100 and not mask[-1]
    assert np.array_equal(mask, np.arange(len(mask)) * 160 + 160 < 16_129)
    assert not features[~mask].any()


@pytest.mark.parametrize("settings", [
    dict(feature_size=80, min_frequency=60.0, max_frequency=7600.0, mel_floor=1e-5, fft_overdrive=True),
    dict(preemphasis=0.97, preemphasis_htk_flavor=True, input_scale_factor=32768.0 / 4),
    dict(preemphasis=0.97, preemphasis_htk_flavor=False, padding_side="left", padding_value=0.25),
    dict(sampling_rate=8_000, max_frequency=4000.0, feature_size=64),  # 20 ms: 160-sample frames
    dict(per_bin_mean=list(np.linspace(-4.0, 1.0, 128)), per_bin_stddev=list(np.linspace(0.5, 3.0, 128))),
], ids=["bins_range_floor_overdrive", "preemphasis_htk_scaled", "preemphasis_plain_left_pad",
        "8khz", "per_bin_normalization"])
def test_non_default_config_from_to_dict(settings):
    """A config read from transformers' own to_dict() (and its JSON) gives transformers' features."""
    reference = Gemma4AudioFeatureExtractor(**settings)
    config = Gemma4AudioFeatureConfig.from_preprocessor_config(reference.to_dict())
    assert config == Gemma4AudioFeatureConfig.from_preprocessor_config(json.loads(reference.to_json_string()))
    assert config.frame_length_samples == reference.frame_length
    assert config.hop_length_samples == reference.hop_length
    assert config.fft_length_samples == reference.fft_length
    ours = Gemma4AudioFeatures(config)
    for num_samples in (100, 16_037, 37_000):
        assert_same(ours, reference, noise(num_samples, seed=num_samples) + tone(num_samples))


def test_non_default_frames_with_their_milliseconds():
    """25 ms frames every 12.5 ms: to_dict() drops the milliseconds, so they are written back as a
    hand-made config would carry them; transformers' own reload of that dict agrees."""
    reference = Gemma4AudioFeatureExtractor(frame_length_ms=25.0, hop_length_ms=12.5, feature_size=96)
    written = {**reference.to_dict(), "frame_length_ms": 25.0, "hop_length_ms": 12.5}
    config = Gemma4AudioFeatureConfig.from_preprocessor_config(written)
    frames = (config.frame_length_samples, config.hop_length_samples, config.fft_length_samples)
    assert frames == (400, 200, 512)
    ours = Gemma4AudioFeatures(config)
    for num_samples in (300, 16_037, 59_200):
        clip = noise(num_samples, seed=num_samples)
        assert_same(ours, reference, clip)
        assert_same(ours, Gemma4AudioFeatureExtractor.from_dict(dict(written)), clip)


def test_lossy_frame_settings_are_refused():
    """transformers' to_dict() of 25 ms frames reloads (in transformers) as 20 ms frames; reading it
    here raises instead of choosing between the writer's 400 samples and the reader's 320."""
    written = Gemma4AudioFeatureExtractor(frame_length_ms=25.0, hop_length_ms=12.5).to_dict()
    assert Gemma4AudioFeatureExtractor.from_dict(dict(written)).frame_length == 320
    with pytest.raises(ModelLoadError, match="frame_length is 400"):
        Gemma4AudioFeatureConfig.from_preprocessor_config(written)


def test_defaults_are_transformers_defaults():
    reference = Gemma4AudioFeatureExtractor()
    config = Gemma4AudioFeatureConfig.from_preprocessor_config({})
    assert config == Gemma4AudioFeatureConfig() == Gemma4AudioFeatureConfig.from_preprocessor_config(
        reference.to_dict())
    assert (config.sampling_rate_hz, config.mel_bins, config.frame_length_samples, config.hop_length_samples,
            config.fft_length_samples, config.mel_floor) == (16_000, 128, 320, 160, 512, 1e-3)
    ours = Gemma4AudioFeatures(config)
    assert np.array_equal(ours._window, reference.window)
    assert np.array_equal(ours._mel_filters, reference.mel_filters)


def test_dither_draws_from_numpys_global_rng():
    reference = Gemma4AudioFeatureExtractor(dither=1e-4)
    ours = Gemma4AudioFeatures(Gemma4AudioFeatureConfig.from_preprocessor_config(reference.to_dict()))
    clip = tone(10_000)
    np.random.seed(11)
    expected = reference([clip])["input_features"][0]
    np.random.seed(11)
    features, _ = ours(clip)
    assert np.array_equal(features, expected)


@pytest.mark.parametrize("num_samples", [0, 1, 127, 128, 129, 160, 161, 288, 289, 449, 450, 16_000, 16_001,
                                         479_872, 479_873, 480_000, 480_001, 10**7])
def test_num_frames_matches_transformers(reference, ours, num_samples):
    """The frame count of the reference's own arithmetic, checked against its output for short clips."""
    if num_samples <= 20_000:
        expected = reference([np.zeros(num_samples, dtype=np.float32)])["input_features"][0].shape[0]
    else:
        padded = min(-(-num_samples // 128) * 128, 480_000)
        expected = (padded + 160 - 321) // 160 + 1
    assert ours.num_frames(num_samples) == expected


def test_bad_input_and_config():
    ours = Gemma4AudioFeatures(Gemma4AudioFeatureConfig())
    with pytest.raises(InvalidInputError):
        ours(np.zeros((2, 1000), dtype=np.float32))
    with pytest.raises(ModelLoadError):
        Gemma4AudioFeatureConfig.from_preprocessor_config({"feature_size": 4, "per_bin_mean": [0.0]})
    with pytest.raises(ValueError):
        Gemma4AudioFeatureConfig(padding_side="middle")  # type: ignore[arg-type]
