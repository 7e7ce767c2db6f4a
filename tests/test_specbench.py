"""`specdec specbench` on a tiny random chat model: answer files in Spec-Bench's format, the lossless
check, Spec-Bench's figures, and resuming after a kill (truncated line, SIGKILLed process)."""

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from rich.console import Console

from specdec.bench.questions import Question
from specdec.bench.runner import AnswerFile
from specdec.bench.specbench_figures import BASELINE, method_stats, summarize
from specdec.cli.specbench import SpecBenchConfig, evaluate
from tiny_chat import save_tiny_chat, tiny_chat_model, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]
ARTICLE = ("The river rose in the night. The river rose over the road. The river rose into the square, "
           "and by morning the river had reached the steps of the town hall. ")
QUESTIONS = [
    {"question_id": 11, "category": "writing", "turns": ["Write a line about rain.", "Now make it sad."]},
    {"question_id": 12, "category": "summarization", "turns": ["Summarize: " + ARTICLE * 2]},
    {"question_id": 13, "category": "coding", "turns": ["def f(x): return x", "Add a docstring."]},
    {"question_id": 14, "category": "qa", "turns": ["Why is ice slippery?"]},
]
MAX_NEW = 10


def _question_file(tmp_path) -> Path:
    p = tmp_path / "question.jsonl"
    p.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    return p


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny forwards on one thread


@pytest.fixture(scope="module")
def tiny():
    return tiny_chat_model(), tiny_tokenizer()


def _evaluate(tiny, out_dir, drafters=("prompt-lookup", "none"), questions=None):
    model, tok = tiny
    qs = questions or [Question(q["question_id"], q["category"], tuple(q["turns"])) for q in QUESTIONS]
    cfg = SpecBenchConfig(out_dir=out_dir, drafters=drafters, max_new_tokens=MAX_NEW, warmup_tokens=2)
    return evaluate(model, tok, "tiny", qs, cfg, Console(file=io.StringIO(), width=160))


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def _answered_ids(out_dir: Path) -> dict[str, list]:
    return {p.stem: [r["question_id"] for r in _lines(p)] for p in sorted((out_dir / "model_answer").glob("*.jsonl"))}


def test_answers_in_spec_bench_format_and_identical(tiny, tmp_path):
    out = tmp_path / "run"
    summary = _evaluate(tiny, out)
    files = sorted(p.name for p in (out / "model_answer").glob("*.jsonl"))
    assert files == ["tiny-baseline.jsonl", "tiny-none.jsonl", "tiny-prompt-lookup.jsonl"]
    for name in files:
        recs = _lines(out / "model_answer" / name)
        assert [r["question_id"] for r in recs] == [11, 12, 13, 14]
        for r, q in zip(recs, QUESTIONS):
            assert set(r) == {"question_id", "category", "answer_id", "model_id", "choices", "tstamp"}
            assert r["category"] == q["category"] and r["model_id"] == "tiny-" + name[5:-6]
            c = r["choices"][0]
            n_turns = len(q["turns"])
            for key in ("turns", "new_tokens", "wall_time", "decoding_steps", "token_ids"):
                assert len(c[key]) == n_turns, key
            assert c["index"] == 0
            assert c["new_tokens"] == [len(t) for t in c["token_ids"]]
            assert sum(c["accept_lengths"]) == sum(c["new_tokens"])  # one entry per target forward
            assert len(c["accept_lengths"]) == sum(c["decoding_steps"])
            assert all(0 < n <= MAX_NEW for n in c["new_tokens"])
            if name == "tiny-baseline.jsonl":
                assert set(c["accept_lengths"]) == {1}
    pl = summary["methods"]["prompt-lookup"]
    assert pl["overall"]["identical"] and summary["methods"]["none"]["overall"]["identical"]
    assert pl["overall"]["questions"] == 4
    assert summary["tasks"] == ["mt_bench", "summarization", "qa"]
    assert pl["tasks"]["mt_bench"]["questions"] == 2
    # the repetitive article lets prompt lookup accept drafts: more than one token per forward
    assert pl["tasks"]["summarization"]["mean_accepted_tokens"] > 1
    assert summary["methods"]["none"]["overall"]["mean_accepted_tokens"] == 1
    saved = json.loads((out / "summary.json").read_text())
    assert saved["methods"]["prompt-lookup"]["overall"]["speedup"] == pytest.approx(pl["overall"]["speedup"])


def test_second_turn_sees_the_models_own_answer(tiny, tmp_path, monkeypatch):
    import specdec.cli.specbench as sb

    seen = []
    real = sb.chat_ids
    monkeypatch.setattr(sb, "chat_ids", lambda tok, msgs: seen.append([dict(m) for m in msgs]) or real(tok, msgs))
    _evaluate(tiny, tmp_path / "run", drafters=("none",), questions=[Question(1, "writing", ("a?", "b?"))])
    rec = _lines(tmp_path / "run" / "model_answer" / "tiny-none.jsonl")[0]
    second = [m for m in seen if len(m) == 3][-1]
    assert [m["role"] for m in second] == ["user", "assistant", "user"]
    assert second[1]["content"] == rec["choices"][0]["turns"][0]


def test_rerun_answers_nothing_twice(tiny, tmp_path):
    out = tmp_path / "run"
    _evaluate(tiny, out)
    before = {p.name: p.read_bytes() for p in (out / "model_answer").glob("*.jsonl")}
    _evaluate(tiny, out)
    assert {p.name: p.read_bytes() for p in (out / "model_answer").glob("*.jsonl")} == before


def test_resume_after_a_line_cut_mid_write(tiny, tmp_path):
    out = tmp_path / "run"
    _evaluate(tiny, out)
    pl = out / "model_answer" / "tiny-prompt-lookup.jsonl"
    base = out / "model_answer" / "tiny-baseline.jsonl"
    kept = _lines(pl)[:2]
    text = pl.read_text().splitlines(keepends=True)
    pl.write_text("".join(text[:2]) + text[2][: len(text[2]) // 2])  # killed while writing question 13
    lines = base.read_text().splitlines(keepends=True)
    base.write_text("".join(lines[:3]) + lines[3].rstrip("\n"))  # killed before the final newline
    summary = _evaluate(tiny, out)
    assert _answered_ids(out) == {n: [11, 12, 13, 14] for n in ("tiny-baseline", "tiny-none", "tiny-prompt-lookup")}
    assert _lines(pl)[:2] == kept  # finished answers are never redone
    assert summary["methods"]["prompt-lookup"]["overall"]["identical"]


def test_adding_a_drafter_later_reuses_the_baseline(tiny, tmp_path):
    out = tmp_path / "run"
    _evaluate(tiny, out, drafters=("none",))
    base = (out / "model_answer" / "tiny-baseline.jsonl").read_bytes()
    summary = _evaluate(tiny, out, drafters=("prompt-lookup",))
    assert (out / "model_answer" / "tiny-baseline.jsonl").read_bytes() == base
    assert list(summary["methods"]) == [BASELINE, "prompt-lookup"]


def test_broken_line_inside_the_file_is_an_error(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_text('{"question_id": 1}\n{"question_id": 2, "cho\n{"question_id": 3}\n')
    with pytest.raises(ValueError, match=r"a\.jsonl:2: broken answer record"):
        AnswerFile(p)
    p.write_text('{"question_id": 1}\n{"question_id": 1}\n')
    with pytest.raises(ValueError, match=r"a\.jsonl:2: second answer for question 1"):
        AnswerFile(p)


def test_records_keyed_by_several_fields_resume_the_same_way(tmp_path):
    """bench-longctx's records (one file, keyed by prompt and method) get the same repair on resume."""
    p = tmp_path / "longctx.jsonl"
    p.write_text('{"prompt": "b0/10/summary", "method": "none"}\n{"prompt": "b0/10/summary", "meth')
    f = AnswerFile(p, key=("prompt", "method"))
    assert list(f.records) == [("b0/10/summary", "none")]
    assert p.read_text() == '{"prompt": "b0/10/summary", "method": "none"}\n'  # the cut record is gone
    p.write_text('{"prompt": "a", "method": "none"}\n{"prompt": "a", "method": "none"}\n')
    with pytest.raises(ValueError, match=r"longctx\.jsonl:2: second answer for prompt 'a', method 'none'"):
        AnswerFile(p, key=("prompt", "method"))


def test_methods_rotate_one_place_per_question():
    from specdec.bench.runner import rotated

    assert [rotated(["a", "b", "c"], i) for i in range(4)] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"],
                                                                ["a", "b", "c"]]
    assert rotated([], 3) == []


def test_other_settings_in_the_same_directory_are_refused(tiny, tmp_path):
    out = tmp_path / "run"
    _evaluate(tiny, out, drafters=("none",), questions=[Question(1, "qa", ("a?",))])
    model, tok = tiny
    cfg = SpecBenchConfig(out_dir=out, drafters=("none",), max_new_tokens=MAX_NEW + 1)
    with pytest.raises(ValueError, match="max_new_tokens: 10 there, 11 now"):
        evaluate(model, tok, "tiny", [Question(1, "qa", ("a?",))], cfg, Console(file=io.StringIO()))
    with pytest.raises(ValueError, match="answered as category 'qa'.*says 'rag'"):
        _evaluate(tiny, out, drafters=("none",), questions=[Question(1, "rag", ("a?",))])


def _rec(qid, category, new_tokens, seconds, steps, ids=None):
    return {"question_id": qid, "category": category, "choices": [{
        "new_tokens": new_tokens, "wall_time": seconds, "decoding_steps": steps,
        "accept_lengths": [], "token_ids": ids if ids is not None else [[qid] * n for n in new_tokens]}]}


def test_figures_follow_spec_benchs_definitions():
    qs = [Question(1, "writing", ("a", "b")), Question(2, "qa", ("c",)), Question(3, "rag", ("d",))]
    base = {1: _rec(1, "writing", [10, 10], [1.0, 1.0], [10, 10]),  # 10 tokens/s
            2: _rec(2, "qa", [30], [1.0], [30]),  # 30 tokens/s
            3: _rec(3, "rag", [5], [1.0], [5])}
    fast = {1: _rec(1, "writing", [10, 10], [0.5, 0.5], [5, 5]),  # 20 tokens/s, 2 tokens per forward
            2: _rec(2, "qa", [30], [0.5], [10], ids=[[9] * 30])}  # 60 tokens/s but different tokens
    s = summarize({BASELINE: base, "fast": fast}, qs)
    f = s["methods"]["fast"]
    # speedup = mean over questions of tokens/s, over the baseline's mean on the same questions
    assert f["overall"]["speedup"] == pytest.approx(((20 + 60) / 2) / ((10 + 30) / 2))
    assert f["overall"]["mean_accepted_tokens"] == pytest.approx(50 / 20)
    assert f["overall"]["questions"] == 2  # question 3 is not answered by "fast": left out
    assert not f["overall"]["identical"] and f["overall"]["mismatched_questions"] == [2]
    assert f["tasks"]["mt_bench"]["identical"] and f["tasks"]["mt_bench"]["speedup"] == pytest.approx(2)
    assert f["tasks"]["rag"] == {"questions": 0}
    assert s["methods"][BASELINE]["overall"]["speedup"] == pytest.approx(1)
    assert s["tasks"] == ["mt_bench", "qa", "rag"]
    assert method_stats([], []) == {"questions": 0}


def test_killed_process_resumes_with_every_question_once(tmp_path):
    """Run the real CLI in a subprocess, SIGKILL it after its first answers, run it again."""
    model_dir = tmp_path / "tiny-model"
    save_tiny_chat(model_dir)
    qfile = tmp_path / "question.jsonl"
    qs = [dict(q, question_id=100 + i * 10 + k) for i in range(2) for k, q in enumerate(QUESTIONS)]  # 8 questions
    qfile.write_text("".join(json.dumps(q) + "\n" for q in qs))
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "specdec.cli", "specbench", "--model", str(model_dir), "--questions", str(qfile),
           "--drafter", "prompt-lookup", "--max-new-tokens", "24", "--out", str(out), "--dtype", "float64"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS="1", SPECDEC_KERNEL_CALIBRATE="0")  # the resuming, not the kernels' self-check
    answers = out / "model_answer" / "tiny-model-baseline.jsonl"
    proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            if answers.exists() and answers.read_bytes().count(b"\n") >= 1:
                break
            time.sleep(0.01)
        assert proc.poll() is None, f"finished before it could be killed: {proc.stderr.read().decode()[-2000:]}"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    partial = _answered_ids(out)
    assert sum(map(len, partial.values())) < 2 * len(qs), "the kill came too late to test resuming"
    done = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    ids = [q["question_id"] for q in qs]
    assert _answered_ids(out) == {"tiny-model-baseline": ids, "tiny-model-prompt-lookup": ids}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["methods"]["prompt-lookup"]["overall"]["questions"] == len(qs)
    assert summary["methods"]["prompt-lookup"]["overall"]["identical"]


def test_speedup_chart_from_summaries(tiny, tmp_path):
    pytest.importorskip("matplotlib")
    from specdec.bench.chart import plot_speedups, read_speedups

    _evaluate(tiny, tmp_path / "run")
    ours = tmp_path / "run" / "summary.json"
    assert set(read_speedups(ours)) == {"prompt-lookup", "none"}  # the baseline is the 1.0 line
    assert set(read_speedups(ours)["prompt-lookup"]) == {"mt_bench", "summarization", "qa", "overall"}
    bench = tmp_path / "bench.json"  # the shape `specdec bench` writes
    bench.write_text(json.dumps({"overall": {"hf-generate": {"speedup": 1.0}, "specdec:x": {"speedup": 1.4}},
                                 "by_task": {"qa": {"hf-generate": {"speedup": 1.0}, "specdec:x": {"speedup": 1.2}}}}))
    assert read_speedups(bench) == {"specdec:x": {"qa": 1.2, "overall": 1.4}}
    png = plot_speedups([ours, bench], tmp_path / "chart" / "speedup.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="not a summary"):
        read_speedups(tmp_path / "run" / "run.json")


def test_throughput_mode_answers_each_question_as_batch_one_does(tiny, tmp_path):
    """--batch-size 3: questions go 3 at a time, turn by turn (a second turn after the question's own
    first answer); answers keep Spec-Bench's format and equal the one-at-a-time answers token for token."""
    model, tok = tiny
    qs = [Question(q["question_id"], q["category"], tuple(q["turns"])) for q in QUESTIONS]
    runs = {}
    for B in (1, 3):
        cfg = SpecBenchConfig(out_dir=tmp_path / f"b{B}", drafters=("prompt-lookup",), max_new_tokens=MAX_NEW,
                              warmup_tokens=2, batch_size=B)
        summary = evaluate(model, tok, "tiny", qs, cfg, Console(file=io.StringIO(), width=160))
        runs[B] = {p.stem: _lines(p) for p in sorted((tmp_path / f"b{B}" / "model_answer").glob("*.jsonl"))}
    assert summary["methods"]["prompt-lookup"]["overall"]["questions"] == 4
    for name in ("tiny-baseline", "tiny-prompt-lookup"):
        assert [r["question_id"] for r in runs[3][name]] == [11, 12, 13, 14]
        assert [r["batch_size"] for r in runs[3][name]] == [3, 3, 3, 1]
        for one, many in zip(runs[1][name], runs[3][name]):
            c1, c3 = one["choices"][0], many["choices"][0]
            assert c3["token_ids"] == c1["token_ids"], (name, one["question_id"])
            assert len(c3["accept_lengths"]) == sum(c3["decoding_steps"])
            assert sum(c3["accept_lengths"]) == sum(c3["new_tokens"])
