"""engine/output_processor.py with the scheduler (core/), fed fake multi-token step outputs (no weights).

Today every step samples one token per request; speculative decoding will send k. These tests send k
tokens per request per step through `Scheduler.update` (stop ids, `max_tokens` checked token by token)
and `OutputProcessor.process` (stop strings, logprobs, text), and check that the tokens after the one
that finishes a request are dropped, and that the scheduler finishes the request (its KV freed)."""

from __future__ import annotations

import pytest

from mmserve.core.request import Request, RequestStatus
from mmserve.core.step import EngineCoreOutput, ModelRunnerOutput, TokenLogprobs
from mmserve.engine.choices import ChoiceGroups
from mmserve.engine.output_processor import GRAMMAR_REFUSED, OutputProcessor
from mmserve.sampling_params import SamplingParams
from tests.unit.core_factories import make_scheduler

EOS = 2
VOCAB = {EOS: "<eos>", 10: "Hi", 11: " th", 12: "ere", 13: " STOP", 14: "!", 15: "ab", 16: "cXd", 17: "ef", 20: "p"}
PROMPT = [20, 20, 20, 20, 20]


class FakeTokenizer:
    """Each id is a fixed piece of text; the eos id is special."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(VOCAB[i] for i in ids if not (skip_special_tokens and i == EOS))


class FakeGrammars:
    def __init__(self, refuse: set[int] = frozenset()) -> None:
        self.refuse = set(refuse)
        self.released: list[str] = []

    def accept(self, request_id: str, token_ids: list[int]) -> bool:
        return not self.refuse & set(token_ids)

    def release(self, request_id: str) -> None:
        self.released.append(request_id)


class Harness:
    """A scheduler and an output processor, stepped the way the engine steps them."""

    def __init__(self, grammars: FakeGrammars | None = None) -> None:
        self.sched = make_scheduler()
        self.choices = ChoiceGroups()
        self.finished: list[str] = []
        self.grammars = grammars or FakeGrammars()
        self.proc = OutputProcessor(FakeTokenizer(), self.grammars, self.choices,
                                    on_finished=self.finished.append, clock=lambda: 100.0)

    def add(self, request_id: str = "r", **params) -> Request:
        request = Request(request_id, list(PROMPT), SamplingParams(**{"max_tokens": 16, **params}), (EOS,))
        self.proc.add(request, "prompt")
        assert self.sched.add_request(request) is None
        return request

    def step(self, sampled: dict[str, tuple[int, ...]], logprobs: dict[str, tuple[TokenLogprobs, ...]] | None = None):
        out = self.sched.schedule()
        result = ModelRunnerOutput(sampled_token_ids={r: t for r, t in sampled.items() if r in out.num_scheduled_tokens},
                                   sampled_logprobs=logprobs or {})
        outputs, cuts = self.proc.process(self.sched.update(out, result))
        for rid, cut in cuts.items():  # as Engine.step does
            if cut.num_dropped_tokens:
                self.sched.drop_tokens(rid, cut.num_dropped_tokens)
            if cut.status is not None:
                self.sched.finish_requests([rid], cut.status)
        self.sched.check_integrity()
        return outputs, {rid: cut.status for rid, cut in cuts.items() if cut.status is not None}

    def assert_idle(self) -> None:
        snap = self.sched.snapshot()
        assert not self.sched.ownership().live_request_ids and not self.proc.live_ids()
        assert snap.kv.num_free_blocks == snap.kv.num_blocks, "the finished request's KV blocks were not freed"


def _logprobs(token_id: int, value: float) -> TokenLogprobs:
    return TokenLogprobs(value, 1, (token_id, 14), (value, value - 1.0))


def test_a_stop_string_ending_inside_the_second_of_three_tokens_drops_the_third():
    h = Harness()
    h.add(stop=("X",))
    [out], to_finish = h.step({"r": (15, 16, 17)})
    completion = out.outputs[0]
    assert out.finished and completion.finish_reason == "stop" and completion.stop_reason == "X"
    assert completion.text == "abc" and completion.token_ids == [15, 16]
    assert to_finish == {"r": RequestStatus.FINISHED_STOPPED}  # the scheduler still ran it: the engine finishes it
    assert h.finished == ["r"] and h.grammars.released == ["r"]
    assert h.sched.snapshot().requests.num_generation_tokens == 2  # the dropped third token is not counted
    h.assert_idle()


def test_a_token_the_grammar_refuses_after_a_stop_string_is_surplus_not_an_error():
    h = Harness(FakeGrammars(refuse={17}))
    h.add(stop=("X",))
    [out], to_finish = h.step({"r": (15, 16, 17)})
    assert out.outputs[0].finish_reason == "stop" and out.error is None and not out.internal_error
    assert out.outputs[0].token_ids == [15, 16] and to_finish == {"r": RequestStatus.FINISHED_STOPPED}
    h.assert_idle()


def test_a_stop_string_before_a_stop_id_in_one_step_uncounts_the_tokens_after_it():
    h = Harness()
    h.add(stop=("X",))
    [out], to_finish = h.step({"r": (15, 16, EOS)})  # the scheduler finished it at EOS; "X" ended it earlier
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == "X"
    assert out.outputs[0].token_ids == [15, 16] and to_finish == {}
    assert h.sched.snapshot().requests.num_generation_tokens == 2
    h.assert_idle()


def test_include_stop_str_in_output_keeps_the_stop_string_and_still_drops_the_surplus():
    h = Harness()
    h.add(stop=("X",), include_stop_str_in_output=True)
    [out], _ = h.step({"r": (15, 16, 17)})
    assert out.outputs[0].text == "abcX" and out.outputs[0].token_ids == [15, 16]
    h.assert_idle()


def test_max_tokens_reached_inside_a_step_drops_the_surplus_in_the_scheduler():
    h = Harness()
    request = h.add(max_tokens=2)
    [out], to_finish = h.step({"r": (10, 11, 12)})
    assert out.finished and out.outputs[0].finish_reason == "length" and out.outputs[0].stop_reason is None
    assert out.outputs[0].token_ids == [10, 11] == request.output_token_ids and out.outputs[0].text == "Hi th"
    assert to_finish == {}  # the scheduler finished it itself
    assert h.sched.snapshot().requests.num_generation_tokens == 2
    h.assert_idle()


def test_a_stop_id_inside_a_step_finishes_there():
    h = Harness()
    h.add()
    [out], to_finish = h.step({"r": (10, EOS, 11)})
    completion = out.outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == EOS
    assert completion.token_ids == [10, EOS] and completion.text == "Hi" and to_finish == {}
    h.assert_idle()


def test_a_stop_id_before_min_tokens_does_not_stop_inside_a_step():
    h = Harness()
    h.add(min_tokens=3)
    [out], _ = h.step({"r": (EOS, 10, EOS, 11)})
    assert out.outputs[0].token_ids == [EOS, 10, EOS] and out.outputs[0].stop_reason == EOS
    h.assert_idle()


def test_each_of_k_tokens_gets_its_logprobs_up_to_the_stop():
    h = Harness()
    h.add(logprobs=1, stop=(" STOP",))
    values = {10: -0.5, 11: -1.5, 12: -0.25, 13: -2.0, 14: -3.0}
    [first], _ = h.step({"r": (10, 11)}, {"r": tuple(_logprobs(t, values[t]) for t in (10, 11))})
    assert [list(e) for e in first.outputs[0].logprobs] == [[10, 14], [11, 14]]
    assert first.outputs[0].logprobs[1][11].decoded_token == " th" and first.outputs[0].logprobs[1][14].rank == 2
    [last], _ = h.step({"r": (12, 13, 14)}, {"r": tuple(_logprobs(t, values[t]) for t in (12, 13, 14))})
    completion = last.outputs[0]
    assert completion.token_ids == [10, 11, 12, 13] and completion.text == "Hi there"
    assert [next(iter(e)) for e in completion.logprobs] == [10, 11, 12, 13]  # the dropped token has none
    assert completion.cumulative_logprob == pytest.approx(-0.5 - 1.5 - 0.25 - 2.0)
    h.assert_idle()


def test_streamed_deltas_add_up_to_the_text_and_hold_back_a_stop_strings_start():
    h = Harness()
    h.add(stop=(" there!",))
    deltas = []
    for tokens in [(10,), (11, 12), (13, 14)]:
        [out], _ = h.step({"r": tokens})
        deltas.append(out.delta_text)
    # " th" and " there" might begin the stop string: held back until " STOP" rules it out
    assert deltas == ["Hi", "", " there STOP!"]
    assert "".join(deltas) == out.outputs[0].text
    h.proc.abort(["r"])


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_k_tokens_a_step_give_the_outputs_of_one_token_a_step(k):
    tokens = [10, 11, 12, 14, 15, 16, 17, 11, 12, EOS]
    h = Harness()
    h.add(stop=("Xd",), logprobs=0)
    text, outputs = "", []
    for start in range(0, len(tokens), k):
        chunk = tuple(tokens[start:start + k])
        outputs, _ = h.step({"r": chunk}, {"r": tuple(_logprobs(t, -1.0) for t in chunk)})
        text += outputs[0].delta_text
        if outputs[0].finished:
            break
    completion = outputs[0].outputs[0]
    assert completion.token_ids == tokens[:6] and completion.text == text == "Hi there!abc"
    assert completion.stop_reason == "Xd" and len(completion.logprobs) == 6
    h.assert_idle()


def test_choices_pass_through_the_processor_each_with_its_own_tokens():
    h = Harness()
    params = SamplingParams(n=2, max_tokens=3)
    for choice in h.choices.split("r", params, share_prompt=False):
        request = Request(choice.request_id, list(PROMPT), choice.params, (EOS,))
        h.proc.add(request, "prompt")
        assert h.sched.add_request(request) is None
    first, _ = h.step({"r#0": (10, 11), "r#1": (10, EOS, 12)})
    assert [o.delta_index for o in first] == [0, 1] and not any(o.finished for o in first)  # choice 0 runs on
    assert [c.token_ids for c in first[1].outputs] == [[10, 11], [10, EOS]]
    assert first[1].outputs[1].finish_reason == "stop" and first[1].outputs[1].stop_reason == EOS
    [last], _ = h.step({"r#0": (12, 13, 14)})
    assert last.request_id == "r" and last.finished
    assert [(c.index, c.text, c.finish_reason) for c in last.outputs] == [(0, "Hi there", "length"), (1, "Hi", "stop")]
    h.assert_idle()


def test_a_refused_token_fails_the_request_and_the_engine_finishes_it_in_the_scheduler():
    h = Harness(FakeGrammars(refuse={11}))
    h.add()
    [out], to_finish = h.step({"r": (10, 11)})
    assert out.finished and out.outputs[0].finish_reason == "error" and out.error == GRAMMAR_REFUSED
    assert out.internal_error and to_finish == {"r": RequestStatus.FINISHED_ABORTED}
    h.assert_idle()


def test_abort_and_finish_outside_a_step():
    h = Harness()
    h.add("a")
    h.add("b")
    [aborted] = h.proc.abort(["a", "gone"])
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    handed = h.proc.finish("b", "handoff")
    assert handed.finished and handed.outputs[0].finish_reason == "handoff" and h.finished == ["a", "b"]
    assert handed.metrics.finish_time == 100.0


def test_an_error_from_the_scheduler_finishes_the_output():
    h = Harness()
    h.add()
    [out], to_finish = h.proc.process([EngineCoreOutput("r", (), "error", error="boom")])
    assert out.finished and out.error == "boom" and out.outputs[0].token_ids == [] and to_finish == {}
