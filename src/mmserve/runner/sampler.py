"""Batched token sampling from one step's logits.

Role: turn a (batch, vocab) logits tensor plus per-row options into one token id per row, as one
pipeline of whole-batch tensor ops, in vLLM's order: allowed-token masks (the seam where a grammar's
per-row mask applies too), banned tokens, logit biases, penalties (repetition, then frequency and
presence), then greedy argmax or temperature, top-k, top-p, min-p and the random draw. Each stage is
skipped when no row needs it, so rows that ask for nothing pay nothing; the only Python loop over rows
draws the one uniform number of each seeded row from its own generator, so a seeded request's tokens do
not depend on which other requests share its batch or their order. Rows that ask for logprobs get them from the
raw logits (log-softmax in float32, before any stage), or from the processed ones the caller asks `sample` to
keep (vLLM's logprobs_mode).
What it does not know: requests, SamplingParams, tokenizers, why a token is banned (the caller
bans eos and stop ids while min_tokens is not reached, and bad words' last tokens), where penalty
counts come from (the runner keeps them per request).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import numpy as np
import torch

from mmserve.sampling_params import GREEDY_TEMPERATURE_EPS

_SEED_MODULUS = 2**64  # torch.Generator.manual_seed takes a 64-bit value; wrap any Python int into it


@dataclass
class PenaltyBatch:
    """The penalties of the rows that have any, as columns: `rows` index the batch; `output_counts` are
    each row's generated-token counts and `seen` its prompt-or-output tokens, (len(rows), vocab) each."""

    rows: torch.Tensor  # (P,) int64
    output_counts: torch.Tensor  # (P, vocab) float32
    seen: torch.Tensor  # (P, vocab) bool
    presence: torch.Tensor  # (P, 1) float32
    frequency: torch.Tensor  # (P, 1)
    repetition: torch.Tensor  # (P, 1)


@dataclass
class SamplingMetadata:
    """Per-row sampling options of one step, built on the CPU; every list has one entry per row."""

    temperatures: list[float]
    top_ks: list[int]  # 0 or -1: disabled
    top_ps: list[float]  # 1.0: disabled
    min_ps: list[float]  # 0.0: disabled
    generators: list[torch.Generator | None]  # a per-request seeded generator, or None (global RNG)
    banned_token_ids: list[tuple[int, ...]]  # tokens this row must not produce this step
    # (row, (vocab,) bool): the only tokens that row may produce (allowed_token_ids)
    allowed_masks: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    # grammars' masks: the constrained rows and their packed bitmasks, (len(rows), ceil(vocab / 32)) int32
    # on the logits' device, bit j % 32 of word j // 32 set = token j allowed
    token_bitmask: tuple[list[int], torch.Tensor] | None = None
    logit_bias: list[tuple[int, dict[int, float]]] = field(default_factory=list)  # (row, token id -> bias)
    penalties: PenaltyBatch | None = None
    num_logprobs: list[int | None] | None = None  # per row: top logprobs wanted (None: none); None: no row

    def __post_init__(self) -> None:
        num_rows = len(self.temperatures)
        lengths = {len(self.top_ks), len(self.top_ps), len(self.min_ps), len(self.generators),
                   len(self.banned_token_ids)}
        if self.num_logprobs is not None:
            lengths.add(len(self.num_logprobs))
        if lengths != {num_rows}:
            raise ValueError("SamplingMetadata lists must all have one entry per row")

    @property
    def num_rows(self) -> int:
        return len(self.temperatures)

    def is_greedy(self, row: int) -> bool:
        return self.temperatures[row] < GREEDY_TEMPERATURE_EPS or self.top_ks[row] == 1

    @property
    def processes_logits(self) -> bool:
        """Does any stage before sampling change a logit?"""
        return bool(self.allowed_masks or self.token_bitmask is not None or self.logit_bias
                    or self.penalties is not None or any(self.banned_token_ids))


@dataclass
class SampledLogprobs:
    """The logprobs of the rows that asked for them (`rows`, batch indices), on the logits' device:
    the sampled token's logprob and rank, and the top `k` (the most any row asked for) ids and logprobs."""

    rows: list[int]
    logprobs: torch.Tensor  # (R,) float32
    top_ids: torch.Tensor  # (R, max(k, 1)) int64
    top_logprobs: torch.Tensor  # (R, max(k, 1)) float32
    distribution: torch.Tensor  # (R, vocab) float32 log-probabilities, for the ranks the top k cannot tell

    def ranks(self) -> list[int]:
        """Each row's sampled-token rank as vLLM counts it: 1 + the tokens strictly more likely. A token
        at least as likely as the row's k-th best has every more likely token among the top k, so only
        the other rows (a token sampled from the tail) count over the vocabulary (host values: the
        caller has synced on the step's tokens already)."""
        sampled = self.logprobs.unsqueeze(1)  # (R, 1)
        ranks = (self.top_logprobs > sampled).sum(dim=-1).add_(1).tolist()
        within = (sampled.squeeze(1) >= self.top_logprobs[:, -1]).tolist()
        tail = [i for i, inside in enumerate(within) if not inside]
        if tail:
            index = to_device(tail, self.distribution.device)
            counted = (self.distribution.index_select(0, index) > sampled.index_select(0, index)).sum(dim=-1)
            for i, rank in zip(tail, counted.add_(1).tolist()):
                ranks[i] = rank
        return ranks


# vocabularies at least this big take the blocked argmax below
_BLOCKED_ARGMAX_MIN_VOCAB = 4096
_ARGMAX_BLOCK = 256
# tokens per block of the two-level cumulative sum that draws a sampled row's token
_DRAW_BLOCK = 256


def to_device(values: list, device: torch.device) -> torch.Tensor:
    """A small host-built tensor on `device`: from pinned memory with non_blocking on CUDA, because
    `torch.tensor(values, device=cuda)` copies synchronously (a host sync in the step loop)."""
    host = torch.tensor(values)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(-1)` of a (batch, vocab) tensor, the same index (the first maximum; a NaN counts as
    the maximum, as argmax has it), found faster on the CPU: ATen's argmax walks a row one element at a
    time, while a max over fixed blocks vectorises. The block holding the
    first maximum is the first block whose maximum is the row's; the index is found inside it."""
    batch, vocab = logits.shape
    if vocab < _BLOCKED_ARGMAX_MIN_VOCAB or logits.device.type != "cpu":
        return logits.argmax(dim=-1)
    num_blocks = -(-vocab // _ARGMAX_BLOCK)
    if num_blocks * _ARGMAX_BLOCK != vocab:
        logits = torch.nn.functional.pad(logits, (0, num_blocks * _ARGMAX_BLOCK - vocab), value=float("-inf"))
    blocks = logits.reshape(batch, num_blocks, _ARGMAX_BLOCK)
    best_block = blocks.amax(dim=-1).argmax(dim=-1)  # (batch,)
    inner = blocks[torch.arange(batch, device=logits.device), best_block].argmax(dim=-1)
    return best_block * _ARGMAX_BLOCK + inner


def blocked_topk(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of `values.topk(k, dim=-1)` of a (rows, vocab) tensor, found faster on the CPU:
    every one of a row's k largest lies in one of the k blocks with the largest maxima (a block outside
    them has k larger elements, one in each of those blocks, so none of its elements is among the k), so
    ATen's top k runs over those blocks' k * 256 elements (and the last, partial block's) after a
    vectorised max per block."""
    rows, vocab = values.shape
    num_blocks = vocab // _ARGMAX_BLOCK
    if vocab < _BLOCKED_ARGMAX_MIN_VOCAB or values.device.type != "cpu" or 4 * k > num_blocks:
        return values.topk(k, dim=-1)
    whole = num_blocks * _ARGMAX_BLOCK
    blocks = values[:, :whole].reshape(rows, num_blocks, _ARGMAX_BLOCK)  # a view: no copy
    best_blocks = blocks.amax(dim=-1).topk(k, dim=-1).indices  # (rows, k)
    picked = blocks.gather(1, best_blocks.unsqueeze(-1).expand(rows, k, _ARGMAX_BLOCK)).reshape(rows, -1)
    offsets = torch.arange(_ARGMAX_BLOCK, device=values.device)
    candidates = (best_blocks.unsqueeze(-1) * _ARGMAX_BLOCK + offsets).reshape(rows, -1)
    if whole < vocab:
        picked = torch.cat([picked, values[:, whole:]], dim=1)
        tail = torch.arange(whole, vocab, device=values.device).expand(rows, -1)
        candidates = torch.cat([candidates, tail], dim=1)
    top = picked.topk(k, dim=-1)
    return top.values, candidates.gather(1, top.indices)


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """A generator on `device` seeded with `seed`, or None for an unseeded request."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed % _SEED_MODULUS)
    return generator


class Sampler:
    """Stateless: `sampler(logits, meta)` returns the (batch,) int64 token ids on logits' device
    (`sampled_logprobs` gives the rows' logprobs from the same logits)."""

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        return self.sample(logits, meta)[0]

    def sample(self, logits: torch.Tensor, meta: SamplingMetadata,
               keep_processed: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The rows' tokens and, with `keep_processed`, the float32 logits they were drawn from (vLLM's
        processed logits: after every stage, -inf where a mask, top-k, top-p or min-p dropped a token; a
        greedy row's before temperature, which does not change its argmax)."""
        if logits.dim() != 2 or logits.shape[0] != meta.num_rows:
            raise ValueError(f"logits must be (batch={meta.num_rows}, vocab), got {tuple(logits.shape)}")
        greedy_rows = [meta.is_greedy(row) for row in range(meta.num_rows)]
        if all(greedy_rows) and not meta.processes_logits:
            # the common case: nothing to mask, no copy (float32 is exact for bf16)
            return greedy_argmax(logits), logits if keep_processed else None
        processed = processed_logits(logits, meta)
        return self._choose(processed, meta, greedy_rows, keep_processed), processed if keep_processed else None

    def _choose(self, logits: torch.Tensor, meta: SamplingMetadata, greedy_rows: list[bool],
                keep_processed: bool) -> torch.Tensor:
        if not any(greedy_rows):
            return self._sample(logits, meta, greedy_rows, keep_processed)
        greedy_ids = greedy_argmax(logits)  # (batch,); before _sample, which scales logits in place
        if all(greedy_rows):
            return greedy_ids
        sampled_ids = self._sample(logits, meta, greedy_rows, keep_processed)
        greedy_mask = to_device(greedy_rows, logits.device)
        return torch.where(greedy_mask, greedy_ids, sampled_ids)

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata, greedy_rows: list[bool],
                keep_processed: bool) -> torch.Tensor:
        device, vocab_size = logits.device, logits.shape[1]
        # Greedy rows ride along with neutral options; their result is discarded by the caller.
        temperatures = [1.0 if g else t for g, t in zip(greedy_rows, meta.temperatures)]
        top_ks = [vocab_size if g or not 0 < k < vocab_size else k for g, k in zip(greedy_rows, meta.top_ks)]
        # Disabled top-p is 2.0, not 1.0: a float32 cumsum can reach 1.0 before the last token.
        top_ps = [2.0 if g or p >= 1.0 else p for g, p in zip(greedy_rows, meta.top_ps)]
        min_ps = [0.0 if g else p for g, p in zip(greedy_rows, meta.min_ps)]

        logits.div_(to_device(temperatures, device).unsqueeze(1))
        if any(k < vocab_size for k in top_ks):
            apply_top_k(logits, top_ks)
        if any(p < 1.0 for p in top_ps):
            apply_top_p(logits, to_device(top_ps, device))
        probs = logits.softmax(dim=-1)  # (batch, vocab)
        if any(p > 0.0 for p in min_ps):
            dropped = apply_min_p(probs, to_device(min_ps, device))
            if keep_processed:
                logits.masked_fill_(dropped, -torch.inf)
        return _inverse_cdf_draw(probs, _uniforms(meta.generators, greedy_rows, device))


def sampled_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: list[int | None] | None,
                     normalize: bool = True) -> SampledLogprobs | None:
    """The logprobs of the rows that asked: log-softmax of `logits` (the model's, for the raw distribution)
    in float32; with `normalize` false, the float32 logits themselves (vLLM's *_logits modes)."""
    rows = [] if num_logprobs is None else [row for row, k in enumerate(num_logprobs) if k is not None]
    if not rows:
        return None
    index = None if len(rows) == logits.shape[0] else to_device(rows, logits.device)
    picked = logits if index is None else logits.index_select(0, index)
    logprobs = picked.to(torch.float32)  # (R, vocab)
    logprobs = logprobs.log_softmax(dim=-1) if normalize else logprobs
    sampled = token_ids if index is None else token_ids.index_select(0, index)
    sampled_logprobs = logprobs.gather(1, sampled.unsqueeze(1))  # (R, 1)
    # at least the best token, which ranks most sampled tokens without a pass over the vocabulary
    top_values, top_ids = blocked_topk(logprobs, max(max(num_logprobs[row] for row in rows), 1))
    return SampledLogprobs(rows, sampled_logprobs.squeeze(1), top_ids, top_values, logprobs)


def _apply_allowed_masks(logits: torch.Tensor, masks: list[tuple[int, torch.Tensor]]) -> None:
    if not masks:
        return
    rows = to_device([row for row, _ in masks], logits.device)
    allowed = torch.stack([mask for _, mask in masks])  # (A, vocab) bool
    logits[rows] = logits[rows].masked_fill_(~allowed, -torch.inf)


def processed_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The rows' logits after every stage before temperature: allowed-token masks, grammars, bans, logit
    bias, penalties (float32, a copy)."""
    # a copy: the stages below write in place and must not touch the caller's tensor (nor the raw logits the
    # logprobs are taken from)
    logits = logits.to(torch.float32, memory_format=torch.contiguous_format, copy=True)  # (batch, vocab)
    _apply_allowed_masks(logits, meta.allowed_masks)
    if meta.token_bitmask is not None:
        apply_token_bitmask(logits, *meta.token_bitmask)
    _ban_tokens(logits, meta.banned_token_ids)
    _apply_logit_bias(logits, meta.logit_bias)
    if meta.penalties is not None:
        _apply_penalties(logits, meta.penalties)
    return logits


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """-inf for the tokens the rows' grammars do not allow (tokens past the bitmask's words too)."""
    vocab_size = logits.shape[1]
    if logits.device.type == "cpu" and sys.byteorder == "little" and bitmask.shape[1] * 32 >= vocab_size:
        # numpy's C unpacking of the inverted words' bytes (bit j of a little-endian word is byte j // 8's
        # bit j % 8): the banned tokens in one pass, several times faster than shifting int32 words in torch
        packed = np.invert(bitmask.contiguous().numpy().view(np.uint8))
        banned = torch.from_numpy(np.unpackbits(packed, axis=1, count=vocab_size, bitorder="little")).view(torch.bool)
    else:
        shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
        allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)  # (R, words * 32)
        if allowed.shape[1] < vocab_size:
            allowed = torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]), value=False)
        banned = ~allowed[:, :vocab_size]
    banned = banned.to(logits.device, non_blocking=True)
    if rows == list(range(logits.shape[0])):
        logits.masked_fill_(banned, -torch.inf)
        return
    index = to_device(rows, logits.device)
    logits[index] = logits[index].masked_fill_(banned, -torch.inf)


def _apply_logit_bias(logits: torch.Tensor, biases: list[tuple[int, dict[int, float]]]) -> None:
    if not biases:
        return
    vocab_size = logits.shape[1]
    triples = [(row, token_id, bias) for row, row_biases in biases for token_id, bias in row_biases.items()
               if token_id < vocab_size]
    if not triples:
        return
    rows = to_device([t[0] for t in triples], logits.device)
    ids = to_device([t[1] for t in triples], logits.device)
    logits.index_put_((rows, ids), to_device([t[2] for t in triples], logits.device).to(logits.dtype),
                      accumulate=True)


def _apply_penalties(logits: torch.Tensor, p: PenaltyBatch) -> None:
    """transformers' and vLLM's repetition penalty over prompt and output tokens, then OpenAI's
    frequency and presence penalties over output tokens."""
    rows = logits.index_select(0, p.rows)  # (P, vocab)
    penalised = torch.where(rows > 0, rows / p.repetition, rows * p.repetition)
    rows = torch.where(p.seen, penalised, rows)
    rows -= p.frequency * p.output_counts + p.presence * (p.output_counts > 0)
    logits.index_copy_(0, p.rows, rows)


def _ban_tokens(logits: torch.Tensor, banned_token_ids: list[tuple[int, ...]]) -> None:
    vocab_size = logits.shape[1]
    # The engine refuses ids outside the vocabulary; dropping any here still avoids an index error, or a
    # device-side assert on CUDA, for a caller that did not check.
    pairs = [(row, token_id) for row, ids in enumerate(banned_token_ids) for token_id in ids
             if 0 <= token_id < vocab_size]
    if not pairs:
        return
    index = to_device(pairs, logits.device)  # (num_banned, 2): row, token id
    logits[index[:, 0], index[:, 1]] = -torch.inf


def apply_top_k(logits: torch.Tensor, top_ks: list[int]) -> None:
    """Keep each row's k highest logits (ties with the k-th are kept too)."""
    max_k = max(top_ks)
    top_values = logits.topk(max_k, dim=-1).values  # (batch, max_k), descending
    kth_index = to_device(top_ks, logits.device).sub_(1).unsqueeze(1)  # (batch, 1)
    threshold = top_values.gather(1, kth_index)  # (batch, 1)
    logits.masked_fill_(logits < threshold, -torch.inf)


def apply_top_p(logits: torch.Tensor, top_ps: torch.Tensor) -> None:
    """Keep the smallest highest-probability set whose cumulative probability reaches top_p."""
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)  # (batch, vocab) each
    sorted_probs = sorted_logits.softmax(dim=-1)
    # A token is dropped when the tokens ranked above it already reach top_p; the first token is always
    # kept (its exclusive sum is 0, which a top_p below float32's range, 1e-300, also rounds to)
    mass_above = sorted_probs.cumsum(dim=-1).sub_(sorted_probs)
    drop_sorted = mass_above >= top_ps.unsqueeze(1)
    drop_sorted[:, 0] = False
    drop = torch.empty_like(drop_sorted).scatter_(1, sorted_ids, drop_sorted)
    logits.masked_fill_(drop, -torch.inf)


def apply_min_p(probs: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """Zero tokens whose probability is below min_p times the row's top probability; returns where."""
    threshold = probs.amax(dim=-1, keepdim=True).mul_(min_ps.unsqueeze(1))  # (batch, 1)
    # No renormalisation needed: the draw below scales its uniform by the row's mass.
    dropped = probs < threshold  # (batch, vocab) bool
    probs.masked_fill_(dropped, 0.0)
    return dropped


def _uniforms(generators: list[torch.Generator | None], greedy_rows: list[bool],
              device: torch.device) -> torch.Tensor:
    """(batch,) float32 uniforms in [0, 1); a seeded row's comes from its own generator, one per step."""
    uniforms = torch.rand(len(generators), device=device)  # global RNG; seeded rows are replaced below
    seeded_rows = [row for row, g in enumerate(generators) if g is not None and not greedy_rows[row]]
    if seeded_rows:
        drawn = torch.cat([torch.rand(1, generator=generators[row], device=device) for row in seeded_rows])
        uniforms.index_copy_(0, to_device(seeded_rows, device), drawn)
    return uniforms


def _inverse_cdf_draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row with probability proportional to `probs` (unnormalised, zeros never drawn):
    the first token whose cumulative mass exceeds uniform x the row's mass. The cumulative sum is taken
    in two levels, over blocks of _DRAW_BLOCK tokens and then inside the one block drawn, so it costs
    about one pass over the vocabulary (a vocab-sized random draw per row costs several) and keeps
    float32 rounding to a block's few hundred additions."""
    batch, vocab = probs.shape
    pad = -vocab % _DRAW_BLOCK
    blocks = (torch.nn.functional.pad(probs, (0, pad)) if pad else probs).view(batch, -1, _DRAW_BLOCK)
    block_mass = blocks.sum(dim=-1)  # (batch, num_blocks)
    block_cdf = block_mass.cumsum(dim=-1)
    total = block_cdf[:, -1:]  # (batch, 1)
    # Strictly below the total, so some block's cumulative mass exceeds it; the first that does has
    # mass > 0 (its cdf is above the target, its predecessor's is not).
    target = torch.minimum(uniforms.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    block = torch.searchsorted(block_cdf, target, right=True)  # (batch, 1)
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp_(min=0)), torch.zeros_like(target))
    rows = torch.arange(batch, device=probs.device)
    inner_cdf = blocks[rows, block.squeeze(1)].cumsum(dim=-1)  # (batch, _DRAW_BLOCK)
    inner_total = inner_cdf[:, -1:]
    # The block's own sum may round differently from block_mass: clamp again, as above.
    inner_target = torch.minimum(target - before, torch.nextafter(inner_total, torch.zeros_like(inner_total)))
    inner = torch.searchsorted(inner_cdf, inner_target, right=True)
    return (block * _DRAW_BLOCK + inner).squeeze(1)
