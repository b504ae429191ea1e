"""Properties of the canonical item hash (docs/architecture.md §4, invariant 3)."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from PIL import Image

from mmserve.inputs.hashing import hash_item, serialize_item

scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text() | st.binary()
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner)
                      | st.dictionaries(st.text(max_size=5), inner, max_size=4), max_leaves=12)
arrays = hnp.arrays(dtype=st.sampled_from([np.uint8, np.int32, np.float32, np.float64]),
                    shape=hnp.array_shapes(min_dims=1, max_dims=3, max_side=5))


@given(values)
def test_equal_content_equal_bytes(value):
    import copy

    assert serialize_item(value) == serialize_item(copy.deepcopy(value))


@given(st.dictionaries(st.text(max_size=6), scalars, min_size=2, max_size=6))
def test_dict_key_order_never_matters(d):
    reordered = dict(reversed(list(d.items())))
    assert hash_item(d) == hash_item(reordered)


@given(st.lists(scalars, min_size=1, max_size=5))
def test_list_and_tuple_are_different(items):
    assert hash_item(items) != hash_item(tuple(items))


@settings(max_examples=50)
@given(arrays)
def test_numpy_and_torch_of_same_content_are_equal(arr):
    assert hash_item(arr) == hash_item(torch.from_numpy(arr.copy()))
    assert hash_item(arr) == hash_item(np.asfortranarray(arr))  # memory layout is not identity


@settings(max_examples=50)
@given(hnp.arrays(np.uint8, hnp.array_shapes(min_dims=2, max_dims=2, min_side=2, max_side=6)))
def test_reshaped_array_differs(arr):
    assert hash_item(arr) != hash_item(arr.reshape(-1))
    assert hash_item(arr) != hash_item(arr.astype(np.int16))  # changed dtype


def test_transposed_image_differs():
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 255, (6, 9, 3), dtype=np.uint8)
    img = Image.fromarray(pixels)
    assert hash_item(img) == hash_item(Image.fromarray(pixels.copy()))
    assert hash_item(img) != hash_item(img.transpose(Image.Transpose.TRANSPOSE))
    assert hash_item(img) != hash_item(img.convert("RGBA"))
    square = Image.fromarray(rng.integers(0, 255, (5, 5, 3), dtype=np.uint8))
    assert hash_item(square) != hash_item(square.transpose(Image.Transpose.TRANSPOSE))


def test_scalar_types_do_not_collide():
    distinct = [None, False, 0, 0.0, "", b"", [], (), {}, 1, True, "1", b"1", [0], (0,), {"": 0}]
    assert len({hash_item(v) for v in distinct}) == len(distinct)


def test_bfloat16_tensor_hashes_by_bits():
    t = torch.tensor([1.0, 2.5], dtype=torch.bfloat16)
    assert hash_item(t) == hash_item(t.clone()) != hash_item(t.float())


def test_unsupported_type():
    with pytest.raises(TypeError, match="cannot hash a value of type object"):
        serialize_item(object())


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L", "1", "P", "I;16", "F", "CMYK"])
def test_image_payload_is_exactly_its_pixel_bytes(mode):
    """The serialization ends with the image's `tobytes()`, length-prefixed, whatever the mode and
    however many pieces the pixels are streamed in (the 2000x1500 RGB image takes several)."""
    rng = np.random.default_rng(0)
    for height, width in ((7, 5), (1500, 2000)):
        if mode == "I;16":
            img = Image.fromarray(rng.integers(0, 65535, (height, width), dtype=np.uint16))
        else:
            img = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).convert(mode)
        pixels = img.tobytes()
        data = serialize_item(img)
        assert data.endswith(len(pixels).to_bytes(4, "big") + pixels)
        assert hash_item(img) == hash_item(img.copy())
