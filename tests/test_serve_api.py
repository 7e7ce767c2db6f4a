"""`specdec serve` through the official openai client and raw HTTP: answers (with their drafts
accepted), errors, limits, the API key."""

import json
import socket
import threading
import time

import httpx
import pytest
import torch

from specdec.prompting import chat_ids
from specdec.serve.engine import EngineConfig
from specdec.serve.service import ServeConfig

from serve_helpers import WINDOW, LiveServer, self_drafter, tiny_decoder

openai = pytest.importorskip("openai")
EOS = 256  # the tiny tokenizer's <|im_end|>


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny forwards on one thread


@pytest.fixture(scope="module")
def server(one_thread):
    """The target drafting for itself, at every step: greedy answers accept drafts for certain, so the
    exactness tests below also show that the server's verifier accepts them (one that rejected every
    draft would answer the same)."""
    live = LiveServer(tiny_decoder(self_drafter(), cost_aware=False),
                      ServeConfig(model_name="tiny", default_max_tokens=24, engine=EngineConfig(max_batch=4)))
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def alone(server, messages=None, prompt=None, max_new=24) -> str:
    """What SpecDecoder.generate answers for this prompt alone (a fresh decoder of the same target)."""
    tok = server.tokenizer
    ids = chat_ids(tok, messages)[0] if messages is not None else torch.tensor(tok(prompt)["input_ids"])
    decoder = tiny_decoder(self_drafter(), cost_aware=False)
    out = decoder.generate(ids, max_new_tokens=max_new, eos_token_id=EOS)
    assert torch.equal(out.sequences, decoder.target.generate(ids[None], max_new_tokens=max_new, do_sample=False,
                                                              eos_token_id=EOS, pad_token_id=0,
                                                              attention_mask=torch.ones_like(ids[None]))[:, : out.sequences.shape[1]])
    return tok.decode(out.generated(0), skip_special_tokens=True)


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def drafts(usage, accepted: bool = True) -> dict:
    """usage.specdec, checked: drafted >= accepted (> 0 if ``accepted``), accepted <= the answer's tokens,
    a time to first token, target steps (1 to the answer's tokens)."""
    extra = usage["specdec"] if isinstance(usage, dict) else usage.specdec
    completion = usage["completion_tokens"] if isinstance(usage, dict) else usage.completion_tokens
    assert set(extra) == {"drafted_tokens", "accepted_tokens", "time_to_first_token_s", "steps", "cached_tokens"}
    assert 1 <= extra["steps"] <= completion or completion == 0
    assert extra["drafted_tokens"] >= extra["accepted_tokens"] >= (1 if accepted else 0), extra
    assert extra["accepted_tokens"] < max(completion, 1)  # the first token is never a draft
    assert isinstance(extra["time_to_first_token_s"], float) and extra["time_to_first_token_s"] >= 0
    return extra


def test_openai_chat_answers_as_generate_alone(server, client):
    r = client.chat.completions.create(model="tiny", messages=chat("abc abc abc"), temperature=0, max_tokens=20)
    assert r.choices[0].message.content == alone(server, chat("abc abc abc"), max_new=20)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 20 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    drafts(r.usage)


def test_openai_chat_stream_concatenates_to_the_same_answer(server, client):
    stream = client.chat.completions.create(model="tiny", messages=chat("hello hello"), temperature=0,
                                            max_tokens=20, stream=True, stream_options={"include_usage": True})
    parts, finish, use = [], None, None
    for c in stream:
        if c.usage is not None:
            use = c.usage
        for ch in c.choices:
            parts.append(ch.delta.content or "")
            finish = ch.finish_reason or finish
    assert "".join(parts) == alone(server, chat("hello hello"), max_new=20)
    assert finish in ("stop", "length") and use is not None and use.completion_tokens >= 1
    drafts(use)


def test_openai_completions_stream_and_not(server, client):
    r = client.completions.create(model="tiny", prompt="once upon a time", temperature=0, max_tokens=16)
    expected = alone(server, prompt="once upon a time", max_new=16)
    assert r.choices[0].text == expected
    drafts(r.usage)
    chunks = list(client.completions.create(model="tiny", prompt="once upon a time", temperature=0, max_tokens=16,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert drafts(chunks[-1].usage)["accepted_tokens"] == r.usage.specdec["accepted_tokens"]  # the same steps


def test_concurrent_clients_arriving_mid_batch_get_their_alone_answers(server, client):
    texts = [f"question {i}: " + "xy" * (i + 1) for i in range(8)]
    answers: dict[int, str] = {}
    usages = {}

    def ask(i: int) -> None:
        time.sleep(0.05 * i)  # staggered: later ones join a running batch
        r = client.chat.completions.create(model="tiny", messages=chat(texts[i]), temperature=0, max_tokens=24)
        answers[i], usages[i] = r.choices[0].message.content, r.usage

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]  # 8 at once, 4 rows: some wait
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(answers) == list(range(8))
    for i, text in enumerate(texts):
        assert answers[i] == alone(server, chat(text), max_new=24)
        drafts(usages[i], accepted=False)  # consistent; a row may have drafted nothing yet
    assert sum(drafts(u, accepted=False)["accepted_tokens"] for u in usages.values()) > 0


def test_a_seeded_sampled_answer_repeats(client):
    ask = lambda seed: client.chat.completions.create(  # noqa: E731
        model="tiny", messages=chat("tell me"), temperature=0.9, top_p=0.95, seed=seed, max_tokens=20,
        extra_body={"top_k": 40}).choices[0].message.content
    first = ask(7)
    assert ask(7) == first
    assert any(ask(s) != first for s in (8, 9, 10))


def test_a_stop_string_ends_the_answer_before_it(server, client):
    full = client.completions.create(model="tiny", prompt="stop test", temperature=0, max_tokens=16).choices[0].text
    assert len(full) >= 4
    stop = full[2:4]
    r = client.completions.create(model="tiny", prompt="stop test", temperature=0, max_tokens=16, stop=[stop])
    assert r.choices[0].text == full[: full.find(stop)] and r.choices[0].finish_reason == "stop"


BAD = [  # (body or raw bytes, status, words the message must hold)
    (b"{not json", 400, "not valid JSON"),
    ({"model": "tiny"}, 400, "'messages' is required"),
    ({"model": "tiny", "messages": "hi"}, 400, "non-empty list"),
    ({"model": "tiny", "messages": [{"role": "user", "content": 5}]}, 400, "content must be a string"),
    ({"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": WINDOW}, 400, "context window"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": "5"}, 400, "integer"),
    ({"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}, 404, "does not exist"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": -1}, 400, "temperature"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "'n' must be 1"),
    ({"model": "tiny", "messages": [{"role": "user", "content": ""}]}, 400, "empty prompt"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "z" * (2 * WINDOW)}]}, 400, "context window"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, 400, "boolean"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "echo": True}, 400, "not supported"),
    ([1, 2], 400, "JSON object"),
    (b"[" * 100_000 + b"]" * 100_000, 400, "nested too deeply"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "caf\xe9"}]}', 400, "not UTF-8"),  # Latin-1
    ('{"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}'.encode("utf-16"), 400, "not UTF-8"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400, "NaN"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800"}]}', 400, "lone surrogate"),
    (b'{"model": "\\ud800", "messages": [{"role": "user", "content": "hi"}]}', 404, "does not exist"),
    ({"model": "tiny", "messages": [{}]}, 400, "role"),
    ({"model": "tiny", "messages": ["hi"]}, 400, "must be an object"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "seed": 2**70}, 400, "'seed' must be between"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True,
      "stream_options": {"include_usage": "yes"}}, 400, "boolean"),
]


@pytest.mark.parametrize("body,status,words", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_input_gets_an_openai_error_and_the_server_keeps_serving(server, body, status, words):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.url + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == status
    err = r.json()["error"]
    assert words in err["message"] and set(err) == {"message", "type", "param", "code"}
    ok = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2,
                                                          "temperature": 0}, timeout=30)
    assert ok.status_code == 200


def test_an_empty_completion_prompt_is_refused(server):
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": ""})
    assert r.status_code == 400 and "empty" in r.json()["error"]["message"]


def _batch_size(server) -> int:
    return httpx.get(server.url + "/health").json()["batch_size"]


def test_a_client_leaving_mid_stream_frees_its_row(server):
    # sampled hot: the greedy drafts are rarely kept, a step yields ~1 token and the answer is still running
    # when the client leaves (greedy, every draft is kept: 200 tokens in ~20 steps)
    body = {"model": "tiny", "prompt": "go on and on", "max_tokens": 200, "temperature": 1.5, "seed": 3,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(3)]
        assert any(line.startswith("data: ") for line in got)
        assert _batch_size(server) == 1
    deadline = time.monotonic() + 10
    while _batch_size(server) != 0:
        assert time.monotonic() < deadline, "the row was not freed"
        time.sleep(0.02)
    metrics = httpx.get(server.url + "/metrics").text
    assert 'specdec_requests_total{outcome="cancelled"}' in metrics


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    # a request of its own: the drafter drafts, so its counter exists when read
    client.completions.create(model="tiny", prompt="abc abc abc abc", temperature=0, max_tokens=8)
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    metrics = httpx.get(server.url + "/metrics").text
    for name in ("specdec_queue_length", "specdec_batch_size", "specdec_generated_tokens_total",
                 "specdec_tokens_per_second", "specdec_tau", "specdec_http_requests_total",
                 'specdec_drafted_tokens_total{drafter="ModelDrafter"}'):
        assert name in metrics


def test_malloc_trim_hands_the_freed_heap_back_to_the_system():
    import os
    import sys

    from specdec.runtime.memory import malloc_trim

    trim = malloc_trim()
    if not sys.platform.startswith("linux") or trim is None:
        pytest.skip("glibc's malloc_trim only")
    page = os.sysconf("SC_PAGE_SIZE")
    rss = lambda: int(open("/proc/self/statm").read().split()[1]) * page  # noqa: E731, SIM115
    blocks = [bytearray(4096) for _ in range(40_000)]  # ~160 MB of malloc'd chunks in the heap
    pin = bytearray(4096)  # allocated after them: the heap's top stays in use, so free() cannot shrink it
    del blocks
    before = rss()
    trim()
    assert before - rss() > 100 * 2**20
    del pin


def test_a_full_queue_answers_429_with_retry_after():
    live = LiveServer(tiny_decoder(), ServeConfig(model_name="tiny", engine=EngineConfig(max_batch=1, max_queue=1)))
    held, release = threading.Event(), threading.Event()
    live.service.engine.call(lambda: (held.set(), release.wait(30)))  # the engine thread waits between steps
    try:
        assert held.wait(10)
        body = {"model": "tiny", "prompt": "long", "max_tokens": 4, "temperature": 0}
        waiting = threading.Thread(target=lambda: httpx.post(live.url + "/v1/completions", json=body, timeout=30))
        waiting.start()
        deadline = time.monotonic() + 10
        while httpx.get(live.url + "/health").json()["queue_length"] != 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        r = httpx.post(live.url + "/v1/completions", json=body)
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["type"] == "rate_limit_error"
        release.set()
        waiting.join(30)
    finally:
        release.set()
        live.stop()


def test_the_load_script_measures_both_modes_on_a_small_load(server):
    import asyncio

    from specdec.bench.serve_load import same_answers, percentile, run_load

    assert percentile([1, 2, 3, 4], 50) == 2 and percentile([1, 2, 3, 4], 99) == 4 and percentile([], 50) is None
    bodies = [{"model": "tiny", "messages": chat(f"load {i}"), "stream": True, "max_tokens": 8, "temperature": 0,
               "stream_options": {"include_usage": True}} for i in range(3)]
    together = asyncio.run(run_load(server.url, bodies, 2, 2, 60))
    alone_ = asyncio.run(run_load(server.url, bodies, 1, 4, 60))
    for r in (together, alone_):
        assert r["requests"] == 4 and r["errors"] == 0 and r["tokens"] > 0 and r["ttft_p50_s"] is not None
    assert same_answers(together, alone_)


def test_a_soak_reads_the_servers_memory_as_it_goes_and_measures_growth_after_the_warm_up(server):
    import asyncio
    import sys

    from specdec.bench.serve_load import rss_growth, run_soak, soak_summary

    g = rss_growth([(0, 100), (60, 150), (120, 160), (180, 151), (240, 152)], 60)
    assert g["rss_growth"] == pytest.approx(10 / 150) and g["rss_trend"] == pytest.approx(2 / 150)
    assert rss_growth([(0, 100), (30, None)], 60)["rss_growth"] is None
    bodies = [{"model": "tiny", "messages": chat(f"soak {i}"), "stream": True, "max_tokens": 6, "temperature": 0,
               "stream_options": {"include_usage": True}} for i in range(3)]
    seen = []
    samples, rss, wall = asyncio.run(run_soak(server.url, bodies, 2, 1.5, 0.5, lambda s, r, t: seen.append(len(r))))
    assert seen == sorted(seen) and len(seen) >= 3 and wall >= 1.5  # written after every sample
    assert samples and all(s.error is None for s in samples)
    summary = soak_summary(samples, rss, wall, 0.5)
    assert summary["errors"] == 0 and "samples" not in summary
    if sys.platform == "linux":  # the process collector reads /proc
        assert all(b is not None and b > 10 * 2**20 for _, b in rss)
        assert summary["rss_growth"] is not None


def test_the_load_script_counts_malformed_requests_and_the_good_one_after_them(server):
    import asyncio

    from specdec.bench.serve_load import malformed_bodies, run_malformed

    r = asyncio.run(run_malformed(server.url, "tiny", 2 * len(malformed_bodies("tiny"))))
    assert r["refused_4xx"] == r["requests"] and r["then_served"] and r["errors"] == 0
    assert set(r["statuses"]) == {"400", "404"}


def test_a_client_gone_before_its_whole_answer_frees_its_row(server):
    engine = server.service.engine
    before = engine.counters.finished.get("cancelled", 0)
    held, release = threading.Event(), threading.Event()
    engine.call(lambda: (held.set(), release.wait(30)))  # the request waits in the queue meanwhile
    try:
        assert held.wait(10)
        body = {"model": "tiny", "prompt": "a long one", "max_tokens": 200, "temperature": 0}
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
            httpx.post(server.url + "/v1/completions", json=body, timeout=0.5)
    finally:
        release.set()
    deadline = time.monotonic() + 10
    while engine.counters.finished.get("cancelled", 0) == before or _batch_size(server) != 0:
        assert time.monotonic() < deadline, "the row of the departed client was not freed"
        time.sleep(0.02)


# -- hardening: the API key, the body limit, work off the event loop, the time limit

KEY = "test-key-\u00e9"  # not ASCII: the header's bytes are compared, not its latin-1 text


@pytest.fixture(scope="module")
def guarded():
    live = LiveServer(tiny_decoder(), ServeConfig(model_name="tiny", default_max_tokens=8, api_key=KEY))
    yield live
    live.stop()


def _bearer(key: str) -> dict:
    return {"authorization": b"Bearer " + key.encode()}


def test_an_api_key_guards_every_route_but_health(guarded):
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "temperature": 0}
    assert httpx.get(guarded.url + "/health").status_code == 200
    routes = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"), ("GET", "/metrics")]
    wrong = [_bearer("wrong"), _bearer(KEY[:-1]), {"authorization": b"Basic " + KEY.encode()}]
    for (method, path), headers in [(route, {}) for route in routes] + [(routes[0], h) for h in wrong]:
        r = httpx.request(method, guarded.url + path, json=body if method == "POST" else None, headers=headers)
        assert r.status_code == 401, (path, headers)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == "invalid_api_key"
        assert ("no API key" if not headers else "not valid") in err["message"]
        assert r.headers["www-authenticate"] == "Bearer"
    r = httpx.post(guarded.url + "/v1/completions", json=body, headers=_bearer(KEY))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    metrics = httpx.get(guarded.url + "/metrics", headers=_bearer(KEY))
    assert metrics.status_code == 200
    assert 'specdec_http_requests_total{endpoint="unauthorized",status="401"} 7.0' in metrics.text
    wrong = openai.OpenAI(base_url=guarded.url + "/v1", api_key="wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


def test_a_request_over_its_time_limit_is_cancelled_and_answered_with_an_error():
    """Whole: 504 naming the limit; streaming: the stream ends with the error event. Both are cancelled
    (the engine is held between two steps meanwhile, so neither can finish in time)."""
    live = LiveServer(tiny_decoder(), ServeConfig(model_name="tiny", request_timeout=0.5))
    engine = live.service.engine
    held, release = threading.Event(), threading.Event()
    engine.call(lambda: (held.set(), release.wait(30)))
    try:
        assert held.wait(10)
        body = {"model": "tiny", "prompt": "slow", "max_tokens": 4, "temperature": 0}
        r = httpx.post(live.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 504
        err = r.json()["error"]
        assert err["code"] == "request_timeout" and "--request-timeout" in err["message"]
        with httpx.stream("POST", live.url + "/v1/completions", json={**body, "stream": True}, timeout=30) as s:
            events = [line for line in s.iter_lines() if line.startswith("data: ")]
        assert s.status_code == 200 and events[-1] == "data: [DONE]"
        assert json.loads(events[-2][6:])["error"]["code"] == "request_timeout"
        release.set()
        deadline = time.monotonic() + 10
        while engine.counters.finished.get("cancelled", 0) < 2:
            assert time.monotonic() < deadline, "the timed-out requests were not cancelled"
            time.sleep(0.02)
    finally:
        release.set()
        live.stop()


def _status_line(sock: socket.socket) -> str:
    """The response's status line (reads until the headers end)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed first: {data!r}"
        data += chunk
    return data.split(b"\r\n", 1)[0].decode()


def test_a_body_over_the_limit_is_refused_before_it_is_read(server):
    """8 MiB by default. A Content-Length of 20 MB is answered 413 though not a byte of the body was sent;
    a chunked body as soon as it passes the limit, though it never ends; 20 MB sent whole by the openai
    client's transport, 413 too; and the next request is served."""
    limit = server.service.config.max_body_bytes
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer none\r\n")
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall((head + f"Content-Length: {20 * 10**6}\r\n\r\n").encode())
        assert _status_line(sock).startswith("HTTP/1.1 413")
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall((head + "Transfer-Encoding: chunked\r\n\r\n").encode())
        piece = 2**20
        for _ in range(limit // piece + 1):  # just past the limit, no last chunk
            sock.sendall(f"{piece:x}\r\n".encode() + b" " * piece + b"\r\n")
        assert _status_line(sock).startswith("HTTP/1.1 413")
    r = httpx.post(server.url + "/v1/completions", content=b" " * (20 * 10**6), timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == 413
    err = r.json()["error"]
    assert err["code"] == "request_too_large" and "--max-body-bytes" in err["message"]
    ok = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2,
                                                          "temperature": 0}, timeout=30)
    assert ok.status_code == 200


def test_a_prompt_longer_than_the_window_can_hold_is_refused_before_tokenizing(server, monkeypatch):
    class Untouchable:  # any tokenizer call would be a 500
        def __getattr__(self, name):
            raise AssertionError(f"tokenizer.{name} used")

    chars = server.service.max_prompt_chars  # window 256 x 13 ("<|im_start|>" + 1) x 4
    assert chars == WINDOW * 13 * 4
    monkeypatch.setattr(server.service, "tokenizer", Untouchable())
    for path, body in (("/v1/completions", {"prompt": "z" * (chars + 1)}),
                       ("/v1/chat/completions", {"messages": chat("z" * (chars // 2)) * 2 + chat("z")})):
        r = httpx.post(server.url + path, json={"model": "tiny", **body})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert f"at most {chars} characters" in r.json()["error"]["message"]


def test_a_chat_template_refusing_the_messages_is_a_400(server, monkeypatch):
    monkeypatch.setattr(server.service.tokenizer, "chat_template",
                        "{{ raise_exception('Conversation roles must alternate user/assistant') }}")
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny", "messages": chat("hi")})
    assert r.status_code == 400
    assert "chat template refuses the messages: Conversation roles must alternate" in r.json()["error"]["message"]


def test_tokenizing_runs_off_the_event_loop(server, monkeypatch):
    """A request whose tokenization does not end until another request has been answered: on the event
    loop, that other request could never be answered (the wait below would run out)."""
    entered, other_done, waited = threading.Event(), threading.Event(), []
    encode = server.service.encode

    def slow_encode(g):
        if g.prompt == "slow one":
            entered.set()
            waited.append(other_done.wait(10))
        return encode(g)

    monkeypatch.setattr(server.service, "encode", slow_encode)
    body = {"model": "tiny", "max_tokens": 2, "temperature": 0}
    slow = threading.Thread(target=lambda: httpx.post(server.url + "/v1/completions", timeout=60,
                                                      json={**body, "prompt": "slow one"}))
    slow.start()
    assert entered.wait(30)
    r = httpx.post(server.url + "/v1/completions", json={**body, "prompt": "quick one"}, timeout=60)
    other_done.set()
    slow.join(60)
    assert r.status_code == 200 and waited == [True]
