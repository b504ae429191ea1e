"""The runner's per-request state, and what the engine sends it with each step.

Role: `RunnerPrompt` is what the runner needs of a prompt to compute it (positions, the embed mask and
cumsum, the items' content keys and rows, stop tokens, bidirectional spans; no pixels: those come as
`EncodeJob`s); `StepInputs` is what the engine sends with a step besides the scheduler's output;
`RunnerRequest` is a request as the runner holds it between steps (its tokens, blocks and progress);
`PromptLogprobRows` are a step's batch rows that give a request's prompt logprobs.
Shared by the model runner, which keeps them, and the batch builder, which reads them.

What it does not know: scheduling, the model, devices.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from mmserve.inputs.items import CrossAttentionSpan, PromptPositions
from mmserve.runner.encoder.runner import EncodeJob
from mmserve.runner.fusion import MultimodalRuntimeData
from mmserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from mmserve.models.layers.cross_attention import CrossKV
    from mmserve.runner.sampling_state import RequestSampling


@dataclass(frozen=True)
class RunnerPrompt:
    """What the runner needs of a prompt to compute it (no pixels: those come as `EncodeJob`s)."""

    positions: PromptPositions
    embed_mask: np.ndarray | None  # (num_prompt_tokens,) bool
    embed_cumsum: np.ndarray | None  # (num_prompt_tokens,) int64
    item_keys: tuple[str, ...]  # content key of each item, in item order
    item_rows: tuple[int, ...]
    # banned while min_tokens is not reached: the stop ids and every EOS id (also under ignore_eos)
    stop_token_ids: tuple[int, ...]
    attention_spans: tuple[tuple[int, int], ...] = ()  # [start, end) runs of tokens attending bidirectionally
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()  # SamplingParams.bad_words, tokenized
    # a family that cross-attends: each item's span (items in order; all or none of them cross-attend)
    cross_spans: tuple[CrossAttentionSpan, ...] = ()


@dataclass
class StepInputs:
    """What the engine sends with a step besides the scheduler's output: each new (or resumed)
    request's prompt, and the payloads of the items to encode, keyed by content key."""

    prompts: dict[str, RunnerPrompt] = field(default_factory=dict)
    encoder_jobs: list[EncodeJob] = field(default_factory=list)
    # request id -> its grammar's packed bitmask for the token it samples this step ((words,) int32, CPU)
    token_bitmasks: dict[str, Any] = field(default_factory=dict)


@dataclass
class RunnerRequest:
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    prompt: RunnerPrompt
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    mm: MultimodalRuntimeData | None = None
    sampling: RequestSampling | None = None  # device-side sampling state, for requests whose options need it
    cross: CrossKV | None = None  # its cross-attention K/V, built at its first chunk (again after a preemption)
    state_slot: int | None = None  # a hybrid model's recurrent-state slot
    pooled: Any = None  # a pooling runner's partial vector (runner/pooler.py): MEAN's sum, CLS's first row
    draft_computed: int = 0  # a draft model's: tokens whose KV its cache holds (runner/draft_model.py)
    draft_fed: tuple[int, ...] = ()  # drafts it was fed after them, valid once verification keeps them
    # its sliding layers' blocks where they are a pool of their own (core/window_kv.py): entry i is logical
    # block i, as in block_ids; entries the window has left are stale (never written, outside every window)
    window_block_ids: list[int] = field(default_factory=list)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return self.prompt.stop_token_ids

    def position_columns(self, start: int, end: int) -> np.ndarray:
        """(num_position_rows, end - start) positions of tokens [start, end)."""
        return self.prompt.positions.columns(start, end, self.num_prompt_tokens)


@dataclass(frozen=True)
class PromptLogprobRows:
    """Rows of the batch whose logits give a request's prompt logprobs: batch rows [offset, offset + num)
    are prompt positions [start, start + num), each predicting the prompt token after it."""

    state: RunnerRequest
    offset: int
    start: int
    num: int
