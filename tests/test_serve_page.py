"""The chat page's server side, without a browser: who wrote each piece of a streamed answer
(``specdec.serve.provenance``), the live panel's numbers and history (``specdec.serve.live``, ``GET
/stats``), and the page's files served at ``/`` without the API key. The page in a real browser:
tests/test_chat_page.py."""

import json

import httpx
import pytest

from specdec.serve.app import PAGE_POLICY
from specdec.serve.live import SAMPLE_EVERY, History, Sample
from specdec.serve.provenance import Provenance
from specdec.serve.service import ServeConfig

from serve_helpers import LiveServer, self_drafter, tiny_decoder


def _chars(ids: list[int]) -> str:
    return "".join(chr(i) for i in ids)  # one character per token


def _utf8(ids: list[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")  # byte tokens, as the tiny chat model's


def _sides(p: Provenance, text: str) -> list[tuple[str, bool, int]]:
    return [(x["text"], x["draft"], x["step"]) for x in p.pieces(0, text)]


def test_a_step_splits_into_its_kept_draft_then_the_targets_token():
    p = Provenance(_chars)
    p.add([ord("H")], 0)  # the prefill's token
    p.add([ord(c) for c in "ell"], 2, "lookup", 3)  # two drafts kept of three, then the target's "l"
    assert _sides(p, "Hell") == [("H", False, 1), ("el", True, 2), ("l", False, 2)]
    piece = p.pieces(1, "el")[0]
    assert (piece["drafter"], piece["drafted"], piece["accepted"]) == ("lookup", 3, 2)


def test_all_accepted_none_accepted_and_nothing_drafted():
    p = Provenance(_chars)
    p.add([1, 2], 2, "suffix", 4)  # every token from the draft (the target's own cut by the length limit)
    p.add([3], 0, "suffix", 4)  # the whole draft rejected: the target's token only
    p.add([4], 0)  # nothing drafted
    assert _sides(p, _chars([1, 2, 3, 4])) == [(_chars([1, 2]), True, 1), (chr(3), False, 2), (chr(4), False, 3)]
    assert p.pieces(0, "")== [] and Provenance(_chars).pieces(0, "") == []
    p.add([], 0)  # an update without tokens (a finish) is no step
    assert p.steps == 3


def test_a_piece_released_late_spans_the_steps_that_wrote_it():
    """TextStream holds text back (a stop string's start, an unfinished character) and releases it
    later: the piece starts mid-span and crosses into the next step."""
    p = Provenance(_chars)
    p.add([ord(c) for c in "abc"], 2, "lookup", 2)
    p.add([ord(c) for c in "de"], 1, "lookup", 1)
    assert [(x["text"], x["draft"], x["step"]) for x in p.pieces(1, "bcd")] == [
        ("b", True, 1), ("c", False, 1), ("d", True, 2)]


def test_a_character_split_over_steps_stays_with_its_first_byte_and_the_text_is_covered():
    p = Provenance(_utf8)
    e_acute = list("é".encode())  # [0xc3, 0xa9]
    p.add([ord("a"), e_acute[0]], 2, "lookup", 2)  # "a\ufffd": both drafted
    p.add([e_acute[1], ord("b")], 0)  # the character completes ("aé" is shorter than "a\ufffd\ufffd")
    text = _utf8([ord("a"), *e_acute, ord("b")])
    pieces = p.pieces(0, text)
    assert "".join(x["text"] for x in pieces) == text == "aéb"
    assert [(x["text"], x["draft"]) for x in pieces] == [("aé", True), ("b", False)]


def test_the_history_gives_rates_per_interval_and_forgets_old_samples():
    h = History(keep=20.0)
    h.record(Sample(0.0, 0, {}, {}))
    h.record(Sample(5.0, 50, {"lookup": 10}, {"lookup": 8}))
    h.record(Sample(10.0, 60, {"lookup": 10, "suffix": 4}, {"lookup": 8, "suffix": 1}))
    points = h.points(now=12.0)
    assert [p["age"] for p in points] == [7.0, 2.0]
    assert [p["tokens_per_second"] for p in points] == [10.0, 2.0]
    assert points[0]["acceptance"] == {"lookup": 0.8}
    assert points[1]["acceptance"] == {"lookup": None, "suffix": 0.25}  # lookup drafted nothing then
    for t in range(15, 60, 5):
        h.record(Sample(float(t), 60, {}, {}))
    assert h.samples[0].at >= 55.0 - 20.0 - SAMPLE_EVERY and len(h.points(55.0)) == 5


@pytest.fixture(scope="module")
def server():
    s = LiveServer(tiny_decoder(self_drafter(), cost_aware=False), ServeConfig(model_name="tiny", api_key="k3y"))
    yield s
    s.stop()


AUTH = {"Authorization": "Bearer k3y"}


def _metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{url}/metrics", headers=AUTH).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_the_page_and_its_files_need_no_key_and_the_rest_still_does(server):
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert page.headers["content-security-policy"] == PAGE_POLICY
    assert "static/app.js" in page.text and "http" not in page.text.replace("http-equiv", "")  # no other host
    for name, kind in (("app.js", "javascript"), ("style.css", "text/css")):
        r = httpx.get(f"{server.url}/static/{name}")
        assert r.status_code == 200 and kind in r.headers["content-type"]
    assert httpx.get(f"{server.url}/static/nothing.js").status_code == 404
    assert httpx.get(f"{server.url}/stats").status_code == 401
    assert httpx.get(f"{server.url}/v1/models").status_code == 401


def test_the_stream_marks_the_drafted_pieces_and_stats_match_metrics(server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}], "temperature": 0,
            "max_tokens": 40}
    whole = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=AUTH, timeout=60).json()
    chunks = []
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", headers=AUTH, timeout=60,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
    text, pieces = "", []
    for c in chunks:
        delta = c["choices"][0]["delta"].get("content", "") if c["choices"] else ""
        if delta:
            assert "".join(p["text"] for p in c["specdec"]["pieces"]) == delta  # each chunk's pieces are its delta
            pieces += c["specdec"]["pieces"]
        text += delta
    assert text == whole["choices"][0]["message"]["content"]
    # the target's own weights draft: every draft is kept, so only a step's last token is the target's
    assert any(p["draft"] and p["drafter"] == "ModelDrafter" for p in pieces)
    assert pieces[0]["step"] == 1 and not pieces[0]["draft"]  # the prefill's token
    usage = chunks[-1]["usage"]
    assert usage["specdec"]["steps"] == max(p["step"] for p in pieces) == whole["usage"]["specdec"]["steps"]
    stats = httpx.get(f"{server.url}/stats", headers=AUTH).json()
    m = _metrics(server.url)
    assert stats["generated_tokens"] == m["specdec_generated_tokens_total"]
    assert stats["steps"] == m["specdec_steps_total"]
    assert (stats["batch_size"], stats["queue_length"]) == (m["specdec_batch_size"], m["specdec_queue_length"])
    assert stats["tau"] == pytest.approx(m["specdec_tau"])
    [d] = stats["drafters"]
    assert d["drafted"] == m['specdec_drafted_tokens_total{drafter="ModelDrafter"}']
    assert d["accepted"] == m['specdec_accepted_tokens_total{drafter="ModelDrafter"}'] == d["rate"] * d["drafted"]
    assert stats["max_batch"] == 8 and stats["sample_every"] == SAMPLE_EVERY
