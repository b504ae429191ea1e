import numpy as np

from mmserve.models.qwen2_vl.mrope import VisionSpan, decode_positions, mrope_positions


def test_text_only_positions_are_aranges():
    pos, delta = mrope_positions(5, [], merge=2)
    assert (pos == np.arange(5)).all() and delta == 0


def test_one_image_grid_positions_and_delta():
    # 2 text tokens, an image with a 4x6 patch grid (2x3 merged rows), 1 text token after
    pos, delta = mrope_positions(2 + 6 + 1, [VisionSpan(2, (1, 4, 6))], merge=2)
    assert pos[:, :2].tolist() == [[0, 1]] * 3
    assert pos[0, 2:8].tolist() == [2] * 6
    assert pos[1, 2:8].tolist() == [2, 2, 2, 3, 3, 3]
    assert pos[2, 2:8].tolist() == [2, 3, 4, 2, 3, 4]
    assert pos[:, 8].tolist() == [5, 5, 5]  # text resumes at start + max(h, w) // merge
    assert delta == 6 - 9
    assert decode_positions(9, 2, delta).tolist() == [[6, 7]] * 3


def test_video_time_interval_spaces_temporal_rows():
    pos, _ = mrope_positions(8, [VisionSpan(0, (2, 4, 4), time_interval=3.0)], merge=2)
    assert pos[0].tolist() == [0, 0, 0, 0, 3, 3, 3, 3]
