"""The one reader of a child's outbox: a thread that hands each message to its owner, and says once
when the child is gone.

Role: a child's outbox (a multiprocessing or torch queue, a Ray queue) is read by blocking calls that
must not run on the owner's thread (an engine's step loop, a server's event loop). `OutboxReader`
reads it on a thread of its own and calls `deliver(message)` for each; with `is_alive` it checks,
whenever `wake_s` passes without a message, that the child still runs, and when it does not it
delivers `CHILD_GONE` once and stops. A message that cannot be read (an output whose sender died
before its shared memory was fetched) is skipped while the child lives; MAX_UNREADABLE in a row mean
the outbox itself broke (a Ray queue's actor died under a live child), and the child counts as gone,
so its owner starts a new one. `deliver` returning False
stops the reader (the owner has heard the last it wants from this generation); so does `stop()`.
The reader owns the queue: with `close_outbox` only it closes it, after it stopped reading (closing
under a reader could hand it a reused file descriptor).
What it does not know: what the messages mean, restarts, what the owner does with them.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("mmserve.supervisor")
UNREADABLE_PAUSE_S = 0.001  # after an unreadable message: should the error repeat, never spin
MAX_UNREADABLE = 1000  # unreadable messages in a row: the outbox is broken, not one message


class _ChildGone:
    def __repr__(self) -> str:
        return "CHILD_GONE"


CHILD_GONE = _ChildGone()  # delivered once when the child no longer runs (or its outbox broke)


class OutboxReader:
    def __init__(self, name: str, outbox: Any, deliver: Callable[[Any], bool], wake_s: float,
                 is_alive: Callable[[], bool] | None = None, close_outbox: bool = False,
                 max_unreadable: int = MAX_UNREADABLE) -> None:
        """`is_alive`: None when the owner watches the child itself (then only `stop()` ends the reader)."""
        self._outbox, self._deliver, self._wake_s = outbox, deliver, wake_s
        self._is_alive, self._close_outbox = is_alive, close_outbox
        self._stop = threading.Event()
        self._num_unreadable, self._max_unreadable = 0, max_unreadable  # in a row
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                message = self._next()
                if message is None:
                    continue
                if not self._deliver(message) or message is CHILD_GONE:
                    return
        finally:
            if self._close_outbox:
                self._outbox.close()

    def _next(self) -> Any:
        """The next message, CHILD_GONE, or None (nothing yet: look again)."""
        try:
            message = self._outbox.get(timeout=self._wake_s)
            self._num_unreadable = 0
            return message
        except queue.Empty:
            return None if self._child_runs() else CHILD_GONE
        except Exception as exc:  # noqa: BLE001 - the thread must outlive one bad message
            if self._stop.is_set():
                return None
            self._num_unreadable += 1
            if not self._child_runs():  # the pipe or the queue's actor is gone: so is the child
                return CHILD_GONE
            if self._num_unreadable >= self._max_unreadable:
                logger.error("a child's outbox keeps failing (%s): the child counts as gone", exc)
                return CHILD_GONE
            logger.debug("unreadable message from a child: %s", exc)
            self._stop.wait(UNREADABLE_PAUSE_S)
            return None

    def _child_runs(self) -> bool:
        return self._is_alive is None or self._is_alive()
