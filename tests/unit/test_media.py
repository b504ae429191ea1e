"""Bad media gets InvalidInputError with a message that says what is wrong."""

import base64
import io

import numpy as np
import pytest
from PIL import Image

from mmserve import InvalidInputError
from mmserve.inputs.media import MediaLimits, load_image, load_video


def _png_bytes(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def test_bad_image_is_an_invalid_input_error_callers_can_catch_as_value_error():
    with pytest.raises(ValueError, match="could not be decoded") as caught:  # vLLM users catch ValueError
        load_image(b"definitely not an image")
    assert isinstance(caught.value, InvalidInputError)


def test_good_sources_load():
    img = Image.new("RGB", (20, 10), (1, 2, 3))
    data = _png_bytes(img)
    uri = "data:image/png;base64," + base64.b64encode(data).decode()
    for source in (img, np.zeros((10, 20, 3), np.uint8), data, uri):
        assert load_image(source).size == (20, 10)


def test_corrupt_bytes():
    with pytest.raises(InvalidInputError, match="could not be decoded"):
        load_image(b"definitely not an image")


def test_truncated_image():
    data = _png_bytes(Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), np.uint8)))
    with pytest.raises(InvalidInputError, match="could not be decoded"):
        load_image(data[: len(data) // 2])


def test_empty_bytes():
    with pytest.raises(InvalidInputError, match="empty"):
        load_image(b"")


def test_zero_sized_image():
    with pytest.raises(InvalidInputError, match="zero size"):
        load_image(Image.new("RGB", (0, 5)))
    with pytest.raises(InvalidInputError, match="zero size"):
        load_image(np.zeros((0, 4, 3), np.uint8))


def test_pixel_cap_checked_before_decoding():
    big = _png_bytes(Image.new("L", (3000, 3000)))  # compresses to a few KB
    with pytest.raises(InvalidInputError, match=r"9000000 pixels, over the limit of 1000000"):
        load_image(big, MediaLimits(max_image_pixels=1_000_000))


def test_byte_cap():
    data = _png_bytes(Image.new("RGB", (50, 50)))
    with pytest.raises(InvalidInputError, match="over the limit of 10 bytes"):
        load_image(data, MediaLimits(max_image_bytes=10))


def test_unsupported_mode():
    """A mode Pillow cannot convert to RGB is refused up front (16-bit, 32-bit and float modes convert, as in
    transformers: clipped to 0..255)."""
    with pytest.raises(InvalidInputError, match="unsupported mode 'La'"):
        load_image(Image.new("La", (8, 8)))
    for mode in ("I", "I;16", "F"):
        assert load_image(Image.new(mode, (8, 8))).mode == mode


def test_unsupported_type():
    with pytest.raises(InvalidInputError, match="unsupported type int"):
        load_image(42)


def test_bad_arrays():
    with pytest.raises(InvalidInputError, match="must be uint8"):
        load_image(np.zeros((4, 4, 3), np.float32))
    with pytest.raises(InvalidInputError, match=r"\(H, W, 3\)"):
        load_image(np.zeros((4, 4, 2), np.uint8))


def test_bad_data_uris():
    with pytest.raises(InvalidInputError, match="invalid base64"):
        load_image("data:image/png;base64,@@@not-base64@@@")
    with pytest.raises(InvalidInputError, match="malformed"):
        load_image("data:image/png;base64")


def test_local_paths_need_an_allowed_root(tmp_path):
    path = tmp_path / "a.png"
    path.write_bytes(_png_bytes(Image.new("RGB", (8, 8))))
    with pytest.raises(InvalidInputError, match="local files are not allowed"):
        load_image(str(path))
    allowed = MediaLimits(allowed_local_media_path=str(tmp_path / "sub"))
    with pytest.raises(InvalidInputError, match="outside the allowed media directory"):
        load_image(str(path), allowed)
    assert load_image("file://" + str(path), MediaLimits(allowed_local_media_path=str(tmp_path))).size == (8, 8)


def test_video_frames_checked():
    with pytest.raises(InvalidInputError, match="no frames"):
        load_video([])
    with pytest.raises(InvalidInputError, match="differ in size"):
        load_video([Image.new("RGB", (8, 8)), Image.new("RGB", (9, 8))])
    with pytest.raises(InvalidInputError, match="3 frames, over the limit of 2"):
        load_video([Image.new("RGB", (8, 8))] * 3, MediaLimits(max_video_frames=2))
    with pytest.raises(InvalidInputError, match="frame 1 could not be decoded"):
        load_video([Image.new("RGB", (8, 8)), b"junk"])
