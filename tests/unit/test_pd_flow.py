"""The server's side of a P/D hand-off (cluster/pd_flow.py) against fake replicas: a decode replica without
room is asked again while the prefill replica holds the KV, and past the bound the request fails clearly
and the prefill replica is told to let go; a prefill replica that cannot send hands back a lost request."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from mmserve.cluster import pd_flow
from mmserve.cluster.pd_flow import HandOff, HandOffLost
from mmserve.cluster.protocol import AbortRequest, AdmitTransferred, ReceiveKV
from mmserve.cluster.router import RouteKeys, Router
from mmserve.engine.async_engine import EngineDeadError
from mmserve.inputs.items import ProcessedPrompt
from mmserve.outputs import CompletionOutput, RequestOutput
from mmserve.sampling_params import SamplingParams


@dataclass
class _Flight:
    request_id: str = "r"
    prompt: ProcessedPrompt = field(default_factory=lambda: ProcessedPrompt(None, [1, 2, 3]))
    params: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float = 0.0
    keys: RouteKeys = field(default_factory=lambda: RouteKeys((), (), 16, 3))
    trace_parent: str | None = None
    replica: int = 0
    generation: int = 1
    counted: bool = True
    transfer: object = None


class _Replicas:
    """The HandOffPeers a ReplicaSet gives a hand-off: one prefill replica (0) and one decode replica (1)."""

    def __init__(self, admits: list, send_fails: bool = False) -> None:
        self.decode_router = Router(1)
        self.admits, self.send_fails = list(admits), send_fails
        self.sent: list = []
        self.asked: list[str] = []

    def decode_replica(self, choice):
        return 1 + choice, 1

    async def ask(self, replica, question, generation=None):
        self.asked.append("admit_transferred" if isinstance(question, AdmitTransferred) else "send_kv")
        if isinstance(question, AdmitTransferred):
            return self.admits.pop(0) if self.admits else None
        if self.send_fails:
            raise RuntimeError("replica 0 died")
        return "transfer"

    def send(self, replica, generation, message):
        self.sent.append((replica, message))

    def uncount(self, flight):
        flight.counted = False

    def discard(self, transfer):
        raise AssertionError("nothing to discard")


FIRST = RequestOutput("r", None, [1, 2, 3], [CompletionOutput(0, "a", [7], None, None)], False, kv_parked=True)


def test_a_decode_replica_without_room_is_asked_again_then_receives(monkeypatch):
    monkeypatch.setattr(pd_flow, "HANDOFF_RETRY_S", 0.001)
    replicas, flight = _Replicas([None, None, [0]]), _Flight()
    hand_off = HandOff(replicas)
    asyncio.run(hand_off(flight, FIRST))
    assert replicas.asked == ["admit_transferred"] * 3 + ["send_kv"]
    assert (flight.replica, flight.transfer) == (1, "transfer")
    assert replicas.sent == [(1, ReceiveKV("r", "transfer"))]
    assert hand_off.latencies.stats()["kv_transfers"] == 1


def test_past_the_bound_the_request_fails_and_the_prefill_replica_lets_go(monkeypatch):
    monkeypatch.setattr(pd_flow, "HANDOFF_RETRY_S", 0.001)
    monkeypatch.setattr(pd_flow, "HANDOFF_TIMEOUT_S", 0.05)
    replicas, flight = _Replicas([]), _Flight()
    with pytest.raises(EngineDeadError, match="no decode replica had room"):
        asyncio.run(HandOff(replicas)(flight, FIRST))
    assert replicas.sent == [(0, AbortRequest("r"))] and not flight.counted


def test_a_prefill_replica_that_cannot_send_loses_the_request_and_frees_the_decode_side():
    replicas, flight = _Replicas([[0, 1]], send_fails=True), _Flight()
    with pytest.raises(HandOffLost, match="could not send"):
        asyncio.run(HandOff(replicas)(flight, FIRST))
    assert replicas.sent == [(1, AbortRequest("r"))]


def test_a_client_leaving_mid_send_leaves_no_transfer_behind():
    class Slow(_Replicas):
        def __init__(self) -> None:
            super().__init__([[0]])
            self.discarded: list = []
            self.release = asyncio.Event()

        async def ask(self, replica, question, generation=None):
            if not isinstance(question, AdmitTransferred):
                await self.release.wait()
                return "transfer"
            return await super().ask(replica, question, generation)

        def discard(self, transfer):
            self.discarded.append(transfer)

    async def run() -> list:
        replicas = Slow()
        task = asyncio.create_task(HandOff(replicas)(_Flight(), FIRST))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        replicas.release.set()  # the prefill replica's answer arrives after the client left
        await asyncio.sleep(0.01)
        return replicas.discarded

    assert asyncio.run(run()) == ["transfer"]
