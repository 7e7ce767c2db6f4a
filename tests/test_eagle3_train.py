"""EAGLE-3 training on a tiny random target: data with the aux layers' features, the training-time test's
masks, a few steps lowering the loss, a killed run resuming to the uninterrupted run's weights, the
trained head drafting exactly, and the command (`train-eagle --arch eagle3`)."""

import dataclasses
import json

import pytest
import torch

from conftest import Interrupt, KillAt, hf_greedy, tiny_llama, train_eagle_run
from specdec import SpecDecoder
from specdec.cli.train_eagle import run
from specdec.drafters.eagle import EagleConfig
from specdec.drafters.eagle3 import Eagle3Drafter
from specdec.drafters.eagle3_head import Eagle3Head, default_aux_layers
from specdec.drafters.eagle3_io import load_eagle3
from specdec.training import DataConfig, generate_data, load_data
from specdec.training.eagle3 import Train3Config, init_from_target, make_batch3, train_head3, ttt_losses

LAYERS = default_aux_layers(3)  # (2, 1, 0) on a 3-layer target
CFG = Train3Config(steps=12, batch_size=3, lr=3e-3, warmup=2, eval_every=6, held_out=0.2, save_minutes=0,
                   draft_vocab=64, ttt_steps=3)


@pytest.fixture(scope="module")
def target():
    """Peaked distributions (a fresh init's are near uniform: nothing to learn from its soft labels)."""
    model = tiny_llama(13, layers=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(10)
    return model


@pytest.fixture(scope="module")
def data_dir(target, tmp_path_factory):
    d = tmp_path_factory.mktemp("eagle3") / "data"
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 128, (int(n),), generator=g).tolist() for n in torch.randint(3, 10, (8,), generator=g)]
    assert generate_data(target, prompts, d, DataConfig(max_new_tokens=24, aux_layers=LAYERS)) == 8
    return d


def test_data_holds_the_inputs_of_the_aux_layers(target, data_dir):
    c = load_data(data_dir)[0]
    states = target(c.ids[None], output_hidden_states=True).hidden_states
    assert c.aux_layers == LAYERS and c.aux.shape == (len(c.ids), 3 * 64)
    torch.testing.assert_close(c.aux, torch.cat([states[j][0] for j in LAYERS], -1).float())


def test_no_ttt_step_row_sees_a_later_position(target, data_dir):
    """Step s's output at row t depends on the features of rows <= t only, at every step (a tree node
    of depth s + 1 sees the committed pairs up to its root and its own ancestors); changing the
    features after row t changes the later rows."""
    head = init_from_target(Eagle3Head(target, draft_vocab=torch.arange(64)), target)
    batch = make_batch3(head, load_data(data_dir)[:1], CFG)
    captured = []
    real = head.forward
    head.forward = lambda *a, **k: captured.append(real(*a, **k)) or captured[-1]
    ttt_losses(head, batch, 3, 0.8)
    before, t = list(captured), 5
    captured.clear()
    aux = batch.aux.clone()
    aux[:, t + 1 :] += 1.0
    ttt_losses(head, dataclasses.replace(batch, aux=aux), 3, 0.8)
    assert len(captured) == 3
    for s, (b, a) in enumerate(zip(before, captured)):
        torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1], msg=f"step {s}")
        assert not torch.allclose(a[:, t + 1], b[:, t + 1]), f"step {s}"


def test_a_few_steps_lower_the_loss_and_a_killed_run_resumes_to_the_same_head(target, data_dir, tmp_path):
    straight = train_head3(target, data_dir, tmp_path / "a", CFG, log=lambda *a: None)
    assert straight.step == 12 and [h["step"] for h in straight.history] == [6, 12]
    depth = straight.history[-1]["held_out_acc_per_depth"]
    assert len(depth) == 3 and all(0.0 <= x <= 1.0 for x in depth)
    head = load_eagle3(tmp_path / "a" / "head", target)
    fresh = init_from_target(Eagle3Head(target, draft_vocab=head.draft_vocab.clone()), target)
    batch = make_batch3(head, load_data(data_dir), CFG)
    with torch.no_grad():
        before, after = (ttt_losses(h, batch, 3, 0.8).loss.item() for h in (fresh, head))
    assert after < 0.9 * before, (before, after)

    with pytest.raises(Interrupt):  # killed at step 8: the checkpoint of step 7 survives
        train_head3(target, data_dir, tmp_path / "b", CFG, progress=KillAt(8), log=lambda *a: None)
    assert json.loads((tmp_path / "b" / "checkpoint" / "train_state.json").read_text())["step"] == 7
    logs = []
    train_head3(target, data_dir, tmp_path / "b", CFG, log=logs.append)
    assert "resuming from step 7" in logs[0]
    b = load_eagle3(tmp_path / "b" / "head", target)
    for (name, x), (_, y) in zip(head.state_dict().items(), b.state_dict().items()):
        torch.testing.assert_close(x, y, atol=1e-12, rtol=0, msg=name)  # the resumed run is the uninterrupted one

    prompt = load_data(data_dir)[0].ids[None, :8]
    out = SpecDecoder(target, Eagle3Drafter(target, head, EagleConfig(total_tokens=6, depth=3, top_k=2))).generate(
        prompt, max_new_tokens=12, eos_token_id=None)
    assert torch.equal(out.sequences, hf_greedy(target, prompt, 12))


def test_training_refuses_data_without_the_heads_features(target, tmp_path):
    g = torch.Generator().manual_seed(1)
    generate_data(target, [torch.randint(1, 128, (5,), generator=g).tolist()] * 2, tmp_path / "d",
                  DataConfig(max_new_tokens=4))
    with pytest.raises(ValueError, match=r"lack EAGLE-3 features of layers \(2, 1, 0\)"):
        train_head3(target, tmp_path / "d", tmp_path / "o", CFG)


def test_cli_trains_an_eagle3_head_and_exports_it(target, data_dir, tmp_path):
    model_dir, out, parser = train_eagle_run(target, data_dir, tmp_path)
    args = parser.parse_args(["--model", str(model_dir), "--out", str(out), "--arch", "eagle3", "--stage", "train",
                              "--steps", "2", "--batch-size", "2", "--draft-vocab", "32", "--quiet",
                              "--export-layout", "speculators"])
    assert run(args) == 0
    cfg = json.loads((out / "eagle3" / "head" / "config.json").read_text())
    assert cfg["architectures"] == ["Eagle3LlamaForCausalLM"] and cfg["draft_vocab_size"] == 32
    spec = json.loads((out / "eagle3" / "head-speculators" / "config.json").read_text())
    assert spec["speculators_model_type"] == "eagle3"
