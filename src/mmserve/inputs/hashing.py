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


def _blob(tag: int, payload: bytes) -> bytes:
    return bytes([tag]) + _u32(len(payload)) + payload


def _int_bytes(value: int) -> bytes:
    length = (value.bit_length() + 8) // 8  # room for the sign bit
    return value.to_bytes(length, "big", signed=True)


def _array(arr: np.ndarray, dtype_name: str | None = None) -> bytes:
    arr = np.ascontiguousarray(arr)
    if arr.dtype.byteorder == ">" or (arr.dtype.byteorder == "=" and not np.little_endian):
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    name = (dtype_name or arr.dtype.str.lstrip("<>|=")).encode()
    meta = _u32(len(name)) + name + _u32(arr.ndim) + b"".join(struct.pack(">Q", d) for d in arr.shape)
    return bytes([_ARRAY]) + meta + _u32(arr.nbytes) + arr.view(np.uint8).tobytes()


def _torch_array(value: Any) -> bytes:
    import torch  # only when a tensor is actually passed

    t = value.detach().to("cpu").contiguous()
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: hash its bits under its own name
        return _array(t.view(torch.int16).numpy(), "bfloat16")
    return _array(t.numpy())


def _image(img: Image.Image) -> bytes:
    mode = img.mode.encode()
    palette = img.getpalette() if img.mode in ("P", "PA") else None
    meta = _u32(len(mode)) + mode + _u32(img.width) + _u32(img.height)
    meta += _blob(_BYTES, bytes(palette) if palette else b"")
    pixels = img.tobytes()
    return bytes([_IMAGE]) + meta + _u32(len(pixels)) + pixels


def serialize_item(value: Any) -> bytes:
    """Canonical bytes of `value` (None, bool, int, float, str, bytes, list, tuple, dict, PIL image,
    numpy array, torch tensor); anything else is a TypeError."""
    if value is None:
        return bytes([_NONE])
    if isinstance(value, bool):  # before int: bool is an int subclass
        return bytes([_BOOL, int(value)])
    if isinstance(value, (int, np.integer)) and not isinstance(value, np.bool_):
        return _blob(_INT, _int_bytes(int(value)))
    if isinstance(value, (float, np.floating)):
        return bytes([_FLOAT]) + struct.pack(">d", float(value))
    if isinstance(value, str):
        return _blob(_STR, value.encode("utf-8"))
    if isinstance(value, (bytes, bytearray, memoryview)):
        return _blob(_BYTES, bytes(value))
    if isinstance(value, (list, tuple)):
        tag = _LIST if isinstance(value, list) else _TUPLE
        return bytes([tag]) + _u32(len(value)) + b"".join(serialize_item(v) for v in value)
    if isinstance(value, dict):
        pairs = sorted((serialize_item(k), serialize_item(v)) for k, v in value.items())
        return bytes([_DICT]) + _u32(len(pairs)) + b"".join(k + v for k, v in pairs)
    if isinstance(value, Image.Image):
        return _image(value)
    if isinstance(value, np.ndarray):
        return _array(value)
    if type(value).__module__ == "torch" and type(value).__name__ in ("Tensor", "Parameter"):
        return _torch_array(value)
    raise TypeError(f"cannot hash a value of type {type(value).__name__}")


def hash_item(value: Any) -> str:
    """Hex blake3 digest of the domain tag plus the canonical serialization."""
    h = blake3.blake3(HASH_DOMAIN)
    h.update(serialize_item(value))
    return h.hexdigest()


def digest_bytes(data: bytes) -> str:
    """Hex blake3 digest of raw source bytes (e.g. a video file), domain-tagged."""
    h = blake3.blake3(HASH_DOMAIN + b".bytes")
    h.update(data)
    return h.hexdigest()
