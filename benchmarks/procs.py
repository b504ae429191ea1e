"""The server's process tree as /proc shows it: who its processes are, their CPU seconds and resident
memory, and ending what outlived it.

Role: one reader of /proc for the benchmarks that start `mmserve serve` (disagg's CPU accounting, the
soak's and the chaos run's memory, the chaos run's victims). What it does not know: mmserve; a process's
role is read from its command line only.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def proc_stat(pid: int | str) -> tuple[str, int, float] | None:
    """(comm, ppid, user+system CPU seconds) of a live process; None once it has exited."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = raw[raw.rfind(")") + 2:].split()  # fields after "pid (comm)": state, ppid, ...
    if rest[0] in ("Z", "X"):  # exited, not yet reaped
        return None
    return raw[raw.find("(") + 1:raw.rfind(")")], int(rest[1]), (int(rest[11]) + int(rest[12])) / CLOCK_TICKS


def cmdline(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    return ""


def process_tree(root: int) -> dict[int, tuple[str, float]]:
    """pid -> (role, CPU seconds) for `root` and every descendant. Roles: engine (the server
    process), encoder_worker (a process-pool worker or the Ray encoder actor), other (the rest: the
    multiprocessing resource tracker, Ray's GCS, raylet, idle workers, agents)."""
    stats = {int(p): s for p in os.listdir("/proc") if p.isdigit() and (s := proc_stat(p)) is not None}
    children: dict[int, list[int]] = {}
    for pid, (_, ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if pid not in stats:
            continue
        todo.extend(children.get(pid, []))
        cmd = cmdline(pid)
        worker = "EncoderWorker" in cmd or ("multiprocessing" in cmd and "resource_tracker" not in cmd)
        role = "engine" if pid == root else "encoder_worker" if worker else "other"
        out[pid] = (role, stats[pid][2])
    return out


def machine_busy_s() -> float:
    """Busy CPU seconds of the whole machine since boot, all cores (all but idle and iowait)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(values[:8]) - values[3] - values[4]) / CLOCK_TICKS  # user nice system idle iowait irq softirq steal


def rss_bytes(pid: int) -> int:
    """VmRSS of `pid` and every descendant (encoder worker processes, when there are any)."""
    total = 0
    for member in process_tree(pid):
        try:
            status = Path(f"/proc/{member}/status").read_text()
        except OSError:  # exited since the tree was read
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024  # reported in kB
    return total


def reap_leftovers(pids: set[int], grace_s: float = 10.0, sig: signal.Signals = signal.SIGTERM) -> list[str]:
    """Processes of the server's tree still alive `grace_s` after it exited (Ray's daemons, say):
    named, then sent `sig` by pid so they do not take CPU from the next run."""
    deadline = time.monotonic() + grace_s
    while (alive := [p for p in pids if proc_stat(p) is not None]) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = []
    for pid in alive:
        stat = proc_stat(pid)
        if stat is not None:
            left.append(f"{stat[0]}({pid})")
            with contextlib.suppress(OSError):
                os.kill(pid, sig)
    return left
