"""The parts of `specdec serve --replicas` that need no Ray: a conversation's routing key, and the
single server's app called in-process as a replica calls it (tests/test_serve_ray.py runs them on Ray)."""

import asyncio
import json

import pytest

from specdec.serve.replicas import KEY_CHARS, Forwarded, _Lifespan, call_app, route_key

from serve_helpers import replica_app

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny forwards on one thread
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def _chat_key(*messages) -> str | None:
    return route_key(CHAT, json.dumps({"model": "tiny", "messages": list(messages)}).encode())


def test_every_turn_of_a_conversation_has_its_first_turns_key():
    system, opening = {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}
    first = _chat_key(system, opening)
    later = _chat_key(system, opening, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"})
    assert first is not None and later == first
    assert _chat_key(system, {"role": "user", "content": "hi!"}) != first  # another conversation
    assert _chat_key({"content": "be brief", "role": "system"}, opening) == first  # key order is not content
    assert _chat_key(system) is not None  # no user message yet: all there is


def test_a_completion_prompt_is_keyed_by_its_first_characters():
    def key(prompt):
        return route_key(COMPLETIONS, json.dumps({"model": "tiny", "prompt": prompt}).encode())

    head = "x" * KEY_CHARS
    assert key(head + "one") == key(head + "two") == key([head + "three"]) != key("y" + head)
    assert key([1, 2, 3]) == key([[1, 2, 3]]) is not None


@pytest.mark.parametrize("path, body", [(CHAT, b"{not json"), (CHAT, b"[1, 2]"), (CHAT, b'{"messages": []}'),
                                        (CHAT, b"[" * 100_000), (COMPLETIONS, b'{"prompt": 7}'),
                                        ("/v1/models", b""), ("/health", b'{"messages": [{"role": "user"}]}')])
def test_a_request_naming_no_conversation_goes_anywhere(path, body):
    assert route_key(path, body) is None


def _request(body: dict) -> Forwarded:
    return Forwarded("POST", CHAT, b"", [(b"content-type", b"application/json")], json.dumps(body).encode())


def test_the_app_called_in_process_answers_and_a_closed_call_cancels_its_row(tmp_path):
    async def scenario():
        app = replica_app(str(tmp_path), 0)
        lifespan = _Lifespan(app)
        await lifespan.startup()
        engine = app.state.service.engine
        try:
            ask = {"model": "tiny", "messages": [{"role": "user", "content": "abc abc"}], "max_tokens": 8}
            items = [item async for item in call_app(app, _request(ask))]
            assert items[0]["status"] == 200
            answer = json.loads(b"".join(items[1:]))
            assert answer["choices"][0]["message"]["content"] and answer["usage"]["completion_tokens"] <= 8
            bad = [item async for item in call_app(app, _request({"model": "tiny", "messages": []}))]
            assert bad[0]["status"] == 400 and "messages" in json.loads(b"".join(bad[1:]))["error"]["message"]

            stream = call_app(app, _request({**ask, "max_tokens": 200, "stream": True}))  # still running when closed
            head = await stream.__anext__()
            assert head["status"] == 200 and (b"content-type", b"text/event-stream; charset=utf-8") in head["headers"]
            assert (await stream.__anext__()).startswith(b"data: ")
            await stream.aclose()  # the caller went away: a disconnect to the app
            for _ in range(500):
                if engine.counters.finished.get("cancelled", 0) == 1 and engine.counters.batch_size == 0:
                    break
                await asyncio.sleep(0.01)
            assert engine.counters.finished.get("cancelled", 0) == 1
        finally:
            await lifespan.shutdown()
        assert engine.stopping and (tmp_path / "replica-0" / "suffix-cache.json").exists()  # saved at shutdown

    asyncio.run(scenario())
