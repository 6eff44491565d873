"""Constrained decoding without a model: random logits (what a random-weight model gives) sampled through the
real sampler with the grammar that server/constrained.py builds and gpu_worker/grammar.py compiles against the
tiny checkpoint's tokenizer. With the grammar the text is valid (JSON that validates, a tool call whose
arguments validate); the must-fail twin: the same logits and seed without the grammar give invalid output."""
from __future__ import annotations

import json

import jsonschema_rs
import pytest
import torch

from gpu_worker.grammar import GrammarCompiler
from gpu_worker.sampling import Sampler, SamplingParams
from server import constrained, tool_calls
from server.errors import APIError

VOCAB = 1024
STOPS = (2, 11)
SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1, "maximum": 14},
    "metric": {"type": "boolean"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "days", "metric", "unit"], "additionalProperties": False}
TOOLS = {"get_weather": SCHEMA, "get_time": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                             "required": ["zone"]}}


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from tools.synth_tokenizer import write_tokenizer
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer(d, VOCAB)
    return d


@pytest.fixture(scope="module")
def hf(tok_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(tok_dir))


@pytest.fixture(scope="module")
def compiler(tok_dir):
    return GrammarCompiler(tok_dir, VOCAB, STOPS)


def sample(compiler, spec, seed, max_tokens=300):
    """Tokens from random logits, with the grammar of `spec` (None: unconstrained); ends at a stop token."""
    grammar = compiler.matcher(spec["structural_tag"], spec["special_tokens"]) if spec is not None else None
    s = Sampler(SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens), grammar=grammar)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(max_tokens):
        t = s.step(torch.randn(VOCAB, generator=gen) * 2)[0]
        out.append(t)
        if t in STOPS:
            break
    return out, grammar


def _matcher(compiler, spec):
    """A fresh xgrammar matcher of the spec, to feed strings."""
    return compiler.matcher(spec["structural_tag"], spec["special_tokens"]).m


def _json_valid(text, schema) -> bool:
    try:
        return jsonschema_rs.is_valid(schema, json.loads(text))
    except ValueError:
        return False


def test_json_schema_output_validates_and_the_unconstrained_twin_does_not(compiler, hf):
    spec = constrained.for_chat({"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA,
                                                                        "strict": True}}, {}, None, True, False)
    for seed in range(3):
        ids, g = sample(compiler, spec, seed)
        assert ids[-1] in STOPS and g.rejected is None
        text = hf.decode(ids[:-1])
        assert _json_valid(text, SCHEMA), text
        free, _ = sample(compiler, None, seed)
        assert not _json_valid(hf.decode([t for t in free if t not in STOPS]), SCHEMA)


def test_schemas_are_read_strictly_unless_they_allow_more_keys(compiler):
    loose = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    for strict in (True, False, None):
        spec = constrained.for_chat({"type": "json_schema", "json_schema": {"schema": loose, "strict": strict}},
                                    {}, None, True, False)
        assert not _matcher(compiler, spec).accept_string('{"a": 1, "b": 2}')
        assert _matcher(compiler, spec).accept_string('{"a": 1}')
    # must-fail twin: the schema that says so gets its extra keys
    spec = constrained.for_chat({"type": "json_schema", "json_schema": {"schema": {**loose,
                                "additionalProperties": True}}}, {}, None, True, False)
    assert _matcher(compiler, spec).accept_string('{"a": 1, "b": 2}')


def test_json_object_is_an_object(compiler, hf):
    spec = constrained.for_chat({"type": "json_object"}, {}, None, True, False)
    m = _matcher(compiler, spec)
    assert m.accept_string('{"x": [1, {"y": null}]}') and m.is_completed()
    m = _matcher(compiler, spec)
    assert not m.accept_string('[1, 2]')


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_call_parses_and_its_arguments_validate(compiler, hf, choice):
    spec = constrained.for_chat(None, TOOLS, choice, True, False)
    for seed in range(3):
        ids, g = sample(compiler, spec, seed)
        assert ids[-1] in STOPS and g.rejected is None
        text = hf.decode(ids[:-1], skip_special_tokens=False)
        content, calls = tool_calls.parse(text, TOOLS)
        assert calls, text
        if isinstance(choice, dict):
            assert {c["function"]["name"] for c in calls} == {"get_weather"}
        for c in calls:
            assert jsonschema_rs.is_valid(TOOLS[c["function"]["name"]], json.loads(c["function"]["arguments"])), c
        # must-fail twin: without the grammar, no call comes out of the same seed
        free, _ = sample(compiler, None, seed)
        assert tool_calls.parse(hf.decode(free, skip_special_tokens=False), TOOLS)[1] == []


def test_no_parallel_calls_stops_after_the_first(compiler, hf):
    spec = constrained.for_chat(None, TOOLS, "required", False, False)
    for seed in range(4):
        ids, _ = sample(compiler, spec, seed)
        assert hf.decode(ids, skip_special_tokens=False).count("<tool_call>") == 1


def test_tool_choice_none_never_opens_a_call(compiler, hf):
    spec = constrained.for_chat(None, TOOLS, "none", True, False)
    m = _matcher(compiler, spec)
    assert m.accept_string("Sunny, 21 degrees.")
    assert not m.accept_string("<tool_call>")


def test_reasoning_comes_first_when_the_prompt_opened_think(compiler):
    spec = constrained.for_chat({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, {}, None, True, True)
    m = _matcher(compiler, spec)
    assert m.accept_string('Paris, a week, metric.</think>\n{"city": "Paris", "days": 7, "metric": true, '
                           '"unit": "celsius"}')
    assert m.is_completed()
    # must-fail twin: the same answer without the reasoning's end is refused
    m = _matcher(compiler, spec)
    assert not (m.accept_string('{"city": "Paris", "days": 7, "metric": true, "unit": "celsius"}')
                and m.is_completed())


def test_special_tokens_are_never_allowed_inside_constrained_text(compiler, hf):
    spec = constrained.for_chat({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, {}, None, True, False)
    g = compiler.matcher(spec["structural_tag"], spec["special_tokens"])
    g.m.accept_string('{"city": "Pa')
    words = torch.zeros((VOCAB + 31) // 32, dtype=torch.int32)
    g.fill(words)
    allowed = {i for i in range(VOCAB) if (int(words[i // 32]) >> (i % 32)) & 1}
    specials = set(range(0, 20))
    assert allowed & specials == set()
    assert len(allowed) > 500          # ordinary text pieces are


@pytest.mark.parametrize("rf,match", [
    ({"type": "json_schema", "json_schema": {"schema": {"type": "bogus"}}}, "bogus"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema is missing"),
    ({"type": "json_schema"}, "json_schema must be"),
    ({"type": "yaml"}, "not supported"),
])
def test_bad_response_formats_are_a_400_that_names_the_problem(rf, match):
    with pytest.raises(APIError, match=match) as e:
        constrained.for_chat(rf, {}, None, True, False)
    assert e.value.status == 400


@pytest.mark.parametrize("choice,match", [
    ("required", "needs tools"), ({"type": "function", "function": {"name": "nope"}}, "not among the tools"),
    ("sometimes", "tool_choice must be")])
def test_bad_tool_choices_are_a_400(choice, match):
    with pytest.raises(APIError, match=match):
        constrained.for_chat(None, {} if choice == "required" else TOOLS, choice, True, False)


def test_a_forced_tool_and_a_response_format_together_are_refused():
    with pytest.raises(APIError, match="cannot both"):
        constrained.for_chat({"type": "json_object"}, TOOLS, "required", True, False)
