"""A synthetic clip of the demo task's shapes moving: the stream for the streaming-video examples.

Role: `moving_shapes(num_frames, fps, seed)` renders frame k of a clip in which a few demo shapes
drift across a white canvas and bounce off its edges. Frame k depends only on (seed, k, fps, size),
so a longer clip of the same seed starts with exactly the frames of a shorter one — a stream that
grows. `encode_video(frames, fps)` writes frames to an MP4 file with PyAV (lossless-ish, for tests).

What it does not know: tokenizers, models, the engine.
"""

from __future__ import annotations

import io
import random
from dataclasses import dataclass

import av
import numpy as np
from PIL import Image

from mmserve.demo.shapes import Scene, Shape, random_scene


@dataclass(frozen=True)
class _Mover:
    shape: Shape
    vx_px_per_s: float
    vy_px_per_s: float


def _bounce(start: float, speed: float, t_s: float, room: int) -> int:
    """Position at time t of a point moving at `speed` from `start`, reflected inside [0, room]."""
    if room <= 0:
        return 0
    span = 2 * room
    x = (start + speed * t_s) % span
    return int(round(x if x <= room else span - x))


def moving_shapes(num_frames: int, fps: float = 2.0, seed: int = 0, width: int = 160,
                  height: int = 120) -> list[Image.Image]:
    """Frames 0..num_frames-1 of clip `seed`, sampled at `fps` frames per second."""
    if num_frames < 1 or fps <= 0:
        raise ValueError("need num_frames >= 1 and fps > 0")
    rng = random.Random(f"moving-shapes:{seed}")
    layout = random_scene(rng)
    scale_x, scale_y = width / layout.width, height / layout.height
    movers = []
    for s in layout.shapes:
        side = max(8, int(s.side * min(scale_x, scale_y)))
        shape = Shape(s.kind, s.color, min(int(s.x0 * scale_x), width - side), min(int(s.y0 * scale_y), height - side),
                      side)
        movers.append(_Mover(shape, rng.uniform(-0.3, 0.3) * width, rng.uniform(-0.2, 0.2) * height))
    frames = []
    for k in range(num_frames):
        t_s = k / fps
        shapes = tuple(Shape(m.shape.kind, m.shape.color,
                             _bounce(m.shape.x0, m.vx_px_per_s, t_s, width - m.shape.side),
                             _bounce(m.shape.y0, m.vy_px_per_s, t_s, height - m.shape.side), m.shape.side)
                       for m in movers)
        frames.append(Scene(width, height, shapes).render())
    return frames


def encode_video(frames: list[Image.Image], fps: int, codec: str = "mpeg4", quality: int = 2) -> bytes:
    """Frames -> MP4 bytes (`quality`: the codec's qscale, 1 best)."""
    buf = io.BytesIO()
    width, height = frames[0].size
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.options = {"qscale": str(quality)}
        for image in frames:
            frame = av.VideoFrame.from_ndarray(np.asarray(image.convert("RGB")), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return buf.getvalue()
