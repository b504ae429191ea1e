"""Canonical, versioned content hashing of media items (blake3).

Role: `serialize_item(value)` turns a value into self-describing bytes — every value is a 1-byte
type tag, typed metadata, then a length-prefixed payload; multi-byte integers are big-endian —
so equal content gives equal bytes and different content (or shape, or dtype, or type) gives
different bytes. Digests are blake3 over the domain tag `mmserve.mm.hash.v1` plus the bytes.

Decisions:
- list and tuple are different types and hash differently (a caller that means the same thing
  should pass the same type);
- dict keys are sorted by their serialized bytes, so insertion order never matters;
- numpy arrays and torch tensors are normalised to a contiguous little-endian numpy array: the
  container does not change the identity, shape and dtype do (bfloat16 keeps its own dtype name);
- a PIL image hashes its mode, size, palette (P modes) and pixel bytes.

What it does not know: models, caches, where the value came from.
"""

from __future__ import annotations

import struct
from typing import Any

import blake3
import numpy as np
from PIL import Image

HASH_DOMAIN = b"mmserve.mm.hash.v1"

_NONE, _BOOL, _INT, _FLOAT, _STR, _BYTES, _LIST, _TUPLE, _DICT, _IMAGE, _ARRAY = range(11)


def _u32(n: int) -> bytes:
    return struct.pack(">I", n)


def _int_bytes(value: int) -> bytes:
    length = (value.bit_length() + 8) // 8  # room for the sign bit
    return value.to_bytes(length, "big", signed=True)


def _write_blob(tag: int, payload: bytes, out: list) -> None:
    out.append(bytes([tag]) + _u32(len(payload)))
    out.append(payload)


def _write_array(arr: np.ndarray, out: list, dtype_name: str | None = None) -> None:
    arr = np.ascontiguousarray(arr)
    if arr.dtype.byteorder == ">" or (arr.dtype.byteorder == "=" and not np.little_endian):
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    name = (dtype_name or arr.dtype.str.lstrip("<>|=")).encode()
    meta = _u32(len(name)) + name + _u32(arr.ndim) + b"".join(struct.pack(">Q", d) for d in arr.shape)
    out.append(bytes([_ARRAY]) + meta + _u32(arr.nbytes))
    out.append(memoryview(arr.reshape(-1).view(np.uint8)))  # no copy: the hasher reads the buffer


def _write_torch(value: Any, out: list) -> None:
    import torch  # only when a tensor is actually passed

    t = value.detach().to("cpu").contiguous()
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: hash its bits under its own name
        _write_array(t.view(torch.int16).numpy(), out, "bfloat16")
    else:
        _write_array(t.numpy(), out)


_PIXEL_CHUNK_BYTES = 1 << 20


def _pixel_chunks(img: Image.Image) -> list[bytes]:
    """The bytes of `img.tobytes()` as ~1 MiB pieces, from the same raw encoder tobytes runs, without
    joining them: a multi-megabyte join costs a copy plus fresh pages, ~10% of hashing a 1280x720 image."""
    encoder_factory = getattr(Image, "_getencoder", None)
    img.load()
    if encoder_factory is None or img.width == 0 or img.height == 0:
        return [img.tobytes()]
    encoder = encoder_factory(img.mode, "raw", img.mode)
    chunks = []
    try:
        encoder.setimage(img.im, (0, 0, *img.size))
        while True:
            _, status, data = encoder.encode(max(_PIXEL_CHUNK_BYTES, img.width * 4))
            chunks.append(data)
            if status:
                break
    finally:
        encoder.cleanup()
    if status < 0:
        return [img.tobytes()]  # let Pillow raise its own error
    return chunks


def _write_image(img: Image.Image, out: list) -> None:
    mode = img.mode.encode()
    palette = img.getpalette() if img.mode in ("P", "PA") else None
    pixels = _pixel_chunks(img)
    palette_bytes = bytes(palette) if palette else b""
    out.append(bytes([_IMAGE]) + _u32(len(mode)) + mode + _u32(img.width) + _u32(img.height)
               + bytes([_BYTES]) + _u32(len(palette_bytes)) + palette_bytes + _u32(sum(map(len, pixels))))
    out.extend(pixels)


def _write(value: Any, out: list) -> None:
    """Append the canonical serialization of `value` to `out` as pieces (bytes or buffers), so large
    payloads are never concatenated: hashing feeds the pieces to blake3 one by one."""
    if value is None:
        out.append(bytes([_NONE]))
    elif isinstance(value, bool):  # before int: bool is an int subclass
        out.append(bytes([_BOOL, int(value)]))
    elif isinstance(value, (int, np.integer)) and not isinstance(value, np.bool_):
        _write_blob(_INT, _int_bytes(int(value)), out)
    elif isinstance(value, (float, np.floating)):
        out.append(bytes([_FLOAT]) + struct.pack(">d", float(value)))
    elif isinstance(value, str):
        _write_blob(_STR, value.encode("utf-8"), out)
    elif isinstance(value, (bytes, bytearray, memoryview)):
        _write_blob(_BYTES, bytes(value), out)
    elif isinstance(value, (list, tuple)):
        out.append(bytes([_LIST if isinstance(value, list) else _TUPLE]) + _u32(len(value)))
        for v in value:
            _write(v, out)
    elif isinstance(value, dict):
        # keys are distinct, and so are their serializations: sorting by the key bytes is total
        keyed = sorted(((serialize_item(k), v) for k, v in value.items()), key=lambda kv: kv[0])
        out.append(bytes([_DICT]) + _u32(len(value)))
        for key_bytes, v in keyed:
            out.append(key_bytes)
            _write(v, out)
    elif isinstance(value, Image.Image):
        _write_image(value, out)
    elif isinstance(value, np.ndarray):
        _write_array(value, out)
    elif type(value).__module__ == "torch" and type(value).__name__ in ("Tensor", "Parameter"):
        _write_torch(value, out)
    else:
        raise TypeError(f"cannot hash a value of type {type(value).__name__}")


def serialize_item(value: Any) -> bytes:
    """Canonical bytes of `value` (None, bool, int, float, str, bytes, list, tuple, dict, PIL image,
    numpy array, torch tensor); anything else is a TypeError."""
    out: list = []
    _write(value, out)
    return b"".join(out)


def hash_item(value: Any) -> str:
    """Hex blake3 digest of the domain tag plus the canonical serialization (streamed, no joined copy)."""
    out: list = []
    _write(value, out)
    h = blake3.blake3(HASH_DOMAIN)
    for piece in out:
        h.update(piece)
    return h.hexdigest()

