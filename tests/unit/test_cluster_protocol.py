"""What crosses between the API server and a replica (cluster/protocol.py): one frozen dataclass per intent,
no verb in a string, and a replica that handles each message and answers each question by its type."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from mmserve.cluster import protocol
from mmserve.cluster.protocol import AbortRequest, AddRequest, Query, Question, ReceiveKV, Stop

TO_A_REPLICA = {AddRequest, ReceiveKV, AbortRequest, Query, Stop}


def _messages() -> list[type]:
    return [c for c in vars(protocol).values() if isinstance(c, type) and dataclasses.is_dataclass(c)
            and c.__module__ == protocol.__name__]


@pytest.mark.parametrize("message", _messages(), ids=lambda c: c.__name__)
def test_every_message_is_frozen_and_carries_no_verb(message):
    assert message.__dataclass_params__.frozen
    assert not {"what", "args", "verb", "op"} & {f.name for f in dataclasses.fields(message)}


def test_a_replica_handles_every_message_and_answers_every_question_by_type():
    from mmserve.cluster.replica_worker import _Replica

    replica = _Replica(engine=None, inbox=None, outbox=None, connector=None)
    assert set(replica._handlers) == TO_A_REPLICA
    assert set(replica._answerers) == set(typing.get_args(Question))
