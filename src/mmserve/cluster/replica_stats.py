"""The replica set's counters: every live replica's summed, each one's own, and the router's.

Role: `summed_stats` builds what `ReplicaSet.stats()` answers from the counters each replica last
sent: numbers summed over the live replicas, settings (strings) from the first, the set's own
(backend, replicas alive, restarts, KV transfers), `replicas` (each replica's own row) and `router`
(how requests were routed and what the router expected them to find cached).
What it does not know: processes, messages, how the counters arrived.
"""

from __future__ import annotations

from typing import Any

from mmserve.cluster.router import Router
from mmserve.supervisor.slot import ChildSlot


def summed_stats(slots: list[ChildSlot], backend: str, router: Router, transfers: dict[str, Any]) -> dict[str, Any]:
    """`slots`: the replicas' slots (their `state.stats` the counters; keys starting "_" are private);
    `transfers`: the P/D hand-off's latency counters."""
    total: dict[str, Any] = {}
    for slot in [s for s in slots if s.ready]:
        for key, value in slot.state.stats.items():
            if key.startswith("_"):
                continue
            if isinstance(value, str):
                total.setdefault(key, value)
            elif isinstance(value, int | float):
                total[key] = total.get(key, 0) + value
    total["replica_backend"] = backend
    total["replicas_total"] = len(slots)
    total["replicas_alive"] = sum(s.ready for s in slots)
    total["replica_restarts"] = sum(s.restarts.num_restarts for s in slots)
    total.update(transfers)
    total["replicas"] = [{"replica": s.index, "role": s.state.role, "alive": s.ready, "pid": s.pid if s.ready else None,
                          "restarts": s.restarts.num_restarts,
                          **{k: v for k, v in s.state.stats.items() if not k.startswith("_")}} for s in slots]
    r = router.stats
    total["router"] = {"policy": router.config.policy,
                       "routed": [{"policy": p, "reason": reason, "requests": n}
                                  for (p, reason), n in sorted(r.routed.items())],
                       "expected_encoder_cache_hits": r.expected_media_hits,
                       "expected_prefix_cache_tokens": r.expected_prefix_tokens}
    return total
