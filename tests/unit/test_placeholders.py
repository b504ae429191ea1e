import numpy as np
import pytest

from mmserve import InvalidInputError
from mmserve.inputs.placeholders import check_item_rows, compute_masks, embeds_in_range, find_spans


def test_issue_example_special_tokens_inside_span():
    m = compute_masks([1, 5, 5, 6, 5, 7, 2], mm_token_ids=[5], special_token_ids=[6, 7])
    assert m.embed_mask.tolist() == [False, True, True, False, True, False, False]
    assert m.mm_mask.tolist() == [False, True, True, True, True, True, False]
    assert m.embed_cumsum.dtype == np.int64
    assert m.embed_cumsum.tolist() == [0, 1, 2, 2, 3, 3, 3]


def test_in_vocab_placeholder_ids():
    m = compute_masks([1, 9, 9, 2, 8, 3], mm_token_ids=[9, 8])
    assert m.embed_mask.tolist() == [False, True, True, False, True, False]
    assert m.mm_mask.tolist() == m.embed_mask.tolist()
    spans = find_spans(m)
    assert [(s.offset, s.length, s.num_embeds) for s in spans] == [(1, 2, 2), (4, 1, 1)]


def test_out_of_vocab_sentinels_when_no_ids_given():
    m = compute_masks([1, 100, 101, 2, 3], vocab_size=100)
    assert m.embed_mask.tolist() == [False, True, True, False, False]


def test_special_tokens_outside_any_span_are_text():
    m = compute_masks([6, 1, 5, 2, 7], mm_token_ids=[5], special_token_ids=[6, 7])
    assert m.mm_mask.tolist() == [False, False, True, False, False]


def test_embeds_in_range_is_a_cumsum_difference():
    m = compute_masks([1, 5, 5, 6, 5, 7, 2], mm_token_ids=[5], special_token_ids=[6, 7])
    assert embeds_in_range(m.embed_cumsum, 0, 7) == 3
    assert embeds_in_range(m.embed_cumsum, 2, 5) == 2
    assert embeds_in_range(m.embed_cumsum, 3, 3) == 0


def test_count_mismatch_names_both_counts_and_item():
    with pytest.raises(InvalidInputError, match=r"image 1.*4 placeholder positions.*6 embedding rows"):
        check_item_rows("image 1", 4, 6)
    check_item_rows("image 0", 6, 6)
