import pytest
import torch
import torch.nn.functional as F

from mmserve.models.vision.segment_attention import SegmentPlan, segment_attention


@pytest.mark.parametrize("segments", [[16], [8, 8, 8], [12, 10, 4, 9, 4, 4, 30], [5, 6, 5, 6], [1, 2, 3]])
def test_bucketed_segments_equal_one_call_per_segment(segments):
    torch.manual_seed(0)
    n = sum(segments)
    q, k, v = (torch.randn(n, 2, 8) for _ in range(3))
    got = segment_attention(q, k, v, SegmentPlan(segments, torch.device("cpu")))
    start, expected = 0, []
    for length in segments:
        sl = slice(start, start + length)
        out = F.scaled_dot_product_attention(q[sl].transpose(0, 1), k[sl].transpose(0, 1), v[sl].transpose(0, 1))
        expected.append(out.transpose(0, 1).reshape(length, -1))
        start += length
    assert torch.allclose(got, torch.cat(expected), atol=1e-6)
