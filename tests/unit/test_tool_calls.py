"""Tool calls: the request's tools validated, the hermes syntax parsed (a broken call stays content), the
stream's deltas (content held back only while a call may be starting), the forced-choice structural tag."""

from __future__ import annotations

import json

import pytest

from mmserve.entrypoints.openai.tool_formats import HERMES, QWEN3_XML, ToolCallStream, tool_format
from mmserve.entrypoints.openai.tools import parse_tools
from mmserve.errors import InvalidInputError

TOOLS = [{"type": "function", "function": {"name": "count", "strict": True, "parameters": {
    "type": "object", "properties": {"color": {"type": "string"}}, "required": ["color"]}}},
         {"type": "function", "function": {"name": "area"}}]


def call(name, arguments):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def streamed(stream, full):
    """(content pieces, (index, call) pairs) of `full` fed to the stream a character at a time."""
    pieces, calls = [], []
    for end in range(1, len(full) + 1):
        text, new = stream.update(full[:end], finished=end == len(full))
        pieces.append(text)
        calls += new
    return pieces, calls


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
    pieces, calls = streamed(stream, full)
    assert "".join(pieces) == "Sure."
    assert [(i, c.name, json.loads(c.arguments)) for i, c in calls] == [(0, "count", {"color": "blue"})]
    stream = ToolCallStream(HERMES, request_tools)
    assert stream.update("Sure. <tool", finished=False) == ("Sure.", [])  # the space waits for what follows
    assert stream.update("Sure. <tools are fine", finished=False) == (" <tools are fine", [])


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


# ---- Qwen3.5's XML syntax ------------------------------------------------------------------------------
XML_TOOLS = [{"type": "function", "function": {"name": "paint", "parameters": {"type": "object", "properties": {
    "color": {"type": "string"}, "coats": {"type": "integer"}, "glossy": {"type": "boolean"},
    "sizes": {"type": "array", "items": {"type": "number"}}, "shade": {"enum": ["dark", "light"]},
    "level": {"enum": [1, 2]}, "note": {"anyOf": [{"type": "string"}, {"type": "null"}]}}}}},
             {"type": "function", "function": {"name": "area"}}]


def xml_call(name, arguments):
    """A call as the Qwen3.5 chat template renders an assistant's: strings raw, other values as JSON."""
    params = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
                     for k, v in arguments.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def test_xml_calls_take_each_value_as_the_schema_types_it():
    tools = parse_tools(XML_TOOLS, "auto", None)
    arguments = {"color": "deep\nred", "coats": 2, "glossy": True, "sizes": [1.5, 2], "shade": "dark", "level": 2,
                 "note": None, "extra": "7"}
    content, calls = QWEN3_XML.parse("I will paint.\n\n" + xml_call("paint", arguments) + "\n" + xml_call("area", {}),
                                     tools)
    assert content == "I will paint."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("paint", arguments), ("area", {})]
    # a string that looks like JSON stays a string where the schema says string
    (call,) = QWEN3_XML.parse(xml_call("paint", {"color": "42", "note": "null"}), tools)[1]
    assert json.loads(call.arguments) == {"color": "42", "note": None}


@pytest.mark.parametrize("text", [
    xml_call("nope", {}), "<tool_call>\n<function=paint>\nno parameters here\n</function>\n</tool_call>",
    "<tool_call>\n<function=paint>\n<parameter=color>\nred\n</parameter>\n",  # cut by max_tokens
    "<tool_call>\n<function=paint>\n<parameter=color>\nred\n</parameter>\n<parameter=color>\nblue\n</parameter>\n"
    "</function>\n</tool_call>",  # one argument twice
    xml_call("area", {}) + " and then some text", call("paint", {"color": "red"}),  # the other syntax
])
def test_text_that_only_looks_like_an_xml_call_stays_content(text):
    assert QWEN3_XML.parse(text, parse_tools(XML_TOOLS, "auto", None)) == (text, [])


def test_an_xml_call_streams_whole_once_its_end_arrives():
    stream = ToolCallStream(QWEN3_XML, parse_tools(XML_TOOLS, "auto", None))
    full = "Sure.\n\n" + xml_call("paint", {"color": "red", "coats": 3})
    pieces, calls = streamed(stream, full)
    assert "".join(pieces) == "Sure."
    assert [(i, c.name, json.loads(c.arguments)) for i, c in calls] == [(0, "paint", {"color": "red", "coats": 3})]


def test_the_xml_forced_tag_holds_the_schema_and_accepts_what_the_template_renders():
    """The forced-call grammar (compiled by xgrammar, as the engine compiles it) accepts a call written as the
    chat template writes one, and refuses an argument the schema does not allow."""
    xgr = pytest.importorskip("xgrammar")
    forced = parse_tools(XML_TOOLS[:1], {"type": "function", "function": {"name": "paint"}}, False)
    tag = QWEN3_XML.structural_tag(forced)
    assert tag["format"]["stop_after_first"]
    assert tag["format"]["tags"][0]["begin"] == "<tool_call>\n<function=paint>\n"
    tokenizer = xgr.TokenizerInfo([chr(c) for c in range(32, 127)] + ["\n"])
    compiled = xgr.GrammarCompiler(tokenizer).compile_structural_tag(json.dumps(tag))
    char_ids = {ch: i for i, ch in enumerate([chr(c) for c in range(32, 127)] + ["\n"])}

    def accepts(text):
        matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        return all(matcher.accept_token(char_ids[ch]) for ch in text) and matcher.is_terminated()
    good = xml_call("paint", {"color": "red", "coats": 2, "glossy": False})
    assert accepts(good)
    assert QWEN3_XML.parse(good, forced)[1][0].name == "paint"
    assert not accepts(xml_call("paint", {"color": "red", "coats": "two"}))
    assert not accepts(xml_call("area", {}))


def test_the_xml_syntax_is_chosen_from_the_template_or_by_vllms_parser_name():
    qwen3_5 = "{% if tools %}<tool_call>\n<function=name>\n<parameter=key>\nvalue\n</parameter>{% endif %}"
    assert tool_format(qwen3_5) is QWEN3_XML
    assert tool_format(qwen3_5, "hermes") is HERMES and tool_format(qwen3_5, "auto") is QWEN3_XML
    assert tool_format("{% if tools %}<tool_call>{% endif %}", "qwen3_coder") is QWEN3_XML
    assert tool_format("{{ messages }}", "qwen3_xml") is None  # the template never tells the model of tools
