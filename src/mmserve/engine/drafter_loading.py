"""Speculative decoding's drafter — a draft model or the target's MTP head — loaded and checked at start-up.

Role: `load_drafter(config, target_spec, target_tokenizer)`: for method "mtp", the target checkpoint's
multi-token-prediction head (its family's `mtp_class`, the `mtp.*` tensors), or a `ConfigError` naming
`speculative_config.method` when the family or the checkpoint has none; for `draft_model`,
the drafter's checkpoint (a directory or a hub id, found as the target's is), its weights in the target's
dtype on the target's device, and its spec — or a `ConfigError` naming `speculative_config.model` when it
cannot draft for this target: no checkpoint there, an architecture mmserve does not load, another
vocabulary or tokenizer, a family that keeps a recurrent state or cross-attends, other position rows.
`build_proposer` gives it its own paged KV cache over the target's block ids (assembly sizes the blocks
with its bytes per token added).
What it does not know: scheduling, how drafts are proposed or verified (runner/draft_model.py,
runner/speculation.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from mmserve.config import EngineConfig
from mmserve.errors import ConfigError, ModelLoadError
from mmserve.hub import checkpoint_dir
from mmserve.models.loader import iter_tensors, load_model, parse_dtype, read_config, safetensors_files
from mmserve.models.prequantized import read_quantization
from mmserve.models.registry import resolve
from mmserve.models.spec import FamilyModel, FamilySpec
from mmserve.runner.attention import PagedAttentionBackend
from mmserve.runner.cpu.layout import prepare_for_cpu
from mmserve.runner.draft_model import DraftModelProposer
from mmserve.runner.kv_storage import PagedKVStorage
from mmserve.runner.mtp import MtpProposer

KEY = "speculative_config.model"


@dataclass(frozen=True)
class Drafter:
    """A draft model (its own spec: layers, heads), or an MTP head (`mtp`: one layer of the target's shape)."""

    model: FamilyModel | torch.nn.Module
    spec: FamilySpec
    path: Path
    mtp: bool = False


def load_drafter(config: EngineConfig, target: FamilySpec, target_tokenizer: Any) -> Drafter | None:
    """The draft model of `config.speculative_config` (None: no draft model; a pooling engine decodes nothing)."""
    speculative = config.speculative_config
    if speculative is None or config.runner == "pooling":
        return None
    if speculative.method == "mtp":
        return _load_mtp_head(config, target)
    if speculative.method != "draft_model":
        return None
    try:
        path = checkpoint_dir(speculative.model)
        raw = read_config(path)
        family = resolve(raw)
        model_config = family.parse_config(raw)
        processor = family.processor_class(path, model_config, config.media)
    except (ModelLoadError, OSError, ValueError) as exc:
        raise ConfigError(f"{KEY}={speculative.model!r} cannot be loaded: {exc}", key=KEY) from exc
    spec = family.build_spec(model_config, processor, config.media)
    _check_fits(spec, target, processor.tokenizer, target_tokenizer, speculative.model)
    try:
        model = load_model(path, config.dtype, config.device)
    except ModelLoadError as exc:
        raise ConfigError(f"{KEY}={speculative.model!r} cannot be loaded: {exc}", key=KEY) from exc
    prepare_for_cpu(model)
    return Drafter(model, spec, path)


def _check_fits(spec: FamilySpec, target: FamilySpec, tokenizer: Any, target_tokenizer: Any, name: str) -> None:
    """ConfigError naming the draft model when its proposals could not be verified as the target's tokens."""
    if spec.vocab_size != target.vocab_size:
        raise ConfigError(f"{KEY}={name!r} has a vocabulary of {spec.vocab_size} tokens; the target's has "
                          f"{target.vocab_size}: a draft model must share the target's vocabulary", key=KEY)
    if tokenizer.backend.get_vocab(with_added_tokens=True) != target_tokenizer.backend.get_vocab(with_added_tokens=True):
        raise ConfigError(f"{KEY}={name!r} has another tokenizer than the target's (the same token ids must mean "
                          "the same text)", key=KEY)
    if spec.linear_state is not None or spec.cross_attention is not None:
        raise ConfigError(f"{KEY}={name!r} is a {spec.name} model, which keeps a recurrent state or cross-attends to "
                          "its images; mmserve drafts with models that do neither", key=KEY)
    if spec.num_position_rows != target.num_position_rows:
        raise ConfigError(f"{KEY}={name!r} numbers positions in {spec.num_position_rows} row(s), the target in "
                          f"{target.num_position_rows}: a draft model must share the target's position scheme",
                          key=KEY)


def _load_mtp_head(config: EngineConfig, target: FamilySpec) -> Drafter:
    """The target checkpoint's MTP head, or ConfigError naming speculative_config.method when it has none."""
    path = Path(config.model)
    raw = read_config(path)
    family = resolve(raw)
    key = "speculative_config.method"
    if family.mtp_class is None:
        raise ConfigError(f"speculative_config.method='mtp': a {target.name} checkpoint has no multi-token-"
                          "prediction head (Qwen3.5's checkpoints ship one); use ngram or draft_model", key=key)
    head = family.mtp_class(family.parse_config(raw))
    dtype = parse_dtype(config.dtype)
    for param in head.parameters():
        param.data = param.data.to(dtype)
    loaded, _ = head.load_weights(iter_tensors(safetensors_files(path), dtype, read_quantization(raw)))
    missing = sorted(head.expected_weight_names() - loaded)
    if missing:
        raise ConfigError(f"speculative_config.method='mtp': {path} has no complete multi-token-prediction head "
                          f"(mtp.{missing[0].split('#')[0]} and {len(missing) - 1} more missing)", key=key)
    one_layer = replace(target, num_layers=1, kv_layers=None)  # its KV: one full-attention layer of the target's shape
    return Drafter(head.to(config.device).eval(), one_layer, path, mtp=True)


def kv_bytes_per_token(drafter: Drafter | None, fmt: Any) -> int:
    """The drafter's KV bytes per token (0: none), as the target's blocks hold them."""
    if drafter is None:
        return 0
    return PagedKVStorage.bytes_per_token_of(drafter.spec.kv_layer_shapes, fmt)


def build_proposer(drafter: Drafter | None, target: FamilyModel, num_blocks: int, block_size: int, fmt: Any,
                   device: torch.device) -> DraftModelProposer | MtpProposer | None:
    """The runner's proposer: the drafter with a KV cache of `num_blocks` blocks (the target's count)."""
    if drafter is None:
        return None
    spec = drafter.spec
    storage = PagedKVStorage.for_layers(spec.kv_layer_shapes, num_blocks, block_size, fmt, device)
    if drafter.mtp:
        return MtpProposer(drafter.model, target, PagedAttentionBackend(storage), device)
    return DraftModelProposer(drafter.model, PagedAttentionBackend(storage), device, spec.forward_reads_token_ids)
