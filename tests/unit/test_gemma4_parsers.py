"""Gemma 4's answers parsed: its `<|tool_call>call:NAME{...}<tool_call|>` calls (unquoted keys, `<|"|>`
strings), whole and streamed alike, its `<|channel>thought\\n` ... `<channel|>` thought, the syntax chosen from
the template or by vLLM's parser names, the forced-call structural tag, and why the answer must be decoded
with its special tokens kept."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mmserve.entrypoints.openai import gemma4_syntax
from mmserve.entrypoints.openai.chat import ChatServing, _parses_special_tokens
from mmserve.entrypoints.openai.reasoning import (
    GEMMA4 as GEMMA4_THOUGHT,
)
from mmserve.entrypoints.openai.reasoning import (
    THINK,
    ReasoningStream,
    ThoughtStart,
    opens_thought,
    split,
    thought_tags,
)
from mmserve.entrypoints.openai.tool_formats import GEMMA4, HERMES, TOOL_FORMATS, ToolCallStream, tool_format
from mmserve.entrypoints.openai.tools import parse_tools
from mmserve.outputs import CompletionOutput

Q = gemma4_syntax.STRING_DELIMITER
WEATHER = {"type": "object", "properties": {
    "location": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer"}, "flags": {"type": "array", "items": {"type": "boolean"}},
    "opts": {"type": "object", "properties": {"deep": {"type": "string"}}}}, "required": ["location"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time"}}]
BRIEF_CALL = (f"<|tool_call>call:get_weather{{location:{Q}Paris, France{Q},unit:{Q}celsius{Q},days:3,"
              f"flags:[true,false],opts:{{deep:{Q}x{Q}}}}}<tool_call|>")
BRIEF_ARGS = {"location": "Paris, France", "unit": "celsius", "days": 3, "flags": [True, False],
              "opts": {"deep": "x"}}
TEMPLATE = Path(__file__).resolve().parents[2] / "testkit" / "gemma4_chat_template.jinja"


def call(name: str, body: str) -> str:
    return f"{gemma4_syntax.CALL_BEGIN}{name}{{{body}}}{gemma4_syntax.CALL_END}"


def named(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.fixture
def request_tools():
    return parse_tools(TOOLS, "auto", None)


# ---- a finished answer -------------------------------------------------------------------------------
def test_a_call_is_read_with_its_typed_arguments(request_tools):
    content, calls = GEMMA4.parse(BRIEF_CALL, request_tools)
    assert content is None and named(calls) == [("get_weather", BRIEF_ARGS)]


def test_parallel_calls_follow_one_another_and_content_comes_before(request_tools):
    text = "Let me look.\n" + call("get_weather", f"location:{Q}Oslo{Q}") + call("get_time", "") + "<turn|>"
    content, calls = GEMMA4.parse(text, request_tools)
    assert content == "Let me look."
    assert named(calls) == [("get_weather", {"location": "Oslo"}), ("get_time", {})]
    single = parse_tools(TOOLS, "auto", False)  # parallel_tool_calls false: the first call only
    assert named(GEMMA4.parse(text, single)[1]) == [("get_weather", {"location": "Oslo"})]


@pytest.mark.parametrize("body, arguments", [
    (f"a:{{b:[1,-2.5,1e3,0,true,false,null,{Q}x{Q},[],{{}}]}},c:{{}}",
     {"a": {"b": [1, -2.5, 1000.0, 0, True, False, None, "x", [], {}]}, "c": {}}),
    (f"s:{Q}a, b {{c}} [d] \"e\" 'f'\ng: h,{Q}", {"s": "a, b {c} [d] \"e\" 'f'\ng: h,"}),
    (f"empty:{Q}{Q},n:-0.5E-2", {"empty": "", "n": -0.005}),
    (f"{Q}quoted key{Q}:1, spaced : [ 1 , 2 ] ", {"quoted key": 1, "spaced": [1, 2]}),  # lenient where unambiguous
    (f"deep:[[[{{k:{Q}v{Q}}}]]]", {"deep": [[[{"k": "v"}]]]}),
])
def test_values_are_read_as_json_would_write_them(request_tools, body, arguments):
    assert named(GEMMA4.parse(call("get_weather", body), request_tools)[1]) == [("get_weather", arguments)]


@pytest.mark.parametrize("text", [
    call("get_forecast", f"location:{Q}Oslo{Q}"),  # no such tool
    call("get_weather", "location:Oslo"),  # a bare word: strings are always delimited
    call("get_weather", '"location":"Oslo"'),  # JSON, not Gemma's notation
    call("get_weather", f"location:{Q}Oslo{Q},"),  # a trailing comma
    call("get_weather", f"location:{Q}Oslo{Q},location:{Q}Bergen{Q}"),  # a repeated key
    call("get_weather", f"location:{Q}Oslo"),  # an unterminated string
    call("get_weather", "days:3x"),
    call("get_weather", "days:[1,2"),
    call("get_weather", "days:01"),  # JSON allows no leading zero
    "<|tool_call>call:get_weather{days:3}} trailing<tool_call|>",
    "<|tool_call>get_weather{days:3}<tool_call|>",  # no `call:`
    "<|tool_call>call:get_weather{days:3}",  # never closed
    call("get_weather", "days:3") + " and then some text",  # text after the last call
    call("get_weather", "[" * 5000 + "]" * 5000),  # deeper than Python's stack: no crash, no call
])
def test_a_malformed_call_stays_content(request_tools, text):
    assert GEMMA4.parse(text, request_tools) == (text, [])


def test_a_turn_end_left_at_the_end_is_no_content(request_tools):
    for end in gemma4_syntax.TURN_ENDS:
        assert GEMMA4.parse("Just an answer." + end, request_tools) == ("Just an answer.", [])
        assert named(GEMMA4.parse(BRIEF_CALL + end, request_tools)[1]) == [("get_weather", BRIEF_ARGS)]
    assert HERMES.parse("Just an answer.<turn|>", request_tools) == ("Just an answer.<turn|>", [])  # only Gemma's


# ---- streaming ---------------------------------------------------------------------------------------
STREAMED = [
    BRIEF_CALL,
    "Checking both.\n" + call("get_weather", f"location:{Q}a<b>c{Q}") + call("get_time", "") + "<|tool_response>",
    "A plain answer, with <b>markup</b> and a < sign.<turn|>",
    "Almost: " + call("get_weather", "location:Oslo") + "<turn|>",  # a broken call: all content
    "<|tool_call>not a call",
]


@pytest.mark.parametrize("text", STREAMED)
def test_streamed_at_every_character_the_calls_and_content_are_the_finished_ones(request_tools, text):
    content, calls = GEMMA4.parse(text, request_tools)
    stream, pieces, streamed = ToolCallStream(GEMMA4, request_tools), [], []
    for end in range(1, len(text) + 1):
        new, fresh = stream.update(text[:end], finished=end == len(text))
        pieces.append(new)
        streamed += [c for _, c in fresh]
    assert "".join(pieces) == (content or "")
    assert named(streamed) == named(calls)
    assert not any(t in "".join(pieces) for t in gemma4_syntax.TURN_ENDS)


@pytest.mark.parametrize("text", STREAMED)
def test_streamed_in_two_chunks_cut_anywhere_the_result_is_the_same(request_tools, text):
    content, calls = GEMMA4.parse(text, request_tools)
    for cut in range(len(text)):
        stream = ToolCallStream(GEMMA4, request_tools)
        first, early = stream.update(text[:cut], finished=False)
        rest, late = stream.update(text, finished=True)
        assert first + rest == (content or "") and named(c for _, c in early + late) == named(calls)


# ---- the thought channel -----------------------------------------------------------------------------
THOUGHTS = [
    ("<|channel>thought\nThe user wants Paris.\n<channel|>It is sunny.<turn|>", False,
     ("The user wants Paris.", "It is sunny.")),
    ("Opened by the prompt.<channel|>\nAnswer.", True, ("Opened by the prompt.", "Answer.")),
    ("thought\nThe prompt opened the channel only.<channel|>Answer.", True,
     ("The prompt opened the channel only.", "Answer.")),
    ("A plain answer.<turn|>", False, (None, "A plain answer.")),
    ("<|channel>thought\n<channel|>Empty thought.", False, ("", "Empty thought.")),
    ("<|channel>thought\nstill thinking when max_tokens came", False, ("still thinking when max_tokens came", "")),
    ("<|channel>thought\nthe turn ended inside it<turn|>", False, ("the turn ended inside it", "")),
    ("<|channel>thought\nthought\nlabel twice<channel|>x", False, ("thought\nlabel twice", "x")),
    ("<|chan is not a tag", False, (None, "<|chan is not a tag")),
    ("<think>\nQwen's tags are text here</think>", False, (None, "<think>\nQwen's tags are text here</think>")),
]


@pytest.mark.parametrize("text, inside, expected", THOUGHTS)
def test_gemma4_thought_split_whole_and_streamed_alike(text, inside, expected):
    start = ThoughtStart(inside, GEMMA4_THOUGHT)
    assert split(text, start) == expected
    stream, thought, answer = ReasoningStream(start), "", ""
    for end in range(1, len(text) + 1):
        new, answer = stream.update(text[:end], finished=end == len(text))
        thought += new
        assert expected[1].startswith(answer)  # the answer only grows: nothing sent is taken back
    assert thought == (expected[0] or "") and answer == expected[1]


@pytest.mark.parametrize("text, inside, expected", THOUGHTS)
def test_gemma4_thought_streamed_with_a_tag_cut_at_a_chunk_end(text, inside, expected):
    for cut in range(len(text)):
        stream = ReasoningStream(ThoughtStart(inside, GEMMA4_THOUGHT))
        early, early_answer = stream.update(text[:cut], finished=False)
        late, answer = stream.update(text, finished=True)
        assert early + late == (expected[0] or "") and expected[1].startswith(early_answer)
        assert answer == expected[1]


def test_think_tags_are_unchanged_and_a_bool_still_means_them():
    text = "<think>\nLook.\n</think>\n\nA red circle."
    assert split(text, False) == split(text, ThoughtStart(False, THINK)) == ("Look.", "A red circle.")
    assert split("<|channel>thought\nx<channel|>y", False) == (None, "<|channel>thought\nx<channel|>y")


def test_a_thought_then_calls_as_chat_answers_them(request_tools):
    text = "<|channel>thought\nNeed the weather.<channel|>" + BRIEF_CALL + "<turn|>"
    completion = CompletionOutput(0, text, [1, 2, 3], "stop")
    message, finish = ChatServing.message_of(completion, (request_tools, GEMMA4), ThoughtStart(False, GEMMA4_THOUGHT))
    assert message.reasoning == "Need the weather." and message.content is None and finish == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", BRIEF_ARGS)]
    plain = CompletionOutput(0, "Sunny.<turn|>", [1], "stop")
    assert ChatServing.message_of(plain, (request_tools, GEMMA4), ThoughtStart(False, GEMMA4_THOUGHT))[0].content \
        == "Sunny."


@pytest.mark.parametrize("prompt, opens", [
    ("<|turn>user\nHi<turn|>\n<|turn>model\n<|channel>thought\n", True),
    ("<|turn>user\nHi<turn|>\n<|turn>model\n<|channel>", True),
    ("<|turn>user\nHi<turn|>\n<|turn>model\n<|channel>thought\n<channel|>", False),  # thinking off
    ("<|turn>user\nHi<turn|>\n<|turn>model\n", False),  # thinking on: the model opens the channel itself
    ("<|tool_response>response:get_time{value:<|\"|>noon<|\"|>}<tool_response|>", False),
])
def test_a_generation_prompt_that_opens_the_channel(prompt, opens):
    assert opens_thought(prompt, GEMMA4_THOUGHT) is opens
    assert not opens_thought(prompt)  # Qwen's tags are not Gemma's


# ---- choosing the syntax -----------------------------------------------------------------------------
def test_the_syntax_is_chosen_from_the_template_or_by_vllms_parser_names():
    snippet = "{% if tools %}{{- '<|tool_call>call:' + name + '{' -}}{% endif %}{{ '<|channel>thought\\n' }}"
    assert tool_format(snippet) is GEMMA4 and tool_format(snippet, "auto") is GEMMA4
    assert tool_format(snippet, "hermes") is HERMES
    assert tool_format("{% if tools %}<tool_call>{% endif %}", "gemma4") is GEMMA4 and TOOL_FORMATS["gemma4"] is GEMMA4
    assert thought_tags(snippet) is GEMMA4_THOUGHT and thought_tags(snippet, "qwen3") is GEMMA4_THOUGHT
    assert thought_tags("{{ x }}", "gemma4") is GEMMA4_THOUGHT and thought_tags("{{ x }}") is None
    assert thought_tags("<think>{{ r }}</think>") is THINK and thought_tags("<think>", "deepseek_r1") is THINK


def test_special_tokens_are_kept_where_a_parser_reads_them(request_tools):
    assert _parses_special_tokens(None, GEMMA4_THOUGHT)
    assert _parses_special_tokens((request_tools, GEMMA4), None)
    assert not _parses_special_tokens((parse_tools(TOOLS, "none", None), GEMMA4), None)  # no call is parsed
    assert not _parses_special_tokens((request_tools, HERMES), THINK) and not _parses_special_tokens(None, None)


@pytest.mark.skipif(not TEMPLATE.is_file(), reason="the official Gemma 4 template is not in testkit")
def test_the_official_template_is_read_back_by_its_own_parsers(request_tools):
    """Gemma 4's own template: chosen by its markers; its generation prompts (thinking on or off) do not open
    a thought; the calls it renders for an earlier assistant message parse back to the same calls."""
    from mmserve.inputs.chat_template import ChatTemplate

    source = TEMPLATE.read_text()
    assert tool_format(source) is GEMMA4 and thought_tags(source) is GEMMA4_THOUGHT
    template = ChatTemplate(source, {"bos_token": "<bos>", "eos_token": "<eos>"})
    user = [{"role": "user", "content": "Weather?"}]
    for thinking in (False, True):
        prompt = template.render(user, True, enable_thinking=thinking)
        assert not opens_thought(prompt, GEMMA4_THOUGHT)
    arguments = {"location": "Paris, France", "days": 3, "flags": [True, False], "opts": {"deep": "a {b}, \"c\""}}
    assistant = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}},
        {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": {}}}]}
    rendered = template.render([*user, assistant], False, tools=TOOLS)
    calls = rendered[rendered.index(gemma4_syntax.CALL_OPEN, rendered.index("<|turn>model")):]
    calls = calls[:calls.rindex(gemma4_syntax.CALL_END) + len(gemma4_syntax.CALL_END)]
    assert named(GEMMA4.parse(calls, request_tools)[1]) == [("get_weather", arguments), ("get_time", {})]


# ---- forcing a call ----------------------------------------------------------------------------------
def test_the_forced_tag_holds_each_tool_in_gemmas_notation(request_tools):
    required = GEMMA4.structural_tag(parse_tools(TOOLS, "required", None))
    assert required["type"] == "structural_tag"
    fmt = required["format"]
    assert fmt["type"] == "tags_with_separator" and fmt["separator"] == "" and fmt["at_least_one"]
    assert not fmt["stop_after_first"]
    assert [(t["begin"], t["end"]) for t in fmt["tags"]] == [("<|tool_call>call:get_weather", "<tool_call|>"),
                                                             ("<|tool_call>call:get_time", "<tool_call|>")]
    content = fmt["tags"][0]["content"]
    assert content["type"] == "json_schema" and content["style"] == "gemma" and content["json_schema"] == WEATHER
    assert "<tool_call|>" in content["excludes"]
    named_choice = GEMMA4.structural_tag(parse_tools(TOOLS, {"type": "function", "function": {"name": "get_time"}},
                                                     None))["format"]
    assert named_choice["stop_after_first"] and [t["begin"] for t in named_choice["tags"]] == [
        "<|tool_call>call:get_time"]


def test_the_forced_grammar_accepts_what_the_parser_reads_and_refuses_the_rest():
    xgr = pytest.importorskip("xgrammar")
    forced = parse_tools(TOOLS, "required", None)
    # one token per character, and Gemma's markers as tokens of their own (as in its tokenizer)
    vocab = [chr(c) for c in range(32, 127)] + ["\n", "<|tool_call>", "<tool_call|>", Q, "<turn|>"]
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo(vocab)).compile_structural_tag(
        json.dumps(GEMMA4.structural_tag(forced)))

    def accepts(text: str) -> bool:
        matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        return matcher.accept_string(text) and matcher.is_terminated()

    good = BRIEF_CALL + call("get_time", "")
    assert accepts(good) and named(GEMMA4.parse(good, forced)[1]) == [("get_weather", BRIEF_ARGS), ("get_time", {})]
    assert accepts(call("get_weather", f"location:{Q}a, b {{c}}\n\"d\"{Q}"))
    for bad in (call("get_weather", "location:Oslo"), call("get_weather", '"location":"Oslo"'),
                call("get_weather", f"location:{Q}Oslo{Q},days:{Q}3{Q}"),  # a string where the schema says integer
                call("get_weather", "days:3"),  # its required location left out
                call("get_weather", f"location:{Q}Oslo{Q},extra:1"),  # a property the schema does not have
                call("get_forecast", ""), "No call at all."):
        assert not accepts(bad), bad


# ---- why the answer is decoded with its special tokens ---------------------------------------------------
def test_gemmas_markers_survive_only_a_decode_that_keeps_special_tokens(request_tools):
    """Every marker is a special token: the OpenAI default (skip_special_tokens) leaves `call:NAME{key:text}`,
    which no parser can read; decoded token by token with them kept, the answer parses."""
    tiny = pytest.importorskip("testkit.tiny_gemma4_tokenizer")
    from mmserve.engine.detokenizer import IncrementalDetokenizer

    tokenizer = tiny.build_tokenizer()
    text = "<|channel>thought\nNeed it.<channel|>" + BRIEF_CALL + "<turn|>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    answers = {}
    for skip in (True, False):
        detokenizer = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=skip)
        for token in ids:
            detokenizer.update([token])
        detokenizer.take_delta(finished=True)
        answers[skip] = detokenizer.output_text
    assert "<|tool_call>" not in answers[True] and "call:get_weather{location:Paris, France" in answers[True]
    assert answers[False] == text
    for skip, answer in answers.items():
        reasoning, content = split(answer, ThoughtStart(False, GEMMA4_THOUGHT))
        calls = GEMMA4.parse(content, request_tools)[1]
        assert (reasoning, named(calls)) == ((None, []) if skip else ("Need it.", [("get_weather", BRIEF_ARGS)]))
