"""The in-memory data of a GPU's EAGLE-3 run (specdec.training.distill): answers are the target's own
greedy answers, appended batch by batch and resumed (a crash's cut last line re-answered), features
from batched forwards equal a forward over each conversation alone, and training takes them from
memory and stops on its time budget with the head saved."""

import json

import pytest
import torch

from conftest import hf_greedy, tiny_llama
from specdec.drafters.eagle3_head import default_aux_layers
from specdec.drafters.eagle3_io import load_eagle3
from specdec.training.distill import AnswerConfig, answer_prompts, features, read_answers
from specdec.training.eagle3 import Train3Config, train_head3

LAYERS = default_aux_layers(3)


@pytest.fixture(scope="module")
def target():
    model = tiny_llama(13, layers=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(10)  # peaked distributions: answers that stop differ from each other
    return model


def _prompts(n=6):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(1, 128, (int(k),), generator=g).tolist() for k in torch.randint(3, 10, (n,), generator=g)]


def test_answers_are_the_targets_greedy_answers_and_a_rerun_resumes(target, tmp_path):
    prompts, path = _prompts(), tmp_path / "answers.jsonl"
    assert answer_prompts(target, prompts, path, AnswerConfig(max_new_tokens=12, batch_size=4), log=lambda *a: None) == 6
    rows = {conv: (p, ids) for conv, p, ids in read_answers(path)}
    for i, prompt in enumerate(prompts):  # batched with left padding: each still its own greedy answer
        p, ids = rows[i]
        ref = hf_greedy(target, torch.tensor([prompt]), 12)[0].tolist()
        assert p == len(prompt) and ids == ref[: len(ids)] and len(ids) > p
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:-1]) + lines[-1][:10])  # a crash cut the last line
    assert len(read_answers(path)) == 5
    assert answer_prompts(target, prompts, path, AnswerConfig(max_new_tokens=12, batch_size=4), log=lambda *a: None) == 1
    assert sorted(conv for conv, _, _ in read_answers(path)) == list(range(6))


def test_sampled_answers_repeat_with_their_seed_and_differ_from_greedy(target, tmp_path):
    prompts, quiet = _prompts(), (lambda *a: None)
    runs = {}
    for name, cfg in (("greedy", AnswerConfig(max_new_tokens=12)), ("a", AnswerConfig(max_new_tokens=12, temperature=1.0)),
                      ("b", AnswerConfig(max_new_tokens=12, temperature=1.0)),
                      ("c", AnswerConfig(max_new_tokens=12, temperature=1.0, seed=5))):
        answer_prompts(target, prompts, tmp_path / f"{name}.jsonl", cfg, log=quiet)
        runs[name] = sorted(read_answers(tmp_path / f"{name}.jsonl"))
    assert runs["a"] == runs["b"]  # seeded: a rerun (or a resumed batch) draws the same answers
    assert runs["a"] != runs["greedy"] and runs["a"] != runs["c"]
    assert all(ids[:p] == prompts[conv] for conv, p, ids in runs["a"])


def test_a_malformed_answer_line_is_named(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps({"conv": 0, "prompt_len": 9, "ids": [1, 2]}) + "\n")
    with pytest.raises(ValueError, match=r"a.jsonl:1: not an answer line"):
        read_answers(path)


def test_batched_features_equal_each_conversations_own_forward(target):
    g = torch.Generator().manual_seed(1)
    answers = [(i, 2, torch.randint(1, 128, (n,), generator=g).tolist()) for i, n in enumerate((5, 17, 9, 30))]
    convs = features(target, answers, LAYERS, dtype=target.dtype, tokens_per_batch=40)  # several groups
    for (_, p, ids), c in zip(answers, convs):
        states = target(torch.tensor([ids]), output_hidden_states=True).hidden_states
        assert c.ids.tolist() == ids and c.prompt_len == p and c.aux_layers == LAYERS
        torch.testing.assert_close(c.hidden, states[-1][0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(c.aux, torch.cat([states[j][0] for j in LAYERS], -1), rtol=1e-4, atol=1e-5)


def test_training_from_memory_stops_on_its_budget_with_the_head_saved(target, tmp_path):
    answers = answer_prompts(target, _prompts(8), tmp_path / "a.jsonl", AnswerConfig(max_new_tokens=16), log=lambda *a: None)
    convs = features(target, read_answers(tmp_path / "a.jsonl"), LAYERS, dtype=target.dtype)
    assert answers == len(convs) == 8
    cfg = Train3Config(steps=50, batch_size=2, draft_vocab=64, held_out=0.25, save_minutes=60, eval_every=100)
    ticks = iter(range(0, 10_000, 20))  # a clock of 20 s a reading: the 1-minute budget ends after 3 steps
    logs = []
    res = train_head3(target, convs, tmp_path / "o", cfg, log=logs.append, clock=lambda: next(ticks), minutes=1)
    assert 0 < res.step < 50 and any("stopped at step" in m for m in logs)
    assert res.history[-1]["stopped"] and len(res.history[-1]["held_out_acc_per_depth"]) == cfg.ttt_steps
    assert load_eagle3(tmp_path / "o" / "head", target).draft_vocab.numel() == 64


def test_cli_in_memory_trains_from_an_answers_file(target, tmp_path):
    from conftest import train_eagle_run
    from specdec.cli.train_eagle import run

    answer_prompts(target, _prompts(6), tmp_path / "a.jsonl", AnswerConfig(max_new_tokens=12), log=lambda *a: None)
    (tmp_path / "d").mkdir()
    model_dir, out, parser = train_eagle_run(target, tmp_path / "d", tmp_path)
    args = parser.parse_args(["--model", str(model_dir), "--out", str(out), "--arch", "eagle3", "--in-memory",
                              "--stage", "train", "--answers", str(tmp_path / "a.jsonl"), "--steps", "2",
                              "--batch-size", "2", "--draft-vocab", "32", "--quiet"])
    assert run(args) == 0
    assert json.loads((out / "eagle3" / "head" / "config.json").read_text())["draft_vocab_size"] == 32
    with pytest.raises(ValueError, match="--in-memory trains an EAGLE-3 head"):
        run(parser.parse_args(["--model", str(model_dir), "--out", str(out), "--in-memory", "--answers", "x"]))
