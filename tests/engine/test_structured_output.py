"""Structured output on the engine: every output of a bounded JSON schema or regex, sampled
at temperature 1 on a random model, ends, parses and validates; JSON is compact; the
grammar's mask is the same with overlapped scheduling; rows with and without grammars,
penalties and bans get in a batch what they get alone; bad constraints name their field."""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import LLM, SamplingParams
from engine.dummy_models import DummyModel
from engine.request import InvalidRequestError
from engine.sampling.grammar import GrammarCompiler
from engine.structured_output import StructuredOutput, StructuredOutputError
from engine.tokenizer import dummy_tokenizer, load_tokenizer
from tests.support.tiny_models import make_tiny_model

VOCAB = 320


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Llama with a byte-level tokenizer: ids 0-255 the bytes, the rest words
    " w<id>" (engine.tokenizer), EOS 2."""
    directory = tmp_path_factory.mktemp("tiny-structured")
    _, path = make_tiny_model(directory, vocab_size=VOCAB, dtype=torch.float64)
    dummy_tokenizer(DummyModel("llama", {"vocab_size": VOCAB, "eos_token_id": 2})).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, dtype="float64", block_size=4, max_num_seqs=16, overlap_scheduling=True)


# ------------------------------------------------------------------ bounded schemas
def leaf_schemas():
    return st.one_of(
        st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
                  st.integers(-1000, 1000), st.integers(0, 5000)),
        st.just({"type": "boolean"}),
        st.just({"type": "null"}),
        st.lists(st.text("abcxyz ", min_size=1, max_size=6), min_size=1, max_size=4, unique=True).map(
            lambda values: {"enum": values}),
        st.integers(0, 8).map(lambda n: {"type": "string", "maxLength": n}),
    )


def schemas():
    """Objects and arrays of bounded size over bounded leaves, two levels deep at most."""
    def containers(children):
        objects = st.dictionaries(st.from_regex(r"[a-z]{1,6}", fullmatch=True), children, min_size=1,
                                  max_size=4).map(lambda props: {"type": "object", "properties": props,
                                                                 "required": sorted(props),
                                                                 "additionalProperties": False})
        arrays = st.builds(lambda item, n: {"type": "array", "items": item, "maxItems": n}, children,
                           st.integers(0, 3))
        return objects | arrays
    return st.recursive(leaf_schemas(), containers, max_leaves=6).filter(lambda s: s.get("type") in
                                                                          ("object", "array"))


def longest_output(schema: dict) -> int:
    """Characters of the longest compact JSON the schema allows, counting a string's
    characters as up to 6 bytes each (an escape \\u1234, or 4 UTF-8 bytes)."""
    if "enum" in schema:
        return max(len(json.dumps(v)) for v in schema["enum"])
    kind = schema["type"]
    if kind == "integer":
        return max(len(str(schema["minimum"])), len(str(schema["maximum"])))
    if kind in ("boolean", "null"):
        return 5
    if kind == "string":
        return 2 + 6 * schema["maxLength"]
    if kind == "array":
        return 2 + schema["maxItems"] * (longest_output(schema["items"]) + 1)
    return 2 + sum(len(json.dumps(k)) + 2 + longest_output(v) for k, v in schema["properties"].items())


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(schema=schemas(), seed=st.integers(0, 2**31))
def test_every_output_of_a_bounded_schema_ends_parses_and_validates(llm, schema, seed):
    bound = longest_output(schema)
    spec = StructuredOutput(json_schema=json.dumps(schema))
    params = [SamplingParams(temperature=1.0, seed=seed + i, max_tokens=4 * bound + 8, structured_output=spec)
              for i in range(4)]
    for out in llm.generate([[5, 6, 7, 8]] * 4, params):
        assert out.finish_reason == "stop", (out.text, bound)
        value = json.loads(out.text)
        jsonschema.validate(value, schema)
        assert out.text == json.dumps(value, separators=(",", ":"), ensure_ascii=False), "compact JSON"


REGEX_PARTS = st.sampled_from([r"[a-c]{1,4}", r"[0-9]{1,3}", r"(yes|no)", r"-", r"x?", r"[0-9a-f]{2}", r"(ab|ba){1,2}"])


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(parts=st.lists(REGEX_PARTS, min_size=1, max_size=5), seed=st.integers(0, 2**31))
def test_every_output_of_a_bounded_regex_ends_and_matches(llm, parts, seed):
    regex = "".join(parts)
    params = [SamplingParams(temperature=1.0, seed=seed + i, max_tokens=40, structured_output=StructuredOutput(
        regex=regex)) for i in range(4)]
    for out in llm.generate([[9, 10]] * 4, params):
        assert out.finish_reason == "stop" and re.fullmatch(regex, out.text), (regex, out.text)


def test_any_object_choice_and_grammar(llm):
    specs = [StructuredOutput(choice=("red", "green", "blue")), StructuredOutput(grammar='root ::= "(" [0-9]{1,4} ")"'),
             StructuredOutput(grammar='start: "<" NAME ">"\nNAME: /[a-z]{1,5}/')]
    outs = llm.generate([[5, 6]] * len(specs), [SamplingParams(temperature=1.0, seed=7, max_tokens=200,
                                                               structured_output=s) for s in specs])
    assert outs[0].text in ("red", "green", "blue")
    assert re.fullmatch(r"\([0-9]{1,4}\)", outs[1].text) and re.fullmatch(r"<[a-z]{1,5}>", outs[2].text)
    assert all(out.finish_reason == "stop" for out in outs)
    # Any object is unbounded (a random model's string may run to max_tokens): what ends parses.
    objects = llm.generate([[5, 6]] * 8, [SamplingParams(temperature=1.0, seed=s, max_tokens=300,
                                                         structured_output=StructuredOutput(json_object=True))
                                          for s in range(8)])
    ended = [out for out in objects if out.finish_reason == "stop"]
    assert ended and all(isinstance(json.loads(out.text), dict) for out in ended)
    assert all(out.text.startswith("{") for out in objects)


def test_min_tokens_does_not_hold_a_grammar_that_is_done(llm):
    """The grammar decides where a constrained output ends: min_tokens does not ban EOS
    where the grammar allows nothing else (the row would have no token left)."""
    out = llm.generate([[5, 6]], [SamplingParams(temperature=1.0, seed=2, max_tokens=20, min_tokens=15,
                                                 structured_output=StructuredOutput(choice=("yes", "no")))])[0]
    assert out.finish_reason == "stop" and out.text in ("yes", "no")


def test_pretty_json_has_bounded_whitespace_and_ends(llm):
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "b": {"type": "boolean"}}, "required": ["a", "b"],
              "additionalProperties": False}
    spec = StructuredOutput(json_schema=json.dumps(schema), pretty_json=True)
    for out in llm.generate([[5, 6]] * 4, [SamplingParams(temperature=1.0, seed=s, max_tokens=300,
                                                          structured_output=spec) for s in range(4)]):
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), schema)
        assert all(len(run) <= 17 for run in re.findall(r"\s+", out.text))


def test_overlap_and_a_mixed_batch_give_each_row_what_it_gets_alone(model_dir):
    """Greedy and seeded rows, with and without grammars, penalties, biases and bad words: the
    batch (overlapped or not) gives each row its tokens alone (float64)."""
    schema = json.dumps({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                                                          "s": {"type": "string", "maxLength": 5}},
                         "required": ["n", "s"], "additionalProperties": False})
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, structured_output=StructuredOutput(json_schema=schema)),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, presence_penalty=1.0),
        SamplingParams(temperature=1.0, seed=4, max_tokens=40, structured_output=StructuredOutput(regex=r"[a-z]{3,9}"),
                       logit_bias={ord("q"): 3.0}),
        SamplingParams(temperature=1.0, seed=5, max_tokens=12, ignore_eos=True, bad_words=["ab"],
                       frequency_penalty=0.5),
        SamplingParams(temperature=0.0, max_tokens=40, structured_output=StructuredOutput(choice=("alpha", "beta"))),
    ]
    prompts = [[5 + i, 6, 7 + 2 * i] for i in range(len(params))]
    results = []
    for overlap in (False, True):
        llm = LLM(model_dir, dtype="float64", block_size=4, overlap_scheduling=overlap)
        batch = [out.token_ids for out in llm.generate(prompts, params)]
        alone = [llm.generate([prompt], [p])[0].token_ids for prompt, p in zip(prompts, params)]
        assert batch == alone
        results.append(batch)
    assert results[0] == results[1]


@pytest.mark.parametrize("spec, field", [
    (dict(json_schema='{"type": "strin"}'), "json_schema"),
    (dict(grammar="root ::= ("), "grammar"),
    (dict(grammar='start: "a" b'), "grammar"),
])
def test_a_constraint_that_cannot_be_used_names_its_field_and_leaves_the_engine_serving(llm, spec, field):
    with pytest.raises(InvalidRequestError) as error:
        llm.engine.add_request([5, 6], SamplingParams(structured_output=StructuredOutput(**spec)))
    assert error.value.name == f"sampling_params.{field}"
    assert not llm.engine.scheduler.requests  # nothing was queued
    assert llm.generate([[5, 6]], [SamplingParams(max_tokens=2)])[0].token_ids


def test_a_regex_whose_lexer_explodes_on_smollm2s_vocabulary_is_refused_when_prepared():
    """Against a real 49k vocabulary the nested repetition passes llguidance's lexer limits:
    refused when prepared, not in a step."""
    compiler = GrammarCompiler(load_tokenizer("smollm2-135m"), 49152)
    started = time.perf_counter()
    with pytest.raises(StructuredOutputError) as error:
        compiler.prepare(StructuredOutput(regex="(.{0,100}){0,100}"))
    assert error.value.name == "regex" and "too many" in str(error.value)
    print(f"refused in {time.perf_counter() - started:.3f} s")  # the tokenizer's first use included
    assert compiler.prepare(StructuredOutput(regex="(a{0,100}){0,100}")) is not None


@pytest.mark.parametrize("fields, name", [
    (dict(), "structured_output"),
    (dict(regex="a", choice=("b",)), "structured_output"),
    (dict(json_schema="{not json"), "json_schema"),
    (dict(json_schema="[1, 2]"), "json_schema"),
    (dict(choice=()), "choice"),
    (dict(choice=("a", "")), "choice"),
    (dict(regex="  "), "regex"),
])
def test_a_malformed_constraint_names_its_field(fields, name):
    with pytest.raises(StructuredOutputError) as error:
        StructuredOutput(**fields)
    assert error.value.name == name
