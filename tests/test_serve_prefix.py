"""`specdec serve` with a prefix cache: a later request sharing a system prompt reuses its rows (usage's
cached_tokens, OpenAI's and ours; /metrics), answers as without the cache; the multi-turn load script on a
tiny load against a server with the cache and one without (the same answers; no timing asserted)."""

import asyncio

import pytest
import torch

from serve_helpers import LiveServer, self_drafter, tiny_model
from specdec import PrefixCache, SpecDecoder
from specdec.config import RuntimeConfig
from specdec.controller.draft_length import DraftLengthConfig
from specdec.decoder import SpecDecoderConfig
from specdec.prompting import chat_ids
from specdec.serve.engine import EngineConfig
from specdec.serve.service import ServeConfig

httpx = pytest.importorskip("httpx")
EOS = 256  # the tiny tokenizer's <|im_end|>
SYSTEM = "You are terse. Notes: alpha beta gamma delta."  # ~60 tokens with the template: 7 blocks of 8


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny forwards on one thread


def _decoder(cache: PrefixCache | None) -> SpecDecoder:
    config = SpecDecoderConfig(draft_length=DraftLengthConfig(cost_aware=False), runtime=RuntimeConfig(calibrate=False))
    return SpecDecoder(tiny_model(0), self_drafter(), config, prefix_cache=cache)


def _config() -> ServeConfig:
    return ServeConfig(model_name="tiny", default_max_tokens=8, engine=EngineConfig(max_batch=4))


@pytest.fixture(scope="module")
def servers(one_thread):
    cached = LiveServer(_decoder(PrefixCache(2**20, block=8)), _config())
    plain = LiveServer(_decoder(None), _config())
    yield cached, plain
    cached.stop()
    plain.stop()


def _messages(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def _post(server, question: str) -> dict:
    body = {"model": "tiny", "messages": _messages(question), "max_tokens": 8, "temperature": 0}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _hf(server, question: str) -> str:
    ids = chat_ids(server.tokenizer, _messages(question))
    out = tiny_model(0).generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=EOS, pad_token_id=0,
                                 attention_mask=torch.ones_like(ids))
    return server.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def _metric(server, name: str) -> float:
    for line in httpx.get(server.url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "_total "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in /metrics")


def test_a_shared_system_prompt_is_reused_and_reported(servers):
    cached, plain = servers
    first, second = _post(cached, "What is one?"), _post(cached, "And two?")
    prompt_tokens = len(chat_ids(cached.tokenizer, _messages("And two?"))[0])
    reused = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # the system turn's whole blocks of 8, up to where the two prompts part
    assert 40 <= reused < prompt_tokens and reused % 8 == 0
    assert second["usage"]["specdec"]["cached_tokens"] == reused
    for q, r in (("What is one?", first), ("And two?", second)):
        assert r["choices"][0]["message"]["content"] == _hf(cached, q) == \
            _post(plain, q)["choices"][0]["message"]["content"]
    assert _post(plain, "And two?")["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert _metric(cached, "specdec_prefix_cache_reused_tokens") >= reused
    assert _metric(cached, "specdec_prefix_cache_hits") >= 1
    assert 0 < _metric(cached, "specdec_prefix_cache_bytes") <= _metric(cached, "specdec_prefix_cache_max_bytes")


def test_the_multiturn_load_script_on_a_tiny_load(servers):
    from specdec.bench.serve_load import compare_conversations, run_conversations, system_prompt, turn_summary

    cached, plain = servers
    system = system_prompt(["alpha beta", "gamma"], 12)  # 48 characters
    assert len(system) == 48 and system.startswith("You are")
    asks = ["hi", "why?", "ok"]
    runs = [asyncio.run(run_conversations(s.url, "tiny", system, asks, 2, 3, 4, 0.0, 120)) for s in (cached, plain)]
    for r in runs:
        assert r["requests"] == 6 and r["errors"] == 0 and r["turns"] == 3
        assert len(r["ttft_p50_by_turn_s"]) == 3 and r["later_over_first"] is not None
    assert runs[0]["cached_tokens"] > 0 and runs[1]["cached_tokens"] == 0
    compared = compare_conversations(runs[0], runs[1], 0.0)
    assert compared["multiturn_answers_identical"] is True and compared["multiturn_throughput_ratio"] > 0
    # the summary on hand-made samples: turn of sample i is i % turns
    from specdec.bench.serve_load import Sample

    samples = [Sample(i, t, t, 1, "", None, 10, c) for i, (t, c) in enumerate([(2.0, 0), (0.4, 8), (0.6, 8)])]
    s = turn_summary(samples, 3)
    assert s["ttft_p50_by_turn_s"] == [2.0, 0.4, 0.6] and s["later_over_first"] == pytest.approx(0.2)
    assert s["cached_tokens"] == 16 and s["prompt_tokens"] == 30


def test_prefix_cache_mb_sizes_the_cache_and_zero_turns_it_off():
    import argparse

    from specdec.cli.serve import add_arguments, prefix_cache

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cache = prefix_cache(parser.parse_args([]))
    assert cache is not None and cache.max_bytes == 512 * 2**20 and cache.block == 64
    assert prefix_cache(parser.parse_args(["--prefix-cache-mb", "8"])).max_bytes == 8 * 2**20
    assert prefix_cache(parser.parse_args(["--prefix-cache-mb", "0"])) is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--prefix-cache-mb", "-1"])


def test_bench_serve_multiturn_against_a_cached_and_a_plain_server(servers, tmp_path, capsys):
    """The command's glue: --modes multiturn with --baseline-url writes both runs and the comparison."""
    import argparse
    import json

    from specdec.bench.serve_load import add_arguments, run

    cached, plain = servers
    questions = tmp_path / "q.jsonl"
    questions.write_text("\n".join(json.dumps({"question_id": i, "category": "c", "turns": [t]})
                                   for i, t in enumerate(["hi", "why?", "ok"])), encoding="utf-8")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "load.json"
    args = parser.parse_args(["--url", cached.url, "--model", "tiny", "--modes", "multiturn", "--clients", "2",
                              "--turns", "2", "--max-tokens", "4", "--system-tokens", "10", "--questions",
                              str(questions), "--baseline-url", plain.url, "--out", str(out)])
    assert run(args) == 0
    result = json.loads(out.read_text())
    assert result["multiturn"]["requests"] == result["multiturn_baseline"]["requests"] == 4
    assert result["multiturn_answers_identical"] is True
    assert "later turns" in capsys.readouterr().out
