"""Tool calls: the request's tools validated, the hermes syntax parsed (a broken call stays content), the
stream's deltas (content held back only while a call may be starting), the forced-choice structural tag."""

from __future__ import annotations

import json

import pytest

from mmserve.entrypoints.openai.tools import HERMES, ToolCallStream, parse_tools, tool_format
from mmserve.errors import InvalidInputError

TOOLS = [{"type": "function", "function": {"name": "count", "strict": True, "parameters": {
    "type": "object", "properties": {"color": {"type": "string"}}, "required": ["color"]}}},
         {"type": "function", "function": {"name": "area"}}]


def call(name, arguments):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


@pytest.fixture
def request_tools():
    return parse_tools(TOOLS, "auto", None)


def test_parse_calls_and_content(request_tools):
    content, calls = HERMES.parse("Let me count.\n" + call("count", {"color": "red"}) + "\n" + call("area", {}),
                                  request_tools)
    assert content == "Let me count."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("count", {"color": "red"}), ("area", {})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    assert HERMES.parse(call("count", {"color": "red"}), request_tools)[0] is None


def test_without_parallel_calls_only_the_first_is_taken():
    two = call("count", {"color": "red"}) + "\n" + call("area", {})
    content, calls = HERMES.parse(two, parse_tools(TOOLS, "auto", False))
    assert content is None and [c.name for c in calls] == ["count"]


@pytest.mark.parametrize("text", [
    "plain answer", "<tool_call>\n{not json}\n</tool_call>", call("nope", {}),
    "<tool_call>\n{\"name\": \"count\", \"arguments\": {\"color\": \"r",  # cut by max_tokens
    call("count", {"color": "red"}) + " and then some text", "<tool_call>\n[1, 2]\n</tool_call>",
    "<tool_call>\n{\"name\": \"count\", \"arguments\": \"red\"}\n</tool_call>",
])
def test_text_that_only_looks_like_a_call_stays_content(request_tools, text):
    assert HERMES.parse(text, request_tools) == (text, [])


def test_stream_holds_back_only_a_possible_opening_tag(request_tools):
    stream = ToolCallStream(HERMES, request_tools)
    full = "Sure." + call("count", {"color": "blue"})
    pieces, calls = [], []
    for end in range(1, len(full) + 1):
        text, new = stream.update(full[:end], finished=end == len(full))
        pieces.append(text)
        calls += new
    assert "".join(pieces) == "Sure."
    assert [(i, c.name, json.loads(c.arguments)) for i, c in calls] == [(0, "count", {"color": "blue"})]
    assert ToolCallStream(HERMES, request_tools).update("Sure. <tool", finished=False) == ("Sure. ", [])


def test_stream_sends_a_broken_call_as_content_at_the_end(request_tools):
    stream = ToolCallStream(HERMES, request_tools)
    broken = "Hi <tool_call>\n{oops}\n</tool_call>"
    sent = stream.update(broken[:8], finished=False)[0] + stream.update(broken, finished=True)[0]
    assert sent == broken and not stream.calls


def test_forced_choice_tag_holds_the_tools(request_tools):
    forced = parse_tools(TOOLS, {"type": "function", "function": {"name": "count"}}, False)
    tag = HERMES.structural_tag(forced)["format"]
    assert tag["stop_after_first"] and tag["at_least_one"]
    assert [t["begin"] for t in tag["tags"]] == ['<tool_call>\n{"name": "count", "arguments": ']
    assert "color" in tag["tags"][0]["content"]["grammar"]  # its parameters' schema
    required = HERMES.structural_tag(parse_tools(TOOLS, "required", None))["format"]
    assert not required["stop_after_first"] and len(required["tags"]) == 2
    assert "color" not in required["tags"][1]["content"]["grammar"]  # a tool without parameters: an empty object


@pytest.mark.parametrize("strict", [False, None, "absent", "inside parameters"])
def test_forced_calls_follow_the_schema_whatever_strict_says(strict):
    """instructor's and LangChain's forced calls send no `strict` (or put it inside `parameters`, where it is no
    schema keyword): the arguments are held to the schema all the same, as vLLM holds them."""
    schema = {"type": "object", "properties": {"color": {"type": "string"}}, "required": ["color"]}
    function = {"name": "count", "parameters": dict(schema)}
    if strict == "inside parameters":
        function["parameters"]["strict"] = True
    elif strict != "absent":
        function["strict"] = strict
    tools = parse_tools([{"type": "function", "function": function}], "required", None)
    assert tools.tools[0].parameters == schema  # `strict` is stripped from the schema, not compiled into it
    assert "color" in HERMES.structural_tag(tools)["format"]["tags"][0]["content"]["grammar"]
    from mmserve.engine.structured_outputs import json_schema_ebnf  # the grammar of the schema itself
    assert json_schema_ebnf(tools.tools[0].parameters, "tools") == json_schema_ebnf(schema, "tools")


def test_nullable_tool_fields_mean_their_defaults():
    tools = parse_tools([{"type": "function", "function": {"name": "area", "parameters": None, "strict": None,
                                                           "description": None}}], None, None)
    assert tools.choice == "auto" and tools.tools[0].parameters == {"type": "object", "properties": {}}


@pytest.mark.parametrize("tools, choice, param", [
    (None, "required", "tool_choice"), ([], {"type": "function", "function": {"name": "x"}}, "tool_choice"),
    (TOOLS, {"type": "function", "function": {"name": "missing"}}, "tool_choice"), (TOOLS, "sometimes", "tool_choice"),
    ("count", "auto", "tools"), ([{"type": "function", "function": {"name": "bad name!"}}], "auto", "tools[0]"),
    ([{"type": "retrieval"}], "auto", "tools[0]"), (TOOLS + TOOLS[:1], "auto", "tools[2]"),
])
def test_bad_tools_name_the_field(tools, choice, param):
    with pytest.raises(InvalidInputError) as info:
        parse_tools(tools, choice, None)
    assert info.value.param == param


def test_format_is_chosen_from_the_template():
    assert tool_format("{% if tools %}...<tool_call>...{% endif %}") is HERMES
    assert tool_format("{{ messages }}") is None and tool_format(None) is None
