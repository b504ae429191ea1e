"""Children as local processes: started by spawn, their messages through a queue each way.

Role: `ProcessLauncher` starts a child process running `target(*args, inbox, outbox)` (spawn, never
fork: the parent has torch threads), with a fresh pair of torch.multiprocessing queues per child (a
child killed mid-send can only spoil its own queues and their cross-process locks; tensors on them
travel as shared-memory handles), and gives up on a stopped child's queues so that what is still
buffered for it never holds the parent's exit.
What it does not know: what the child runs, its messages, restarts (`RestartPolicy`'s).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


class ProcessLauncher:
    def __init__(self, target: Callable[..., None], name: str, daemon: bool = False) -> None:
        """`daemon`: should the parent exit without stopping it, multiprocessing still ends the child."""
        self._ctx = mp.get_context("spawn")
        self._target, self._name, self._daemon = target, name, daemon

    def start(self, *args: Any, name: str | None = None) -> tuple[Any, Any, Any]:
        """A started child (named `name`, else the launcher's name) and its (inbox, outbox); raises
        OSError (out of processes or memory), its queues then closed."""
        inbox, outbox = self._ctx.Queue(), self._ctx.Queue()
        process = self._ctx.Process(target=self._target, name=name or self._name, daemon=self._daemon,
                                    args=(*args, inbox, outbox))
        try:
            process.start()
        except OSError:
            for q in (inbox, outbox):  # no child and no reader use them
                q.cancel_join_thread()
                q.close()
            raise
        return process, inbox, outbox

    def shared_flag(self) -> Any:
        """A lock-free boolean every child of this launcher can read (a stop flag)."""
        return self._ctx.RawValue(ctypes.c_bool, False)

    def abandon(self, *queues: Any) -> None:
        """Give up on a stopped child's queues: what is still buffered for it must not hold this
        process's exit (a queue's feeder thread blocks on a pipe nobody reads)."""
        for q in queues:
            if q is not None:
                q.cancel_join_thread()

    def close(self) -> None:
        """Nothing to release (a Ray launcher stops the Ray it started here; owners call both alike)."""
