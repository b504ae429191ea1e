"""MediaRefs: media kept by uuid, named later by the uuid alone; bounded, least recently used given up first,
and a uuid it does not hold refused naming the uuid (never sent, or evicted)."""

from __future__ import annotations

import pytest
from PIL import Image

from mmserve.errors import InvalidInputError
from mmserve.inputs.media import MediaLimits
from mmserve.inputs.media_refs import MediaRefs

LIMITS = MediaLimits()
IMAGE_BYTES = 10 * 10 * 3


def _img(color: int) -> Image.Image:
    return Image.new("RGB", (10, 10), (color, 0, 0))


def test_media_sent_with_a_uuid_is_named_by_the_uuid_alone():
    refs = MediaRefs(10 * IMAGE_BYTES)
    sent = refs.image(_img(1), "a", LIMITS, "p")
    assert refs.image(None, "a", LIMITS, "q") is sent and refs.used_bytes == IMAGE_BYTES
    newer = refs.image(_img(2), "a", LIMITS, "p")  # the same uuid again: the newer media replace the older
    assert refs.image(None, "a", LIMITS, "q") is newer and refs.used_bytes == IMAGE_BYTES
    frames, fps = refs.video({"frames": [_img(3), _img(4)], "fps": 3}, "a", LIMITS, "v")
    assert refs.video(None, "a", LIMITS, "w") == (frames, 3.0)  # modalities apart
    assert refs.image(_img(5), None, LIMITS, "p").getpixel((0, 0)) == (5, 0, 0)  # no uuid: nothing kept
    assert refs.used_bytes == 3 * IMAGE_BYTES


def test_unknown_and_evicted_uuids_are_refused_naming_them():
    refs = MediaRefs(2 * IMAGE_BYTES)
    with pytest.raises(InvalidInputError, match="'nope'.*never sent") as caught:
        refs.image(None, "nope", LIMITS, "messages[0].content[0].image_url")
    assert caught.value.param == "messages[0].content[0].image_url"
    refs.image(_img(1), "a", LIMITS, "p")
    refs.image(_img(2), "b", LIMITS, "p")
    refs.image(None, "a", LIMITS, "q")  # a is now the most recently used
    refs.image(_img(3), "c", LIMITS, "p")  # evicts b
    assert refs.used_bytes == 2 * IMAGE_BYTES
    with pytest.raises(InvalidInputError, match="'b'.*evicted") as caught:
        refs.image(None, "b", LIMITS, "q")
    assert caught.value.setting == "media_uuid_cache_bytes"
    assert refs.image(None, "a", LIMITS, "q").getpixel((0, 0)) == (1, 0, 0)
    with pytest.raises(InvalidInputError, match="missing"):
        refs.image(None, None, LIMITS, "q")


def test_media_larger_than_the_store_is_not_kept():
    refs = MediaRefs(IMAGE_BYTES - 1)
    refs.image(_img(1), "a", LIMITS, "p")
    assert refs.used_bytes == 0
    with pytest.raises(InvalidInputError, match="'a'.*evicted"):
        refs.image(None, "a", LIMITS, "q")
