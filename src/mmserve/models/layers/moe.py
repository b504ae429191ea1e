"""The sparse mixture-of-experts block of Qwen3-VL-MoE and Qwen3.5-MoE decoders.

Role: a router (`gate`: logits over the experts, softmax in float32, the top k renormalised to sum to one,
cast back), the experts' SwiGLU MLPs as one gate/up and one down linear each (so the CPU kernels and weight
quantization take them like any linear), and an optional shared expert whose output is scaled by
sigmoid(`shared_expert_gate`(x)) (Qwen3.5-MoE). The tokens are grouped by expert: one gate/up and one down
matmul per expert that any token of the batch chose, each over all of that expert's tokens; the routed
outputs are summed back per token in ascending expert order, as the reference does. `PerExpertWeights` loads
experts stored one by one (`experts.{e}.gate_proj.weight`, ...) or fused (`experts.gate_up_proj`, also
transposed as Qwen3-VL-MoE's hub checkpoints store it).

What it does not know: attention, KV, state, which layers are sparse (the family decides).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from mmserve.models.layers.activations import get_activation
from mmserve.models.layers.mlp import GatedMLP


class Experts(nn.Module):
    """Each expert's gate/up projection (rows: gate, then up) and down projection as plain linears, so the
    engine's CPU kernels and weight quantization treat them as every other linear (batch-invariant rows)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, hidden_act: str) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up = nn.ModuleList(nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
                                     for _ in range(num_experts))
        self.down = nn.ModuleList(nn.Linear(intermediate_size, hidden_size, bias=False) for _ in range(num_experts))
        self.act = get_activation(hidden_act)

    def forward(self, x: torch.Tensor, top_index: torch.Tensor, top_weight: torch.Tensor) -> torch.Tensor:
        """x (n, hidden); top_index, top_weight (n, k) -> (n, hidden): sum over each token's k experts."""
        out = torch.zeros_like(x)
        flat = top_index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # the (token, slot) pairs grouped by expert, in token order
        experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
        k = top_index.shape[1]
        start = 0
        for expert, count in zip(experts.tolist(), counts.tolist()):
            pairs = order[start:start + count]
            start += count
            tokens = pairs // k
            gate, up = self.gate_up[expert](x[tokens]).split(self.intermediate_size, dim=-1)
            h = self.down[expert](self.act(gate) * up)
            out.index_add_(0, tokens, (h * top_weight.reshape(-1)[pairs, None]).to(out.dtype))
        return out


class SparseMoeBlock(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int, moe_intermediate_size: int, hidden_act: str,
                 shared_intermediate_size: int | None = None) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be in [1, num_experts {num_experts}]")
        self.top_k = top_k
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = Experts(num_experts, hidden_size, moe_intermediate_size, hidden_act)
        self.shared_expert = None
        if shared_intermediate_size:
            self.shared_expert = GatedMLP(hidden_size, shared_intermediate_size, hidden_act, bias=False)
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top_weight, top_index = torch.topk(probs, self.top_k, dim=-1)
        top_weight = (top_weight / top_weight.sum(dim=-1, keepdim=True)).to(logits.dtype)
        out = self.experts(x, top_index, top_weight)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def load_expert(self, expert: int, projection: str, weight: torch.Tensor) -> None:
        """One expert's `gate_proj`, `up_proj` or `down_proj` weight (out, in), as a checkpoint stores it."""
        inter = self.experts.intermediate_size
        target = {"gate_proj": self.experts.gate_up[expert].weight.data[:inter],
                  "up_proj": self.experts.gate_up[expert].weight.data[inter:],
                  "down_proj": self.experts.down[expert].weight.data}[projection]
        if target.shape != weight.shape:
            raise ValueError(f"expert {expert} {projection} has shape {tuple(weight.shape)}, expected "
                             f"{tuple(target.shape)}")
        target.copy_(weight)

    def load_fused(self, name: str, tensor: torch.Tensor) -> None:
        """Every expert's projection in one tensor: `gate_up_proj` (experts, 2 * inter, hidden) or `down_proj`
        (experts, hidden, inter) as transformers holds them, or transposed (experts, in, out) as Qwen3-VL-MoE's
        hub checkpoints store them (transposed unless the shape is already the former: transformers' rule)."""
        inter, count = self.experts.intermediate_size, len(self.experts.down)
        hidden = self.experts.down[0].weight.shape[0]
        want = (count, 2 * inter, hidden) if name == "gate_up_proj" else (count, hidden, inter)
        if tuple(tensor.shape) != want:
            tensor = tensor.transpose(1, 2)
        if tuple(tensor.shape) != want:
            raise ValueError(f"experts.{name} has shape {tuple(tensor.shape)}, expected {want} or its transpose")
        for e in range(count):
            if name == "gate_up_proj":
                self.load_expert(e, "gate_proj", tensor[e, :inter])
                self.load_expert(e, "up_proj", tensor[e, inter:])
            else:
                self.load_expert(e, "down_proj", tensor[e])

_PER_EXPERT = re.compile(r"^(?P<block>.+\.mlp)\.experts\.(?:(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)"
                         r"\.weight|(?P<fused>gate_up_proj|down_proj))$")


class PerExpertWeights:
    """Checkpoint tensors of experts (stored one by one, or fused in one tensor per projection) copied into a
    model's per-expert linears."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.filled: dict[str, set[tuple[int, str]]] = {}  # block name -> (expert, projection) filled
        self.unexpected: list[str] = []

    def take(self, weights: Iterable[tuple[str, torch.Tensor]],
             rename: Callable[[str, torch.Tensor], tuple[str, torch.Tensor] | None]
             ) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors that are not experts', passed on; the experts' copied in on the way."""
        for hf_name, tensor in weights:
            renamed = rename(hf_name, tensor)
            match = _PER_EXPERT.match(renamed[0]) if renamed is not None else None
            if match is None:
                yield hf_name, tensor
                continue
            try:
                moe = self.model.get_submodule(match["block"])
            except AttributeError:
                moe = None
            if not isinstance(moe, SparseMoeBlock):
                self.unexpected.append(hf_name)
                continue
            count = len(moe.experts.down)
            with torch.no_grad():
                if match["fused"]:
                    moe.load_fused(match["fused"], renamed[1])
                    projections = ("gate_proj", "up_proj") if match["fused"] == "gate_up_proj" else ("down_proj",)
                    done = {(e, p) for e in range(count) for p in projections}
                elif int(match["expert"]) < count:
                    moe.load_expert(int(match["expert"]), match["proj"], renamed[1])
                    done = {(int(match["expert"]), match["proj"])}
                else:
                    self.unexpected.append(hf_name)
                    continue
            self.filled.setdefault(match["block"], set()).update(done)

    def complete(self) -> set[str]:
        """The names of the expert weights filled whole (an expert's gate/up needs both its halves)."""
        done = set()
        for block, filled in self.filled.items():
            for e in range(len(self.model.get_submodule(block).experts.down)):
                if (e, "gate_proj") in filled and (e, "up_proj") in filled:
                    done.add(f"{block}.experts.gate_up.{e}.weight")
                if (e, "down_proj") in filled:
                    done.add(f"{block}.experts.down.{e}.weight")
        return done
