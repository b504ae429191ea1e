"""The `ray` replica backend: each replica a Ray actor, its messages through Ray queues.

Role: `RayLauncher` starts a replica as an actor (placed by Ray, `threads` CPUs each) that runs
cluster/replica_worker.py's `replica_main` behind two `ray.util.queue.Queue`s, the same messages the
`mp` backend sends through pipes, and gives the replicas' slots (cluster/replica_slots.py) a
process-like handle: alive while the
actor's `run` call has not returned, `kill` ends the actor. Ray is joined at `ray_address`, used as
is where this process already initialised it, or started locally and shut down with the launcher.
On a cluster every node needs mmserve installed and the checkpoint at the same path.
What it does not know: routing, requests, what the messages hold.
"""

from __future__ import annotations

from typing import Any

from mmserve.config import EngineConfig
from mmserve.supervisor.ray_support import init_ray


class _ReplicaActor:
    def run(self, config: EngineConfig, threads: int, inbox: Any, outbox: Any) -> None:
        from mmserve.cluster.replica_worker import replica_main

        replica_main(config, threads, inbox, outbox, connector="ray")


class _ActorHandle:
    """What the replicas' slots ask of a replica's process, for an actor."""

    def __init__(self, ray: Any, actor: Any, run_ref: Any) -> None:
        self._ray, self._actor, self._run = ray, actor, run_ref
        self.exitcode: str | None = None

    def is_alive(self) -> bool:
        done, _ = self._ray.wait([self._run], timeout=0)
        if done and self.exitcode is None:
            try:
                self._ray.get(self._run)
                self.exitcode = "returned"
            except Exception as exc:  # the actor died: Ray says how
                self.exitcode = type(exc).__name__
        return not done

    def join(self, timeout_s: float | None = None) -> None:
        self._ray.wait([self._run], timeout=timeout_s)

    def kill(self) -> None:
        self._ray.kill(self._actor, no_restart=True)


class RayLauncher:
    def __init__(self, ray_address: str | None, num_replicas: int, threads_per_replica: int) -> None:
        self._ray, self._started_ray = init_ray(ray_address, num_replicas * threads_per_replica)
        from mmserve.cluster.kv_connector import RayConnector

        self.connector = RayConnector()
        from ray.util.queue import Queue

        self._queue = Queue
        # max_restarts=0: the replica set, not Ray, restarts replicas, so it can route their requests again
        self._actor_class = self._ray.remote(num_cpus=threads_per_replica, max_restarts=0)(_ReplicaActor)

    def start(self, config: EngineConfig, threads: int) -> tuple[_ActorHandle, Any, Any]:
        inbox, outbox = self._queue(), self._queue()
        actor = self._actor_class.remote()
        return _ActorHandle(self._ray, actor, actor.run.remote(config, threads, inbox, outbox)), inbox, outbox

    def abandon(self, *queues: Any) -> None:
        for q in queues:
            if q is not None:
                q.shutdown(force=True)

    def close(self) -> None:
        if self._started_ray:
            self._ray.shutdown()
