"""Synthetic multimodal chat workload shared by the benchmarks.

Role: build a fixed-seed list of conversations that look like a vision-language serving load:
1-2 images of mixed sizes per conversation (smooth gradients, a few shapes and noise, so the
pixels are "natural-ish" rather than white noise), a fraction of images that are repeats of
earlier ones (the very same PIL object, so content hashes match), a fraction of conversations
that share one long system prompt (a prefix-cache opportunity), and short varied questions.
Each conversation comes in two spellings: mmserve's (`image_pil` parts) and the one transformers'
chat template takes (`{"type": "image"}` parts, the PIL images passed alongside).

What it does not know: tokenizers, models or engines; it only makes messages and images.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

LONG_SYSTEM_PROMPT = (
    "You are a helpful assistant that looks at pictures and answers questions about them. "
    "Describe the image with care: say what color each shape is, how many shapes there are, "
    "whether a circle, a square or a triangle is red, green, blue or yellow, and which image has "
    "more shapes when there is more than one picture. Answer yes or no when the question is a yes "
    "or no question, then say one short sentence about why. Count with numbers: 0 1 2 3 4 5 6 7 8 9 "
    "10. When the first and the second picture differ, describe the first, then the second, then "
    "answer the question. If neither picture shows the thing asked about, say so. Do not guess: "
    "when you are not sure, say that you are not sure and describe what you do see in the picture. "
    "Keep every answer short, plain and exact, and never invent a shape that is not there."
)

QUESTIONS = (
    "Describe the image.",
    "What color is the circle?",
    "How many shapes are there?",
    "Is there a yellow square?",
    "What is in this picture?",
    "Which shape is the biggest?",
    "Describe the picture in one sentence.",
    "Is the background dark or light?",
    "What colors do you see?",
    "Is there a red triangle? Answer yes or no.",
    "Count the shapes, then name them.",
    "What is at the center of the image?",
)
TWO_IMAGE_QUESTIONS = (
    "Which image has more shapes?",
    "Compare the first and the second picture.",
    "Are the two pictures the same? Answer yes or no.",
    "Describe the first, then the second picture.",
)


@dataclass(frozen=True)
class Conversation:
    """One request: mmserve-style messages, transformers-style messages and the images in order."""

    messages: list[dict[str, Any]]
    reference_messages: list[dict[str, Any]]
    images: tuple[Image.Image, ...]
    shared_prefix: bool


@dataclass(frozen=True)
class Workload:
    conversations: list[Conversation]
    seed: int
    num_distinct_images: int
    num_repeated_images: int

    def summary(self) -> dict[str, Any]:
        convs = self.conversations
        per_request = [len(c.images) for c in convs]
        num_images = sum(per_request)
        sizes = [im.size for c in convs for im in c.images]
        return {
            "num_requests": len(convs),
            "seed": self.seed,
            "images_per_request": {"min": min(per_request), "max": max(per_request),
                                   "mean": round(num_images / len(convs), 3)},
            "num_images": num_images,
            "num_distinct_images": self.num_distinct_images,
            "repeated_image_fraction": round(self.num_repeated_images / max(num_images, 1), 3),
            "image_side_px": {"min": min(min(s) for s in sizes), "max": max(max(s) for s in sizes)},
            "shared_prefix_fraction": round(sum(c.shared_prefix for c in convs) / len(convs), 3),
        }


def synthetic_image(rng: np.random.Generator, width: int, height: int) -> Image.Image:
    """A gradient background, 1-4 filled shapes and mild noise: compressible, image-like pixels."""
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    c0, c1 = rng.uniform(0, 255, 3), rng.uniform(0, 255, 3)
    t = (xx / max(width - 1, 1) * rng.uniform(0.2, 1.0) + yy / max(height - 1, 1) * rng.uniform(0.2, 1.0)) / 2
    background = c0 * (1 - t[..., None]) + c1 * t[..., None]  # (height, width, 3)
    img = Image.fromarray(background.clip(0, 255).astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(1, 5))):
        x0, y0 = int(rng.integers(0, width - 16)), int(rng.integers(0, height - 16))
        x1, y1 = int(rng.integers(x0 + 12, width)), int(rng.integers(y0 + 12, height))
        fill = tuple(int(v) for v in rng.integers(0, 256, 3))
        shape = rng.integers(0, 3)
        if shape == 0:
            draw.rectangle((x0, y0, x1, y1), fill=fill)
        elif shape == 1:
            draw.ellipse((x0, y0, x1, y1), fill=fill)
        else:
            draw.polygon([(x0, y1), ((x0 + x1) // 2, y0), (x1, y1)], fill=fill)
    noise = rng.normal(0, 8, (height, width, 3))
    return Image.fromarray((np.asarray(img, dtype=np.float32) + noise).clip(0, 255).astype(np.uint8), "RGB")


def _image_slots(rng: np.random.Generator, num_requests: int) -> list[int]:
    """Images per conversation: 1 or 2, about 40% with two."""
    return [1 + int(rng.random() < 0.4) for _ in range(num_requests)]


def _pick_images(rng: np.random.Generator, counts: list[int], repeat_fraction: float,
                 min_side: int, max_side: int) -> tuple[list[list[Image.Image]], int, int]:
    """Images per conversation; exactly round(repeat_fraction * total) are earlier images again."""
    total = sum(counts)
    # the first conversation's slots are always new, so every repeat has an earlier image to reuse
    candidates = np.arange(counts[0], total)
    num_repeats = min(round(repeat_fraction * total), candidates.size)
    repeat_slots = set(rng.choice(candidates, size=num_repeats, replace=False).tolist())
    pool: list[Image.Image] = []
    out: list[list[Image.Image]] = []
    slot = 0
    for count in counts:
        images: list[Image.Image] = []
        for _ in range(count):
            earlier = [im for im in pool if all(im is not other for other in images)]
            if slot in repeat_slots and earlier:
                images.append(earlier[int(rng.integers(len(earlier)))])
            else:
                w, h = (int(v) for v in rng.integers(min_side, max_side + 1, 2))
                images.append(synthetic_image(rng, w, h))
                pool.append(images[-1])
            slot += 1
        out.append(images)
    return out, len(pool), total - len(pool)


def _conversation(images: list[Image.Image], question: str, system: str | None,
                  system_with_images: bool = True) -> Conversation:
    """`system_with_images` False (a template that refuses a system message beside images): the system
    text leads the user's message instead."""
    parts: list[dict[str, Any]] = [{"type": "image_pil", "image_pil": im} for im in images]
    parts.append({"type": "text", "text": question})
    shared = system == LONG_SYSTEM_PROMPT
    if system is not None and not system_with_images:
        parts.insert(0, {"type": "text", "text": system})
        system = None
    ref_parts = [{"type": "image"} if p["type"] == "image_pil" else p for p in parts]
    messages = [{"role": "user", "content": parts}]
    reference = [{"role": "user", "content": ref_parts}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
        reference.insert(0, {"role": "system", "content": system})
    return Conversation(messages, reference, tuple(images), shared)


def build_workload(num_requests: int = 64, seed: int = 0, repeat_fraction: float = 0.3,
                   shared_prefix_fraction: float = 0.2, min_side: int = 112, max_side: int = 448,
                   system_with_images: bool = True) -> Workload:
    """The fixed-seed workload: same arguments, same conversations (pixels included). `system_with_images`
    False: the shared system prompt leads the user's message (Llama 3.2 Vision's template refuses a
    system message beside images); the pixels and questions stay the same."""
    if num_requests <= 0:
        raise ValueError(f"num_requests must be positive, got {num_requests}")
    rng = np.random.default_rng(seed)
    counts = _image_slots(rng, num_requests)
    images, num_distinct, num_repeated = _pick_images(rng, counts, repeat_fraction, min_side, max_side)
    num_shared = round(shared_prefix_fraction * num_requests)
    shared = set(rng.choice(num_requests, size=num_shared, replace=False).tolist())
    conversations = []
    for i, imgs in enumerate(images):
        pool = TWO_IMAGE_QUESTIONS if len(imgs) == 2 else QUESTIONS
        question = pool[int(rng.integers(len(pool)))]
        if rng.random() < 0.3:
            question += " Be brief."
        conversations.append(_conversation(imgs, question, LONG_SYSTEM_PROMPT if i in shared else None,
                                           system_with_images))
    return Workload(conversations, seed, num_distinct, num_repeated)
