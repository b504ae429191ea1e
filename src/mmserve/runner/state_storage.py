"""The recurrent state of a hybrid model's linear-attention layers: one row per slot, one tensor pair per layer.

Role: own, for each linear-attention layer, a conv state (num_slots, channels, kernel - 1) and a recurrent
state (num_slots, value_heads, key_dim, value_dim), in float32 whatever the model's dtype: the recurrent
state compounds a decay and a correction at every token of a long prompt, and half precision would drift
from the reference over thousands of tokens (the conv state holds plain inputs; float32 keeps them
exactly). `clear(slot)` zeroes a slot the scheduler has just handed to a request (a fresh prompt, or one
recomputed after a preemption, starts from zero state); layers read and write their rows in place
(`layers/gated_deltanet.py`).

What it does not know: requests, which slot is whose (core/state_slots.py), KV, attention.
"""

from __future__ import annotations

import torch

from mmserve.models.spec import LinearStateLayout

STATE_DTYPE = torch.float32


class LinearStateStorage:
    def __init__(self, layout: LinearStateLayout, num_slots: int, num_snapshots: int = 0,
                 device: torch.device | str = "cpu") -> None:
        """Rows [0, num_slots) are the running requests' slots, the next `num_snapshots` rows the prefix
        cache's snapshots (`snapshot_row`)."""
        self.layout = layout
        self.num_slots = num_slots
        rows = num_slots + num_snapshots
        self.conv = [torch.zeros((rows, *layout.conv_shape), dtype=STATE_DTYPE, device=device)
                     for _ in range(layout.num_layers)]
        self.recurrent = [torch.zeros((rows, *layout.recurrent_shape), dtype=STATE_DTYPE, device=device)
                          for _ in range(layout.num_layers)]

    def snapshot_row(self, snapshot_id: int) -> int:
        return self.num_slots + snapshot_id

    @staticmethod
    def bytes_per_slot(layout: LinearStateLayout) -> int:
        return layout.bytes_per_slot(torch.empty((), dtype=STATE_DTYPE).element_size())

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Linear-attention layer `index`'s (conv, recurrent) state tensors, all slots."""
        return self.conv[index], self.recurrent[index]

    def clear(self, slot: int) -> None:
        for conv, recurrent in zip(self.conv, self.recurrent):
            conv[slot].zero_()
            recurrent[slot].zero_()

    def copy(self, source: int, target: int) -> None:
        """Row `target` takes row `source`'s state (a snapshot taken, or a request resuming from one)."""
        for conv, recurrent in zip(self.conv, self.recurrent):
            conv[target].copy_(conv[source])
            recurrent[target].copy_(recurrent[source])
