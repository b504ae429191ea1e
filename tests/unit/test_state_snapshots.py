"""A hybrid model's state slots and prefix snapshots in the scheduler (core/state_snapshots.py), with a fake
runner that models the recurrent state as the tokens it has folded in: a request that resumes from a snapshot
must find exactly the state of the tokens before its first computed one (never a guess), and every slot and
snapshot is accounted for after every step."""

from __future__ import annotations

import pytest

from mmserve.core.chunk_policy import ChunkBoundaryPolicy
from mmserve.core.kv_cache import KVCacheManager
from mmserve.core.scheduler import Scheduler, SchedulerLimits
from mmserve.core.state_slots import StateSlotLayout, StateSlotPool
from mmserve.core.state_snapshots import HybridStates, SnapshotBook
from mmserve.core.step import ModelRunnerOutput, SchedulerOutput
from tests.unit.core_factories import FakeRunner, make_items, make_request, run_to_completion

BLOCK = 4


def hybrid_scheduler(num_slots: int = 4, max_snapshots: int = 8, num_blocks: int = 64,
                     max_num_batched_tokens: int = 64, snapshot_interval: int | None = None) -> Scheduler:
    kv = KVCacheManager(num_blocks, BLOCK, True)
    states = HybridStates(StateSlotPool(StateSlotLayout(num_slots, 100, max_snapshots)), max_snapshots, BLOCK)
    kv.on_evict = states.evicted
    chunking = ChunkBoundaryPolicy(snapshot_block_size=BLOCK if max_snapshots else None,
                                   snapshot_interval=snapshot_interval)
    return Scheduler(SchedulerLimits(max_num_seqs=8, max_num_batched_tokens=max_num_batched_tokens), kv,
                     make_items(), chunking, states=states)


class StateRunner(FakeRunner):
    """FakeRunner plus the state: a slot holds the token ids it has folded in, a snapshot a copy of one."""

    def __init__(self) -> None:
        super().__init__()
        self.slots: dict[int, list[int]] = {}
        self.slot_of: dict[str, int] = {}
        self.tokens: dict[str, list[int]] = {}
        self.snapshots: dict[int, list[int]] = {}
        self.restored: list[tuple[str, int]] = []  # (request id, tokens resumed from a snapshot)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for rid in out.finished_request_ids:
            self.slot_of.pop(rid, None)
        for new in out.new_requests:
            assert new.state_slot not in self.slot_of.values(), "a slot given to two live requests"
            self.tokens[new.request_id] = list(new.token_ids)
            self.slot_of[new.request_id] = new.state_slot
            if new.state_restore is None:
                assert new.num_computed_tokens == 0, "a prefix hit without a state to resume from"
                self.slots[new.state_slot] = []
            else:
                state = list(self.snapshots[new.state_restore])
                assert state == list(new.token_ids[:new.num_computed_tokens]), "resumed from a wrong state"
                self.slots[new.state_slot] = state
                self.restored.append((new.request_id, new.num_computed_tokens))
        starts = {rid: self.progress.get(rid, 0) for rid in out.num_scheduled_tokens}
        for new in out.new_requests:
            starts[new.request_id] = new.num_computed_tokens
        result = super().execute(out)
        for rid, n in out.num_scheduled_tokens.items():
            if rid not in result.skipped:
                self.slots[self.slot_of[rid]].extend(self.tokens[rid][starts[rid]:starts[rid] + n])
            if rid in result.sampled_token_ids:
                self.tokens[rid].append(result.sampled_token_ids[rid])
        for rid, snapshot_id in out.state_snapshots.items():
            if rid not in result.skipped:
                self.snapshots[snapshot_id] = list(self.slots[self.slot_of[rid]])
                assert len(self.snapshots[snapshot_id]) % BLOCK == 0, "a snapshot off a block boundary"
        return result


def test_a_repeated_prompt_resumes_from_the_snapshot_at_its_last_full_block():
    sched, runner = hybrid_scheduler(), StateRunner()
    first = make_request(10, max_tokens=2)
    sched.add_request(first)
    run_to_completion(sched, runner)
    # the prefill chunk that would cross the prompt's last full block (8) ends there
    assert runner.history[0].num_scheduled_tokens[first.request_id] == 8
    assert runner.history[0].state_snapshots == {first.request_id: 0}
    again = make_request(prompt=list(first.prompt_token_ids), max_tokens=2)
    sched.add_request(again)
    run_to_completion(sched, runner)
    assert runner.restored == [(again.request_id, 8)] and again.num_cached_tokens == 8
    assert again.output_token_ids == first.output_token_ids


def test_the_next_turn_resumes_from_the_deepest_decode_snapshot():
    sched, runner = hybrid_scheduler(), StateRunner()
    turn1 = make_request(10, max_tokens=9)
    sched.add_request(turn1)
    run_to_completion(sched, runner)
    history = list(turn1.prompt_token_ids) + turn1.output_token_ids[:-1]  # 18 computed tokens
    turn2 = make_request(prompt=history + [turn1.output_token_ids[-1], 30, 31, 32], max_tokens=1)
    sched.add_request(turn2)
    run_to_completion(sched, runner)
    assert runner.restored == [(turn2.request_id, 16)]  # the deepest boundary turn 1 decoded across


@pytest.mark.parametrize("interval, resumed", [(None, []), (8, [40])])
def test_a_snapshot_interval_lets_a_prompt_sharing_part_of_another_resume_where_they_part(interval, resumed):
    """Two prompts sharing their first 40 tokens (10 blocks): the first's own snapshot (its last full block,
    44) lies past the shared part, so the second resumes only from an interval's snapshot (at 40)."""
    sched, runner = hybrid_scheduler(max_snapshots=16, snapshot_interval=interval), StateRunner()
    shared = [200 + i for i in range(40)]
    first = make_request(prompt=shared + [1, 2, 3, 4, 5, 6], max_tokens=1)
    sched.add_request(first)
    run_to_completion(sched, runner)
    assert [h.num_scheduled_tokens[first.request_id] for h in runner.history[:2]] == ([44, 2] if interval is None
                                                                                    else [8, 8])
    second = make_request(prompt=shared + [7, 8, 9], max_tokens=1)
    sched.add_request(second)
    run_to_completion(sched, runner)
    assert [n for _, n in runner.restored] == resumed and second.num_cached_tokens == sum(resumed)
    sched.states.check_integrity(set())


def test_a_prefix_hit_without_a_snapshot_is_not_taken():
    sched, runner = hybrid_scheduler(max_snapshots=0), StateRunner()
    first = make_request(10, max_tokens=2)
    sched.add_request(first)
    run_to_completion(sched, runner)
    assert runner.history[0].num_scheduled_tokens[first.request_id] == 10  # no cut without snapshots
    again = make_request(prompt=list(first.prompt_token_ids), max_tokens=2)
    sched.add_request(again)
    run_to_completion(sched, runner)
    assert runner.restored == [] and again.num_cached_tokens == 0


def test_snapshots_are_bounded_and_leave_with_their_blocks():
    sched, runner = hybrid_scheduler(max_snapshots=2, num_blocks=12), StateRunner()
    prompts = [[100 + 10 * k + i for i in range(9)] for k in range(4)]
    for prompt in prompts:  # each takes a prompt-end snapshot; the book keeps two, the KV few blocks
        request = make_request(prompt=list(prompt), max_tokens=1)
        sched.add_request(request)
        run_to_completion(sched, runner)
    assert len(sched.states.book.by_hash) <= 2
    sched.states.check_integrity(set())
    for prompt in prompts:  # whatever hits now resumes from a right state (StateRunner asserts it)
        sched.add_request(make_request(prompt=list(prompt), max_tokens=1))
    run_to_completion(sched, runner)


def test_preempted_requests_recompute_from_zero_state_and_slots_come_back():
    sched, runner = hybrid_scheduler(num_slots=2, num_blocks=6, max_num_batched_tokens=16), StateRunner()
    reqs = [make_request(prompt=[50 + 7 * k + i for i in range(6)], max_tokens=8) for k in range(3)]
    for r in reqs:
        sched.add_request(r)
    run_to_completion(sched, runner)
    assert all(r.output_token_ids == [7] * 8 for r in reqs)
    assert sched.stats.num_preemptions > 0
    assert sched.states.slots.num_free == 2


def test_book_hands_out_each_id_once_and_evicts_least_recent():
    book = SnapshotBook(2)
    a, b = book.reserve(), book.reserve()
    book.commit(a, b"a")
    book.commit(b, b"b")
    book.lookup(b"a")  # a is now the more recent
    c = book.reserve()
    assert c == b and b"b" not in book.by_hash  # b was the least recently used
    book.cancel(c)
    book.check_integrity()
    d = book.reserve()
    book.commit(d, b"d")
    book.held.update({b"a", b"d"})
    assert book.reserve() is None  # every saved snapshot is some running request's: a full book takes none
    book.check_integrity()
