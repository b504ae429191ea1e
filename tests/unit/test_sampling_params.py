import dataclasses

import pytest

from mmserve.errors import InvalidInputError
from mmserve.sampling_params import SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (1, 1.0, 1.0, 0, 0.0, None)
    assert (p.max_tokens, p.min_tokens, p.ignore_eos) == (16, 0, False)
    assert p.skip_special_tokens is True and p.include_stop_str_in_output is False
    assert p.stop == () and p.stop_token_ids == ()
    assert not p.is_greedy


def test_penalty_and_bias_defaults_are_neutral_and_normalised():
    p = SamplingParams()
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.logit_bias == {} and p.allowed_token_ids is None and p.bad_words == () and p.logprobs is None
    assert not p.needs_penalties
    q = SamplingParams(logit_bias={3: 1}, allowed_token_ids=[4, 4, 2], bad_words=["x"], repetition_penalty=1.1)
    assert q.logit_bias == {3: 1.0} and q.allowed_token_ids == (4, 2) and q.bad_words == ("x",)
    assert q.needs_penalties


def test_stop_forms_are_normalised_to_tuples():
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    assert SamplingParams(stop_token_ids=[3, 7]).stop_token_ids == (3, 7)


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        SamplingParams().temperature = 0.5


@pytest.mark.parametrize("kwargs, message", [
    ({"n": 0}, r"n must be an integer in \[1, 128\]"),
    ({"n": 2.0}, "n must be"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.1}, "min_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 17, "max_tokens": 16}, "must not exceed max_tokens"),
    ({"stop_token_ids": [1, -3]}, "stop_token_ids"),
    ({"stop": ""}, "stop must not contain empty strings"),
    ({"stop": ["ok", ""]}, "stop must not contain empty strings"),
    ({"stop": ["ok", 3]}, "stop must be a string"),
    ({"seed": 1.5}, "seed"),
    # found by the fuzzers (tests/models/test_fuzz_offline.py): these raised TypeError or were accepted
    ({"stop": 5}, "stop must be a string or a list"),
    ({"stop_token_ids": 5}, "stop_token_ids must be a list"),
    ({"seed": 2**64}, r"seed must be null or an integer in \[-2\*\*63, 2\*\*64\)"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"ignore_eos": {"x": 1}}, "ignore_eos must be true or false"),
    ({"skip_special_tokens": None}, "skip_special_tokens must be true or false"),
    ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output must be true or false"),
    ({"presence_penalty": 2.5}, r"presence_penalty must be a number in \[-2, 2\]"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"frequency_penalty": "1"}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be a finite number > 0"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias keys must be token ids"),
    ({"logit_bias": {5: 101}}, r"logit_bias values must be numbers in \[-100, 100\]"),
    ({"logit_bias": [5]}, "logit_bias must map token ids to numbers"),
    ({"allowed_token_ids": []}, "allowed_token_ids must be a non-empty list"),
    ({"allowed_token_ids": [1, -1]}, "allowed_token_ids must be token ids"),
    ({"bad_words": "word"}, "bad_words must be a list of strings"),
    ({"bad_words": ["ok", " "]}, "bad_words must be non-empty strings"),
    ({"logprobs": 21}, r"logprobs must be null or an integer in \[0, 20\]"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"truncate_prompt_tokens": 0}, r"truncate_prompt_tokens must be null, -1 or an integer >= 1"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": 2.0}, "truncate_prompt_tokens"),
])
def test_validation_errors(kwargs, message):
    with pytest.raises(InvalidInputError, match=message) as raised:
        SamplingParams(**kwargs)
    assert raised.value.param in kwargs  # the field at fault, for the server's error JSON


def test_invalid_input_error_is_a_value_error():
    with pytest.raises(ValueError):
        SamplingParams(top_p=0)


@pytest.mark.parametrize("kwargs, greedy", [
    ({"temperature": 0.0}, True),
    ({"top_k": 1}, True),
    ({"temperature": 0.7, "top_k": 1}, True),
    ({"temperature": 0.7}, False),
    ({"top_k": -1}, False),
    ({"top_k": 2}, False),
])
def test_is_greedy(kwargs, greedy):
    assert SamplingParams(**kwargs).is_greedy is greedy


def test_boundary_values_are_accepted():
    p = SamplingParams(top_p=1.0, top_k=-1, min_p=1.0, min_tokens=16, max_tokens=16, stop_token_ids=[0])
    assert p.min_tokens == p.max_tokens
