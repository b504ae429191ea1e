import numpy as np
import pytest
import torch

from mmserve.inputs.placeholders import compute_masks
from mmserve.runner.fusion import MultimodalRuntimeData, gather_chunk_rows

# tokens: 2 text, item 0 (4 rows), 1 text, item 1 (3 rows), 2 text
IDS = [1, 1, 9, 9, 9, 9, 1, 9, 9, 9, 1, 1]


@pytest.fixture
def mm():
    m = compute_masks(IDS, mm_token_ids=[9])
    return MultimodalRuntimeData(m.embed_mask, m.embed_cumsum, [4, 3])


def test_rows_before_is_the_cumsum(mm):
    assert [mm.rows_before(t) for t in (0, 2, 4, 6, 7, 10, 12)] == [0, 0, 2, 4, 4, 7, 7]


@pytest.mark.parametrize("streams", [1, 3])
def test_chunk_inside_one_item_is_a_view_of_every_stream(mm, streams):
    outputs = {0: torch.randn(streams, 4, 8), 1: torch.randn(streams, 3, 8)}
    pieces = mm.plan_chunk(3, 5)
    assert [(p.item_index, p.row_start, p.row_end, p.token_positions.tolist()) for p in pieces] == [(0, 1, 3, [0, 1])]
    (rows,) = gather_chunk_rows(pieces, outputs)
    assert rows.data_ptr() == outputs[0][0, 1].data_ptr()  # no copy
    assert torch.equal(rows, outputs[0][:, 1:3])


def test_chunk_across_items_splits_by_item(mm):
    pieces = mm.plan_chunk(4, 9)
    assert [(p.item_index, p.row_start, p.row_end, p.token_positions.tolist()) for p in pieces] == [
        (0, 2, 4, [0, 1]), (1, 0, 2, [3, 4])]


def test_text_only_chunk_needs_nothing(mm):
    assert mm.plan_chunk(0, 2) == [] and mm.plan_chunk(10, 12) == []
    assert mm.items_needed(0, 12) == {0, 1}


def test_row_count_mismatch_is_refused():
    m = compute_masks(IDS, mm_token_ids=[9])
    with pytest.raises(ValueError, match="items produce 8 rows but the prompt has 7"):
        MultimodalRuntimeData(m.embed_mask, m.embed_cumsum, [4, 4])


def test_every_split_point_covers_every_row_once(mm):
    for cut in range(1, len(IDS)):
        rows = [(p.item_index, r) for s, e in ((0, cut), (cut, len(IDS)))
                for p in mm.plan_chunk(s, e) for r in range(p.row_start, p.row_end)]
        assert rows == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2)]
    assert np.array_equal(mm.item_of_row, [0, 0, 0, 0, 1, 1, 1])


# Mistral 3's layout: per row of patches [IMG]x2 then [IMG_BREAK] (5), the last break is [IMG_END] (6)
SPECIAL_IDS = [1, 9, 9, 5, 9, 9, 5, 9, 9, 6, 1, 1]


def test_special_rows_inside_a_span_take_no_encoder_row():
    m = compute_masks(SPECIAL_IDS, mm_token_ids=[9], special_token_ids=[5, 6])
    assert m.mm_mask[1:10].all() and not m.embed_mask[[3, 6, 9]].any()
    mm = MultimodalRuntimeData(m.embed_mask, m.embed_cumsum, [6])
    outputs = {0: torch.arange(6.0)[None, :, None]}
    for cut in range(1, len(SPECIAL_IDS)):  # ends on an [IMG] row, on a break row, on the end row
        fused = []
        for start, end in ((0, cut), (cut, len(SPECIAL_IDS))):
            pieces = mm.plan_chunk(start, end)
            for rows, piece in zip(gather_chunk_rows(pieces, outputs), pieces):
                fused += [(start + int(t), float(r)) for t, r in zip(piece.token_positions, rows[0, :, 0])]
        # every [IMG] token gets the next encoder row, whatever the split; specials get none
        assert fused == [(1, 0.0), (2, 1.0), (4, 2.0), (5, 3.0), (7, 4.0), (8, 5.0)], cut
