"""Decode an encoded video file (mp4, webm, ...) into sampled RGB frames with PyAV.

Role: `decode_video(data, fps, max_frames, max_pixels, sampling=...)` returns uint8 (H, W, 3)
frames sampled at `fps` frames per second of video time, at most `max_frames` of them, at the
instants `frame_sampling.sample_times` picks ("fps" anchored at t=0, "even", or "auto").
Raises `InvalidInputError` for anything undecodable, frameless or over the pixel cap (checked
from the stream header before a frame is converted).

What it does not know: models, patch sizes, tokens, where the bytes came from.
"""

from __future__ import annotations

import io

import av
import numpy as np

from mmserve.errors import InvalidInputError
from mmserve.inputs.frame_sampling import sample_times


def _check_pixels(stream: av.video.stream.VideoStream, max_pixels: int, what: str) -> None:
    width, height = stream.codec_context.width, stream.codec_context.height
    if width and height and width * height > max_pixels:
        raise InvalidInputError(f"{what} is {width}x{height} = {width * height} pixels per frame, over the "
                                f"limit of {max_pixels} pixels")


def _duration_s(data: bytes, container: av.container.InputContainer,
                stream: av.video.stream.VideoStream) -> float | None:
    """From the header when it says; else from the packets' timestamps (demuxed, not decoded)."""
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return container.duration / av.time_base
    with av.open(io.BytesIO(data), mode="r") as again:
        video = again.streams.video[0]
        stamps = [p.pts for p in again.demux(video) if p.pts is not None]
        if not stamps or video.time_base is None:
            return None
        frame_s = 1.0 / float(video.average_rate) if video.average_rate else 0.0
        return float((max(stamps) - min(stamps)) * video.time_base) + frame_s


def _sample(container: av.container.InputContainer, stream: av.video.stream.VideoStream,
            times: list[float]) -> list[np.ndarray]:
    """For each sample instant (seconds from the first frame), the first frame at or after it; the
    last picked frame stands in for instants past the end. Frames are converted as they are picked,
    so only the chosen ones are ever held."""
    picked: list[np.ndarray] = []
    start: float | None = None
    for index, frame in enumerate(container.decode(stream)):
        t = float(frame.time) if frame.time is not None else index / float(stream.average_rate or 1)
        start = t if start is None else start
        array: np.ndarray | None = None
        while len(picked) < len(times) and t - start >= times[len(picked)] - 1e-6:
            array = array if array is not None else frame.to_ndarray(format="rgb24")
            picked.append(array)
        if len(picked) == len(times):
            break
    if picked and len(picked) < len(times):  # the header overstated the duration
        picked.extend([picked[-1]] * (len(times) - len(picked)))
    return picked


def decode_video(data: bytes, fps: float, max_frames: int, max_pixels: int,
                 what: str = "video", sampling: str = "auto") -> list[np.ndarray]:
    """Encoded video bytes -> sampled RGB frames, each a uint8 array (H, W, 3)."""
    if not data:
        raise InvalidInputError(f"{what} is empty (0 bytes)")
    if fps <= 0 or max_frames <= 0:
        raise InvalidInputError(f"{what}: fps and max frames must be positive")
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise InvalidInputError(f"{what} has no video stream")
            stream = container.streams.video[0]
            _check_pixels(stream, max_pixels, what)
            duration = _duration_s(data, container, stream)
            times = sample_times(duration or 0.0, fps, max_frames, sampling, what)
            frames = _sample(container, stream, times)
    except InvalidInputError:
        raise
    except (av.FFmpegError, OSError, ValueError, EOFError) as exc:
        raise InvalidInputError(f"{what} could not be decoded (corrupt, truncated or not a video): {exc}") from exc
    if not frames:
        raise InvalidInputError(f"{what} has no decodable frames")
    return frames
