"""`specdec train-eagle`: train an EAGLE head for a target by self-distillation, offline.

Stages (each resumable; rerunning the same command continues where it stopped):

1. data     the target answers the project's own instructions (``specdec/data/eagle_prompts.txt``,
            or ``--prompts FILE``), greedy or sampled; each conversation is written with the
            target's last hidden states as ``DIR/data/conv_00012.safetensors`` as soon as it is done.
2. train    the head learns to predict the next feature (smooth-L1, weight 1.0) and the target's
            next-token distribution (cross-entropy against softmax(lm_head(next feature)), weight
            0.1), from the features with uniform noise, as EAGLE trains; AdamW, linear warmup and
            decay, gradient values clipped at 0.5. A checkpoint (head, optimizer, step) is written
            every ``--save-every`` steps to ``DIR/checkpoint``; held-out top-1 accuracy (the head's
            token == the target's greedy token, teacher-forced features) every ``--eval-every``.
            ``--answers FILE`` keeps the answers (token ids only, ~1 KB each) in a file that
            later runs rebuild the conversations from (one forward each, no decoding), so a
            dataset grows across sessions instead of being regenerated.
3. output   ``DIR/head`` (load with ``specdec.drafters.eagle.load_head`` or SPECDEC_EAGLE_HEAD),
            and with ``--export-eagle DIR2`` the same weights in EAGLE's checkpoint layout.

``--arch eagle3`` trains an EAGLE-3 head instead (specdec.training.eagle3): the data stage also
stores the inputs of the head's three target layers; training unrolls ``--ttt-steps`` steps of the
training-time test against the target's soft labels over a draft vocabulary of ``--draft-vocab`` ids
(default 8192), checkpointing every ``--save-minutes`` to ``DIR/eagle3/checkpoint``; the head goes to
``DIR/eagle3/head`` in vLLM's layout (SPECDEC_EAGLE3_HEAD loads it), and with ``--export-layout`` also
to ``DIR/eagle3/head-LAYOUT`` (sglang, speculators).

``--in-memory`` (EAGLE-3, for a GPU): the data stage appends greedy answers to ``--answers FILE`` in
batches of ``--data-batch-size`` (for at most ``--data-minutes``; a rerun answers the rest), the features
of every answer there (and of each ``--with-answers FILE``) come from batched forwards and stay in the
device's memory (specdec.training.distill: no per-conversation files), and training runs at most
``--train-minutes``. ``--device cuda`` runs the target and the head there.

Under ``torchrun`` (``--arch eagle3``; README "Training on several GPUs"): W processes, one per GPU (NCCL)
or CPU process (gloo, ``--device cpu``), from the environment torchrun sets. Conversation i is rank
i % W's: it answers it and writes its file (``--in-memory``: its answers go to ``FILE.rank{r}-of-{W}.jsonl``
beside ``--answers FILE`` and its features stay in its own device's memory); every rank reads every
conversation's ids; the head trains under DDP on the same global batch of ``--batch-size`` conversations
as one process would (specdec.training.distributed); rank 0 writes the checkpoints and the head. A
checkpoint resumes under any rank count.

Batches are a pure function of (seed, step), so a resumed run equals an uninterrupted one.
Nothing here reads or writes pickles.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from specdec.arguments import non_negative_float, non_negative_int, positive_int
from specdec.training.distributed import SOLO, Ranks, close_ranks, init_ranks
from specdec.training.eagle import TrainConfig, train_head
from specdec.training.eagle3 import Train3Config
from specdec.training.eagle_data import (PROMPTS_FILE, DataConfig, encode_prompts, generate_data, read_prompts,
                                         restore_answers, save_answers)


def add_arguments(parser) -> None:
    parser.add_argument("--model", default="default", help="target: 'default', a .gguf file or a HF dir")
    parser.add_argument("--arch", choices=["eagle", "eagle3"], default="eagle",
                        help="eagle: EAGLE-1/2's head (DIR/head); eagle3: EAGLE-3's (DIR/eagle3/head)")
    parser.add_argument("--ttt-steps", type=positive_int, default=Train3Config.ttt_steps,
                        help="eagle3: unrolled steps of the training-time test")
    parser.add_argument("--save-minutes", type=non_negative_float, default=Train3Config.save_minutes,
                        help="eagle3: checkpoint period in minutes (eagle: --save-every steps)")
    parser.add_argument("--export-layout", choices=["sglang", "speculators"], default=None,
                        help="eagle3: also write the head in this layout to DIR/eagle3/head-LAYOUT")
    parser.add_argument("--out", required=True, help="output directory (data/, checkpoint/, head/)")
    parser.add_argument("--prompts", default=str(PROMPTS_FILE), help="instructions, one per line")
    parser.add_argument("--num-prompts", type=positive_int, default=None, help="use only the first N prompts")
    parser.add_argument("--max-new-tokens", type=positive_int, default=DataConfig.max_new_tokens)
    parser.add_argument("--temperature", type=non_negative_float, default=DataConfig.temperature,
                        help="0: greedy answers; > 0: sampled")
    parser.add_argument("--data-batch-size", type=positive_int, default=DataConfig.batch_size,
                        help="prompts the target answers together in the data stage")
    parser.add_argument("--steps", type=positive_int, default=TrainConfig.steps)
    parser.add_argument("--batch-size", type=positive_int, default=TrainConfig.batch_size)
    parser.add_argument("--lr", type=non_negative_float, default=TrainConfig.lr)
    parser.add_argument("--warmup", type=non_negative_int, default=TrainConfig.warmup)
    parser.add_argument("--max-len", type=positive_int, default=TrainConfig.max_len)
    parser.add_argument("--save-every", type=positive_int, default=TrainConfig.save_every)
    parser.add_argument("--eval-every", type=positive_int, default=TrainConfig.eval_every)
    parser.add_argument("--draft-vocab", type=positive_int, default=None,
                        help="draft from the M most frequent tokens of the data (default: full vocab; "
                             f"eagle3: {Train3Config.draft_vocab})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stage", choices=["all", "data", "train"], default="all")
    parser.add_argument("--answers", default=None, metavar="FILE",
                        help="answers file (token ids, JSONL): the data stage first rebuilds the "
                             "conversations it holds, then writes every conversation back to it")
    parser.add_argument("--export-eagle", default=None, metavar="DIR",
                        help="also write the head in EAGLE's checkpoint layout to DIR")
    parser.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    parser.add_argument("--device", default="cpu", help="where the target and the head run (cpu, cuda)")
    parser.add_argument("--in-memory", action="store_true",
                        help="EAGLE-3: answers to --answers, features in memory (a GPU's data stage)")
    parser.add_argument("--with-answers", action="append", default=[], metavar="FILE",
                        help="--in-memory: also train on these answers files (read only)")
    parser.add_argument("--data-minutes", type=non_negative_float, default=None,
                        help="--in-memory: start no new answer batch after this long")
    parser.add_argument("--train-minutes", type=non_negative_float, default=None,
                        help="stop training after this long (the head is evaluated and saved)")
    parser.add_argument("--tf32", action="store_true",
                        help="train with TF32 matmuls on a GPU (answers and features stay full fp32)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def run(args) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.in_memory and (args.arch != "eagle3" or not args.answers):
        raise ValueError("--in-memory trains an EAGLE-3 head (--arch eagle3) and keeps its answers in --answers FILE")
    ranks = init_ranks(args.device)
    try:
        if ranks.world > 1 and args.arch != "eagle3":
            raise ValueError(f"train-eagle on {ranks.world} ranks trains EAGLE-3 heads (--arch eagle3); EAGLE-1's "
                             "head trains in one process")
        return _run(args, ranks)
    finally:
        close_ranks(ranks)


def _run(args, ranks: Ranks) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from specdec.models import load_model

    console = Console(stderr=True, quiet=args.quiet or not ranks.lead)  # rank 0 speaks for the run
    t0 = time.time()
    loaded = load_model(args.model, device=str(ranks.device), weights="fp32")
    target = loaded.model.eval()
    console.print(f"target {loaded.name} loaded in {time.time() - t0:.1f} s" +
                  (f" on each of {ranks.world} ranks ({ranks.device.type})" if ranks.world > 1 else ""))
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[loss]:.3f} loss  {task.fields[acc]:.1%} acc", justify="right"),
               TimeRemainingColumn()]
    progress = lambda cols: Progress(*cols, console=console, disable=args.quiet or not ranks.lead)  # noqa: E731
    if args.in_memory:
        data = _answers_in_memory(args, loaded, target, console, ranks)
        if args.tf32:
            torch.set_float32_matmul_precision("high")
        with progress(columns) as prog:
            _train_eagle3(args, target, console, prog, data, ranks)
        return 0
    if args.stage in ("all", "data"):
        _data_stage(args, loaded, target, console, progress(columns[:3] + [TimeRemainingColumn()]), ranks)
    if args.stage in ("all", "train"):
        with progress(columns) as prog:
            if args.arch == "eagle3":
                _train_eagle3(args, target, console, prog, ranks=ranks)
            else:
                _train_eagle(args, target, console, prog)
    return 0


def _aux_layers(args, target) -> tuple[int, ...]:
    """The target layers an EAGLE-3 head reads (its default ones), () for EAGLE's head."""
    from specdec.drafters.eagle3_head import default_aux_layers
    from specdec.introspect import text_config

    return default_aux_layers(text_config(target).num_hidden_layers) if args.arch == "eagle3" else ()


def _data_stage(args, loaded, target, console, prog, ranks: Ranks = SOLO) -> None:
    out = Path(args.out)
    if loaded.tokenizer is None:
        raise ValueError(f"{args.model} has no tokenizer: train-eagle needs one to encode its prompts")
    aux = _aux_layers(args, target)
    data_cfg = DataConfig(args.max_new_tokens, args.temperature, args.seed, args.data_batch_size, aux)
    prompts = read_prompts(args.prompts)[: args.num_prompts]
    ids = encode_prompts(loaded.tokenizer, prompts)
    shard = (ranks.rank, ranks.world)  # each rank answers and writes its own conversations
    with prog:
        if args.answers and Path(args.answers).exists():
            k = restore_answers(target, args.answers, out / "data", prog, aux, shard)
            console.print(f"answers: {k} conversations rebuilt from {args.answers}")
        n = generate_data(target, ids, out / "data", data_cfg, prog, shard)
    console.print(f"data: {n} new conversations (rank 0's), {len(ids)} in {out / 'data'}" if ranks.world > 1
                  else f"data: {n} new conversations, {len(ids)} in {out / 'data'}")
    ranks.barrier()  # every shard written before anyone reads them all
    if args.answers and ranks.lead:
        k = save_answers(out / "data", args.answers)
        console.print(f"answers: {k} conversations written to {args.answers}")


def _train_eagle(args, target, console, prog) -> None:
    from specdec.drafters.eagle import export_eagle, load_head

    out = Path(args.out)
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, warmup=args.warmup,
                      max_len=args.max_len, save_every=args.save_every, eval_every=args.eval_every,
                      draft_vocab=args.draft_vocab, seed=args.seed)
    res = train_head(target, out / "data", out, cfg, prog, log=console.print)
    acc = "n/a" if res.held_out_accuracy is None else f"{res.held_out_accuracy:.1%}"
    console.print(f"head after {res.step} steps in {out / 'head'}; held-out top-1 accuracy {acc}")
    print(json.dumps({"step": res.step, "held_out_accuracy": res.held_out_accuracy, "head": str(out / "head")}))
    if args.export_eagle:
        export_eagle(load_head(out / "head", target), args.export_eagle)
        console.print(f"EAGLE layout written to {args.export_eagle}")


def _answers_in_memory(args, loaded, target, console, ranks: Ranks = SOLO):
    """--in-memory's data: new answers appended to --answers (a rank's to its own file beside it), then the
    features of this rank's share of every answer in memory (conversation i of the list: rank i % W's)."""
    from specdec.training.distill import AnswerConfig, answer_prompts, features, read_all_answers, read_answers
    from specdec.training.eagle_data import Entry, ShardedData

    if args.stage in ("all", "data"):
        prompts = encode_prompts(loaded.tokenizer, read_prompts(args.prompts)[: args.num_prompts])
        cfg = AnswerConfig(args.max_new_tokens, args.data_batch_size, args.data_minutes, args.temperature, args.seed)
        n = answer_prompts(target, prompts, args.answers, cfg, log=console.print, shard=(ranks.rank, ranks.world))
        console.print(f"answers: {n} new in {args.answers}" + (" (rank 0's)" if ranks.world > 1 else ""))
        ranks.barrier()  # every rank's answers appended before anyone reads them all
    answers = read_all_answers(args.answers)
    for extra in args.with_answers:
        answers += read_answers(extra)
    t = time.time()
    mine = [i for i in range(len(answers)) if ranks.owns(i)]
    convs = features(target, [answers[i] for i in mine], _aux_layers(args, target), max_len=args.max_len)
    console.print(f"features of {len(convs)} conversations ({sum(len(c.ids) for c in convs)} tokens) "
                  f"in memory in {time.time() - t:.1f} s" + (f", rank 0's of {len(answers)}" if ranks.world > 1 else ""))
    index = [Entry(i, torch.tensor(ids[: args.max_len]), p) for i, (_, p, ids) in enumerate(answers)]
    return ShardedData(index, dict(zip(mine, convs)))


def _train_eagle3(args, target, console, prog, data=None, ranks: Ranks = SOLO) -> None:
    from specdec.drafters.eagle3_io import load_eagle3, save_eagle3
    from specdec.training.eagle3 import schedule_note, train_head3

    out = Path(args.out) / "eagle3"
    cfg = Train3Config(steps=args.steps, batch_size=args.batch_size, lr=args.lr, warmup=args.warmup,
                       max_len=args.max_len, save_minutes=args.save_minutes, eval_every=args.eval_every,
                       draft_vocab=args.draft_vocab or Train3Config.draft_vocab, seed=args.seed,
                       ttt_steps=args.ttt_steps)
    console.print(schedule_note(cfg))
    res = train_head3(target, Path(args.out) / "data" if data is None else data, out, cfg, prog if ranks.lead else None,
                      log=console.print, minutes=args.train_minutes, ranks=ranks)
    depth = res.history[-1].get("held_out_acc_per_depth") if res.history else None
    console.print(f"EAGLE-3 head after {res.step} steps in {out / 'head'}; held-out top-1 per depth {depth}")
    if not ranks.lead:
        return
    print(json.dumps({"step": res.step, "held_out_accuracy_per_depth": depth, "head": str(out / "head"),
                      "ranks": ranks.world}))
    if args.export_layout:
        save_eagle3(load_eagle3(out / "head", target), out / f"head-{args.export_layout}", args.export_layout)
        console.print(f"{args.export_layout} layout written to {out / f'head-{args.export_layout}'}")
