"""The one restart policy of mmserve's children (encoder workers and replicas, processes and actors).

Role: `RestartPolicy` says when a dead child's slot gets a new one; `RestartHistory` is a slot's
record of its recent restarts, which the policy reads.

The policy, counted over the restarts of one slot within the last `window_s` seconds:
- back-off: the first restart in a window is at once; while the slot keeps dying, each further one
  waits `first_backoff_s`, doubling with every restart in the window, up to `max_backoff_s`
  (`first_backoff_s` = 0: always at once);
- window: restarts older than `window_s` are forgotten, so a child that lived long starts over;
- give-up: with `max_restarts_per_window`, a slot that restarted that many times in the window gets
  no new child until its oldest restart leaves the window (None: it never gives up).
What it does not know: processes, actors, clocks (its callers pass `now_s`, a monotonic time).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RestartPolicy:
    window_s: float = 60.0
    max_restarts_per_window: int | None = None  # None: never give up
    first_backoff_s: float = 0.0  # the wait before the second restart in a window; 0: never wait
    max_backoff_s: float = 60.0

    def __post_init__(self) -> None:
        if self.window_s <= 0 or self.first_backoff_s < 0 or self.max_backoff_s < 0:
            raise ValueError(f"a restart policy needs a positive window and non-negative back-off: {self}")
        if self.max_restarts_per_window is not None and self.max_restarts_per_window < 0:
            raise ValueError(f"max_restarts_per_window must be >= 0, got {self.max_restarts_per_window}")

    def delay_s(self, num_recent_restarts: int) -> float | None:
        """How long to wait before the next restart, after `num_recent_restarts` in the window;
        None: give up until the window moves."""
        if self.max_restarts_per_window is not None and num_recent_restarts >= self.max_restarts_per_window:
            return None
        if num_recent_restarts == 0 or self.first_backoff_s == 0:
            return 0.0
        return min(self.max_backoff_s, self.first_backoff_s * 2.0 ** (num_recent_restarts - 1))


@dataclass
class RestartHistory:
    """One slot's restarts: the recent ones' monotonic times and how many over its life."""

    recent_s: deque[float] = field(default_factory=deque)
    num_restarts: int = 0

    def num_recent(self, policy: RestartPolicy, now_s: float) -> int:
        while self.recent_s and now_s - self.recent_s[0] >= policy.window_s:
            self.recent_s.popleft()
        return len(self.recent_s)

    def decide(self, policy: RestartPolicy, now_s: float) -> float | None:
        """A restart decided at `now_s`: its delay (the restart is recorded), or None (given up for now,
        nothing recorded: ask again later)."""
        delay_s = policy.delay_s(self.num_recent(policy, now_s))
        if delay_s is not None:
            self.recent_s.append(now_s)
            self.num_restarts += 1
        return delay_s
