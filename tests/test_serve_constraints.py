"""`specdec serve`'s response_format, regex and grammar constraints, logprobs, penalties and logit_bias,
through the official openai client and raw HTTP: each answer the library's own (plain decoding's) for
the same options, every constrained answer valid, every unsupported or bad option a 400 naming it."""

import json

import httpx
import pytest

from specdec.drafters.chooser import Sources
from specdec.drafters.grammar import GrammarDrafter
from specdec.processing import Constraint
from specdec.prompting import chat_ids
from specdec.serve.engine import EngineConfig
from specdec.serve.service import ServeConfig

from serve_helpers import LiveServer, self_drafter, tiny_decoder

openai = pytest.importorskip("openai")
EOS = 256  # the tiny tokenizer's <|im_end|>
SCHEMA = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 8}, "n": {"type": "integer"},
                                           "ok": {"type": "boolean"}},
          "required": ["word", "n", "ok"], "additionalProperties": False}


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny forwards on one thread


@pytest.fixture(scope="module")
def server(one_thread):
    """The grammar's forced tokens and the target drafting for itself, at every step."""
    drafter = Sources({"grammar": GrammarDrafter(), "self": self_drafter()})
    live = LiveServer(tiny_decoder(drafter, cost_aware=False),
                      ServeConfig(model_name="tiny", default_max_tokens=40, engine=EngineConfig(max_batch=4)))
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def plain(server, messages, max_new=40, **kw):
    """What plain decoding (no drafter) gives the same prompt and options in the library."""
    ids = chat_ids(server.tokenizer, messages)[0]
    out = tiny_decoder(None).generate(ids, max_new_tokens=max_new, eos_token_id=EOS, tokenizer=server.tokenizer, **kw)
    return out


def text_of(server, out) -> str:
    return server.tokenizer.decode(out.generated(0), skip_special_tokens=True)


def valid(answer: dict) -> bool:
    return (set(answer) == {"word", "n", "ok"} and isinstance(answer["word"], str) and len(answer["word"]) <= 8
            and isinstance(answer["n"], int) and isinstance(answer["ok"], bool))


def test_json_schema_answers_validate_and_are_plain_decodings(server, client):
    for q in ("name a word", "abc abc", "count to three"):
        r = client.chat.completions.create(
            model="tiny", messages=chat(q), temperature=0, max_tokens=40,
            response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}})
        content = r.choices[0].message.content
        assert content == text_of(server, plain(server, chat(q), constraint=Constraint.json_schema(SCHEMA)))
        if r.choices[0].finish_reason == "stop":
            assert valid(json.loads(content)), content


def test_json_object_regex_and_gbnf_through_raw_http(server):
    cases = [({"response_format": {"type": "json_object"}}, Constraint.json_object()),
             ({"regex": "(yes|no), [a-z]{2,5}\\."}, Constraint.regex("(yes|no), [a-z]{2,5}\\.")),
             ({"grammar": 'root ::= "x" [0-9]+ "y"'}, Constraint.gbnf('root ::= "x" [0-9]+ "y"'))]
    for extra, constraint in cases:
        body = {"model": "tiny", "messages": chat("go"), "temperature": 0, "max_tokens": 30} | extra
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == text_of(
            server, plain(server, chat("go"), max_new=30, constraint=constraint))


def test_penalties_and_logit_bias_are_honoured_as_the_library_applies_them(server, client):
    kw = dict(frequency_penalty=1.2, presence_penalty=0.5, logit_bias={"97": 5.0, "98": -100})
    r = client.chat.completions.create(model="tiny", messages=chat("abab"), temperature=0, max_tokens=30, **kw,
                                       extra_body={"repetition_penalty": 1.3})
    want = plain(server, chat("abab"), max_new=30, frequency_penalty=1.2, presence_penalty=0.5,
                 logit_bias={97: 5.0, 98: -100.0}, repetition_penalty=1.3)
    assert r.choices[0].message.content == text_of(server, want)
    assert "b" not in r.choices[0].message.content  # token 98 is b, biased out


def test_chat_logprobs_are_plain_decodings_whole_and_streamed(server, client):
    constraint = Constraint.json_schema(SCHEMA)
    want = plain(server, chat("hi"), constraint=constraint, logprobs=3).logprobs[0]
    rf = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}
    r = client.chat.completions.create(model="tiny", messages=chat("hi"), temperature=0, max_tokens=40,
                                       response_format=rf, logprobs=True, top_logprobs=3)
    got = r.choices[0].logprobs.content
    # a byte-level token may hold part of a character: its bytes, joined, are the text
    assert b"".join(bytes(x.bytes) for x in got).decode() == r.choices[0].message.content
    for x, w in zip(got, want):
        assert abs(x.logprob - w.logprob) < 1e-5
        assert [bytes(t.bytes) for t in x.top_logprobs] == [bytes(server.service.vocabulary().tokenizer.decode_bytes([t]))
                                                           for t, _ in w.top]
    stream = client.chat.completions.create(model="tiny", messages=chat("hi"), temperature=0, max_tokens=40,
                                            response_format=rf, logprobs=True, top_logprobs=3, stream=True)
    streamed = [x for c in stream for ch in c.choices if ch.logprobs for x in ch.logprobs.content]
    assert [(x.token, round(x.logprob, 6)) for x in streamed] == [(x.token, round(x.logprob, 6)) for x in got]


def test_completions_logprobs_in_openai_shape(server):
    body = {"model": "tiny", "prompt": "abc", "temperature": 0, "max_tokens": 8, "logprobs": 2}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    lp = r["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(lp["tokens"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) >= 1
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
    # keyed by token text, as OpenAI's are (two byte tokens of one character share a text): 1 or 2 each
    assert all(1 <= len(t) <= 2 and max(t.values()) >= v - 1e-9 for t, v in zip(lp["top_logprobs"], lp["token_logprobs"]))


def test_a_stop_string_inside_accepted_drafts_cuts_the_constrained_answer(server, client):
    base = client.chat.completions.create(model="tiny", messages=chat("stop"), temperature=0, max_tokens=40,
                                          response_format={"type": "json_object"}).choices[0].message.content
    stop = base[3:5]
    r = client.chat.completions.create(model="tiny", messages=chat("stop"), temperature=0, max_tokens=40,
                                       response_format={"type": "json_object"}, stop=[stop])
    assert r.choices[0].message.content == base[: base.find(stop)] and r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"regex": "(ab"}, "regex"),
    ({"grammar": "root ::= ("}, "grammar"),
    ({"regex": "a+", "response_format": {"type": "json_object"}}, "regex"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"99999": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"frequency_penalty": 3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ({"echo": True}, "echo"),
    ({"min_p": 0.1}, "min_p"),
])
def test_bad_or_unsupported_options_are_a_400_naming_them(server, extra, param):
    body = {"model": "tiny", "messages": chat("x"), "max_tokens": 4} | extra
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    ok = httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny", "messages": chat("x"), "max_tokens": 2},
                    timeout=60)
    assert ok.status_code == 200  # and the server keeps serving


def test_concurrent_requests_with_different_constraints_get_their_alone_answers(server, client):
    """Four requests in one batch (each its own grammar, penalties or none), joining mid-batch: each
    answer is the one plain decoding gives it alone."""
    import concurrent.futures

    asks = [({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}},
             dict(constraint=Constraint.json_schema(SCHEMA))),
            ({"extra_body": {"regex": "[a-c]{3,9}!"}}, dict(constraint=Constraint.regex("[a-c]{3,9}!"))),
            ({"frequency_penalty": 1.5, "logit_bias": {"120": 4.0}}, dict(frequency_penalty=1.5, logit_bias={120: 4.0})),
            ({}, {})]

    def ask(i):
        kw, _ = asks[i % len(asks)]
        return client.chat.completions.create(model="tiny", messages=chat(f"q{i}"), temperature=0, max_tokens=30,
                                              **kw).choices[0].message.content

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(ask, range(8)))
    for i, content in enumerate(got):
        _, lib = asks[i % len(asks)]
        assert content == text_of(server, plain(server, chat(f"q{i}"), max_new=30, **lib)), i


def metric(server, name: str) -> float:
    """One unlabelled sample from /metrics."""
    lines = httpx.get(server.url + "/metrics", timeout=30).text.splitlines()
    return float(next(line for line in lines if line.startswith(name + " ")).split()[1])


def test_concurrent_requests_with_one_schema_share_its_grammar_and_answer_as_uncached_decoding(
        server, client, monkeypatch):
    """Two requests at once with a schema no other test sends: each answer is plain decoding's with a
    grammar compiled for it alone; the schema is compiled once (twice if both missed at once), and a third
    request with it compiles nothing."""
    import concurrent.futures

    schema = {"type": "object", "properties": {"tag": {"type": "string", "maxLength": 5}, "k": {"type": "integer"}},
              "required": ["tag", "k"], "additionalProperties": False}
    asks = ("one", "two two")
    want = [text_of(server, plain(server, chat(q), max_new=30, constraint=Constraint.json_schema(schema)))
            for q in asks]
    compiles = []
    compile_ = Constraint.compile
    monkeypatch.setattr(Constraint, "compile", lambda self, vocab: compiles.append(self) or compile_(self, vocab))
    hits = metric(server, "specdec_grammar_cache_hits_total")
    rf = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}

    def ask(q: str) -> str:
        return client.chat.completions.create(model="tiny", messages=chat(q), temperature=0, max_tokens=30,
                                              response_format=rf).choices[0].message.content

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        assert list(pool.map(ask, asks)) == want
    assert 1 <= len(compiles) <= 2
    first = len(compiles)
    assert ask(asks[0]) == want[0] and len(compiles) == first
    assert metric(server, "specdec_grammar_cache_hits_total") >= hits + 3 - first
    assert metric(server, "specdec_grammar_cache_entries") == len(server.service.grammars)


def test_a_bad_schema_gets_its_400_every_time(server):
    body = {"model": "tiny", "messages": chat("x"), "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}}
    cache = server.service.grammars
    held, misses = len(cache), cache.misses
    errors = [httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60) for _ in range(2)]
    assert [r.status_code for r in errors] == [400, 400]
    assert errors[0].json()["error"] == errors[1].json()["error"]
    assert errors[0].json()["error"]["param"] == "response_format"
    assert "does not compile" in errors[0].json()["error"]["message"] and "nope" in errors[0].json()["error"]["message"]
    assert (len(cache), cache.misses) == (held, misses + 2)
