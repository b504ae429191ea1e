"""Which instants of a video its frames are sampled at: the two samplers and the choice between them.

Role: `sample_times(duration_s, fps, max_frames, sampling)` returns the sample instants (seconds
from the first frame). Samplers, chosen per request (`mm_processor_kwargs={"video_sampling": ...}`):
- "fps": anchored at t=0, one sample every 1/fps seconds. A video that grows (a live stream
  re-sent as it is recorded) keeps the samples it had and gains new ones at the end, so its
  leading frames — and their encoder outputs and KV — can be reused. A video that needs more
  than `max_frames` samples is refused.
- "even": `duration * fps` samples spread evenly over the whole video; a long video is sampled
  more sparsely, not cut short (every sample moves when the video grows).
- "auto" (the default): "fps" when the video fits `max_frames` at that rate, else "even".

What it does not know: codecs, pixels, models.
"""

from __future__ import annotations

import math

from mmserve.errors import InvalidInputError

SAMPLING_KWARG = "video_sampling"  # the mm_processor_kwargs key that picks the sampler
SAMPLERS = ("auto", "fps", "even")
# sample instants within this much of the end of the video still count as inside it
_EDGE_S = 1e-6


def check_sampling(value: object) -> str:
    """The sampler a request asked for (None: "auto"); InvalidInputError for anything else."""
    if value is None:
        return "auto"
    if value not in SAMPLERS:
        raise InvalidInputError(f"mm_processor_kwargs.{SAMPLING_KWARG} must be one of {', '.join(SAMPLERS)}; "
                                f"got {value!r:.40}", param=f"mm_processor_kwargs.{SAMPLING_KWARG}")
    return str(value)


def check_fps(value: object, what: str = "fps", param: str | None = None) -> float:
    """A frame rate: a positive finite number (not a bool); InvalidInputError (naming `param`) otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise InvalidInputError(f"{what} must be a positive number, got {value!r:.40}", param=param)
    return float(value)


def _even_times(duration_s: float, fps: float, max_frames: int) -> list[float]:
    """Evenly spaced sample instants in [0, duration): duration * fps of them, within [1, max_frames]."""
    count = max(1, min(max_frames, math.floor(duration_s * fps)))
    step = duration_s / count
    return [i * step for i in range(count)]


def _anchored_count(duration_s: float, fps: float) -> int:
    """Instants k / fps that lie inside [0, duration): at least the first frame."""
    return max(1, math.ceil(duration_s * fps - _EDGE_S))


def sample_times(duration_s: float, fps: float, max_frames: int, sampling: str = "auto",
                 what: str = "video") -> list[float]:
    """The instants (seconds from the first frame) the sampler picks frames at."""
    sampling = check_sampling(sampling)
    count = _anchored_count(duration_s, fps)
    if sampling == "even" or (sampling == "auto" and count > max_frames):
        return _even_times(duration_s, fps, max_frames)
    if count > max_frames:
        raise InvalidInputError(f"{what} is {duration_s:.2f} s long: sampling at {fps:g} fps from t=0 takes "
                                f"{count} frames, over the limit of {max_frames} (lower fps, raise the frame "
                                "limit, or use video_sampling='even')")
    return [k / fps for k in range(count)]
