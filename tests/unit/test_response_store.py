"""The Responses API's store (responses_store.py) on a fake clock: bounded by bytes and by age, the oldest
evicted first; an unknown, deleted or evicted id is ResponseNotStored (the route's 404); a chain deeper than
the limit is ChainTooDeep (the route's 400); the byte count is always the sum of what it holds."""

from __future__ import annotations

import pytest

from mmserve.entrypoints.openai.responses_store import (
    ChainTooDeep,
    ResponseNotStored,
    ResponseStore,
    json_size_bytes,
)


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def response(response_id: str, text: str = "hi") -> dict:
    return {"id": response_id, "output": [{"type": "message", "id": f"msg_{response_id}", "role": "assistant",
                                          "status": "completed", "content": [{"type": "output_text", "text": text}]}]}


def user(text: str, item_id: str = "") -> dict:
    return {"type": "message", "id": item_id or f"msg_{text}", "role": "user", "content": text, "status": "completed"}


def entry_bytes(response_id: str, items: list[dict], text: str = "hi") -> int:
    return json_size_bytes(response(response_id, text)) + json_size_bytes(items)


def test_the_oldest_go_first_when_the_bytes_run_out():
    clock = FakeClock()
    size = entry_bytes("resp_0", [user("q")])
    store = ResponseStore(max_bytes=3 * size, clock=clock)
    for i in range(3):
        assert store.put(f"resp_{i}", response(f"resp_{i}"), [user("q")], 0)
        clock.now_s += 1
    assert len(store) == 3 and store.num_bytes == 3 * size
    store.check_integrity()
    store.put("resp_3", response("resp_3"), [user("q")], 0)  # one more: the oldest goes
    assert "resp_0" not in store and all(f"resp_{i}" in store for i in (1, 2, 3))
    store.check_integrity()
    # an entry of two entries' bytes: the two oldest go
    big = [user("q" * (2 * size - entry_bytes("resp_big", [user("", "msg_big")])), "msg_big")]
    assert entry_bytes("resp_big", big) == 2 * size
    assert store.put("resp_big", response("resp_big"), big, 0)
    assert [r for r in ("resp_1", "resp_2", "resp_3", "resp_big") if r in store] == ["resp_3", "resp_big"]
    assert store.num_evicted == 3
    store.check_integrity()


def test_a_response_over_the_whole_budget_is_not_kept():
    store = ResponseStore(max_bytes=1000, clock=FakeClock())
    store.put("resp_small", response("resp_small"), [user("q")], 0)
    assert not store.put("resp_huge", response("resp_huge"), [user("q" * 2000)], 0)
    assert "resp_huge" not in store and "resp_small" in store  # nothing else was evicted for it
    store.check_integrity()


def test_responses_expire_by_age():
    clock = FakeClock()
    store = ResponseStore(max_age_s=60, clock=clock)
    store.put("resp_old", response("resp_old"), [user("q")], 0)
    clock.now_s += 30
    store.put("resp_new", response("resp_new"), [user("q")], 0)
    clock.now_s += 29.5
    assert store.get("resp_old").response["id"] == "resp_old"
    clock.now_s += 0.5  # resp_old is 60 s old
    with pytest.raises(ResponseNotStored) as missing:
        store.get("resp_old")
    assert missing.value.response_id == "resp_old" and "evicted" in str(missing.value) and "60 s" in str(missing.value)
    assert "resp_new" in store and store.num_bytes == entry_bytes("resp_new", [user("q")])
    clock.now_s += 30
    assert len(store) == 0 and store.num_bytes == 0
    store.check_integrity()


def test_unknown_and_deleted_ids_are_not_stored():
    store = ResponseStore(clock=FakeClock())
    with pytest.raises(ResponseNotStored):
        store.get("resp_never")
    with pytest.raises(ResponseNotStored):
        store.delete("resp_never")
    store.put("resp_1", response("resp_1"), [user("q")], 0)
    store.delete("resp_1")
    with pytest.raises(ResponseNotStored):
        store.get("resp_1")
    assert store.num_bytes == 0
    store.check_integrity()


def test_a_stored_response_holds_its_whole_conversation():
    """A continuation's input items are the earlier conversation and its own input, so it needs no older
    response: it outlives the one it continued."""
    store = ResponseStore(clock=FakeClock())
    store.put("resp_1", response("resp_1", "three"), [user("q1")], 0)
    first = store.get("resp_1")
    assert first.conversation == [user("q1"), response("resp_1", "three")["output"][0]]
    store.put("resp_2", response("resp_2", "two"), [*first.conversation, user("q2")], store.chain_depth_after(first))
    store.delete("resp_1")
    second = store.get("resp_2")
    assert [item["id"] for item in second.conversation] == ["msg_q1", "msg_resp_1", "msg_q2", "msg_resp_2"]
    assert second.chain_depth == 1
    store.check_integrity()


def test_a_chain_deeper_than_the_limit_is_refused():
    store = ResponseStore(max_chain_depth=2, clock=FakeClock())
    assert store.chain_depth_after(None) == 0
    previous = None
    for i in range(3):
        depth = store.chain_depth_after(previous)
        store.put(f"resp_{i}", response(f"resp_{i}"), [user(f"q{i}")], depth)
        previous = store.get(f"resp_{i}")
    assert previous.chain_depth == 2
    with pytest.raises(ChainTooDeep, match="at most 2"):
        store.chain_depth_after(previous)
    store.check_integrity()


def test_integrity_catches_a_wrong_count_and_the_limits_are_checked():
    store = ResponseStore(clock=FakeClock())
    store.put("resp_1", response("resp_1"), [user("q")], 0)
    store.num_bytes += 1
    with pytest.raises(AssertionError):
        store.check_integrity()
    for bad in ({"max_bytes": 0}, {"max_age_s": 0}, {"max_chain_depth": 0}):
        with pytest.raises(ValueError):
            ResponseStore(**bad)


def test_replacing_an_id_counts_its_bytes_once():
    store = ResponseStore(clock=FakeClock())
    store.put("resp_1", response("resp_1"), [user("q")], 0)
    store.put("resp_1", response("resp_1", "longer text"), [user("q")], 0)
    assert len(store) == 1 and store.num_bytes == entry_bytes("resp_1", [user("q")], "longer text")
    store.check_integrity()
