"""EAGLE-3 training on 2 gloo ranks (torch.multiprocessing, 1 thread each, a tiny fp32 target): the sharded
data equals one process's, 2 ranks train the head one process trains for the same global batch, a killed
2-rank run resumes to the uninterrupted one, a 2-rank checkpoint resumes on 1 rank, and the data's
files are checked before use.

Tolerance: the ranks' losses are summed in another order than one process's (two partial sums, the
batches padded to their own lengths), so the heads agree to fp32 rounding through 12 AdamW steps
(rtol 1e-5, atol 1e-6; they differ by at most 1.2e-7), not bit for bit; the same rank count resumes bit for bit."""

import json
import os
import shutil
import socket

import pytest
import torch
import torch.multiprocessing as mp

from conftest import Interrupt, KillAt, tiny_llama
from specdec.drafters.eagle3_head import default_aux_layers
from specdec.drafters.eagle3_io import load_eagle3
from specdec.training import DataConfig, generate_data, load_data
from specdec.training.distributed import close_ranks, init_ranks
from specdec.training.eagle import batch_indices, split_held_out
from specdec.training.eagle3 import Train3Config, train_head3
from specdec.training.eagle_data import load_shard

LAYERS = default_aux_layers(3)
CFG = Train3Config(steps=12, batch_size=3, lr=3e-3, warmup=2, eval_every=6, held_out=0.2, save_minutes=0,
                   draft_vocab=64, ttt_steps=3)
DATA = DataConfig(max_new_tokens=24, aux_layers=LAYERS)
FP32 = dict(rtol=1e-4, atol=1e-5)  # fp32 sums in another order (module docstring)


def _target():
    model = tiny_llama(13, layers=3, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(10)  # peaked distributions: something to learn from the soft labels
    return model


def _prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(1, 128, (int(n),), generator=g).tolist() for n in torch.randint(3, 10, (8,), generator=g)]


def _worker(rank: int, world: int, port: int, jobs: list[tuple]) -> None:
    """One rank of a gloo group made here (init_ranks adopts it), running ``jobs`` in order."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    ranks = init_ranks("cpu")
    assert (ranks.rank, ranks.world) == (rank, world)
    try:
        target = _target()
        for kind, *args in jobs:
            if kind == "data":
                generate_data(target, _prompts(), args[0], DATA, shard=(ranks.rank, ranks.world))
                ranks.barrier()
            else:
                data, out, kill = args
                try:
                    train_head3(target, data, out, CFG, progress=KillAt(kill) if kill else None, log=lambda *a: None,
                                ranks=ranks)
                except Interrupt:
                    pass
    finally:
        close_ranks(ranks)


def _spawn(jobs: list[tuple], world: int = 2) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(world, port, jobs), nprocs=world, join=True)


def _heads_close(a, b, **tol):
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        torch.testing.assert_close(x, y, msg=lambda m: f"{name}: {m}", **tol)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two ranks write the data, train 12 steps, and train again killed at step 7 (the step-6 checkpoint
    survives); a copy of that checkpoint is kept, and 2 ranks resume the other."""
    root = tmp_path_factory.mktemp("ddp")
    _spawn([("data", root / "data"), ("train", root / "data", root / "a2", None),
            ("train", root / "data", root / "b", 7)])
    shutil.copytree(root / "b", root / "b1")
    _spawn([("train", root / "data", root / "b", None)])
    return root


def test_two_ranks_write_the_data_one_process_writes(runs, tmp_path):
    generate_data(_target(), _prompts(), tmp_path / "one", DATA)
    two, one = load_data(runs / "data"), load_data(tmp_path / "one")
    assert len(two) == len(one) == 8
    for a, b in zip(two, one):
        assert torch.equal(a.ids, b.ids) and a.prompt_len == b.prompt_len
        torch.testing.assert_close(a.aux, b.aux)


def test_a_step_may_give_a_rank_none_of_its_batch(runs):
    """The schedule is the one process's: some step of this run gives one rank all 3 conversations (the
    other computes a masked batch, loss 0, so DDP's all-reduce still meets it)."""
    train, _ = split_held_out(load_shard(runs / "data").index, CFG.held_out)
    owners = [{train[i].conv % 2 for i in batch_indices(s, len(train), CFG)} for s in range(CFG.steps)]
    assert any(len(o) == 1 for o in owners)


@pytest.fixture(scope="module")
def one(runs):
    """One process, the same data and global batch: runs/a1."""
    result = train_head3(_target(), runs / "data", runs / "a1", CFG, log=lambda *a: None)
    assert result.step == 12 and [h["step"] for h in result.history] == [6, 12]
    return runs / "a1"


def test_two_ranks_train_the_head_one_process_trains(runs, one):
    target = _target()
    _heads_close(load_eagle3(runs / "a2" / "head", target), load_eagle3(one / "head", target), **FP32)


def test_a_killed_two_rank_run_resumes_to_the_uninterrupted_one(runs):
    target = _target()
    _heads_close(load_eagle3(runs / "b" / "head", target), load_eagle3(runs / "a2" / "head", target), rtol=0, atol=0)


def test_a_two_rank_checkpoint_resumes_on_one_rank(runs, one):
    target = _target()
    assert json.loads((runs / "b1" / "checkpoint" / "train_state.json").read_text())["step"] == 6
    logs = []
    train_head3(target, runs / "data", runs / "b1", CFG, log=logs.append)
    assert "resuming from step 6" in logs[0]
    _heads_close(load_eagle3(runs / "b1" / "head", target), load_eagle3(one / "head", target), **FP32)


def test_a_resume_over_another_schedule_is_refused(runs, tmp_path):
    shutil.copytree(runs / "a2", tmp_path / "a2")
    other = Train3Config(**{**CFG.__dict__, "batch_size": 2})
    with pytest.raises(ValueError, match="the checkpoint's step counts batches of"):
        train_head3(_target(), runs / "data", tmp_path / "a2", other, log=lambda *a: None)


def test_a_damaged_file_is_named_and_a_file_for_other_layers_is_answered_again(runs, tmp_path):
    d = tmp_path / "data"
    shutil.copytree(runs / "data", d)
    f = d / "conv_00003.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-5] ^= 0xFF  # a flipped byte in the last tensor's data
    f.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="conv_00003.safetensors: contents differ from the digest"):
        load_data(d)
    f.write_bytes((runs / "data" / "conv_00003.safetensors").read_bytes())
    target = _target()
    generate_data(target, _prompts()[:4], d / "other", DataConfig(max_new_tokens=4))  # EAGLE-1 files: no aux
    shutil.copy(d / "other" / "conv_00001.safetensors", d / "conv_00001.safetensors")
    with pytest.raises(ValueError, match=r"lack EAGLE-3 features of layers \(2, 1, 0\)"):
        train_head3(target, d, tmp_path / "o", CFG)
    assert generate_data(target, _prompts(), d, DATA, shard=(1, 2)) == 1  # conversation 1, in rank 1's shard
    assert len(load_data(d)) == 8


def test_train_eagle_under_torchrun_trains_the_head_one_process_trains(runs, tmp_path):
    """``torchrun --nproc_per_node 2 -m specdec.cli train-eagle --arch eagle3`` (gloo from --device cpu) and the
    same command in this process: the same head to fp32 rounding, rank 0's JSON line alone."""
    import subprocess
    import sys

    from conftest import train_eagle_run
    from specdec.cli.train_eagle import run

    model_dir, out, parser = train_eagle_run(_target(), runs / "data", tmp_path)
    argv = ["--model", str(model_dir), "--arch", "eagle3", "--stage", "train", "--steps", "6", "--batch-size", "3",
            "--lr", "3e-3", "--warmup", "2", "--draft-vocab", "64", "--save-minutes", "0", "--threads", "1", "--quiet"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "specdec.cli", "train-eagle", "--out", str(out), *argv],
                          capture_output=True, text=True, env=env, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(ln) for ln in done.stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1 and lines[0]["ranks"] == 2 and lines[0]["step"] == 6
    (tmp_path / "solo").mkdir()
    (tmp_path / "solo" / "data").symlink_to(runs / "data", target_is_directory=True)
    assert run(parser.parse_args(["--out", str(tmp_path / "solo"), *argv])) == 0
    target = _target()
    _heads_close(load_eagle3(out / "eagle3" / "head", target), load_eagle3(tmp_path / "solo" / "eagle3" / "head", target),
                 **FP32)


def test_ranks_answer_their_own_prompts_into_their_own_files(tmp_path):
    """--in-memory's answers on 2 ranks: rank r answers conversations c % 2 == r into its own file beside
    the answers file; every rank reads them all; one rank later finds nothing left to answer."""
    from specdec.training.distill import AnswerConfig, answer_files, answer_prompts, read_all_answers, read_answers

    target, path, quiet = _target(), tmp_path / "answers.jsonl", (lambda *a: None)
    cfg = AnswerConfig(max_new_tokens=8, batch_size=4)
    for r in (0, 1):
        assert answer_prompts(target, _prompts(), path, cfg, log=quiet, shard=(r, 2)) == 4
    files = answer_files(path)
    assert [f.name for f in files] == ["answers.rank0-of-2.jsonl", "answers.rank1-of-2.jsonl"]
    assert [sorted(c for c, _, _ in read_answers(f)) for f in files] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert [c for c, _, _ in read_all_answers(path)] == list(range(8))
    assert answer_prompts(target, _prompts(), path, cfg, log=quiet) == 0 and not path.exists()
