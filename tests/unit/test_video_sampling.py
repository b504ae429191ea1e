"""Frame sampling of video files (`inputs/video.py`): the anchored sampler keeps the frames a growing
video already had; the even spread covers a long video whole; "auto" picks between them."""

from __future__ import annotations

import numpy as np
import pytest

from mmserve.demo.video import encode_video, moving_shapes
from mmserve.errors import InvalidInputError
from mmserve.inputs.frame_sampling import sample_times
from mmserve.inputs.video import decode_video

SOURCE_FPS = 10


@pytest.fixture(scope="module")
def clip():
    return moving_shapes(4 * SOURCE_FPS, fps=SOURCE_FPS, seed=7)


def _cut(clip, seconds: float) -> bytes:
    return encode_video(clip[:round(seconds * SOURCE_FPS)], SOURCE_FPS)


def _source_index(frame: np.ndarray, clip) -> int:
    """Which source frame a decoded frame is (the codec is lossy: the nearest one)."""
    errors = [np.abs(frame.astype(np.int16) - np.asarray(s, dtype=np.int16)).mean() for s in clip]
    return int(np.argmin(errors))


def _decode(data: bytes, sampling: str, max_frames: int = 32) -> list[np.ndarray]:
    return decode_video(data, fps=2.0, max_frames=max_frames, max_pixels=10**6, sampling=sampling)


def test_anchored_sampling_keeps_the_prefix_of_a_growing_video(clip):
    short, long = _decode(_cut(clip, 2.0), "fps"), _decode(_cut(clip, 4.0), "fps")
    assert len(short) == 4 and len(long) == 8
    for a, b in zip(short, long[:4], strict=True):
        np.testing.assert_array_equal(a, b)  # the first 2 s yield the same frames, bit for bit
    assert [_source_index(f, clip) for f in long] == [k * SOURCE_FPS // 2 for k in range(8)]  # t = k / 2 s
    # a length between samples gains the sample it reaches, and keeps the earlier ones
    odd = _decode(_cut(clip, 2.3), "fps")
    assert len(odd) == 5 and all(np.array_equal(a, b) for a, b in zip(odd, long[:5]))


def test_even_spread_moves_samples_as_the_video_grows(clip):
    even = _decode(_cut(clip, 2.3), "even")
    long = _decode(_cut(clip, 4.0), "even")
    assert len(even) == 4  # floor(2.3 s * 2): spread over 2.3 s, so the later samples sit between the 2 fps ticks
    assert [_source_index(f, clip) for f in even] != [_source_index(f, clip) for f in long[:4]]


def test_auto_uses_fps_until_the_frame_limit_then_spreads(clip):
    data = _cut(clip, 4.0)
    fits = _decode(data, "auto")
    assert [_source_index(f, clip) for f in fits] == [k * SOURCE_FPS // 2 for k in range(8)]
    capped = _decode(data, "auto", max_frames=5)  # 8 samples at 2 fps do not fit: five spread over 4 s
    assert [_source_index(f, clip) for f in capped] == [round(k * 0.8 * SOURCE_FPS) for k in range(5)]
    with pytest.raises(InvalidInputError, match="over the limit of 5"):
        _decode(data, "fps", max_frames=5)
    with pytest.raises(InvalidInputError, match="video_sampling must be one of"):
        _decode(data, "sometimes")


def test_sample_times():
    assert sample_times(2.0, 2.0, 32, "fps") == [0.0, 0.5, 1.0, 1.5]
    assert sample_times(2.0, 2.0, 32, "even") == [0.0, 0.5, 1.0, 1.5]
    assert sample_times(0.1, 2.0, 32, "fps") == [0.0]  # at least the first frame
    assert sample_times(10.0, 1.0, 4, "auto") == [0.0, 2.5, 5.0, 7.5]
