"""The one supervisor (mmserve/supervisor/): its restart policy (back-off doubling, window, give-up) on
injected times, a slot's due restarts, and the outbox reader (messages in order, the child's end said once,
an unreadable message skipped while the child lives). No processes: queues and flags stand in."""

from __future__ import annotations

import ast
import queue
import threading
from pathlib import Path

import pytest

from mmserve.supervisor.reader import CHILD_GONE, OutboxReader
from mmserve.supervisor.restarts import RestartHistory, RestartPolicy
from mmserve.supervisor.slot import ChildSlot

REPLICAS = RestartPolicy(window_s=60.0, first_backoff_s=2.0, max_backoff_s=60.0)
WORKERS = RestartPolicy(window_s=60.0, max_restarts_per_window=3)
HANG_GUARD_S = 120.0


def test_back_off_doubles_while_a_child_keeps_dying_up_to_the_bound():
    history = RestartHistory()
    delays = [history.decide(REPLICAS, now_s=t) for t in (0.0, 1.0, 4.0, 9.0, 18.0, 30.0, 40.0, 50.0)]
    assert delays == [0.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0]
    assert history.num_restarts == 8


def test_the_window_forgets_old_restarts():
    history = RestartHistory()
    assert [history.decide(REPLICAS, t) for t in (0.0, 10.0)] == [0.0, 2.0]
    assert history.decide(REPLICAS, 10.0 + 60.0) == 0.0  # both older than the window: at once again


def test_a_bounded_policy_gives_up_until_the_window_moves():
    history = RestartHistory()
    assert [history.decide(WORKERS, t) for t in (0.0, 1.0, 2.0)] == [0.0, 0.0, 0.0]
    assert history.decide(WORKERS, 30.0) is None and history.num_restarts == 3  # given up: nothing recorded
    assert history.decide(WORKERS, 60.0) == 0.0  # the first restart left the window


@pytest.mark.parametrize("bad", [{"window_s": 0.0}, {"first_backoff_s": -1.0}, {"max_restarts_per_window": -1}])
def test_a_policy_says_what_is_wrong(bad):
    with pytest.raises(ValueError):
        RestartPolicy(**bad)


def test_a_slot_restarts_when_its_back_off_is_due():
    slot: ChildSlot[None] = ChildSlot(0, None)
    assert slot.next_generation() == 0 and not slot.ready
    assert slot.due_for_restart(REPLICAS, now_s=0.0)  # the first: at once
    assert not slot.due_for_restart(REPLICAS, now_s=1.0)  # the second waits 2 s from its decision
    assert not slot.due_for_restart(REPLICAS, now_s=2.9)
    assert slot.due_for_restart(REPLICAS, now_s=3.0)
    assert slot.restarts.num_restarts == 2


class _Outbox:
    """A queue whose `get` may raise once (an unreadable message)."""

    def __init__(self) -> None:
        self.items: queue.Queue = queue.Queue()
        self.closed = threading.Event()

    def get(self, timeout: float) -> object:
        item = self.items.get(timeout=timeout)
        if isinstance(item, Exception):
            raise item
        return item

    def close(self) -> None:
        self.closed.set()


def _reader(outbox: _Outbox, alive: threading.Event, got: list, done: threading.Event,
            seen_b: threading.Event | None = None, max_unreadable: int = 1000) -> OutboxReader:
    def deliver(message: object) -> bool:
        got.append(message)
        if message == "b" and seen_b is not None:
            seen_b.set()
        if message is CHILD_GONE or message == "last":
            done.set()
        return message != "last"

    return OutboxReader("test-reader", outbox, deliver, wake_s=0.01, is_alive=alive.is_set, close_outbox=True,
                        max_unreadable=max_unreadable)


def test_the_reader_delivers_in_order_skips_the_unreadable_and_says_once_the_child_is_gone():
    outbox, alive, got, done, seen_b = _Outbox(), threading.Event(), [], threading.Event(), threading.Event()
    alive.set()
    for item in ("a", EOFError("a dead sender's output"), "b"):
        outbox.items.put(item)
    reader = _reader(outbox, alive, got, done, seen_b)
    assert seen_b.wait(HANG_GUARD_S)  # the child dies only once all it sent was read
    alive.clear()
    assert done.wait(HANG_GUARD_S)
    reader.join(HANG_GUARD_S)
    assert got == ["a", "b", CHILD_GONE] and not reader.is_alive() and outbox.closed.is_set()


def test_an_outbox_that_keeps_failing_under_a_live_child_counts_as_the_child_gone():
    outbox, alive, got, done = _Outbox(), threading.Event(), [], threading.Event()
    alive.set()  # the child runs, but every read fails (a Ray queue whose actor died)
    for _ in range(3):
        outbox.items.put(ConnectionError("the queue's actor is gone"))
    reader = _reader(outbox, alive, got, done, max_unreadable=3)
    assert done.wait(HANG_GUARD_S)
    reader.join(HANG_GUARD_S)
    assert got == [CHILD_GONE] and not reader.is_alive()


def test_the_reader_stops_when_its_owner_has_heard_enough():
    outbox, alive, got, done = _Outbox(), threading.Event(), [], threading.Event()
    alive.set()
    outbox.items.put("last")
    outbox.items.put("never read")
    reader = _reader(outbox, alive, got, done)
    assert done.wait(HANG_GUARD_S)
    reader.join(HANG_GUARD_S)
    assert got == ["last"] and not reader.is_alive()


def test_the_supervisor_knows_nothing_of_its_children():
    """Shared by workers/ and cluster/: it imports neither, nor what they serve (module level or lazy)."""
    root = Path(__file__).resolve().parents[2] / "src" / "mmserve" / "supervisor"
    forbidden = ("mmserve.engine", "mmserve.runner", "mmserve.entrypoints", "mmserve.cluster", "mmserve.workers")
    for path in root.glob("*.py"):
        tree = ast.parse(path.read_text())
        names = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert not [m for m in names if m.startswith(forbidden)], path.name
