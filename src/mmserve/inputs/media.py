"""Load media for a request, with limits, into validated PIL images and frame lists.

Role: accept what callers hand us — PIL images, uint8 numpy arrays, encoded bytes, data URIs,
local paths (only under an allowed root) — and return decoded RGB-convertible PIL images, or
raise `InvalidInputError` with a message that says what was wrong. The pixel cap is checked
from the header before any pixel is decoded (decompression-bomb guard).

Each kind of source becomes the pixels transformers makes of it, so answers match theirs: encoded
images (bytes, data URIs, files, and the URLs the server fetches) go through transformers'
`load_image` steps — turned upright by their EXIF orientation, then `convert("RGB")`, which drops an
alpha channel rather than blending it; a PIL image is handed on as it is (the family's processor then
composites transparency onto white, as transformers' image processors do); an RGBA array is composited
onto white in float64 and rounded, as transformers' `convert_to_rgb` does for arrays.

`MediaLimits` holds every media limit, audio's too (`.audio`: audio.py's `AudioLimits`); audio itself is
loaded by audio_sources.py.

What it does not know: models, patch sizes, tokens. Network fetching lives with the server.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image, ImageOps

from mmserve.errors import InvalidInputError
from mmserve.inputs.frame_sampling import check_fps
from mmserve.options import option

if TYPE_CHECKING:
    from mmserve.inputs.audio import AudioLimits

# The modes Pillow converts to RGB (as transformers does: 16-bit, 32-bit and float values are clipped to
# 0..255, not rescaled). "La" (premultiplied) has no conversion to RGB in Pillow.
SUPPORTED_IMAGE_MODES = frozenset({"1", "L", "LA", "P", "PA", "RGB", "RGBA", "RGBa", "RGBX", "CMYK", "YCbCr", "LAB",
                                   "HSV", "I", "I;16", "I;16L", "I;16B", "I;16N", "F"})


@dataclass(frozen=True)
class MediaLimits:
    max_image_bytes: int = option(32 * 1024 * 1024, "largest encoded image", shown="32MiB")
    max_image_pixels: int = option(64_000_000, "largest image in width x height pixels, checked before decoding")
    max_video_frames: int = option(32, "most frames of one video (also sizes a whole-video item)")
    max_pixels_per_request: int = option(256_000_000, "decoded pixels of all images and video frames of a request")
    allowed_local_media_path: str | None = option(None, "local files may be read only below this directory",
                                                  shown="none")
    media_uuid_cache_bytes: int = option(256 * 1024 * 1024, "decoded media kept by uuid, so a later request may "
                                         "name it by its uuid alone (0: none kept)", shown="256MiB")
    max_audio_bytes: int = option(25 * 1024 * 1024, "largest encoded audio file (OpenAI's upload limit)",
                                  shown="25MiB")
    max_audio_duration_s: float = option(600.0, "longest audio clip in seconds, refused from its header "
                                         "before decoding, else as soon as decoding passes it")

    def __post_init__(self) -> None:
        if min(self.max_image_bytes, self.max_image_pixels, self.max_video_frames,
               self.max_pixels_per_request, self.max_audio_bytes, self.max_audio_duration_s) <= 0:
            raise ValueError("media limits must be positive")
        if self.media_uuid_cache_bytes < 0:
            raise ValueError("media_uuid_cache_bytes must be >= 0")

    @property
    def audio(self) -> AudioLimits:
        """What one audio input may cost (audio.py's limits): the bytes and duration set here, audio.py's
        sampling-rate and channel bounds."""
        from mmserve.inputs.audio import AudioLimits  # here: importing PyAV is not every config's cost

        return AudioLimits(max_bytes=self.max_audio_bytes, max_duration_s=self.max_audio_duration_s)


class PixelBudget:
    """The decoded pixels one request may hold over all its images and video frames."""

    def __init__(self, limits: MediaLimits) -> None:
        self.limit = limits.max_pixels_per_request
        self.used = 0

    def take(self, images: list[Image.Image], what: str) -> None:
        self.used += sum(im.width * im.height for im in images)
        if self.used > self.limit:
            raise InvalidInputError(f"the request's images and video frames hold {self.used} pixels by {what}, over "
                                    f"the limit of {self.limit} pixels per request (max_pixels_per_request)",
                                    setting="max_pixels_per_request")


def _check_size(width: int, height: int, limits: MediaLimits, what: str) -> None:
    if width <= 0 or height <= 0:
        raise InvalidInputError(f"{what} has zero size ({width}x{height})")
    if width * height > limits.max_image_pixels:
        raise InvalidInputError(
            f"{what} is {width}x{height} = {width * height} pixels, over the limit of "
            f"{limits.max_image_pixels} pixels (max_image_pixels)", setting="max_image_pixels"
        )


def validate_image(image: Image.Image, limits: MediaLimits, what: str = "image") -> Image.Image:
    _check_size(image.width, image.height, limits, what)
    if image.mode not in SUPPORTED_IMAGE_MODES:
        raise InvalidInputError(
            f"{what} has unsupported mode {image.mode!r}; supported: {', '.join(sorted(SUPPORTED_IMAGE_MODES))}"
        )
    return image


def decode_image_bytes(data: bytes, limits: MediaLimits, what: str = "image") -> Image.Image:
    if not data:
        raise InvalidInputError(f"{what} is empty (0 bytes)")
    if len(data) > limits.max_image_bytes:
        raise InvalidInputError(f"{what} is {len(data)} bytes, over the limit of {limits.max_image_bytes} bytes "
                                "(max_image_bytes)", setting="max_image_bytes")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            _check_size(image.width, image.height, limits, what)  # header only: nothing decoded yet
            image.load()
    except InvalidInputError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise InvalidInputError(f"{what} is too large to decode safely: {exc}") from exc
    except Image.UnidentifiedImageError as exc:  # its text names the in-memory file object: of no use to a client
        raise InvalidInputError(f"{what} could not be decoded (not an image in a format Pillow reads)") from exc
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise InvalidInputError(f"{what} could not be decoded (corrupt, truncated or not an image): {exc}") from exc
    return as_loaded_by_transformers(validate_image(image, limits, what), what)


def as_loaded_by_transformers(image: Image.Image, what: str = "image") -> Image.Image:
    """What transformers' `load_image` makes of a decoded file: upright by its EXIF orientation, then RGB
    by `convert("RGB")` (an alpha channel is dropped, not blended)."""
    try:
        upright = ImageOps.exif_transpose(image)
        return upright if upright.mode == "RGB" else upright.convert("RGB")
    except (OSError, SyntaxError, ValueError, EOFError) as exc:  # a corrupt EXIF block, a failed conversion
        raise InvalidInputError(f"{what} could not be decoded (corrupt EXIF data or colour mode): {exc}") from exc


def image_from_array(array: np.ndarray, limits: MediaLimits, what: str = "image") -> Image.Image:
    """A channels-last uint8 array (H, W), (H, W, 1), (H, W, 3) or (H, W, 4) as a PIL image; four channels are
    composited onto white as transformers' `convert_to_rgb` does for an array (float64, then rounded)."""
    if array.dtype != np.uint8:
        raise InvalidInputError(f"{what} array must be uint8, got {array.dtype}")
    if array.ndim == 3 and array.shape[2] == 1:
        array = array[:, :, 0]
    if array.ndim not in (2, 3) or (array.ndim == 3 and array.shape[2] not in (3, 4)):
        raise InvalidInputError(f"{what} array must be (H, W), (H, W, 1), (H, W, 3) or (H, W, 4); got {array.shape}")
    _check_size(array.shape[1], array.shape[0], limits, what)
    if array.ndim == 3 and array.shape[2] == 4:
        alpha = array[..., 3:4] / 255
        array = np.round(alpha * array[..., :3] + (1 - alpha) * 255).astype(np.uint8)
    return Image.fromarray(np.ascontiguousarray(array))


def decode_data_uri(uri: str, what: str = "image") -> bytes:
    header, sep, payload = uri.partition(",")
    if not sep or not header.startswith("data:"):
        raise InvalidInputError(f"{what} data URI is malformed (expected 'data:<mime>;base64,<data>')")
    if not header.endswith(";base64"):
        raise InvalidInputError(f"{what} data URI must be base64-encoded")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidInputError(f"{what} data URI has invalid base64: {exc}") from exc


_URL_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")  # a URL, not a path: only file:// is read here


def read_local_file(path_or_url: str, limits: MediaLimits, what: str = "image", max_bytes: int | None = None,
                    setting: str = "max_image_bytes") -> bytes:
    """Read a local path or file:// URL, only inside `limits.allowed_local_media_path`, of at most `max_bytes`
    (default: `limits.max_image_bytes`; `setting` names the limit)."""
    scheme = _URL_SCHEME.match(path_or_url)
    if scheme and scheme.group(1).lower() != "file":
        raise InvalidInputError(f"{what}: URL scheme {scheme.group(1)!r} is not supported (http(s), data: or a "
                                "local file)")
    raw = path_or_url[len("file://"):] if path_or_url.startswith("file://") else path_or_url
    if limits.allowed_local_media_path is None:
        raise InvalidInputError(f"{what}: local files are not allowed (set allowed_local_media_path)",
                                setting="allowed_local_media_path")
    root = Path(limits.allowed_local_media_path).resolve()
    path = Path(raw).resolve()
    if not path.is_relative_to(root):
        raise InvalidInputError(f"{what}: path {raw!r} is outside the allowed media directory "
                                "(allowed_local_media_path)", setting="allowed_local_media_path")
    if not path.is_file():
        raise InvalidInputError(f"{what}: no such file {raw!r}")
    size, cap = path.stat().st_size, limits.max_image_bytes if max_bytes is None else max_bytes
    if size > cap:
        raise InvalidInputError(f"{what} is {size} bytes, over the limit of {cap} bytes ({setting})",
                                setting=setting)
    return path.read_bytes()


def load_image(source: Any, limits: MediaLimits | None = None, what: str = "image") -> Image.Image:
    """Any supported image source -> validated PIL image (not yet converted to RGB)."""
    limits = limits or MediaLimits()
    if isinstance(source, Image.Image):
        return validate_image(source, limits, what)
    if isinstance(source, np.ndarray):
        return image_from_array(source, limits, what)
    if isinstance(source, (bytes, bytearray, memoryview)):
        return decode_image_bytes(bytes(source), limits, what)
    if isinstance(source, str):
        if source.startswith("data:"):
            return decode_image_bytes(decode_data_uri(source, what), limits, what)
        if source.startswith(("http://", "https://")):
            raise InvalidInputError(f"{what}: http(s) URLs are fetched only by the server")
        return decode_image_bytes(read_local_file(source, limits, what), limits, what)
    raise InvalidInputError(
        f"{what} has unsupported type {type(source).__name__}; "
        "expected a PIL image, a uint8 numpy array, bytes, a data URI or a local path"
    )


@dataclass(frozen=True)
class VideoFrames:
    """A video given as its frames, with the rate they were sampled at (None: the request's
    `fps` in mm_processor_kwargs, else the family's default)."""

    frames: Sequence[Any]
    fps: float | None = None


def _video_source(source: Any, what: str) -> tuple[Any, float | None]:
    """Unwrap `VideoFrames` or a `{"frames" | "urls": [...], "fps": x}` dict (a `video_frames` part)."""
    if isinstance(source, VideoFrames):
        source, fps = source.frames, source.fps
    elif isinstance(source, dict):
        unknown = sorted(set(source) - {"frames", "urls", "fps"})
        frames = source.get("frames", source.get("urls"))
        if unknown or frames is None or ("frames" in source and "urls" in source):
            raise InvalidInputError(f"{what}: a frame list is {{'frames' or 'urls': [...], 'fps': <number>}}"
                                    + (f"; unknown keys {unknown}" if unknown else ""))
        source, fps = frames, source.get("fps")
    else:
        return source, None
    return source, None if fps is None else check_fps(fps, f"{what}: fps")


def load_video(source: Any, limits: MediaLimits | None = None,
               what: str = "video") -> tuple[list[Image.Image], float | None]:
    """A video given as frames — a list of image sources, a (F, H, W, C) uint8 array, `VideoFrames`
    or a `{"frames" | "urls": [...], "fps": x}` dict — as (frames, the fps it states or None)."""
    limits = limits or MediaLimits()
    source, fps = _video_source(source, what)
    if isinstance(source, np.ndarray):
        if source.ndim != 4:
            raise InvalidInputError(f"{what} array must be (frames, H, W, C); got {source.shape}")
        source = list(source)
    if not isinstance(source, (list, tuple)):
        raise InvalidInputError(f"{what} must be a list of frames or a (frames, H, W, C) array, "
                                f"got {type(source).__name__}")
    if not source:
        raise InvalidInputError(f"{what} has no frames")
    if len(source) > limits.max_video_frames:
        raise InvalidInputError(f"{what} has {len(source)} frames, over the limit of {limits.max_video_frames} "
                                "(max_video_frames)", setting="max_video_frames")
    frames = [load_image(f, limits, f"{what} frame {i}") for i, f in enumerate(source)]
    sizes = {f.size for f in frames}
    if len(sizes) > 1:
        raise InvalidInputError(f"{what} frames differ in size: {sorted(sizes)}")
    return frames, fps
