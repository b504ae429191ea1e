"""The shapes generator obeys every rule of the demo task's spec."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest

from mmserve.demo import shapes

SAMPLES = shapes.make_samples(seed=123, count=600)


def _all_scenes():
    return [scene for s in SAMPLES for scene in s.scenes]


def test_image_size_and_background():
    for sample in SAMPLES:
        for scene, img in zip(sample.scenes, sample.images):
            assert img.mode == "RGB"
            assert img.size == (scene.width, scene.height)
            assert 56 <= scene.width <= 168 and 56 <= scene.height <= 168
            assert img.getpixel((0, 0)) == (255, 255, 255) or any(
                s.x0 == 0 and s.y0 == 0 for s in scene.shapes)


def test_layout_rules():
    for scene in _all_scenes():
        assert 1 <= len(scene.shapes) <= 3
        m = min(scene.width, scene.height)
        for s in scene.shapes:
            assert s.kind in shapes.KINDS and s.color in shapes.COLORS
            assert max(16, 0.3 * m) <= s.side <= 0.45 * m
            assert 0 <= s.x0 and s.x0 + s.side <= scene.width
            assert 0 <= s.y0 and s.y0 + s.side <= scene.height
        for i, a in enumerate(scene.shapes):
            for b in scene.shapes[i + 1:]:
                assert not shapes.boxes_overlap(a, b)
                assert abs(a.center[0] - b.center[0]) >= max(8, 0.1 * scene.width)
                assert (a.kind, a.color) != (b.kind, b.color)


def test_pixels_match_shapes():
    for scene in _all_scenes()[:200]:
        img = np.asarray(scene.render())
        labels = scene.pixel_labels()
        assert labels.shape == img.shape[:2]
        assert (img[labels == 0] == 255).all()
        for s in scene.shapes:
            mask = labels == s.label
            assert mask.any()
            assert (img[mask] == shapes.COLORS[s.color]).all()
            ys, xs = np.nonzero(mask)
            assert xs.min() >= s.x0 and xs.max() < s.x0 + s.side
            assert ys.min() >= s.y0 and ys.max() < s.y0 + s.side
            if s.kind == "square":
                assert mask.sum() == s.side * s.side
            if s.kind == "circle":  # fills its box: touches all four sides
                assert xs.min() == s.x0 and xs.max() == s.x0 + s.side - 1
                assert ys.min() == s.y0 and ys.max() == s.y0 + s.side - 1
            if s.kind == "triangle":  # base on the bottom edge, apex at the top centre
                assert mask[s.y0 + s.side - 1, s.x0:s.x0 + s.side].all()
                top = np.nonzero(mask[s.y0])[0]
                assert len(top) and abs(top.mean() - (s.x0 + (s.side - 1) / 2)) <= 1


def test_question_answer_strings():
    seen = Counter(s.question_type for s in SAMPLES)
    assert set(seen) == set(shapes.QUESTION_TYPES)
    for s in SAMPLES:
        msg = s.messages
        assert len(msg) == 1 and msg[0]["role"] == "user"
        parts = msg[0]["content"]
        assert [p["type"] for p in parts] == ["image_pil"] * len(s.images) + ["text"]
        assert parts[-1]["text"] == s.question
        scene = s.scenes[0]
        kinds = [x.kind for x in scene.shapes]
        colors = [x.color for x in scene.shapes]
        if s.question_type == "count":
            assert s.question == "How many shapes are there?"
            assert s.answer == ["one", "two", "three"][len(scene.shapes) - 1]
        elif s.question_type == "color":
            kind = s.question.removeprefix("What color is the ").removesuffix("?")
            assert kinds.count(kind) == 1
            assert s.answer == colors[kinds.index(kind)]
        elif s.question_type == "shape":
            color = s.question.removeprefix("What shape is the ").removesuffix(" one?")
            assert colors.count(color) == 1
            assert s.answer == kinds[colors.index(color)]
        elif s.question_type == "yesno":
            color, kind = s.question.removeprefix("Is there a ").removesuffix("?").split()
            assert s.answer == ("yes" if (kind, color) in set(zip(kinds, colors)) else "no")
        elif s.question_type == "describe":
            assert s.question == "Describe the image."
            ordered = sorted(scene.shapes, key=lambda x: x.x0 + x.side / 2)
            expected = ", ".join(("an " if x.color == "orange" else "a ") + f"{x.color} {x.kind}" for x in ordered)
            assert s.answer == expected
        else:
            assert len(s.images) == 2 and s.question == "Which image has more shapes?"
            a, b = (len(x.shapes) for x in s.scenes)
            assert s.answer == ("the first" if a > b else "the second" if b > a else "neither")
        if s.question_type != "compare":
            assert len(s.images) == 1


def test_answer_variety():
    answers = Counter((s.question_type, s.answer) for s in SAMPLES)
    assert ("compare", "neither") in answers and ("compare", "the first") in answers
    assert any(a.startswith("an orange") or ", an orange" in a for t, a in answers if t == "describe")
    for word in ("one", "two", "three"):
        assert ("count", word) in answers
    assert ("yesno", "yes") in answers and ("yesno", "no") in answers
    for kind in shapes.KINDS:
        assert ("shape", kind) in answers


def test_phrase_article():
    assert shapes.Shape("circle", "orange", 0, 0, 20).phrase == "an orange circle"
    assert shapes.Shape("square", "red", 0, 0, 20).phrase == "a red square"


def test_deterministic_per_seed():
    a, b = shapes.make_sample(7, 42), shapes.make_sample(7, 42)
    assert (a.question, a.answer, a.scenes) == (b.question, b.answer, b.scenes)
    assert [np.asarray(i).tobytes() for i in a.images] == [np.asarray(i).tobytes() for i in b.images]
    other = [shapes.make_sample(8, i).scenes for i in range(20)]
    assert [shapes.make_sample(7, i).scenes for i in range(20)] != other
    random.seed(999)  # the global RNG has no influence
    assert shapes.make_sample(7, 42).scenes == a.scenes


def test_unknown_question_type():
    with pytest.raises(ValueError):
        shapes.make_sample(0, 0, "size")
