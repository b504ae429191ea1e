"""Structured outputs on xgrammar: every output of a constrained request matches its schema, regex, choice
or grammar (greedy and sampled, with images, in mixed batches, chunked, preempted, n > 1); unconstrained
neighbours are untouched; bad grammars are refused naming the field; matchers are released."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmserve import LLM, InvalidInputError, SamplingParams, StructuredOutputsParams
from mmserve.demo import shapes
from mmserve.demo.eval import default_model_dir
from testkit.conversations import parity_workload

SHAPE_SCHEMA = {"type": "object", "properties": {
    "color": {"enum": list(shapes.COLOR_NAMES)}, "shape": {"enum": list(shapes.KINDS)},
    "count": {"type": "integer", "minimum": 1, "maximum": 3}}, "required": ["color", "shape", "count"],
    "additionalProperties": False}

# JSON Schema features xgrammar supports, each a schema of its own, bounded so a random model ends
SCHEMAS = [
    SHAPE_SCHEMA,
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "score": {"type": "number", "minimum": 0,
                                                                            "maximum": 1}},
     "required": ["ok", "score"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                               "maxItems": 2},
                                      "inner": {"type": "object", "properties": {"n": {"type": "integer",
                                                                                      "minimum": 0, "maximum": 9}},
                                                "required": ["n"], "additionalProperties": False}},
     "required": ["tags", "inner"], "additionalProperties": False},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                      "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{1,3}$"}},
     "required": ["name", "code"], "additionalProperties": False},
    {"anyOf": [{"type": "null"}, {"const": "none"}, {"type": "integer", "minimum": 0, "maximum": 99}]},
]


def _leaf_schemas() -> st.SearchStrategy[dict]:
    word = st.text(alphabet="abcxyz", min_size=1, max_size=4)
    low = st.integers(-20, 20)
    return st.one_of(
        st.lists(word, min_size=1, max_size=4, unique=True).map(lambda ws: {"enum": ws}),
        word.map(lambda w: {"const": w}),
        low.map(lambda lo: {"type": "integer", "minimum": lo, "maximum": lo + 30}),
        st.just({"type": "number", "minimum": 0, "maximum": 1}),
        st.just({"type": "boolean"}), st.just({"type": "null"}),
        st.integers(1, 6).map(lambda n: {"type": "string", "maxLength": n}),
        st.just({"type": "string", "pattern": "^[a-z]{1,4}$"}),
    )


def _schemas() -> st.SearchStrategy[dict]:
    """JSON schemas over the features xgrammar supports, bounded so that a sampled model ends them."""
    def compound(children: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
        return st.one_of(
            st.dictionaries(st.sampled_from(["a", "b", "c", "d"]), children, min_size=1, max_size=3).map(
                lambda props: {"type": "object", "properties": props, "required": sorted(props),
                               "additionalProperties": False}),
            st.tuples(children, st.integers(0, 3)).map(
                lambda t: {"type": "array", "items": t[0], "maxItems": t[1]}),
            st.lists(children, min_size=2, max_size=2).map(lambda cs: {"anyOf": cs}),
        )
    return st.recursive(_leaf_schemas(), compound, max_leaves=4)


@pytest.fixture(scope="module")
def demo():
    return LLM(str(default_model_dir()))


def _chats(count: int, start: int = 0) -> list:
    return [shapes.make_sample(7, i, "describe").messages for i in range(start, start + count)]


def _valid(params: StructuredOutputsParams, text: str) -> bool:
    if params.json is not None:
        try:
            jsonschema.validate(json.loads(text), json.loads(params.json))
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if params.json_object:
        try:
            return isinstance(json.loads(text), dict)
        except ValueError:
            return False
    if params.regex is not None:
        return re.fullmatch(params.regex, text) is not None
    return text in params.choice


@pytest.mark.parametrize("temperature", [0.0, 1.3])
def test_every_kind_of_constraint_holds_with_images(demo, temperature):
    """Schemas (a picture's shapes into an object, and the other supported features), any JSON object,
    a regex, a choice and an EBNF grammar: each finished output matches; sampled ones too."""
    cases = [StructuredOutputsParams(json=s) for s in SCHEMAS] + [
        StructuredOutputsParams(json_object=True),
        StructuredOutputsParams(regex=r"(a|an) (red|blue|green|yellow) (circle|square|triangle)"),
        StructuredOutputsParams(choice=["circle", "square", "triangle", "none of them"]),
        StructuredOutputsParams(grammar='root ::= "count: " [1-3] ("." | "!")')]
    chats = _chats(len(cases))
    params = [SamplingParams(temperature=temperature, seed=11, max_tokens=96, structured_outputs=c) for c in cases]
    outputs = demo.chat(chats, params, use_tqdm=False)
    for case, out in zip(cases, outputs):
        completion = out.outputs[0]
        if case.json_object and completion.finish_reason == "length":
            continue  # an untrained model may write a long object: only finished outputs must parse
        assert completion.finish_reason == "stop", (case, completion.text)
        if case.grammar is not None:
            assert re.fullmatch(r"count: [1-3][.!]", completion.text), completion.text
        else:
            assert _valid(case, completion.text), (case, completion.text)
    demo.engine.check_integrity()
    assert demo.get_stats()["grammar_matchers"] == 0


@settings(max_examples=4, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(schemas=st.lists(_schemas(), min_size=6, max_size=6))
def test_generated_schemas_hold_for_sampled_outputs(demo, schemas):
    """Property: for generated schemas (enums, consts, bounded numbers, booleans, nulls, length-bounded and
    patterned strings, objects, arrays, anyOf, nested), every sampled output that finishes validates."""
    cases = [StructuredOutputsParams(json=schema) for schema in schemas]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=160, structured_outputs=c) for i, c in enumerate(cases)]
    finished = 0
    for case, out in zip(cases, demo.chat(_chats(len(cases), start=80), params, use_tqdm=False)):
        if out.outputs[0].finish_reason == "stop":
            finished += 1
            assert _valid(case, out.outputs[0].text), (case.json, out.outputs[0].text)
    assert finished >= 3  # the bounds let most end: a property over outputs that exist
    assert demo.get_stats()["grammar_matchers"] == 0


def test_demo_model_fills_a_schema_from_the_picture(demo):
    """The demo model (never trained on JSON) answers the describe question in the schema's fields with
    a colour and kind the picture holds far more often than chance (one pair in twelve per shape)."""
    hits = 0
    samples = [shapes.make_sample(3, i, "describe") for i in range(16)]
    schema = {"type": "object", "properties": {"color": {"enum": list(shapes.COLOR_NAMES)},
                                               "shape": {"enum": list(shapes.KINDS)}},
              "required": ["color", "shape"], "additionalProperties": False}
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=schema))
    for sample, out in zip(samples, demo.chat([s.messages for s in samples], params, use_tqdm=False)):
        answer = json.loads(out.outputs[0].text)
        scene_pairs = {(s.color, s.kind) for s in sample.scenes[0].shapes}
        hits += (answer["color"], answer["shape"]) in scene_pairs
    assert hits >= 6, hits  # chance: about 3 of 16


def test_unconstrained_neighbours_are_untouched(demo):
    """A request's tokens are the same alone and in a batch where other rows carry grammars."""
    chats = _chats(6, start=20)
    plain = SamplingParams(temperature=0, max_tokens=24)
    alone = demo.chat(chats[0::2], plain, use_tqdm=False)
    constrained = SamplingParams(temperature=0, max_tokens=80,
                                 structured_outputs=StructuredOutputsParams(json=SHAPE_SCHEMA))
    mixed = demo.chat(chats, [plain, constrained, plain, constrained, plain, constrained], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in alone] == [mixed[i].outputs[0].token_ids for i in (0, 2, 4)]
    for i in (1, 3, 5):
        assert _valid(constrained.structured_outputs, mixed[i].outputs[0].text)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_5"])  # qwen3_5: the state recomputed, forked, resumed
def test_grammar_follows_chunking_preemption_and_n_choices(all_checkpoints, family):
    """On a tiny random checkpoint, a tight KV cache preempts and prompts are chunked: greedy constrained
    outputs equal those of an unhurried engine and stay valid; n=3 greedy gives 3 identical valid
    outputs, n=3 sampled 3 valid ones, each choice with its own matcher."""
    model_dir = str(all_checkpoints[family])
    chats = parity_workload(family)[:8]
    so = StructuredOutputsParams(json=SCHEMAS[3])
    params = SamplingParams(temperature=0, max_tokens=48, structured_outputs=so)
    calm = LLM(model_dir)
    tight = LLM(model_dir, num_kv_blocks=24, max_num_batched_tokens=64)
    expected = calm.chat(chats, params, use_tqdm=False)
    hurried = tight.chat(chats, params, use_tqdm=False)
    assert tight.get_stats()["num_preemptions"] > 0
    assert [o.outputs[0].token_ids for o in expected] == [o.outputs[0].token_ids for o in hurried]
    for out in hurried:
        if out.outputs[0].finish_reason == "stop":
            assert _valid(so, out.outputs[0].text), out.outputs[0].text
    greedy = calm.chat(chats[0], SamplingParams(n=3, temperature=0, max_tokens=48, structured_outputs=so),
                       use_tqdm=False)[0]
    assert len({c.text for c in greedy.outputs}) == 1
    sampled = calm.chat(chats[1], SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=48,
                                                 structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
                        use_tqdm=False)[0]
    assert all(c.text in ("yes", "no") for c in sampled.outputs)
    for engine in (calm, tight):
        engine.engine.check_integrity()
        assert engine.get_stats()["grammar_matchers"] == 0


def test_length_bounded_strings_stay_valid_json(demo):
    """xgrammar 0.2.9 lets raw control characters into a maxLength string; mmserve's rewrite keeps every
    such output parseable and within its bounds, sampled hot."""
    schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": 1, "maxLength": 5}},
              "required": ["s"], "additionalProperties": False}
    so = StructuredOutputsParams(json=schema)
    params = [SamplingParams(temperature=2.0, seed=i, max_tokens=30, structured_outputs=so) for i in range(12)]
    for out in demo.chat(_chats(12, start=40), params, use_tqdm=False):
        if out.outputs[0].finish_reason == "stop":
            value = json.loads(out.outputs[0].text)["s"]
            assert 1 <= len(value) <= 5 and not any(ord(c) < 0x20 for c in value)
    with pytest.raises(InvalidInputError) as info:
        demo.chat(_chats(1), SamplingParams(structured_outputs=StructuredOutputsParams(
            json={"type": "string", "maxLength": 3, "pattern": "^a+$"})), use_tqdm=False)
    assert info.value.param == "structured_outputs"


def test_abort_mid_generation_releases_the_matcher(demo):
    engine = demo.engine
    prompt = engine.process_chat(_chats(1, start=60)[0])
    engine.add_request("grammar-abort", prompt, SamplingParams(
        temperature=0, max_tokens=64, structured_outputs=StructuredOutputsParams(json=SHAPE_SCHEMA)))
    for _ in range(4):
        engine.step()
    assert demo.get_stats()["grammar_matchers"] == 1
    engine.abort_request(["grammar-abort"])
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_integrity()
    assert demo.get_stats()["grammar_matchers"] == 0


@pytest.mark.parametrize("bad", [
    dict(json={"type": "object", "properties": {"a": {"type": "nonsense"}}}),
    dict(json="{not json"),
    dict(regex="(unclosed"),
    dict(grammar="root ::= missing_rule"),
    dict(choice=[]),
    dict(json={"type": "object"}, regex="a"),
    dict(),
])
def test_bad_grammars_are_refused_naming_the_field(demo, bad):
    with pytest.raises(InvalidInputError) as info:
        params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(**bad))
        demo.chat(_chats(1), params, use_tqdm=False)
    assert info.value.param == "structured_outputs"
    out = demo.chat(_chats(1), SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason is not None
    demo.engine.check_integrity()


@pytest.fixture(scope="module")
def thinking_llm(tmp_path_factory):
    """A tiny checkpoint whose template thinks and whose thought tags are single tokens."""
    from testkit.tiny_checkpoints import build_checkpoint

    llm = LLM(str(build_checkpoint(tmp_path_factory.mktemp("thinking"), thinking=True)), dtype="float32")
    tok = llm.engine.processor.tokenizer
    yield llm, tok.token_to_id("<think>"), tok.token_to_id("</think>")
    llm.engine.check_integrity()


def _thinking_chat(seed: int = 0) -> list[dict]:
    return shapes.make_sample(3, seed, "describe").messages


def test_grammar_applies_after_a_thought_the_prompt_opened(thinking_llm):
    """The generation prompt opened a thought: the thought is free (here the bias makes its first token the
    closing tag, which no JSON could start with) and the schema holds from the token after it."""
    llm, open_id, close_id = thinking_llm
    so = StructuredOutputsParams(json=SHAPE_SCHEMA)
    params = SamplingParams(temperature=0, max_tokens=60, logit_bias={close_id: 100}, structured_outputs=so)
    (out,) = llm.chat([_thinking_chat()], params, use_tqdm=False, chat_template_kwargs={"enable_thinking": True})
    assert open_id in out.prompt_token_ids[-3:]
    ids = out.outputs[0].token_ids
    assert ids[0] == close_id
    assert close_id not in ids[1:]  # after the thought the mask holds, whatever the bias
    answer = llm.engine.processor.tokenizer.decode(list(ids[1:]))
    jsonschema.validate(json.loads(answer), SHAPE_SCHEMA)
    # outside a thought the closing tag is masked, whatever its bias (here the opening tag is biased away)
    params = SamplingParams(temperature=0, max_tokens=60, logit_bias={close_id: 100, open_id: -100},
                            structured_outputs=so)
    (plain,) = llm.chat([_thinking_chat()], params, use_tqdm=False)
    assert close_id not in plain.outputs[0].token_ids
    jsonschema.validate(json.loads(plain.outputs[0].text), SHAPE_SCHEMA)
    assert llm.get_stats()["grammar_matchers"] == 0
    llm.engine.check_integrity()


def test_a_model_may_open_a_thought_before_the_grammar(thinking_llm):
    """Without a thought in the prompt the first token may open one: the mask allows the grammar's tokens and
    the opening tag, not the closing one; inside the thought there is no mask; after its closing tag the
    grammar's mask alone, the tags excluded."""
    llm, open_id, close_id = thinking_llm
    structured = llm.engine.structured
    tok = llm.engine.processor.tokenizer
    brace = tok.token_to_id("{")

    def allowed(rid: str) -> set[int] | None:
        rows = structured.fill([rid])
        if rid not in rows:
            return None
        words = rows[rid].tolist()
        return {t for t in (open_id, close_id, brace) if (words[t // 32] >> (t % 32)) & 1}

    so = StructuredOutputsParams(json=SHAPE_SCHEMA)
    structured.start("probe", so, tok.encode("<|im_start|>assistant\n"))
    try:
        assert allowed("probe") == {open_id, brace}
        assert structured.accept("probe", [open_id])
        assert allowed("probe") is None  # inside the thought: unconstrained
        assert structured.accept("probe", tok.encode("two shapes") + [open_id])
        assert allowed("probe") is None
        assert structured.accept("probe", [close_id])
        assert allowed("probe") == {brace}
        assert structured.accept("probe", tok.encode('{"color":"red"'))  # compact: no space after separators
        assert not structured.accept("probe", [close_id])  # the thought is over: its tags are not JSON
    finally:
        structured.release("probe")
    assert not structured.tracked_ids()
    # the engine path: bias opens a thought (allowed by the mask), then the bias alone rules inside it
    params = SamplingParams(temperature=0, max_tokens=4, logit_bias={open_id: 100}, structured_outputs=so)
    (out,) = llm.chat([_thinking_chat(1)], params, use_tqdm=False)
    assert out.outputs[0].token_ids == [open_id] * 4
    llm.engine.check_integrity()
