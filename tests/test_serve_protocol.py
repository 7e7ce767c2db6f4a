"""OpenAI request checks and the streamed text: pure functions, no server."""

import pytest

from specdec.serve.protocol import ApiError, parse_json, parse_request
from specdec.serve.responses import TextStream

MODELS = ("tiny",)


def _chat(**kw):
    return parse_request({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **kw}, True, MODELS)


def test_temperature_zero_is_greedy_and_openai_defaults_apply():
    assert _chat(temperature=0).sampling is None
    g = _chat()
    assert g.sampling is not None and g.sampling.temperature == 1.0 and g.sampling.top_k == 0
    g = _chat(temperature=0.5, top_p=0.9, top_k=7, seed=3, stop="x", stream=True, stream_options={"include_usage": True})
    assert (g.sampling.temperature, g.sampling.top_p, g.sampling.top_k, g.seed) == (0.5, 0.9, 7, 3)
    assert g.stop == ("x",) and g.stream and g.include_usage


def test_text_parts_are_joined_and_a_missing_model_means_the_served_one():
    g = parse_request({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                   {"type": "text", "text": "b"}]}]}, True, MODELS)
    assert g.messages == [{"role": "user", "content": "ab"}]


@pytest.mark.parametrize("kw,param", [({"temperature": True}, "temperature"), ({"top_p": 0}, "top_p"),
                                      ({"top_k": -1}, "top_k"), ({"seed": 1.5}, "seed"), ({"stop": ["a"] * 5}, "stop"),
                                      ({"stop": [""]}, "stop"), ({"max_tokens": 0}, "max_tokens"),
                                      ({"echo": True}, "echo"), ({"best_of": 3}, "best_of")])
def test_each_bad_field_is_named(kw, param):
    with pytest.raises(ApiError) as e:
        _chat(**kw)
    assert e.value.status == 400 and e.value.param == param and param in e.value.message


@pytest.mark.parametrize("raw,words", [
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),  # past json's recursion limit: once a 500
    (b'{"a": "\xff"}', "not UTF-8 text: byte 0xff at offset 7"),
    (b'{"a": Infinity}', "Infinity is not a JSON number"),
    (b'{"a": 1', "not valid JSON"),
])
def test_a_body_that_is_not_utf8_json_is_a_400_naming_why(raw, words):
    with pytest.raises(ApiError) as e:
        parse_json(raw)
    assert e.value.status == 400 and words in e.value.message


def test_a_utf8_json_body_parses():
    assert parse_json('{"a": [1, "é", "\\u00e9"]}'.encode()) == {"a": [1, "é", "é"]}


@pytest.mark.parametrize("body,words", [
    ({"messages": [{}]}, "messages[0].role"),  # checked before it is read (once a KeyError: a 500)
    ({"messages": [None]}, "messages[0] must be an object"),
    ({"messages": [{"role": "user", "content": "a\ud800"}]}, "lone surrogate"),  # as json reads "\\ud800"
    ({"messages": [{"role": "user", "content": "hi"}], "stop": ["\udfff"]}, "lone surrogate"),
    ({"messages": [{"role": "user", "content": "hi"}], "seed": 2**64}, "'seed' must be between"),
    ({"messages": [{"role": "user", "content": "hi"}], "model": ["tiny"]}, "'model' must be a string"),
    ({"messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": "yes"}}, "boolean"),
])
def test_wrong_shapes_and_values_are_400s_not_crashes(body, words):
    with pytest.raises(ApiError) as e:
        parse_request(body, True, MODELS)
    assert e.value.status == 400 and words in e.value.message


def _decode(tokens):
    return bytes(tokens).decode("utf-8", errors="replace")


def test_a_character_split_over_tokens_comes_out_whole():
    s = TextStream(_decode, ())
    e_acute = "é".encode()
    assert s.feed([ord("a"), e_acute[0]]) == "a"  # half of é is held back
    assert s.feed([e_acute[1]]) == "é"


def test_a_stop_string_across_chunks_is_cut_and_never_sent():
    s = TextStream(_decode, ("END",))
    out = s.feed(list(b"abcE")) + s.feed(list(b"N")) + s.feed(list(b"D and more"))
    assert out == "abc" and s.stopped and s.text == "abc"
    s = TextStream(_decode, ("END",))
    assert s.feed(list(b"abE")) == "ab" and s.feed(list(b"x"), final=False) == "Ex"  # not a stop after all
    assert s.feed([], final=True) == "" and not s.stopped


@pytest.mark.parametrize("name, value, field, want", [
    ("frequency_penalty", 0.5, "frequency_penalty", 0.5), ("presence_penalty", -1.0, "presence_penalty", -1.0),
    ("logit_bias", {"5": 10}, "logit_bias", ((5, 10.0),)), ("repetition_penalty", 1.2, "repetition_penalty", 1.2),
    ("logprobs", True, "logprobs", 0)])
def test_options_that_change_the_answer_are_read_into_the_generation(name, value, field, want):
    from specdec.serve.protocol import parse_request

    g = parse_request({"messages": [{"role": "user", "content": "hi"}], name: value}, chat=True, models=("default",))
    assert getattr(g.options, field) == want


def test_response_format_regex_and_grammar_become_constraints():
    from specdec.serve.protocol import parse_request

    chat = {"messages": [{"role": "user", "content": "hi"}]}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    g = parse_request(chat | {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}},
                      chat=True, models=("default",))
    assert g.options.constraint.kind == "json_schema" and g.options.constraint.source == schema
    assert parse_request(chat | {"response_format": {"type": "json_object"}}, chat=True,
                         models=("default",)).options.constraint.kind == "json_object"
    assert parse_request(chat | {"regex": "a+"}, chat=True, models=("default",)).options.constraint.kind == "regex"
    assert parse_request(chat | {"grammar": 'root ::= "a"'}, chat=True, models=("default",)).options.constraint.kind == "gbnf"
    assert parse_request({"prompt": "x", "logprobs": 3}, chat=False, models=("default",)).options.logprobs == 3


@pytest.mark.parametrize("name, value", [("response_format", {"type": "text"}), ("frequency_penalty", 0),
                                         ("presence_penalty", 0.0), ("logit_bias", {}), ("repetition_penalty", 1.0)])
def test_neutral_values_of_those_options_are_accepted(name, value):
    from specdec.serve.protocol import parse_request

    parse_request({"messages": [{"role": "user", "content": "hi"}], name: value}, chat=True, models=("default",))
