"""`specdec train-eagle` end to end on a tiny random target: data generation (resumable), training
(checkpointed, resumable to the same weights), held-out accuracy, and the trained head drafting
losslessly with partial acceptance."""

import json

import pytest
import torch

from conftest import Interrupt, KillAt, hf_greedy, tiny_llama, train_eagle_run
from specdec import SpecDecoder, SpecDecoderConfig
from specdec.controller import DraftLengthConfig
from specdec.drafters.eagle import EagleConfig, EagleDrafter, EagleHead, load_head
from specdec.kv.bmc import BMCConfig
from specdec.cli.train_eagle import run
from specdec.training import (PROMPTS_FILE, Conversation, DataConfig, TrainConfig, batch_indices, generate_data,
                              load_data, lr_at, read_answers, read_prompts, restore_answers, save_answers,
                              split_held_out, train_head)

STEPS = 60
CFG = TrainConfig(steps=STEPS, batch_size=4, lr=1e-2, warmup=4, save_every=5, eval_every=20, held_out=0.2)


@pytest.fixture(scope="module")
def target():
    return tiny_llama(11)


@pytest.fixture(scope="module")
def data_dir(target, tmp_path_factory):
    d = tmp_path_factory.mktemp("eagle") / "data"
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 128, (int(n),), generator=g).tolist()
               for n in torch.randint(3, 12, (10,), generator=g)]
    assert generate_data(target, prompts[:6], d, DataConfig(max_new_tokens=48)) == 6
    assert generate_data(target, prompts, d, DataConfig(max_new_tokens=48)) == 4  # resumes
    return d


def test_data_files_hold_ids_and_features(target, data_dir):
    convs = load_data(data_dir)
    assert len(convs) == 10
    c = convs[0]
    assert c.hidden.shape == (len(c.ids), 64) and len(c.ids) == c.prompt_len + 48
    assert torch.equal(c.ids[None], hf_greedy(target, c.ids[None, : c.prompt_len], 48))


def test_answers_file_carries_the_data_without_features(target, data_dir, tmp_path):
    answers = tmp_path / "answers.jsonl"
    assert save_answers(data_dir, answers) == 10
    assert answers.stat().st_size < 20_000  # token ids only
    rebuilt = tmp_path / "rebuilt"
    assert restore_answers(target, answers, rebuilt) == 10
    assert restore_answers(target, answers, rebuilt) == 0  # files there are kept
    for a, b in zip(load_data(data_dir), load_data(rebuilt)):
        assert torch.equal(a.ids, b.ids) and a.prompt_len == b.prompt_len
        torch.testing.assert_close(a.hidden, b.hidden)  # recomputed by one forward
    bad = tmp_path / "bad.jsonl"
    bad.write_text(answers.read_text().splitlines()[0] + "\n" + '{"conv": 3, "prompt_len": 9, "ids": [1, 2]}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: not an answer line"):
        read_answers(bad)


def test_schedule_and_batches_are_pure_functions_of_the_step():
    assert lr_at(0, CFG) == pytest.approx(CFG.lr / 4) and lr_at(3, CFG) == pytest.approx(CFG.lr)
    assert lr_at(STEPS, CFG) == 0.0
    seen = sum((batch_indices(s, 8, CFG) for s in range(2)), [])
    assert sorted(seen) == list(range(8))  # one epoch covers every conversation once
    assert batch_indices(5, 8, CFG) == batch_indices(5, 8, CFG)


def test_train_resume_and_draft_losslessly(target, data_dir, tmp_path):
    straight = train_head(target, data_dir, tmp_path / "a", CFG, log=lambda *a: None)
    assert straight.step == STEPS and 0.0 <= straight.held_out_accuracy <= 1.0
    assert [h["step"] for h in straight.history] == [20, 40, 60]

    with pytest.raises(Interrupt):  # killed at step 13: the last checkpoint is step 10
        train_head(target, data_dir, tmp_path / "b", CFG, progress=KillAt(13), log=lambda *a: None)
    state = json.loads((tmp_path / "b" / "checkpoint" / "train_state.json").read_text())
    assert state["step"] == 10
    logs = []
    resumed = train_head(target, data_dir, tmp_path / "b", CFG, log=logs.append)
    assert logs and "resuming from step 10" in logs[0]
    a, b = load_head(tmp_path / "a" / "head", target), load_head(tmp_path / "b" / "head", target)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name  # a resumed run is the uninterrupted run
    assert resumed.held_out_accuracy == straight.held_out_accuracy

    # the trained head drafts losslessly, on a training prompt (where a briefly trained head has
    # learnt the target's answer: deep acceptance) and a held-out one; a random head gets ~nothing
    seen, held = split_held_out(load_data(data_dir), CFG.held_out)
    cfg = SpecDecoderConfig(bmc=BMCConfig(3), draft_length=DraftLengthConfig(initial=10, maximum=10, adaptive=False,
                                                                           cost_aware=False))
    torch.manual_seed(0)
    random_head = EagleHead(target)
    taus = {}
    for conv, c in (("seen", seen[0]), ("held", held[0])):
        ids = c.ids[None, : c.prompt_len]
        ref = hf_greedy(target, ids, 40)
        for name, head in (("trained", a), ("random", random_head)):
            drafter = EagleDrafter(target, head, EagleConfig(total_tokens=10, depth=5, top_k=2, bmc=BMCConfig(3)))
            out = SpecDecoder(target, drafter, cfg).generate(ids, max_new_tokens=40, eos_token_id=None)
            assert torch.equal(out.sequences, ref), (conv, name)
            taus[conv, name] = out.mean_accepted_tokens
            if name == "trained" and conv == "seen":
                accepted = [x for s in out.steps[1:] for x in s.num_accepted]
                assert 0 < max(accepted) and min(accepted) < 5, accepted  # partial acceptance
    assert taus["seen", "trained"] > 2.0 and taus["seen", "random"] < 1.2, taus
    assert taus["held", "trained"] >= taus["held", "random"], taus


def test_cli_trains_from_existing_data_and_needs_a_tokenizer_for_prompts(target, data_dir, tmp_path):
    model_dir, out, parser = train_eagle_run(target, data_dir, tmp_path)
    args = parser.parse_args(["--model", str(model_dir), "--out", str(out), "--stage", "train", "--steps", "3",
                              "--batch-size", "2", "--save-every", "2", "--eval-every", "2", "--quiet",
                              "--export-eagle", str(tmp_path / "exported")])
    assert run(args) == 0
    assert (out / "head" / "eagle_head.json").is_file() and (tmp_path / "exported" / "config.json").is_file()
    args = parser.parse_args(["--model", str(model_dir), "--out", str(out), "--stage", "data", "--quiet"])
    with pytest.raises(ValueError, match="has no tokenizer"):
        run(args)


def test_packaged_prompts_are_many_and_distinct():
    prompts = read_prompts(PROMPTS_FILE)
    assert 300 <= len(prompts) <= 600 and len(set(prompts)) == len(prompts)


def test_held_out_split_keeps_every_answer_to_a_prompt_on_one_side_whatever_the_order():
    def conv(prompt, answer):
        ids = torch.tensor(prompt + answer)
        return Conversation(ids, torch.zeros(len(ids), 4), len(prompt))

    prompts = [[i, i + 1] for i in range(10)]
    convs = [conv(p, [7]) for p in prompts] + [conv(p, [8, 9]) for p in prompts]  # greedy, then sampled
    train, held = split_held_out(convs, 0.2)
    held_prompts = {tuple(c.ids[:2].tolist()) for c in held}
    assert len(held_prompts) == 2 and len(held) == 4 and len(train) == 16
    assert not held_prompts & {tuple(c.ids[:2].tolist()) for c in train}
    for order in (convs[::-1], convs[10:] + convs[:10], convs[1::2] + convs[::2]):  # the data read in another order
        assert {tuple(c.ids[:2].tolist()) for c in split_held_out(order, 0.2)[1]} == held_prompts
    everything, none = split_held_out(convs, 0.0)
    assert none == [] and all(a is b for a, b in zip(everything, convs)) and len(everything) == 20


def test_jsonl_prompts_keep_their_line_breaks_and_name_a_bad_line(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "Summarize:\n\nA passage.\nSecond line."}) + "\n\n"
                 + json.dumps({"prompt": "Plain one"}) + "\n")
    assert read_prompts(f) == ["Summarize:\n\nA passage.\nSecond line.", "Plain one"]
    f.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"text": "no prompt key"}) + "\n")
    with pytest.raises(ValueError, match=r"p\.jsonl:2"):
        read_prompts(f)
    f.write_text("\n")
    with pytest.raises(ValueError, match="no prompts"):
        read_prompts(f)
