"""Copy a checkpoint's tensors into a module: renaming, stacked projections, clear shape errors.

Role: the part of `load_weights` every family shares. A family says how a Hugging Face name maps
onto its module (`rename`, which may also reshape a tensor, or return None to skip it, e.g. a tied
LM head) and which projections it stores stacked (q/k/v in one matrix, gate/up in one matrix):
each `StackedParam` names the checkpoint fragment, the stacked fragment and the shard index; the
shard sizes along dim 0 come from the family's `shard_sizes`.

`CheckpointWeights` is the whole of it for a family model whose language model sits under
`language_model.` with the usual stacking: the model supplies `_rename` and `config.text`.

What it does not know: files (see loader.py), any family's names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mmserve.models.layers.moe import PerExpertWeights

# hf name, tensor -> (our name, tensor) or None to skip the tensor
Rename = Callable[[str, torch.Tensor], tuple[str, torch.Tensor] | None]
# stacked parameter name, parameter -> the sizes of its shards along dim 0
ShardSizes = Callable[[str, torch.Tensor], Sequence[int]]


@dataclass(frozen=True)
class StackedParam:
    hf_fragment: str  # e.g. ".q_proj."
    fragment: str  # e.g. ".qkv_proj."
    shard: int  # position of this projection in the stacked matrix


# the usual stacking: q/k/v in one matrix, gate/up in one matrix
QKV_GATE_UP = (
    StackedParam(".q_proj.", ".qkv_proj.", 0),
    StackedParam(".k_proj.", ".qkv_proj.", 1),
    StackedParam(".v_proj.", ".qkv_proj.", 2),
    StackedParam(".gate_proj.", ".gate_up_proj.", 0),
    StackedParam(".up_proj.", ".gate_up_proj.", 1),
)


def even_shards(name: str, param: torch.Tensor, count: int) -> list[int]:
    """`count` equal shards (gate/up stacks)."""
    return [param.shape[0] // count] * count


def decoder_shard_sizes(name: str, param: torch.Tensor, text: Any) -> list[int]:
    """Shards of a stacked parameter: the language model's q/k/v by its heads (q may be wider than k and
    v), any other stacked q/k/v (a vision tower's) in equal thirds, gate/up in equal halves."""
    if name.startswith("language_model.") and ".qkv_proj." in name:
        return [text.num_attention_heads * text.head_dim] + [text.num_key_value_heads * text.head_dim] * 2
    return even_shards(name, param, 3 if ".qkv_proj." in name else 2)


def loadable_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """What a checkpoint fills: the parameters and the persistent buffers (clipping bounds, layer scalars)."""
    tensors = dict(module.named_parameters())
    for name, sub in module.named_modules():
        for buffer_name, buffer in sub.named_buffers(recurse=False):
            if buffer is not None and buffer_name not in sub._non_persistent_buffers_set:
                tensors[f"{name}.{buffer_name}" if name else buffer_name] = buffer
    return tensors


def load_weights(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], rename: Rename,
                 stacked: Sequence[StackedParam], shard_sizes: ShardSizes) -> tuple[set[str], list[str]]:
    """Copy tensors in. Returns (names of parameters filled, `name#shard` for stacked ones; unexpected hf
    names). Raises ValueError naming the tensor on a shape mismatch."""
    params = loadable_tensors(module)
    loaded: set[str] = set()
    unexpected: list[str] = []
    for hf_name, tensor in weights:
        renamed = rename(hf_name, tensor)
        if renamed is None:
            continue
        name, tensor = renamed
        shard = None
        for s in stacked:
            if s.hf_fragment in name:
                name, shard = name.replace(s.hf_fragment, s.fragment), s.shard
                break
        param = params.get(name)
        if param is None:
            unexpected.append(hf_name)
            continue
        target = param.data
        if shard is not None:
            sizes = shard_sizes(name, param)
            target = param.data.narrow(0, sum(sizes[:shard]), sizes[shard])
        if target.shape != tensor.shape:
            raise ValueError(f"tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(target.shape)} for {name!r}")
        with torch.no_grad():
            target.copy_(tensor)
        loaded.add(name if shard is None else f"{name}#{shard}")
    return loaded, unexpected


def expected_weight_names(module: nn.Module, stacked: Sequence[StackedParam]) -> set[str]:
    """What `load_weights` must have filled for the module to be complete."""
    shards: dict[str, int] = {}
    for s in stacked:
        shards[s.fragment] = max(shards.get(s.fragment, 0), s.shard + 1)
    out = set()
    for name in loadable_tensors(module):
        count = next((n for frag, n in shards.items() if frag in name), 0)
        if count:
            out.update(f"{name}#{i}" for i in range(count))
        else:
            out.add(name)
    return out


class CheckpointWeights:
    """`load_weights` / `expected_weight_names` for a family model (mix in before nn.Module): it supplies
    `_rename(hf_name, tensor)` and a `config.text` with the language model's head layout."""

    config: Any
    stacked: Sequence[StackedParam] = QKV_GATE_UP  # a family with more stacked projections lists them all

    def _rename(self, hf_name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        raise NotImplementedError

    def _shard_sizes(self, name: str, param: torch.Tensor) -> list[int]:
        return decoder_shard_sizes(name, param, self.config.text)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> tuple[set[str], list[str]]:
        """Copy checkpoint tensors in. Returns (names of our parameters filled, unexpected hf names). Experts
        stored one by one (`experts.{e}.gate_proj.weight`) fill a sparse block's fused tensors.

        Raises ValueError naming the tensor on a shape mismatch."""
        per_expert = PerExpertWeights(self)
        loaded, unexpected = load_weights(self, per_expert.take(weights, self._rename), self._rename, self.stacked,
                                          self._shard_sizes)
        return loaded | per_expert.complete(), unexpected + per_expert.unexpected

    def expected_weight_names(self) -> set[str]:
        """What `load_weights` must have filled for the model to be complete."""
        return expected_weight_names(self, self.stacked)
