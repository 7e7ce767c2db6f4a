"""specdec.bench.compare: paired speed ratios with bootstrap intervals (pure functions, no model)."""

import json
import random

import pytest

from specdec.bench.compare import compare, main, paired_ratio, read_records, speed_ratio


def _records(path, speeds: dict[str, float], questions: int = 12, noise: float = 0.0, seed: int = 0):
    """Bench records: per qa question, each method's time = tokens / its speed x (1 +- noise)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for q in range(questions):
            tokens = rng.randrange(50, 250)
            for m, v in speeds.items():
                sec = tokens / v * (1 + rng.uniform(-noise, noise))
                f.write(json.dumps({"pass": 1, "question_id": q, "category": "qa", "method": m,
                                    "new_tokens": tokens, "seconds": sec, "steps": 10, "identical": True}) + "\n")
    return path


def test_speed_ratio_sums_before_dividing():
    assert speed_ratio([(10, 1.0), (10, 1.0)], [(10, 2.0), (10, 2.0)]) == 2.0
    assert speed_ratio([(100, 1.0), (10, 1.0)], [(100, 2.0), (10, 0.5)]) == pytest.approx((110 / 2) / (110 / 2.5))


def test_the_interval_holds_the_ratio_and_shrinks_with_less_noise():
    rng = random.Random(1)
    b = [(rng.randrange(50, 250), 0.0) for _ in range(30)]
    b = [(t, t / 20) for t, _ in b]
    noisy = [(t, s / 1.1 * (1 + rng.uniform(-0.2, 0.2))) for t, s in b]
    quiet = [(t, s / 1.1 * (1 + rng.uniform(-0.01, 0.01))) for t, s in b]
    r, lo, hi = paired_ratio(noisy, b)
    rq, loq, hiq = paired_ratio(quiet, b)
    assert lo <= r <= hi and loq <= rq <= hiq
    assert hiq - loq < (hi - lo) / 4
    assert loq > 1.05 and paired_ratio(b, b)[1:] == (1.0, 1.0)
    assert paired_ratio(noisy, b, seed=3) == paired_ratio(noisy, b, seed=3)  # seeded
    with pytest.raises(ValueError, match="same non-zero number"):
        paired_ratio(noisy[:3], b)


def test_verdicts_per_task_and_overall(tmp_path):
    path = _records(tmp_path / "r.jsonl", {"hf-generate": 20.0, "auto": 60.0, "suffix": 50.0, "lookup": 60.0},
                    noise=0.02)
    rows = compare(read_records(path), "auto", ["suffix", "lookup"])
    by = {(r.group, r.other): r for r in rows}
    assert set(by) == {("qa", "suffix"), ("qa", "lookup"), ("overall", "suffix"), ("overall", "lookup")}
    assert by["qa", "suffix"].verdict == "faster" and by["qa", "suffix"].units == 12
    assert by["qa", "lookup"].verdict == "level" and by["qa", "lookup"].low < 1 < by["qa", "lookup"].high
    best = compare(read_records(path), "auto", ["suffix", "lookup"], best=True)
    assert [(r.group, r.other) for r in best] == [("qa", "lookup"), ("overall", "lookup")]


def test_long_context_records_compare_the_decode_phase(tmp_path):
    path = tmp_path / "lc.jsonl"
    with open(path, "w") as f:
        for prompt in range(4):
            for m, decode in (("auto", 2.0), ("suffix", 4.0)):
                f.write(json.dumps({"prompt": f"p{prompt}", "batch": 1, "length": 2048, "method": m,
                                    "new_tokens": 256, "seconds": 10.0 + decode, "ttft": 10.0}) + "\n")
    whole = compare(read_records(path), "auto", ["suffix"])[0]
    decode = compare(read_records(path, decode=True), "auto", ["suffix"])[0]
    assert whole.group == "2048 tokens" and whole.ratio == pytest.approx(14 / 12)
    assert decode.ratio == pytest.approx(2.0) and decode.verdict == "faster"


def test_bad_input_is_named(tmp_path, capsys):
    path = _records(tmp_path / "r.jsonl", {"auto": 60.0, "suffix": 50.0})
    with pytest.raises(ValueError, match="no records of eagle; the file has auto, suffix"):
        compare(read_records(path), "auto", ["eagle"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"method": "auto"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: not a record"):
        read_records(bad)
    assert main([str(path), "auto", "suffix", "--resamples", "200"]) == 0
    assert "faster" in capsys.readouterr().out
