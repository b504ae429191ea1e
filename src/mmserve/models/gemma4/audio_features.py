"""Gemma 4's audio front end: one mono clip to the log-mel features the audio tower reads.

Role: transformers' `Gemma4AudioFeatureExtractor` for one clip, bit for bit, in numpy. The clip is
truncated to 480,000 samples (30 s at 16 kHz) and padded to a multiple of 128 samples, as transformers
does for a batch of one; then semicausal framing (frame_length // 2 zeros in front, windows of
frame_length + 1 samples every hop), optional preemphasis, a periodic Hann window, the magnitude of
an FFT, an HTK mel filter bank without normalization, log(mel + mel_floor), optional per-bin
normalization. A frame is real when the sample one past its window is real audio; the features of the
other frames are zeroed. `num_frames` gives the frame count without computing features.

Each step keeps transformers' dtypes (float32 samples, window and FFT; float64 filter bank, log and
normalization; float32 out) and array shapes (a leading batch axis of one), so numpy runs the same
kernels on the same inputs and the output is identical, not just close.

What it does not know: decoding or resampling audio files, batches of clips (transformers pads a batch
to its longest clip: more padding frames, the same real ones), the audio tower and its subsampling,
audio tokens.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from mmserve.errors import InvalidInputError, ModelLoadError

PaddingSide = Literal["left", "right"]


@dataclass(frozen=True)
class Gemma4AudioFeatureConfig:
    """Every setting the extractor reads; the defaults are transformers' (its constructor's, and its
    `__call__`'s for the last three, which no preprocessor config carries)."""

    sampling_rate_hz: int = 16_000
    mel_bins: int = 128  # transformers' feature_size
    frame_length_samples: int = 320  # 20 ms
    hop_length_samples: int = 160  # 10 ms
    fft_length_samples: int = 512  # next power of two above the frame, doubled by fft_overdrive
    min_frequency_hz: float = 0.0
    max_frequency_hz: float = 8000.0
    mel_floor: float = 1e-3  # added to the mel magnitudes before the log
    preemphasis: float = 0.0  # only a coefficient > 0 applies, as in transformers
    preemphasis_htk_flavor: bool = True
    dither_stddev: float = 0.0  # in sample units; drawn from numpy's global RNG, as transformers does
    input_scale_factor: float = 1.0
    per_bin_mean: tuple[float, ...] | None = None
    per_bin_stddev: tuple[float, ...] | None = None
    padding_value: float = 0.0
    padding_side: PaddingSide = "right"
    max_length_samples: int | None = 480_000
    pad_to_multiple_of_samples: int | None = 128
    truncation: bool = True

    def __post_init__(self) -> None:
        positive = {"sampling_rate_hz": self.sampling_rate_hz, "mel_bins": self.mel_bins,
                    "frame_length_samples": self.frame_length_samples,
                    "hop_length_samples": self.hop_length_samples}
        for name, value in positive.items():
            if value < 1:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.fft_length_samples < self.frame_length_samples:
            raise ValueError(f"fft_length_samples ({self.fft_length_samples}) is shorter than a frame "
                             f"({self.frame_length_samples})")
        if self.min_frequency_hz > self.max_frequency_hz:
            raise ValueError(f"min_frequency_hz ({self.min_frequency_hz}) > max_frequency_hz "
                             f"({self.max_frequency_hz})")
        if self.padding_side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', got {self.padding_side!r}")
        for name, values in (("per_bin_mean", self.per_bin_mean), ("per_bin_stddev", self.per_bin_stddev)):
            if values is not None and len(values) != self.mel_bins:
                raise ValueError(f"{name} has {len(values)} values for {self.mel_bins} mel bins")
        if self.truncation and self.max_length_samples is None:
            raise ValueError("truncation needs max_length_samples")
        if self.pad_to_multiple_of_samples is not None and self.pad_to_multiple_of_samples < 1:
            raise ValueError(f"pad_to_multiple_of_samples must be positive, got "
                             f"{self.pad_to_multiple_of_samples}")

    @classmethod
    def from_preprocessor_config(cls, config: Mapping[str, Any]) -> Gemma4AudioFeatureConfig:
        """The settings of the feature extractor's dict of a `preprocessor_config.json` (or the
        `feature_extractor` entry of a `processor_config.json`), read as transformers' constructor
        reads it. Unknown keys are ignored, as the constructor keeps them as inert attributes.

        transformers derives the frame and hop from `frame_length_ms` / `hop_length_ms` (20 / 10 when
        absent) and writes the results as `frame_length` / `hop_length` / `fft_length` without the
        milliseconds, then ignores those keys on reading: a config saved with other milliseconds
        reloads in transformers with the defaults. Such a config (written keys that disagree with the
        derived ones) raises here rather than pick one of the two readings silently."""
        try:
            return cls._read(config)
        except (TypeError, ValueError) as exc:
            raise ModelLoadError(f"unusable Gemma 4 audio feature extractor config: {exc}") from exc

    @classmethod
    def _read(cls, config: Mapping[str, Any]) -> Gemma4AudioFeatureConfig:
        sampling_rate = config.get("sampling_rate", 16_000)
        # the expressions of transformers' constructor, so that rounding ties fall the same way
        frame = int(round(sampling_rate * config.get("frame_length_ms", 20.0) / 1000.0))
        hop = int(round(sampling_rate * config.get("hop_length_ms", 10.0) / 1000.0))
        fft = 2 ** math.ceil(math.log2(frame)) * (2 if config.get("fft_overdrive", False) else 1)
        for key, derived in (("frame_length", frame), ("hop_length", hop), ("fft_length", fft)):
            if key in config and int(config[key]) != derived:
                raise ValueError(f"{key} is {config[key]} but the config's milliseconds and fft_overdrive "
                                 f"give {derived} (transformers would use {derived})")
        mel_bins = int(config.get("feature_size", 128))
        return cls(
            sampling_rate_hz=int(sampling_rate), mel_bins=mel_bins, frame_length_samples=frame,
            hop_length_samples=hop, fft_length_samples=fft,
            min_frequency_hz=float(config.get("min_frequency", 0.0)),
            max_frequency_hz=float(config.get("max_frequency", 8000.0)),
            # to_dict() writes mel_floor as a 0-d array; float() reads it and a JSON number alike
            mel_floor=float(config.get("mel_floor", 1e-3)),
            preemphasis=float(config.get("preemphasis", 0.0)),
            preemphasis_htk_flavor=bool(config.get("preemphasis_htk_flavor", True)),
            dither_stddev=float(config.get("dither", 0.0)),
            input_scale_factor=float(config.get("input_scale_factor", 1.0)),
            per_bin_mean=_per_bin(config.get("per_bin_mean")),
            per_bin_stddev=_per_bin(config.get("per_bin_stddev")),
            padding_value=float(config.get("padding_value", 0.0)),
            padding_side=config.get("padding_side", "right"),
        )


def _per_bin(values: Any) -> tuple[float, ...] | None:
    """A per-bin statistic as a flat tuple: to_dict() writes it as the (1, 1, bins) array it keeps."""
    if values is None:
        return None
    return tuple(float(v) for v in np.asarray(values, dtype=np.float64).reshape(-1))


def _round_up(length: int, multiple: int | None) -> int:
    """`length` up to a multiple of `multiple` (None: unchanged), as transformers' padding rounds."""
    if multiple is None or length % multiple == 0:
        return length
    return (length // multiple + 1) * multiple


def _periodic_hann(length: int) -> np.ndarray:
    """transformers' `window_function(length)`: a periodic Hann window, cast to float32."""
    return np.hanning(length + 1)[:-1].astype(np.float32)


def _htk_mel_filter_bank(num_frequency_bins: int, num_mel_filters: int, min_frequency_hz: float,
                         max_frequency_hz: float, sampling_rate_hz: int) -> np.ndarray:
    """transformers' `mel_filter_bank(..., norm=None, mel_scale="htk")`, (bins, filters) float64.

    The same numpy expressions in the same order, so each weight is the same double. With the
    defaults the top filter falls between FFT bins and is all zero; transformers keeps it, so do we."""
    mel_min = 2595.0 * np.log10(1.0 + (min_frequency_hz / 700.0))
    mel_max = 2595.0 * np.log10(1.0 + (max_frequency_hz / 700.0))
    mel_freqs = np.linspace(mel_min, mel_max, num_mel_filters + 2)
    filter_freqs = 700.0 * (np.power(10, mel_freqs / 2595.0) - 1.0)
    # the integer half of the sampling rate, as transformers spaces the bins
    fft_freqs = np.linspace(0, sampling_rate_hz // 2, num_frequency_bins)
    filter_diff = np.diff(filter_freqs)
    slopes = np.expand_dims(filter_freqs, 0) - np.expand_dims(fft_freqs, 1)
    down_slopes = -slopes[:, :-2] / filter_diff[:-1]
    up_slopes = slopes[:, 2:] / filter_diff[1:]
    return np.maximum(np.zeros(1), np.minimum(down_slopes, up_slopes))


def _unfold(waveform: np.ndarray, size: int, step: int) -> np.ndarray:
    """(batch, samples) -> (batch, windows, size): every `step`-th window of `size` samples, a view."""
    batch, length = waveform.shape
    if length < size:
        return np.zeros((batch, 0, size), dtype=waveform.dtype)
    return np.lib.stride_tricks.sliding_window_view(waveform, size, axis=-1)[:, ::step]


def _read_only(array: np.ndarray) -> np.ndarray:
    # the tables are shared by every call (and thread) of an extractor: nothing may write to them
    array.flags.writeable = False
    return array


class Gemma4AudioFeatures:
    """Log-mel features of one clip, as transformers' `Gemma4AudioFeatureExtractor` gives them for a
    batch of that one clip. The window and the mel filter bank are built once, here."""

    def __init__(self, config: Gemma4AudioFeatureConfig) -> None:
        self.config = config
        self._window = _read_only(_periodic_hann(config.frame_length_samples))
        self._mel_filters = _read_only(_htk_mel_filter_bank(
            config.fft_length_samples // 2 + 1, config.mel_bins, config.min_frequency_hz,
            config.max_frequency_hz, config.sampling_rate_hz))
        # transformers adds the floor as a float64 0-d array and keeps the statistics in float64
        self._mel_floor = np.array(config.mel_floor, dtype=np.float64)
        self._per_bin_mean = _statistic(config.per_bin_mean)
        self._per_bin_stddev = _statistic(config.per_bin_stddev)

    def padded_length(self, num_samples: int) -> int:
        """Samples of a clip of `num_samples` after truncation and padding, as the frames see it."""
        config = self.config
        if config.truncation and config.max_length_samples is not None:
            # transformers truncates to max_length rounded up to the padding multiple
            num_samples = min(num_samples, _round_up(config.max_length_samples,
                                                     config.pad_to_multiple_of_samples))
        return _round_up(num_samples, config.pad_to_multiple_of_samples)

    def num_frames(self, num_samples: int) -> int:
        """Feature frames (real and padding) of a clip of `num_samples`: the rows `__call__` returns."""
        frame = self.config.frame_length_samples
        # semicausal framing: frame // 2 zeros in front, windows of frame + 1 samples
        spare = self.padded_length(num_samples) + frame // 2 - (frame + 1)
        return max(0, spare // self.config.hop_length_samples + 1)

    def __call__(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(features (frames, mel_bins) float32, mask (frames,) bool, True on real frames) of one mono
        clip at the config's sampling rate. The features of padding frames are zero."""
        clip = np.asarray(samples)
        if clip.ndim != 1:
            raise InvalidInputError(f"audio samples must be one mono clip (1-D), got shape {clip.shape}")
        # transformers casts float64 samples to float32 before framing; float32 passes unchanged
        waveform, sample_mask = self._pad(clip.astype(np.float32, copy=False))
        features, frame_mask = self._log_mel(waveform[None, :], sample_mask)
        return features * frame_mask[:, None], frame_mask

    def _pad(self, clip: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The clip truncated and padded to `padded_length`, and its int32 mask of real samples."""
        config = self.config
        target = self.padded_length(len(clip))
        clip = clip[:target]
        sample_mask = np.ones(len(clip), dtype=np.int32)
        missing = target - len(clip)
        if missing > 0:
            widths = (0, missing) if config.padding_side == "right" else (missing, 0)
            sample_mask = np.pad(sample_mask, widths)
            clip = np.pad(clip, widths, "constant", constant_values=config.padding_value)
        return clip, sample_mask

    def _log_mel(self, waveform: np.ndarray, sample_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """transformers' `_extract_spectrogram` on a (1, samples) float32 waveform."""
        config = self.config
        if config.dither_stddev > 0.0:
            # numpy's global RNG, as transformers draws it: the same seed gives the same features
            noise = np.random.randn(*waveform.shape).astype(waveform.dtype)
            waveform = waveform + config.dither_stddev * noise
        if config.input_scale_factor != 1.0:
            waveform = waveform * config.input_scale_factor
        # semicausal: the first frame is centred on the first sample; the front zeros are never real
        front = config.frame_length_samples // 2
        waveform = np.pad(waveform, ((0, 0), (front, 0)), mode="constant")
        sample_mask = np.pad(sample_mask, (front, 0), mode="constant", constant_values=0)
        window_size = config.frame_length_samples + 1
        frames = self._preemphasize(_unfold(waveform, window_size, config.hop_length_samples))
        # rfft of float32 frames is complex64 (numpy >= 2), and its magnitude float32, as in transformers
        spectrum = np.fft.rfft(frames * self._window, n=config.fft_length_samples, axis=-1)
        log_mel = np.log(np.matmul(np.abs(spectrum), self._mel_filters) + self._mel_floor)
        if self._per_bin_mean is not None:
            log_mel = log_mel - self._per_bin_mean
        if self._per_bin_stddev is not None:
            log_mel = log_mel / self._per_bin_stddev
        log_mel = log_mel.squeeze(0)
        # a frame is real when the sample one past its window (the preemphasis look-ahead) is real
        ends = np.arange(log_mel.shape[0]) * config.hop_length_samples + window_size - 1
        return log_mel.astype(np.float32), sample_mask[ends].astype(bool)

    def _preemphasize(self, windows: np.ndarray) -> np.ndarray:
        """Frames of frame_length samples from windows of frame_length + 1 (the extra one is the
        look-ahead the non-HTK preemphasis reads; otherwise it is dropped)."""
        coefficient = self.config.preemphasis
        if coefficient <= 0.0:
            return windows[..., :-1]
        if self.config.preemphasis_htk_flavor:
            first = windows[..., :1] * (1.0 - coefficient)
            rest = windows[..., 1:-1] - coefficient * windows[..., :-2]
            return np.concatenate([first, rest], axis=-1)
        return windows[..., 1:] - coefficient * windows[..., :-1]


def _statistic(values: tuple[float, ...] | None) -> np.ndarray | None:
    """A per-bin statistic as the float64 row transformers broadcasts over the frames."""
    return None if values is None else _read_only(np.array(values, dtype=np.float64))
