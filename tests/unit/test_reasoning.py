"""Reasoning: a thought split from the answer, whole and streamed alike."""

from __future__ import annotations

import pytest

from mmserve.entrypoints.openai.reasoning import ReasoningStream, opens_thought, split
from mmserve.inputs.chat_template import thinks

CASES = [
    ("<think>\nLook at the colours.\n</think>\n\nA red circle.", False, ("Look at the colours.", "A red circle.")),
    ("Look first.\n</think>\n\nA square.", True, ("Look first.", "A square.")),  # the prompt opened the thought
    ("A plain answer.", False, (None, "A plain answer.")),
    ("<think>\nstill thinking when max_tokens came", False, ("still thinking when max_tokens came", "")),
    ("<thinking is not a tag", False, (None, "<thinking is not a tag")),
]


@pytest.mark.parametrize("text, in_thought, expected", CASES)
def test_split_and_stream_agree(text, in_thought, expected):
    assert split(text, in_thought) == expected
    stream = ReasoningStream(in_thought)
    thought = ""
    for end in range(1, len(text) + 1):
        new, answer = stream.update(text[:end], finished=end == len(text))
        thought += new
        assert not answer or expected[1].startswith(answer)  # the answer only grows
    assert thought == (expected[0] or "") and answer == expected[1]


def test_templates_and_prompts_that_think():
    assert thinks("{% if reasoning %}<think>{{ reasoning }}</think>{% endif %}") and not thinks("{{ x }}")
    assert opens_thought("<|im_start|>assistant\n<think>\n") and not opens_thought("<|im_start|>assistant\n")
