"""Gemma 4's features of audio files: mmserve's whole path (decode, mix to mono, resample, log-mel) against
transformers' (`audio_utils.load_audio` with its soundfile backend — soundfile decodes, soxr resamples, as
`librosa.load` — then `Gemma4AudioFeatureExtractor`), exactly, for WAV, FLAC and MP3 files at 8, 16, 44.1
and 48 kHz, mono and stereo."""

from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile
from transformers.audio_utils import load_audio
from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor

from mmserve.inputs.audio import AudioLimits, decode_audio
from mmserve.models.gemma4.audio_features import Gemma4AudioFeatureConfig, Gemma4AudioFeatures

FORMATS = {"wav": ("WAV", "PCM_16"), "flac": ("FLAC", "PCM_16"), "mp3": ("MP3", "MPEG_LAYER_III")}
RATES = (8_000, 16_000, 44_100, 48_000)


def _signal(rate: int, channels: int, seconds: float = 1.3) -> np.ndarray:
    """(samples, channels): a tone per channel under seeded noise."""
    t = np.arange(int(seconds * rate)) / rate
    rng = np.random.default_rng(rate + channels)
    return np.stack([0.3 * np.sin(2 * np.pi * (330 + 220 * c) * t) + 0.05 * rng.standard_normal(t.size)
                     for c in range(channels)], axis=1)


@pytest.mark.parametrize("channels", [1, 2], ids=["mono", "stereo"])
@pytest.mark.parametrize("rate", RATES, ids=lambda r: f"{r}Hz")
@pytest.mark.parametrize("kind", list(FORMATS))
def test_an_audio_files_features_equal_transformers(kind, rate, channels, tmp_path):
    buffer = io.BytesIO()
    container, subtype = FORMATS[kind]
    soundfile.write(buffer, _signal(rate, channels), rate, format=container, subtype=subtype)
    data = buffer.getvalue()
    path = tmp_path / f"clip.{kind}"
    path.write_bytes(data)
    reference = Gemma4AudioFeatureExtractor()([load_audio(str(path), sampling_rate=16_000, backend="soundfile")])
    clip = decode_audio(data, param="clip", sampling_rate_hz=16_000, limits=AudioLimits(), format=kind)
    features, mask = Gemma4AudioFeatures(Gemma4AudioFeatureConfig())(clip.samples)
    want_features, want_mask = reference["input_features"][0], reference["input_features_mask"][0]
    assert np.array_equal(mask, want_mask)
    assert np.array_equal(features, want_features), np.abs(features - want_features).max()
