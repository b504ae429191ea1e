"""Media referenced by uuid alone once seen (vLLM's `multi_modal_uuids` / a content part's `uuid`).

Role: `MediaRefs`, a bounded store of decoded media by (modality, uuid). An item that comes with its
media and a uuid is loaded and kept here under the uuid (newer media under the same uuid replace the
older: a growing video stream keeps its latest frames); an item that comes with the uuid and no media
(None) is the media kept under it. The store holds at most `capacity_bytes` of decoded pixels, the
least recently used given up first (an audio clip counts its float32 samples: 4 bytes each, at the model's
rate); a uuid it never held, or no longer holds, is an `InvalidInputError`
naming the uuid (which of the two it is, for the latest evictions). Thread-safe: prompts are processed
on worker threads.
What it does not know: content keys, the encoder cache, the engine, HTTP.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import numpy as np
from PIL import Image

from mmserve.errors import InvalidInputError
from mmserve.inputs.audio_sources import load_audio
from mmserve.inputs.media import MediaLimits, load_image, load_video

EVICTED_KEPT = 4096  # evicted uuids remembered, to say "evicted" rather than "never sent"


def _image_bytes(image: Image.Image) -> int:
    return image.width * image.height * max(len(image.getbands()), 1)


class MediaRefs:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._items: OrderedDict[tuple[str, str], tuple[Any, int]] = OrderedDict()
        self._evicted: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._used_bytes = 0
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        return self._used_bytes

    def image(self, source: Any, uuid: str | None, limits: MediaLimits, where: str) -> Image.Image:
        """An image item: `source` loaded (and kept under `uuid`), or, with no source, the one kept under `uuid`."""
        if source is None:
            return self._get("image", uuid, where)
        image = load_image(source, limits, where)
        if uuid is not None:
            self._put(("image", uuid), image, _image_bytes(image))
        return image

    def video(self, source: Any, uuid: str | None, limits: MediaLimits,
              where: str) -> tuple[list[Image.Image], float | None]:
        """A video item as (frames, the fps it states): loaded (and kept under `uuid`), or the one kept."""
        if source is None:
            return self._get("video", uuid, where)
        video = load_video(source, limits, where)
        if uuid is not None:
            self._put(("video", uuid), video, sum(_image_bytes(f) for f in video[0]))
        return video

    def audio(self, source: Any, uuid: str | None, limits: MediaLimits, sampling_rate_hz: int,
              where: str) -> np.ndarray:
        """An audio item as mono float32 samples at `sampling_rate_hz`: loaded (and kept under `uuid`), or the
        one kept."""
        if source is None:
            return self._get("audio", uuid, where)
        samples = load_audio(source, limits, sampling_rate_hz, where)
        if uuid is not None:
            self._put(("audio", uuid), samples, samples.nbytes)
        return samples

    def _get(self, modality: str, uuid: str | None, where: str) -> Any:
        if uuid is None:
            raise InvalidInputError(f"{where}: the {modality} is missing (give its media, or the uuid of media sent "
                                    "before)", param=where)
        key = (modality, uuid)
        with self._lock:
            found = self._items.get(key)
            if found is not None:
                self._items.move_to_end(key)
                return found[0]
            evicted = key in self._evicted
        why = ("was evicted from the store of media by uuid" if evicted else
               f"was never sent with its {modality}")
        raise InvalidInputError(f"{where}: {modality} uuid {uuid!r} is unknown: it {why} (holding "
                                f"{self.capacity_bytes} bytes, media_uuid_cache_bytes); send the {modality} again "
                                "with its uuid", param=where, setting="media_uuid_cache_bytes" if evicted else None)

    def _put(self, key: tuple[str, str], media: Any, size_bytes: int) -> None:
        if size_bytes > self.capacity_bytes:  # never held: a later reference by uuid alone says it was evicted
            with self._lock:
                self._drop(key)
                self._remember_evicted(key)
            return
        with self._lock:
            self._drop(key)
            self._items[key] = (media, size_bytes)
            self._used_bytes += size_bytes
            self._evicted.pop(key, None)
            while self._used_bytes > self.capacity_bytes:
                old_key, (_, old_bytes) = self._items.popitem(last=False)
                self._used_bytes -= old_bytes
                self._remember_evicted(old_key)

    def _drop(self, key: tuple[str, str]) -> None:
        old = self._items.pop(key, None)
        if old is not None:
            self._used_bytes -= old[1]

    def _remember_evicted(self, key: tuple[str, str]) -> None:
        self._evicted[key] = None
        while len(self._evicted) > EVICTED_KEPT:
            self._evicted.popitem(last=False)
