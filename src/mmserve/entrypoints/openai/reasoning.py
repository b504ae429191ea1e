"""Reasoning on the chat route: a thinking model's thought apart from its answer.

Role: for a chat template that thinks (it renders `<think>`, as Qwen3-VL Thinking's does), `split` turns an
answer into (reasoning_content, content): the text inside `<think>` ... `</think>` and what follows. A
thought is open when the output starts with `<think>` or the prompt ended inside one (a generation prompt
that opens it); output without a thought is all content. `ReasoningStream` makes the same split as deltas
of a growing answer (a tail that may be the start of a tag is held back).
What it does not know: tools, grammars, the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from mmserve.inputs.chat_template import THOUGHT_CLOSE as CLOSE
from mmserve.inputs.chat_template import THOUGHT_OPEN as OPEN


def opens_thought(prompt_text: str) -> bool:
    """Does the prompt end inside a thought (the generation prompt opened `<think>`)?"""
    tail = prompt_text.rstrip()
    return tail.endswith(OPEN)


def split(text: str, in_thought: bool) -> tuple[str | None, str]:
    """(reasoning, content) of a whole answer; reasoning None when there is no thought."""
    stripped = text.lstrip()
    if not in_thought and not stripped.startswith(OPEN):
        return None, text
    body = stripped[len(OPEN):] if stripped.startswith(OPEN) else text
    end = body.find(CLOSE)
    if end < 0:
        return body.strip("\n"), ""
    return body[:end].strip("\n"), body[end + len(CLOSE):].lstrip("\n")


def partial_tag_len(text: str, tag: str) -> int:
    """How many characters at the end of `text` may be the start of `tag` (a stream holds them back)."""
    return max((k for k in range(1, len(tag)) if text.endswith(tag[:k])), default=0)


@dataclass
class ReasoningStream:
    in_thought: bool
    sent_reasoning: int = 0
    sent_content: int = 0

    def update(self, text: str, finished: bool) -> tuple[str, str]:
        """(new reasoning, the content so far) of the growing answer (tool calls are parsed out of the whole
        content; `take_content` gives its new part)."""
        stripped = text.lstrip()
        if not finished and not self.in_thought and len(stripped) < len(OPEN) and OPEN.startswith(stripped):
            return "", ""  # may yet open a thought
        reasoning, content = split(text, self.in_thought)
        if reasoning is None:
            return "", content
        if CLOSE not in text and not finished:
            # inside the thought: hold back what may begin the closing tag
            body = stripped[len(OPEN):] if stripped.startswith(OPEN) else text
            visible = body[:len(body) - partial_tag_len(body, CLOSE)].strip("\n")  # as split strips the whole thought
            new, self.sent_reasoning = visible[self.sent_reasoning:], max(self.sent_reasoning, len(visible))
            return new, ""
        new = reasoning[self.sent_reasoning:]
        self.sent_reasoning = max(self.sent_reasoning, len(reasoning))
        return new, content

    def take_content(self, content: str) -> str:
        """The part of the content so far not sent yet."""
        new, self.sent_content = content[self.sent_content:], max(self.sent_content, len(content))
        return new
