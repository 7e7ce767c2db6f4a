"""bench-controller's recordings and replays: a recording predicts every step the decoder takes with
the same drafter on the same prompt, and a replay prices steps as the decoder's loop would."""

import pytest
import torch

from conftest import tiny_llama
from specdec import SpecDecoder
from specdec.bench.runner import fixed_setting
from specdec.bench.policy import Recording, _leading, compare, overall, record, replay
from specdec.controller import DraftLengthConfig, DraftLengthController
from specdec.decoder import SpecDecoderConfig
from specdec.drafters.prompt_lookup import PromptLookupDrafter
from specdec.drafters.base import Capabilities
from specdec.drafters.self_spec import StreamingDrafter

TARGET = tiny_llama(5, layers=2)


def _streaming():
    # compacted after every step (overshoot 0): the window is then a function of the text alone; with an
    # overshoot it holds budget .. budget + overshoot rows by where the last compaction fell (module doc)
    return StreamingDrafter(TARGET, budget=10, sink=2, overshoot=0)  # a 30-token prompt: most rows dropped


def test_leading_matches():
    assert _leading([3, 4, 5], [3, 4, 9]) == 2
    assert _leading([3, 4], [3, 4, 9]) == 2
    assert _leading([3, 4, 5], [3]) == 1
    assert _leading([7], [3]) == 0


@pytest.mark.parametrize("make", [_streaming, PromptLookupDrafter], ids=["streaming", "prompt-lookup"])
def test_a_recording_predicts_every_step_of_the_decoder(make):
    """A k-token chain at answer token s accepts min(k, runs[s]): checked against the decoder's own
    steps under fixed lengths and under an adaptive one, on seeded prompts with partial acceptance
    (a prompt that repeats itself: prompt lookup finds matches)."""
    partial = 0
    for seed in range(2):
        half = torch.randint(1, 128, (1, 15), generator=torch.Generator().manual_seed(seed))
        ids = torch.cat([half, half], dim=1)
        rec = record(TARGET, make, ids, 40, None, depth=6, timed_tokens=20)
        assert len(rec.tokens) == 40 and len(rec.runs) == len(rec.sizes) == len(rec.classes) == 38  # none at the last token (nothing wanted)
        assert set(rec.verify) <= set(range(1, 8)) and 1 in rec.verify and rec.draft
        partial += sum(0 < r < 6 for r in rec.runs)
        configs = [fixed_setting("k=2"), fixed_setting("k=5"),
                   SpecDecoderConfig(draft_length=DraftLengthConfig(cost_aware=False, initial=3, maximum=6))]
        for config in configs:
            out = SpecDecoder(TARGET, make(), config).generate(ids, max_new_tokens=40)
            assert out.generated(0).tolist() == rec.tokens
            pos = 0
            for step in out.steps[1:]:
                k, a = step.num_drafted[0], step.num_accepted[0]
                if k:
                    assert k <= rec.sizes[pos] and a == min(k, rec.runs[pos]), (seed, pos, k, a, rec.runs[pos])
                pos += 1 + a
            if config.draft_length.cost_aware is False and not config.draft_length.adaptive:
                assert replay(rec, k=config.draft_length.initial)[1] == len(out.steps) - 1
    assert partial >= 5  # the property is exercised where a chain is cut short, not only whole or empty


def _hand() -> Recording:
    return Recording("hand", [0] * 5, [2, 0, 0, 0], [10] * 4, [None] * 4, {1: 1.0, 3: 1.2}, {2: 0.5})


def test_replay_of_fixed_lengths_by_hand():
    rec = _hand()
    assert replay(rec, k=2) == pytest.approx((2.7, 2))  # 2 accepted at token 0 (1.7 s); token 3 wants 0 more
    assert replay(rec, k=0) == pytest.approx((4.0, 4))  # plain decoding: a step per token
    # k = 1: 2 rows cost 3's (the nearest timed size up), a 1-token draft half the 2-token one; token 0
    # accepts 1, token 2 none, token 3 wants nothing more
    assert replay(rec, k=1) == pytest.approx((1.45 + 1.45 + 1.0, 3))


def test_replay_noise_is_seeded_and_moves_the_seconds():
    rec = _hand()
    assert replay(rec, k=2, noise=0.1, seed=3) == replay(rec, k=2, noise=0.1, seed=3)
    assert replay(rec, k=2, noise=0.1, seed=3)[0] != replay(rec, k=2)[0]


def test_compare_finds_the_best_fixed_length_and_scores_the_controller():
    # runs of 5 accepted tokens then a miss, verify nearly flat, drafts cheap: k = 5 is best
    runs = ([5, 4, 3, 2, 1, 0] * 20)[:119]
    rec = Recording("runs", [0] * 120, runs, [8] * 119, [None] * 119,
                    {q: 1.0 + 0.02 * (q - 1) for q in range(1, 10)}, {k: 0.01 * k for k in range(9)})
    row = compare(rec, lambda: DraftLengthController(SpecDecoderConfig().draft_length), max_k=8, seeds=3)
    assert row["best_k"] == 5 and row["best"] == max(row["fixed"].values()) > 4
    assert 1.0 < row["controller"] <= row["best"] + 1e-9 and row["noisy_worst"] <= row["noisy_mean"]


def test_a_free_drafters_gated_off_class_is_scored_in_the_replay():
    """As in the decoder: a step a free drafter's class drafts nothing in scores a shadow draft of it
    against the one token the plain step commits; a drafter whose drafts cost forwards gets none."""
    runs = ([0, 0, 0, 0, 0, 0, 3, 2, 1] * 12)[:107]
    costs = {q: 1.0 + 0.1 * (q - 1) for q in range(1, 9)}, {k: 0.0 for k in range(8)}
    shadows = {}
    for free in (True, False):
        rec = Recording("r", [0] * 108, runs, [6] * 107, [None] * 107, *costs, free=free)
        c = DraftLengthController(SpecDecoderConfig().draft_length)
        seen, observe = [], c.observe_shadow
        c.observe_shadow = lambda p, a, j, d=None, key=None: (seen.append(j), observe(p, a, j, d, key))
        replay(rec, c)
        shadows[free] = seen
    assert shadows[True] and all(j == [1] for j in shadows[True]) and shadows[False] == []


def test_the_overall_row_is_the_geometric_mean_of_each_column():
    rows = [{"fixed": {1: 1.0, 2: 4.0}, "best": 4.0, "controller": 2.0, "noisy_mean": 2.0, "noisy_worst": 1.0},
            {"fixed": {1: 4.0, 2: 1.0}, "best": 4.0, "controller": 8.0, "noisy_mean": 2.0, "noisy_worst": None}]
    row = overall(rows)
    assert row["fixed"] == pytest.approx({1: 2.0, 2: 2.0}) and row["best"] == pytest.approx(4.0)
    assert row["controller"] == pytest.approx(4.0) and row["noisy_worst"] == pytest.approx(1.0)  # None: skipped
    assert row["prompt"] == "all 2 (geomean)"


def test_a_tree_drafter_is_refused():

    class Tree(StreamingDrafter):
        capabilities = Capabilities(sizes_own_tree=True, batches=True, samples=True)

    with pytest.raises(ValueError, match="chain drafters"):
        record(TARGET, lambda: Tree(TARGET, budget=10, sink=2), torch.ones(1, 5, dtype=torch.long), 4, None)


def test_the_recording_error_names_file_and_line(tmp_path, capsys):
    from specdec.cli import main

    out = tmp_path / "policy"
    out.with_suffix(".jsonl").write_text("\nnot json\n")
    assert main(["bench-controller", "--books", "1", "--out", str(out)]) == 2  # one line, no traceback
    assert "policy.jsonl:2: not a recording" in capsys.readouterr().err


def test_recordings_are_kept_per_target_weights(tmp_path, monkeypatch, capsys):
    """A recording on the fp32 target replays for fp32 and is not taken for a packed target's (another
    verify curve): there the model loads, with the weights asked for, to record afresh."""
    import json
    from dataclasses import asdict

    from specdec.bench.books import BOOKS, read_books
    from specdec.cli import main

    book = read_books(BOOKS)[0]["id"]
    rec = record(TARGET, _streaming, torch.randint(1, 128, (1, 30), generator=torch.Generator().manual_seed(0)),
                 6, None, f"{book}/7000/continue", 2, drafter="streaming@512")
    out = tmp_path / "policy"
    out.with_suffix(".jsonl").write_text(json.dumps(asdict(rec)) + "\n")
    asked = []

    def load_model(spec, weights="fp32", **kw):
        asked.append(weights)
        raise ValueError(f"no model here ({weights})")

    monkeypatch.setattr("specdec.models.load_model", load_model)
    argv = ["bench-controller", "--books", "1", "--lengths", "7000", "--instruction", "continue", "--depth", "2",
            "--seeds", "1", "--out", str(out)]
    assert main(argv) == 0 and asked == []  # replayed from the file
    assert main([*argv, "--weights", "packed"]) == 2 and asked == ["packed"]
    assert "no model here (packed)" in capsys.readouterr().err
