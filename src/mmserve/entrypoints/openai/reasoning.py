"""Reasoning on the chat route: a thinking model's thought apart from its answer.

Role: a model writes its thought between tags of its own (`ThoughtTags`): `<think>` ... `</think>` (`THINK`:
Qwen3-VL Thinking, Qwen3.5, DeepSeek-R1 style) or Gemma 4's channel, `<|channel>thought\\n` ... `<channel|>`
(`GEMMA4`, whose tags are special tokens, so its answer is decoded with them kept). `thought_tags` picks them
from the chat template, or by vLLM's --reasoning-parser name. `split` turns an answer into (reasoning_content,
content): the text inside the tags and what follows. A thought is open when the output starts with the
opening tag or the prompt ended inside one (`opens_thought`: a generation prompt that opens it); output
without a thought is all content. `ReasoningStream` makes the same split as deltas of a growing answer (a
tail that may be the start of a tag is held back). A turn-end marker the decode left at the very end (Gemma
4's stop token, where special tokens are kept) is no part of either.
What it does not know: tools, grammars, the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mmserve.entrypoints.openai import gemma4_syntax
from mmserve.inputs.chat_template import THOUGHT_CLOSE, THOUGHT_OPEN


@dataclass(frozen=True)
class ThoughtTags:
    """How one model family writes a thought."""

    name: str
    open: str
    close: str
    label: str = ""  # written right after `open` (Gemma 4's channel name): no part of the thought
    ends: tuple[str, ...] = ()  # turn-end markers dropped from the end of the answer
    special: bool = False  # the tags are special tokens: the answer must be decoded with them kept

    def settled(self, text: str, close: bool = False) -> str:
        """What a stream may send of `text` so far: less its turn-end markers and a tail that may begin one
        (or, with `close`, the closing tag)."""
        text = without_end(text, self.ends)
        tags = (*self.ends, self.close) if close else self.ends
        return text[:len(text) - max((partial_tag_len(text, t) for t in tags), default=0)]


THINK = ThoughtTags("think", THOUGHT_OPEN, THOUGHT_CLOSE)
GEMMA4 = ThoughtTags("gemma4", gemma4_syntax.CHANNEL_OPEN, gemma4_syntax.CHANNEL_CLOSE, gemma4_syntax.THOUGHT_LABEL,
                     gemma4_syntax.TURN_ENDS, special=True)
# vLLM's --reasoning-parser names of tags other than `<think>` (any other name: the template's tags)
THOUGHT_TAGS: dict[str, ThoughtTags] = {"gemma4": GEMMA4}


@dataclass(frozen=True)
class ThoughtStart:
    """Where an answer starts: inside a thought or not, and the tags its thought is written with (a plain
    bool, wherever one is taken, means `<think>`)."""

    inside: bool
    tags: ThoughtTags = THINK


def thought_tags(chat_template: str | None, parser: str | None = None) -> ThoughtTags | None:
    """The tags of the thought the model's chat template renders, or the ones `parser` names (None: the
    template does not think)."""
    if parser in THOUGHT_TAGS:
        return THOUGHT_TAGS[parser]
    if not chat_template:
        return None
    if GEMMA4.open in chat_template:
        return GEMMA4
    return THINK if THINK.open in chat_template else None


def _start(in_thought: bool | ThoughtStart) -> ThoughtStart:
    return in_thought if isinstance(in_thought, ThoughtStart) else ThoughtStart(in_thought)


def opens_thought(prompt_text: str, tags: ThoughtTags = THINK) -> bool:
    """Does the prompt end inside a thought (the generation prompt opened one, with its label or not)?"""
    tail = prompt_text.rstrip()
    return tail.endswith(tags.open) or bool(tags.label) and tail.endswith((tags.open + tags.label).rstrip())


def _after_open(text: str, tags: ThoughtTags) -> str:
    """The thought's text, from after its opening tag where the answer writes one (else from the start)."""
    stripped = text.lstrip()
    return stripped[len(tags.open):] if stripped.startswith(tags.open) else text


def split(text: str, in_thought: bool | ThoughtStart) -> tuple[str | None, str]:
    """(reasoning, content) of a whole answer; reasoning None when there is no thought."""
    start = _start(in_thought)
    tags = start.tags
    if not start.inside and not text.lstrip().startswith(tags.open):
        return None, without_end(text, tags.ends)
    body = _after_open(text, tags)
    body = body[len(tags.label):] if tags.label and body.startswith(tags.label) else body
    end = body.find(tags.close)
    if end < 0:
        return without_end(body, tags.ends).strip("\n"), ""
    return body[:end].strip("\n"), without_end(body[end + len(tags.close):], tags.ends).lstrip("\n")


def without_end(text: str, ends: tuple[str, ...]) -> str:
    """`text` less the turn-end markers (`ends`) at its end."""
    while (end := next((e for e in ends if text.endswith(e)), None)) is not None:
        text = text[:-len(end)]
    return text


def partial_tag_len(text: str, tag: str) -> int:
    """How many characters at the end of `text` may be the start of `tag` (a stream holds them back)."""
    return max((k for k in range(1, len(tag)) if text.endswith(tag[:k])), default=0)


@dataclass
class ReasoningStream:
    in_thought: bool | ThoughtStart
    sent_reasoning: int = 0
    sent_content: int = 0
    start: ThoughtStart = field(init=False)

    def __post_init__(self) -> None:
        self.start = _start(self.in_thought)

    def update(self, text: str, finished: bool) -> tuple[str, str]:
        """(new reasoning, the content so far) of the growing answer (tool calls are parsed out of the whole
        content; `take_content` gives its new part)."""
        tags, stripped = self.start.tags, text.lstrip()
        if not finished and not self.start.inside and len(stripped) < len(tags.open) and tags.open.startswith(stripped):
            return "", ""  # may yet open a thought
        reasoning, content = split(text, self.start)
        if reasoning is None:
            return "", content if finished else tags.settled(content)
        if tags.close not in text and not finished:
            # inside the thought: hold back its label while it may still be coming, and what may begin the
            # closing tag or a turn end
            body = _after_open(text, tags)
            if tags.label and len(body) < len(tags.label) and tags.label.startswith(body):
                return "", ""
            body = body[len(tags.label):] if tags.label and body.startswith(tags.label) else body
            visible = tags.settled(body, close=True).strip("\n")  # as split strips the whole thought
            new, self.sent_reasoning = visible[self.sent_reasoning:], max(self.sent_reasoning, len(visible))
            return new, ""
        new = reasoning[self.sent_reasoning:]
        self.sent_reasoning = max(self.sent_reasoning, len(reasoning))
        return new, content if finished else tags.settled(content)

    def take_content(self, content: str) -> str:
        """The part of the content so far not sent yet."""
        new, self.sent_content = content[self.sent_content:], max(self.sent_content, len(content))
        return new
