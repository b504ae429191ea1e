"""Beam search as transformers' `generate(num_beams=W, do_sample=False)` runs it, one step at a time.

Role: `BeamSearch` holds one prompt's search: the live beams (the tokens each would extend), and after each
step, given every live beam's top next-token logprobs, keeps transformers' rules exactly — the top
`K = max(2, 1 + number of EOS ids) * W` candidates by summed logprob; of those, the ones among the first W
that end (an EOS id, or max_tokens) become hypotheses scored `sum / generated_tokens ** length_penalty`
(merged into the W best kept so far); the best W that do not end live on; the search stops when no live
beam can beat the worst hypothesis (`early_stopping` False or "never": transformers' heuristic), when W
hypotheses are found (True), or when every candidate ended. Scores are float32 and the -1e9 masks are
transformers', so near-ties break the same way. `beam_prompt` makes a beam's prompt: the original
processed prompt (its media items, masks and positions as they are) with the beam's tokens appended as
text, so its prefix (and the items' encoder outputs) come from the caches. `step_params`: what each beam's
one-token request asks for.
What it does not know: the engine, requests, asyncio, text.

Where vLLM differs (we follow transformers): vLLM keeps 2W candidates whatever the EOS ids; counts the
prompt in the length a score is divided by (and not the EOS); files every EOS candidate as a hypothesis
(not only the top W's); has no early stopping (it runs max_tokens steps) and ranks unfinished beams with
the finished ones at the end.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mmserve.errors import InvalidInputError
from mmserve.inputs.items import ProcessedPrompt, PromptPositions
from mmserve.outputs import Logprob
from mmserve.sampling_params import MAX_LOGPROBS, BeamSearchParams, SamplingParams

_MASK = np.float32(-1.0e9)  # transformers' "impossible" score


@dataclass(frozen=True)
class Hypothesis:
    """A beam or an ended hypothesis: its generated tokens, their steps' logprob entries, its scores."""

    token_ids: tuple[int, ...]
    entries: tuple[dict[int, Logprob], ...]
    cumulative: np.float32  # the summed logprobs (a beam's running score, masks included)
    score: np.float32  # a hypothesis' length-penalized score (a beam: its running score)
    finished: bool = False  # a hypothesis that ended (not a placeholder slot)


def num_candidates(beam_width: int, num_eos: int) -> int:
    """transformers' top-K per step: enough that W candidates survive even if every EOS id is among them."""
    return max(2, 1 + num_eos) * beam_width


class BeamSearch:
    def __init__(self, params: BeamSearchParams, eos_token_ids: Sequence[int], width_param: str = "beam_width") -> None:
        self.params = params
        self.eos = frozenset(()) if params.ignore_eos else frozenset(eos_token_ids)
        self.width = params.beam_width
        self.num_candidates = num_candidates(self.width, len(self.eos))
        if self.num_candidates > MAX_LOGPROBS:
            raise InvalidInputError(
                f"beam width {self.width} needs the top {self.num_candidates} tokens of each beam (max(2, 1 + "
                f"{len(self.eos)} EOS ids) x the width), more than the {MAX_LOGPROBS} an engine step reports: "
                f"use a beam width of at most {MAX_LOGPROBS // max(2, 1 + len(self.eos))}", param=width_param)
        zero = np.float32(0.0)
        # transformers starts with W copies of the prompt, all but the first masked: only the first counts
        self.beams = [Hypothesis((), (), zero, zero)]
        self.slots = [Hypothesis((), (), _MASK, _MASK)] * self.width  # the W best hypotheses, best first
        self.num_generated = 0
        self.improvable = True  # transformers' is_early_stop_heuristic_unsatisfied (sticky once False)
        self.done = False

    def _candidates(self, entries: Sequence[dict[int, Logprob]]) -> list[tuple[np.float32, int, int]]:
        """The top K (summed logprob, beam, token), best first (ties: lower beam, then vocabulary order)."""
        found = []
        for b, (beam, entry) in enumerate(zip(self.beams, entries, strict=True)):
            for token, lp in entry.items():
                found.append((np.float32(beam.cumulative + np.float32(lp.logprob)), b, token))
        found.sort(key=lambda c: (-c[0], c[1], c[2]))
        return found[:self.num_candidates]

    def advance(self, entries: Sequence[dict[int, Logprob]]) -> None:
        """One step: `entries[b]` holds live beam b's top next tokens (at least K) with their logprobs."""
        assert not self.done
        top = self._candidates(entries)
        ends = [token in self.eos or self.num_generated + 1 >= self.params.max_tokens for _, _, token in top]
        extended = [Hypothesis(self.beams[b].token_ids + (token,), self.beams[b].entries + (entries[b],), acc, acc)
                    for acc, b, token in top]
        # the next live beams: the best W that do not end (an ended one only fills in, masked)
        alive = sorted(range(len(top)), key=lambda i: -(extended[i].cumulative + (_MASK if ends[i] else 0)))
        self.beams = [dataclasses.replace(extended[i], cumulative=np.float32(extended[i].cumulative
                                                                             + (_MASK if ends[i] else 0)))
                      for i in alive[:self.width]]
        self._file_hypotheses(extended, ends)
        self.num_generated += 1
        self._check_stop(ends)

    def _file_hypotheses(self, extended: list[Hypothesis], ends: list[bool]) -> None:
        """transformers' _update_finished_beams: only the top W candidates may end; each is scored and
        merged into the W best hypotheses unless the search cannot take it any more."""
        divisor = (self.num_generated + 1) ** self.params.length_penalty
        full = all(s.finished for s in self.slots) and self.params.early_stopping is True
        merged = list(self.slots)
        for i, candidate in enumerate(extended):
            qualifies = ends[i] and i < self.width
            score = np.float32(candidate.cumulative / np.float32(divisor))
            score = np.float32(score + (_MASK if full else 0) + (_MASK if not self.improvable else 0)
                               + (0 if qualifies else _MASK))
            merged.append(dataclasses.replace(candidate, score=score, finished=qualifies))
        order = sorted(range(len(merged)), key=lambda i: -merged[i].score)  # stable: kept slots win ties
        self.slots = [merged[i] for i in order[:self.width]]

    def _check_stop(self, ends: list[bool]) -> None:
        """transformers' _check_early_stop_heuristic and _beam_search_has_unfinished_sequences."""
        params = self.params
        if params.early_stopping == "never" and params.length_penalty > 0:
            best_length = params.max_tokens
        else:
            best_length = self.num_generated
        best_running = np.float32(self.beams[0].cumulative / np.float32(best_length ** params.length_penalty))
        worst = min(s.score for s in self.slots)
        worst_finished = [worst if s.finished else _MASK for s in self.slots]
        self.improvable = self.improvable and any(best_running > w for w in worst_finished)
        all_found = all(s.finished for s in self.slots) and params.early_stopping is True
        self.done = not self.improvable or all_found or all(ends)

    def best(self) -> list[Hypothesis]:
        """The W best hypotheses, best first (after `done`)."""
        return list(self.slots)

    def finish_reason(self, hypothesis: Hypothesis) -> tuple[str, int | None]:
        last = hypothesis.token_ids[-1] if hypothesis.token_ids else None
        return ("stop", last) if last in self.eos else ("length", None)


def beam_prompt(prompt: ProcessedPrompt, token_ids: Sequence[int]) -> ProcessedPrompt:
    """The prompt a beam extends: the original's tokens, items, masks and positions, then the beam's tokens
    as text (positions past the prompt as a generated token's: index + decode delta)."""
    if not token_ids:
        return prompt
    extra = len(token_ids)
    ids = list(prompt.prompt_token_ids) + list(token_ids)

    def grown(mask: np.ndarray | None, fill: bool | int) -> np.ndarray | None:
        return None if mask is None else np.concatenate([mask, np.full(extra, fill, dtype=mask.dtype)])

    cumsum = prompt.embed_cumsum
    last_count = int(cumsum[-1]) if cumsum is not None and len(cumsum) else 0
    positions = prompt.positions
    if positions.table is not None:
        after = np.arange(prompt.num_tokens, len(ids), dtype=np.int64) + positions.decode_delta
        table = np.concatenate([positions.table, np.broadcast_to(after, (positions.num_rows, extra))], axis=1)
        positions = PromptPositions(positions.num_rows, table, positions.decode_delta)
    return dataclasses.replace(prompt, prompt_token_ids=ids, mm_mask=grown(prompt.mm_mask, False),
                               embed_mask=grown(prompt.embed_mask, False), embed_cumsum=grown(cumsum, last_count),
                               positions=positions)


def step_params(search: BeamSearch, num_logprobs: int) -> SamplingParams:
    """Each beam's request: one greedy token (never kept) and the top logprobs the search and the caller need."""
    return SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                          logprobs=max(search.num_candidates, num_logprobs))
