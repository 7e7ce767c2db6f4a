"""The decoder on every device at hand: the exactness suite of ``specdec bench-device`` run as tests
(CUDA cases skipped without a GPU), the command's plan and a CPU rehearsal of it, and the pricing of
acceptance traces by a verify curve."""

import json

import pytest
import torch

from specdec.bench.device import exactness
from specdec.bench.device.pricing import Curve, chain_gain, price, price_all, step_gain
from specdec.cli import main

CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                     reason="CUDA is not available on this machine"))
CASES = list(exactness.cases("cpu"))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_exactness_case_holds_on_device(device, case):
    if device == "cpu" and case.startswith("sampling/"):
        pytest.skip("on the CPU tests/test_sampling.py runs these with more samples and a wrong rule")
    [record] = exactness.run(device, [case])
    assert record["passed"], record["detail"]


def test_a_broken_case_is_reported_not_raised(monkeypatch):
    """A part that raises on a device is a failed case with the error and where it broke."""
    def boom(name, batch, device, config):
        raise RuntimeError("tensors on two devices")

    monkeypatch.setattr(exactness, "_greedy_case", boom)
    [record] = exactness.run("cpu", ["greedy/none"])
    assert not record["passed"] and "RuntimeError: tensors on two devices" in record["detail"]
    with pytest.raises(ValueError, match="unknown exactness cases"):
        exactness.run("cpu", ["greedy/nope"])


def test_dry_run_prints_the_plan(capsys):
    assert main(["bench-device", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "exactness: 23 cases" in out and "steps dynamic,static" in out and "8B" in out and "store: 1B" in out
    assert main(["bench-device", "--dry-run", "--steps", "graphs"]) == 2
    assert "--steps: unknown graphs" in capsys.readouterr().err
    assert main(["bench-device", "--dry-run", "--shapes", "9B"]) == 2
    assert "unknown 9B" in capsys.readouterr().err


def test_cpu_rehearsal_writes_every_part(tmp_path):
    """The command end to end on the CPU with the tiny shape: curves, store steps, priced traces."""
    traces = tmp_path / "traces.json"
    traces.write_text(json.dumps({"methods": {
        "prompt-lookup": {"kind": "chain", "depth": 3, "answers": [{"runs": [3, 0, 2, 1, 0, 3]}]},
        "streaming@32": {"kind": "chain", "depth": 3, "draft_budget": 32, "answers": [{"runs": [2, 2, 2, 2]}]}}}))
    out = tmp_path / "device.json"
    assert main(["bench-device", "--device", "cpu", "--parts", "verify,store,price", "--shapes", "tiny",
                 "--store-shape", "tiny", "--dtype", "float32", "--batches", "1,2", "--contexts", "64,512",
                 "--rows", "1,2,4", "--store-batches", "2", "--store-contexts", "64", "--repeats", "1",
                 "--traces", str(traces), "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    verify = doc["parts"]["verify"]  # 2 batches x 2 contexts x 3 rows, on BMC's store and on static steps
    assert len(verify) == 2 * 2 * 3 * 2 and all(r["seconds"] > 0 for r in verify)
    assert {r["steps"] for r in verify} == {"dynamic", "static"}
    [store] = doc["parts"]["store"]
    assert store["bmc_seconds"] > 0 and store["dynamic_seconds"] > 0
    assert {r["steps"] for r in doc["parts"]["price"]} == {"dynamic", "static"}  # priced by each kind's curve
    priced = {(r["method"], r["context"]) for r in doc["parts"]["price"]}
    # text drafters at the shortest context; self-speculation only where the context passes its budget
    assert ("prompt-lookup", 64) in priced and ("streaming@32", 512) in priced and ("streaming@32", 64) not in priced


# ----------------------------------------------------------------------------------- pricing (pure)

FLAT = Curve({(1, 1024): {1: 1.0, 4: 1.0, 16: 1.0}})  # verifying costs what a plain step costs


def test_chain_gain_replays_the_answer():
    assert chain_gain([{"runs": [3, 0, 5, 1]}], 2) == (5, 3)
    assert chain_gain([{"runs": [3, 0, 5, 1]}], 0) == (5, 5)  # plain decoding: a step per token
    assert chain_gain([{"runs": [3, 3, 3, 3], "sizes": [1, 1, 1, 1]}], 3) == (5, 3)  # a copy that ran out


def test_free_perfect_drafts_on_a_flat_curve_gain_the_whole_chain():
    trace = {"kind": "chain", "depth": 4, "answers": [{"runs": [4] * 49}]}  # 50 tokens, every draft right
    best = price(trace, FLAT, 1, 1024)
    assert best["k"] == 4 and best["speedup"] == pytest.approx(50 / 11)


def test_costly_verification_turns_drafting_off():
    steep = Curve({(1, 1024): {1: 1.0, 2: 3.0, 16: 30.0}})
    trace = {"kind": "chain", "depth": 4, "answers": [{"runs": [1, 0] * 20}]}
    assert price(trace, steep, 1, 1024) == {"k": 0, "tokens_per_step": 1.0, "speedup": 1.0, "verify_over_plain": 1.0}


def test_self_speculation_pays_its_draft_steps():
    curve = Curve({(1, 64): {1: 0.5}, (1, 4096): {1: 1.0, 4: 1.0, 16: 1.0}})
    trace = {"kind": "chain", "depth": 1, "draft_budget": 64, "answers": [{"runs": [1] * 9}]}
    best = price(trace, curve, 1, 4096)  # k = 1: the prefill + 5 steps of 2 tokens, each 1 + 0.5
    assert best["k"] == 1 and best["speedup"] == pytest.approx(10 / 6 / 1.5)


def test_steps_trace_is_priced_at_its_mean_rows():
    assert step_gain([[[8, 2], [8, 0]], [[4, 1]]]) == (6, 3, pytest.approx(1 + 20 / 3))
    records = [{"shape": "x", "batch": 1, "context": 1024, "rows": r, "seconds": 1.0 + r / 100} for r in (1, 16)]
    [row] = price_all({"suffix n=8": {"kind": "steps", "setting": "n=8", "answers": [[[8, 2], [8, 0]]]}}, records)
    assert row["regime"] == "bass" and row["tokens_per_step"] == 2.0
    assert row["speedup"] == pytest.approx(2.0 * 1.01 / (1.01 + 0.15 / 15 * 8))
