"""Deterministic generator of the synthetic shapes task: images, questions, exact answers, pixel labels.

Role: the single definition of the demo task, used by the trainer, the eval and the tests. A sample
is fully determined by (seed, index): `make_sample(seed, index)` draws from its own
`random.Random` keyed by both, so any sample can be rebuilt alone and streams never overlap.

Seed ranges: the eval and the tests use seeds below `TRAIN_SEED_BASE`; the trainer only draws from
seeds at or above it, so held-out conversations are never trained on.

What it does not know: tokenizers, models, the engine.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

KINDS = ("circle", "square", "triangle")
COLORS = {
    "red": (220, 20, 20),
    "green": (20, 160, 20),
    "blue": (20, 40, 220),
    "yellow": (230, 200, 20),
    "purple": (140, 40, 180),
    "orange": (240, 120, 10),
}
COLOR_NAMES = tuple(COLORS)
BACKGROUND = (255, 255, 255)
MIN_SIDE_PX, MAX_SIDE_PX = 56, 168  # image width and height
QUESTION_TYPES = ("count", "color", "shape", "yesno", "describe", "compare")
NUMBER_WORDS = ("one", "two", "three")
TRAIN_SEED_BASE = 1_000_000  # trainer seeds are >= this; eval/test seeds are below it
NUM_LABELS = 1 + len(KINDS) * len(COLORS)  # label 0 = background, else 1 + kind * 6 + colour


@dataclass(frozen=True)
class Shape:
    kind: str
    color: str
    x0: int  # top-left corner of the square bounding box, px
    y0: int
    side: int  # bounding-box side, px

    @property
    def center(self) -> tuple[float, float]:
        return self.x0 + self.side / 2, self.y0 + self.side / 2

    @property
    def label(self) -> int:
        """Class id in the label maps: 1 + kind index * 6 + colour index."""
        return 1 + KINDS.index(self.kind) * len(COLORS) + COLOR_NAMES.index(self.color)

    @property
    def phrase(self) -> str:
        article = "an" if self.color[0] in "aeiou" else "a"
        return f"{article} {self.color} {self.kind}"


@dataclass(frozen=True)
class Scene:
    width: int
    height: int
    shapes: tuple[Shape, ...]

    def render(self) -> Image.Image:
        image = Image.new("RGB", (self.width, self.height), BACKGROUND)
        draw = ImageDraw.Draw(image)
        for shape in self.shapes:
            _draw(draw, shape, COLORS[shape.color])
        return image

    def pixel_labels(self) -> np.ndarray:
        """(height, width) uint8: the label of the shape covering each pixel, 0 for background.

        Drawn with the same calls as `render`, so labels and pixels agree exactly."""
        image = Image.new("L", (self.width, self.height), 0)
        draw = ImageDraw.Draw(image)
        for shape in self.shapes:
            _draw(draw, shape, shape.label)
        return np.asarray(image, dtype=np.uint8)

    def left_to_right(self) -> list[Shape]:
        return sorted(self.shapes, key=lambda s: s.center[0])

    def description(self) -> str:
        return ", ".join(s.phrase for s in self.left_to_right())


@dataclass(frozen=True)
class Sample:
    scenes: tuple[Scene, ...]
    images: tuple[Image.Image, ...]
    question: str
    answer: str
    question_type: str  # one of QUESTION_TYPES

    @property
    def messages(self) -> list[dict[str, Any]]:
        """One user turn, OpenAI format: the image(s) first, then the question."""
        parts: list[dict[str, Any]] = [{"type": "image_pil", "image_pil": img} for img in self.images]
        parts.append({"type": "text", "text": self.question})
        return [{"role": "user", "content": parts}]


def _draw(draw: ImageDraw.ImageDraw, shape: Shape, fill: Any) -> None:
    x0, y0 = shape.x0, shape.y0
    x1, y1 = x0 + shape.side - 1, y0 + shape.side - 1  # PIL boxes are inclusive
    if shape.kind == "circle":
        draw.ellipse((x0, y0, x1, y1), fill=fill)
    elif shape.kind == "square":
        draw.rectangle((x0, y0, x1, y1), fill=fill)
    else:  # base on the bottom edge, apex at the top centre
        draw.polygon([(x0, y1), (x1, y1), ((x0 + x1) / 2, y0)], fill=fill)


def side_range(width: int, height: int) -> tuple[int, int]:
    """Allowed integer box sides: [0.3, 0.45] x min(width, height), at least 16 px."""
    m = min(width, height)
    return max(16, math.ceil(0.3 * m)), math.floor(0.45 * m)


def min_center_gap(width: int) -> float:
    return max(8.0, 0.1 * width)


def boxes_overlap(a: Shape, b: Shape) -> bool:
    """True when the boxes share any pixel (boxes cover [x0, x0 + side) x [y0, y0 + side))."""
    return a.x0 < b.x0 + b.side and b.x0 < a.x0 + a.side and a.y0 < b.y0 + b.side and b.y0 < a.y0 + a.side


def _place(rng: random.Random, width: int, height: int, identities: list[tuple[str, str]]) -> Scene | None:
    lo, hi = side_range(width, height)
    gap = min_center_gap(width)
    shapes: list[Shape] = []
    for kind, color in identities:
        for _ in range(50):
            side = rng.randint(lo, hi)
            cand = Shape(kind, color, rng.randint(0, width - side), rng.randint(0, height - side), side)
            if all(not boxes_overlap(cand, s) and abs(cand.center[0] - s.center[0]) >= gap for s in shapes):
                shapes.append(cand)
                break
        else:
            return None
    return Scene(width, height, tuple(shapes))


def random_scene(rng: random.Random, num_shapes: int | None = None) -> Scene:
    """A scene obeying every layout rule; sizes and layouts that cannot fit are redrawn."""
    count = num_shapes or rng.randint(1, 3)
    while True:
        width, height = rng.randint(MIN_SIDE_PX, MAX_SIDE_PX), rng.randint(MIN_SIDE_PX, MAX_SIDE_PX)
        combos = [(k, c) for k in KINDS for c in COLOR_NAMES]
        identities = rng.sample(combos, count)  # unique kind+colour within the scene
        for _ in range(20):
            scene = _place(rng, width, height, identities)
            if scene is not None:
                return scene


def _unique(scene: Scene, attr: str) -> list[str]:
    values = [getattr(s, attr) for s in scene.shapes]
    return sorted(v for v in set(values) if values.count(v) == 1)


def _yesno(rng: random.Random, scene: Scene) -> tuple[str, str]:
    present = {(s.kind, s.color) for s in scene.shapes}
    if rng.random() < 0.5:
        kind, color = rng.choice(sorted(present))
        return f"Is there a {color} {kind}?", "yes"
    base = rng.choice(scene.shapes)
    # Mostly near misses (right colour or right kind) so the answer needs both attributes.
    roll = rng.random()
    absent = [(k, c) for k in KINDS for c in COLOR_NAMES if (k, c) not in present]
    if roll < 0.35:
        absent_near = [(k, base.color) for k in KINDS if (k, base.color) not in present]
    elif roll < 0.7:
        absent_near = [(base.kind, c) for c in COLOR_NAMES if (base.kind, c) not in present]
    else:
        absent_near = absent
    kind, color = rng.choice(absent_near or absent)
    return f"Is there a {color} {kind}?", "no"


def _single(rng: random.Random, qtype: str) -> tuple[Scene, str, str]:
    while True:
        scene = random_scene(rng)
        if qtype == "count":
            return scene, "How many shapes are there?", NUMBER_WORDS[len(scene.shapes) - 1]
        if qtype == "describe":
            return scene, "Describe the image.", scene.description()
        if qtype == "yesno":
            return (scene, *_yesno(rng, scene))
        attr = "kind" if qtype == "color" else "color"
        choices = _unique(scene, attr)
        if not choices:
            continue  # no shape is alone in its kind (colour): draw another scene
        value = rng.choice(choices)
        shape = next(s for s in scene.shapes if getattr(s, attr) == value)
        if qtype == "color":
            return scene, f"What color is the {value}?", shape.color
        return scene, f"What shape is the {value} one?", shape.kind


def make_sample(seed: int, index: int, question_type: str | None = None) -> Sample:
    """Sample `index` of stream `seed`. Question types cycle through QUESTION_TYPES by index unless given."""
    qtype = question_type or QUESTION_TYPES[index % len(QUESTION_TYPES)]
    if qtype not in QUESTION_TYPES:
        raise ValueError(f"unknown question type {qtype!r}; expected one of {QUESTION_TYPES}")
    rng = random.Random(f"shapes:{seed}:{index}")
    if qtype == "compare":
        first, second = random_scene(rng), random_scene(rng)
        a, b = len(first.shapes), len(second.shapes)
        answer = "the first" if a > b else "the second" if b > a else "neither"
        scenes = (first, second)
        question = "Which image has more shapes?"
    else:
        scene, question, answer = _single(rng, qtype)
        scenes = (scene,)
    return Sample(scenes, tuple(s.render() for s in scenes), question, answer, qtype)


def make_samples(seed: int, count: int, start: int = 0) -> list[Sample]:
    return [make_sample(seed, i) for i in range(start, start + count)]
