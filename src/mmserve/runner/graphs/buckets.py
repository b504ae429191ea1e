"""Bucket planning for captured graphs: which static shape a step's work is padded up to.

Role: pure-Python arithmetic shared by the encoder and decode graph runners, unit-tested on the CPU.
- Encoder: a captured vision-tower graph is keyed by `EncoderBucket` (models/layers/encoder_batch.py,
  where the families' graph layouts find it) — the total encoder tokens and,
  per attention kind, the number of contexts (attention segments). Qwen2-VL has one kind (full
  attention within each frame); Qwen2.5-VL has two (full, and window attention), whose context counts
  differ for the same tokens, so the key holds both. `plan_encoder_batch` picks the smallest bucket a
  batch fits and describes its padding: the padded tokens form dummy contexts at the tail, every one
  holding at least one token, because the varlen attention kernel rejects empty contexts — so there is
  always at least one dummy, even when the real tokens fill a bucket exactly (such a batch takes the
  next bucket). No bucket fits: `None`, the batch runs eagerly.
- Decode: batch-size buckets (1, 2, 4, 8, ... up to max_num_seqs); `pad_decode_batch` rounds up.

What it does not know: torch, devices, models, how a graph is captured. A "context" is a run of
tokens that attend to each other; which runs those are is the family's business.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mmserve.models.layers.encoder_batch import EncoderBucket, EncoderPlan

DEFAULT_MIN_ENCODER_BUCKET_TOKENS = 256  # smallest captured encoder bucket; smaller batches pad up to it
CONTEXT_LEVEL_GROWTH = 4  # context capacities per kind: 2, 8, 32, ...: few graphs, at most 4x dummy contexts


def _dummies(pad_tokens: int, num_dummies: int) -> tuple[int, ...] | None:
    """The padding as `num_dummies` contexts of >= 1 token: the first takes the remainder."""
    if num_dummies < 1 or pad_tokens < num_dummies:
        return None
    return (pad_tokens - (num_dummies - 1),) + (1,) * (num_dummies - 1)


def plan_encoder_batch(context_tokens: Sequence[Sequence[int]],
                       buckets: Sequence[EncoderBucket]) -> EncoderPlan | None:
    """The smallest bucket (fewest tokens, then fewest contexts) this batch fits, with its padding.

    `context_tokens[k]` lists the batch's context lengths under attention kind k; every kind covers
    the same tokens. A bucket fits when it has room for the real tokens plus at least one padding
    token, and per kind for the real contexts plus at least one dummy context, with enough padding
    tokens to give every dummy context one. None: no bucket fits (run eagerly)."""
    if not context_tokens or not context_tokens[0]:
        raise ValueError("an encoder batch has at least one context")
    real = sum(context_tokens[0])
    for kind, lengths in enumerate(context_tokens):
        if sum(lengths) != real:
            raise ValueError(f"attention kind {kind} covers {sum(lengths)} tokens; kind 0 covers {real}")
        if min(lengths) < 1:
            raise ValueError(f"attention kind {kind} has an empty context: {list(lengths)}")
    for bucket in sorted(buckets):
        if len(bucket.num_contexts) != len(context_tokens):
            raise ValueError(f"{bucket} has {len(bucket.num_contexts)} attention kinds; the batch has "
                             f"{len(context_tokens)}")
        pad = bucket.total_tokens - real
        padded = []
        for lengths, capacity in zip(context_tokens, bucket.num_contexts):
            dummies = _dummies(pad, capacity - len(lengths))
            if dummies is None:
                break
            padded.append(tuple(lengths) + dummies)
        else:
            return EncoderPlan(bucket, real, tuple(padded), tuple(len(c) for c in context_tokens))
    return None


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _context_levels(cap: int) -> list[int]:
    """2, 8, 32, ... below `cap`, then `cap`."""
    levels, level = [], 2
    while level < cap:
        levels.append(level)
        level *= CONTEXT_LEVEL_GROWTH
    return levels + [cap]


def _scaling_context_levels(cap: int) -> list[int]:
    """`cap`, cap/4, cap/16 (at least 2): for a kind whose context count grows with the tokens (windows), a
    batch far below `cap` contexts also has far fewer tokens and takes a smaller token level."""
    return sorted({max(2, cap // CONTEXT_LEVEL_GROWTH ** i) for i in range(3)})


def default_encoder_buckets(max_tokens_per_step: int, max_items_per_step: int, num_kinds: int,
                            token_multiple: int = 1,
                            min_tokens: int = DEFAULT_MIN_ENCODER_BUCKET_TOKENS) -> tuple[EncoderBucket, ...]:
    """Buckets derived from the encoder budgets: token levels double from `min_tokens` until one holds
    the largest legal step plus a dummy context; per level, kind 0 (one context per item or frame)
    gets capacities 2, 8, 32, ... up to the items budget + 1; any other kind (e.g. windows, each at
    least `token_multiple` tokens) gets the level's tokens / `token_multiple`, and a quarter and a
    sixteenth of that. Totals are
    multiples of `token_multiple` (the family's merge unit). Batches beyond the largest run eagerly."""
    if min(max_tokens_per_step, max_items_per_step, num_kinds, token_multiple, min_tokens) <= 0:
        raise ValueError("encoder bucket defaults need positive budgets")
    top = _round_up(max_tokens_per_step + 1, token_multiple)
    levels, level = [], _round_up(min(min_tokens, top), token_multiple)
    while level < top:
        levels.append(level)
        level = _round_up(level * 2, token_multiple)
    levels.append(top)
    out = []
    for tokens in levels:
        per_kind = [_context_levels(min(max_items_per_step + 1, tokens))]
        per_kind += [_scaling_context_levels(max(2, tokens // token_multiple))] * (num_kinds - 1)
        grids: list[tuple[int, ...]] = [()]
        for levels in per_kind:
            grids = [g + (c,) for g in grids for c in levels]
        out.extend(EncoderBucket(tokens, g) for g in grids)
    return tuple(out)


def parse_encoder_buckets(spec: Sequence[Sequence[int]], num_kinds: int) -> tuple[EncoderBucket, ...]:
    """Buckets from the engine arg `encoder_graph_buckets`: (total_tokens, contexts of kind 0, ...) tuples.
    A tuple with a single context count applies it to every kind."""
    out = []
    for entry in spec:
        values = tuple(int(v) for v in entry)
        if len(values) == 2:
            values = values + (values[1],) * (num_kinds - 1)
        if len(values) != 1 + num_kinds:
            raise ValueError(f"encoder_graph_buckets entry {tuple(entry)}: expected (total_tokens, contexts) or "
                             f"(total_tokens, one context count per attention kind: {num_kinds})")
        out.append(EncoderBucket(values[0], values[1:]))
    return tuple(sorted(set(out)))


def decode_batch_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every 8 up to 32, then every 16, ending at max_num_seqs (vLLM's spacing, roughly):
    padding wastes at most half a tiny batch and a few rows of a large one."""
    if max_num_seqs <= 0:
        raise ValueError(f"max_num_seqs must be positive, got {max_num_seqs}")
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs]
    size = 8
    while size < max_num_seqs:
        sizes.append(size)
        size += 8 if size < 32 else 16
    return tuple(sizes + [max_num_seqs])


def pad_decode_batch(num_decodes: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured batch size >= num_decodes; None: larger than every graph (run eagerly)."""
    if num_decodes <= 0:
        raise ValueError(f"a decode batch has at least one sequence, got {num_decodes}")
    return next((s for s in sorted(sizes) if s >= num_decodes), None)


MIN_DECODE_BLOCK_WIDTH = 4  # KV blocks per sequence of the narrowest decode graph


def decode_block_widths(max_blocks_per_sequence: int) -> tuple[int, ...]:
    """KV-block widths of the decode graphs' block tables: 4, 8, 16, ... then the longest context's
    blocks. A decode batch attends over padded blocks (masked), so the width is part of the key:
    doubling keeps the masked keys under half of those attended."""
    if max_blocks_per_sequence <= 0:
        raise ValueError(f"max_blocks_per_sequence must be positive, got {max_blocks_per_sequence}")
    widths, width = [], MIN_DECODE_BLOCK_WIDTH
    while width < max_blocks_per_sequence:
        widths.append(width)
        width *= 2
    return tuple(widths + [max_blocks_per_sequence])


@dataclass(frozen=True, order=True)
class DecodeBucket:
    """The key of one captured decode graph."""

    batch_size: int  # decodes, real and padding
    num_blocks: int  # block-table width per sequence


def plan_decode_batch(num_blocks_per_sequence: Sequence[int], buckets: Sequence[DecodeBucket]) -> DecodeBucket | None:
    """The smallest bucket holding these decodes (batch, then width); None: run eagerly."""
    batch, width = len(num_blocks_per_sequence), max(num_blocks_per_sequence)
    return next((b for b in sorted(buckets) if b.batch_size >= batch and b.num_blocks >= width), None)
