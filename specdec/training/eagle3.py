"""EAGLE-3's objective and a resumable training loop for its head (Li et al., 2025, "EAGLE-3").

    result = train_head3(target, "DIR/data", "DIR/eagle3", Train3Config())   # .../checkpoint, then .../head

The training-time test, ``ttt_steps`` = k unrolled steps over every position t of a conversation at once:

    step 0   row t feeds (fc(a_t), x_t+1) at position t            -> h0_t, predicts x_t+2
    step s   row t feeds (h(s-1)_t, x_t+1+s) at position t + s      -> hs_t, predicts x_t+2+s
             its attention sees step 0's rows 0..t (the committed pairs) and its own rows of steps
             1..s (its ancestors in a draft tree): exactly what a node of depth s + 1 sees when drafting

Tokens are the data's (the target's own answers); the head's own outputs are fed back as hidden
states, so it learns on the features it will meet at depth. Each step's loss is the cross-entropy
against the target's soft labels over the draft vocabulary (softmax of the target's logits at those
ids), weighted ``decay ** s``. The draft vocabulary is the ``draft_vocab`` most frequent ids of the
training data. AdamW, linear warmup and decay, gradient values clipped. A checkpoint (head in vLLM's
layout, optimizer, step) is written every ``save_minutes`` and at the end, each file atomically;
batches are a pure function of (seed, step), so a resumed run equals an uninterrupted one.

On W ranks (``ranks=``, specdec.training.distributed: torchrun, DDP) each rank holds the conversations
c % W == r and computes the part of step s's global batch it holds, its losses divided by the whole
batch's position counts; the ranks' summed gradients are one process's for that batch (to fp32 rounding).

Dimensions: B conversations, S pair positions (longest conversation - 1), k steps, D hidden, M draft vocab.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import DynamicCache

from specdec.drafters.eagle3_head import Eagle3Head, Eagle3HeadConfig, default_aux_layers
from specdec.drafters.eagle3_io import load_eagle3, save_eagle3
from specdec.drafters.eagle_head import causal_bias
from specdec.introspect import text_config
from specdec.training.eagle import (TrainResult, batch_indices, load_checkpoint, lr_at, save_checkpoint,
                                    split_held_out, top_tokens)
from specdec.training.distributed import SOLO, Ranks
from specdec.training.eagle_data import Conversation, Entry, ShardedData, load_shard, sharded


@dataclass(frozen=True)
class Train3Config:
    steps: int = 2000  # optimizer steps in total
    batch_size: int = 4  # conversations per step
    lr: float = 3e-4  # peak learning rate (SpecForge: 1e-4 on far more tokens)
    warmup: int = 100  # linear warmup steps, then linear decay to 0 at `steps`
    betas: tuple[float, float] = (0.9, 0.95)  # AdamW
    grad_clip: float = 0.5  # clip gradient values (EAGLE)
    ttt_steps: int = 3  # unrolled steps of the training-time test: the draft depth it trains for
    step_decay: float = 0.8  # weight of step s's loss: decay ** s (EAGLE-3's 0.8)
    max_len: int = 1024  # tokens per conversation seen in training (longer ones are cut)
    loss_on_prompt: bool = False  # False: learn on the answer positions only, as EAGLE
    held_out: float = 0.05  # fraction of prompts whose answers are kept for the accuracy report
    save_minutes: float = 5.0  # checkpoint period in minutes of training (0: every step); a crash loses at most this
    eval_every: int = 200  # held-out accuracy period in steps
    draft_vocab: int | None = 8192  # draft from the M most frequent ids of the training data; None = all
    seed: int = 0  # batch order and initial weights
    head: Eagle3HeadConfig = Eagle3HeadConfig()


@dataclass(frozen=True)
class Batch3:
    aux: torch.Tensor  # [B, S, 3D] target features a_0..a_S-1
    tokens: torch.Tensor  # [B, S + k - 1] x_1..: token i + 1 of each conversation (0-padded)
    soft: torch.Tensor  # [B, S + k - 1, M] target distribution at position i + 1 over the draft vocab
    best: torch.Tensor  # [B, S + k - 1] the target's greedy token there (target id; full vocab in eval)
    mask: torch.Tensor  # [B, S] bool: positions whose step-0 prediction counts in the loss
    lengths: torch.Tensor  # [B] pair positions per conversation (n - 1)


@torch.no_grad()
def make_batch3(head: Eagle3Head, convs: list[Conversation], config: Train3Config, full_vocab: bool = False) -> Batch3:
    """Pad ``convs`` into a batch; soft labels from the target's lm_head at the draft vocabulary's rows
    (``full_vocab``: ``best`` is the target's greedy token over its whole vocabulary, for the report)."""
    p = head.fc.weight
    dev = p.device  # the batch is made where the head is (conversations' features may be there already)
    k = config.ttt_steps
    n = [min(len(c.ids), config.max_len) for c in convs]
    B, S, D = len(convs), max(n) - 1, convs[0].hidden.shape[1]
    aux = torch.zeros(B, S, head.feature_size, dtype=p.dtype, device=dev)
    tokens = torch.zeros(B, S + k - 1, dtype=torch.long, device=dev)
    nxt = torch.zeros(B, S + k - 1, D, dtype=p.dtype, device=dev)  # target last hidden state at position i + 1
    mask = torch.zeros(B, S, dtype=torch.bool, device=dev)
    for b, (c, m) in enumerate(zip(convs, n)):
        aux[b, : m - 1] = c.aux[: m - 1].to(p.dtype)
        tokens[b, : m - 1] = c.ids[1:m]
        nxt[b, : m - 1] = c.hidden[1:m].to(p.dtype)
        first = 0 if config.loss_on_prompt else max(0, c.prompt_len - 2)  # row t predicts x_t+2
        mask[b, first : m - 1] = True
    lm = head._target.lm_head.weight.detach()
    logits = nxt @ lm[head.draft_vocab].T.to(p.dtype)  # [B, S + k - 1, M]
    best = (nxt @ lm.T.to(p.dtype)).argmax(-1) if full_vocab else head.to_target_ids(logits.argmax(-1))
    return Batch3(aux, tokens, torch.softmax(logits.float(), dim=-1), best, mask,
                  torch.tensor([m - 1 for m in n], dtype=torch.long, device=dev))


def _diagonal_bias(B: int, S: int, dtype, device) -> torch.Tensor:
    """[B, 1, S, S] additive: each row sees only its own key (a step's rows are one row's ancestors)."""
    bias = torch.full((S, S), torch.finfo(dtype).min, dtype=dtype, device=device).fill_diagonal_(0)
    return bias.expand(B, 1, S, S)


@dataclass
class StepStats:
    loss: torch.Tensor  # scalar: sum over steps of decay ** s * cross-entropy
    hits: list[int]  # per step: the head's top-1 == the target's greedy token, counted positions
    counts: list[int]  # per step: positions counted


def step_counts(batch: Batch3, steps: int) -> torch.Tensor:
    """[k] positions counted in the loss at each step of the training-time test (a row t + s past its
    conversation's end has no label at step s)."""
    B, S, _ = batch.aux.shape
    pos = torch.arange(S, device=batch.mask.device).expand(B, S)
    return torch.stack([(batch.mask & (pos + s < batch.lengths[:, None])).sum() for s in range(steps)])


def ttt_losses(head: Eagle3Head, batch: Batch3, steps: int, decay: float,
               counts: torch.Tensor | None = None) -> StepStats:
    """The training-time test over ``batch`` (see the module docstring): k forwards of the head, the
    step-s rows attending to step 0's causal prefix and their own rows of steps 1..s. ``counts`` [k]:
    the positions each step's cross-entropy is averaged over (default this batch's, ``step_counts``; a
    rank holding part of a global batch passes the whole batch's)."""
    B, S, _ = batch.aux.shape
    dtype, dev = head.fc.weight.dtype, head.fc.weight.device
    cache = DynamicCache()  # the head's K/V of every step so far: [B, H, S * (s + 1), Dh]
    causal, diagonal = causal_bias(B, S, dtype, dev, batch.lengths), _diagonal_bias(B, S, dtype, dev)
    pos = torch.arange(S, device=dev).expand(B, S)
    hidden = head.fuse(batch.aux)  # [B, S, D]
    total = torch.zeros((), dtype=torch.float32, device=dev)
    stats = StepStats(total, [], [])
    for s in range(steps):
        bias = torch.cat([causal] + [diagonal] * s, dim=-1)  # [B, 1, S, S * (s + 1)]
        hidden = head(hidden, batch.tokens[:, s : s + S], pos + s, bias, cache)  # [B, S, D]: fed back next step
        logq = torch.log_softmax(head.logits(hidden).float(), dim=-1)  # [B, S, M]
        m = batch.mask & (pos + s < batch.lengths[:, None])  # row t + s must still have a label
        count = m.sum()
        den = count if counts is None else counts[s]
        ce = (-(batch.soft[:, s : s + S] * logq).sum(-1) * m).sum() / den.clamp(min=1)
        total = total + decay**s * ce
        guess = head.to_target_ids(logq.detach().argmax(-1))
        stats.hits.append(int(((guess == batch.best[:, s : s + S]) & m).sum()))
        stats.counts.append(int(count))
    stats.loss = total
    return stats


class _TTTLoss(nn.Module):
    """The training-time test's loss as a module's forward, so that DDP (which hooks a module's forward)
    sees one forward per step; ``head`` is its only submodule (the target's parts are not modules)."""

    def __init__(self, head: Eagle3Head, config: Train3Config) -> None:
        super().__init__()
        self.head, self.steps, self.decay = head, config.ttt_steps, config.step_decay

    def forward(self, batch: Batch3, counts: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(``scale`` x this rank's share of the loss, its top-1 hits per step [k])."""
        st = ttt_losses(self.head, batch, self.steps, self.decay, counts)
        return st.loss * scale, torch.tensor(st.hits, dtype=torch.float32, device=st.loss.device)


@torch.no_grad()
def _depth_hits(head: Eagle3Head, convs: list[Conversation], config: Train3Config) -> torch.Tensor:
    """[2, k] (hits, counted positions) per depth of the training-time test over ``convs``, teacher-forced
    against the target's greedy token over its whole vocabulary."""
    was = head.training
    head.eval()
    out = torch.zeros(2, config.ttt_steps, dtype=torch.float64)
    for i in range(0, len(convs), config.batch_size):
        st = ttt_losses(head, make_batch3(head, convs[i : i + config.batch_size], config, True),
                        config.ttt_steps, config.step_decay)
        out += torch.tensor([st.hits, st.counts], dtype=torch.float64)
    head.train(was)
    return out


def evaluate3(head: Eagle3Head, convs: list[Conversation], config: Train3Config) -> list[float] | None:
    """Held-out top-1 per depth (training-time-test rows: head token == the target's greedy token over
    its whole vocabulary), a proxy for acceptance at each depth; None without held-out data."""
    if not convs:
        return None
    hits, counts = _depth_hits(head, convs, config)
    return [float(h / max(1.0, float(c))) for h, c in zip(hits, counts)]


def _evaluate_sharded(head: Eagle3Head, data: ShardedData, held: list, config: Train3Config,
                      ranks: Ranks) -> list[float] | None:
    """``evaluate3`` over every rank's share of the held-out conversations, summed."""
    if not held:
        return None
    mine = [data.features[e.conv] for e in held if ranks.owns(e.conv)]
    hc = ranks.sum(_depth_hits(head, mine, config).to(ranks.device)).cpu() if mine else \
        ranks.sum(torch.zeros(2, config.ttt_steps, dtype=torch.float64, device=ranks.device)).cpu()
    return [float(h / max(1.0, float(c))) for h, c in zip(hc[0], hc[1])]


def init_from_target(head: Eagle3Head, target) -> Eagle3Head:
    """A warm start: lm_head from the target's rows of the draft vocabulary, norm from its final norm."""
    with torch.no_grad():
        head.lm_head.weight.copy_(target.get_output_embeddings().weight[head.draft_vocab])
        norm = getattr(getattr(target, "model", None), "norm", None)
        if norm is not None and norm.weight.shape == head.norm.weight.shape:
            head.norm.weight.copy_(norm.weight)
    return head


def _data(data, target, head_layers: tuple[int, ...], ranks: Ranks) -> ShardedData:
    """``data`` (a directory, conversations in memory, or a rank's ``ShardedData``) as this rank's share,
    its features checked against the head's layers and the target's width."""
    if isinstance(data, ShardedData):
        shard = data
    elif isinstance(data, list):
        shard = sharded(data)
    else:
        shard = load_shard(data, ranks.owns)
    D = text_config(target).hidden_size
    bad = [c for c in shard.features.values() if c.aux is None or c.aux_layers != head_layers or c.hidden.shape[1] != D]
    if bad:
        have = "none" if bad[0].aux is None else f"layers {bad[0].aux_layers}, width {bad[0].hidden.shape[1]}"
        where = data if isinstance(data, (str, os.PathLike)) else "the conversations given"
        raise ValueError(f"{where}: {len(bad)} conversations lack EAGLE-3 features of layers {head_layers} "
                         f"at width {D} ({have}): rebuild them (--answers FILE into a new directory)")
    missing = [e.conv for e in shard.index if ranks.owns(e.conv) and e.conv not in shard.features]
    if missing:
        raise ValueError(f"rank {ranks.rank} of {ranks.world} lacks the features of conversations {missing[:5]} "
                         "of its shard")
    return shard


def schedule_of(train: list[Entry], config: Train3Config) -> dict:
    """What a checkpoint's step means: the batch schedule's seed and global batch over these conversations
    (their numbers and lengths, hashed). A resume over other data or another schedule is refused."""
    h = hashlib.blake2b(digest_size=8)
    for e in train:
        h.update(f"{e.conv}:{len(e.ids)};".encode())
    return {"seed": config.seed, "batch_size": config.batch_size, "train_conversations": len(train),
            "fingerprint": h.hexdigest()}


def _check_schedule(ckpt: Path, schedule: dict) -> None:
    saved = json.loads((ckpt / "train_state.json").read_text()).get("data")
    if saved is not None and saved != schedule:
        raise ValueError(f"{ckpt}: the checkpoint's step counts batches of {saved}, this run's data and schedule "
                         f"are {schedule}: resume over the same data, seed and global batch, or start afresh")


def _local_batch(head: Eagle3Head, data: ShardedData, train: list[Entry], step: int, config: Train3Config,
                 ranks: Ranks) -> Batch3:
    """This rank's part of step ``step``'s global batch (``batch_indices``, the same on every rank). A rank
    holding none of it computes a fully masked batch of one of its own conversations (loss 0 and zero
    gradients, so that DDP's all-reduce still meets every rank)."""
    convs = [data.features[train[i].conv] for i in batch_indices(step, len(train), config) if ranks.owns(train[i].conv)]
    if convs:
        return make_batch3(head, convs, config)
    any_own = next(iter(data.features.values()))
    b = make_batch3(head, [any_own], config)
    return dataclasses.replace(b, mask=torch.zeros_like(b.mask))


def _start_head(target, ckpt: Path, train: list[Entry], config: Train3Config, schedule: dict,
                resume: bool) -> Eagle3Head:
    """The head to train, in training mode: the checkpoint's (its schedule checked against this run's),
    else a new one seeded with ``config.seed`` and warm-started from the target."""
    if resume:
        _check_schedule(ckpt, schedule)
        head = load_eagle3(ckpt, target)
    else:
        torch.manual_seed(config.seed)
        V = target.get_output_embeddings().weight.shape[0]
        vocab = top_tokens(train, V, config.draft_vocab) if config.draft_vocab else None
        head = init_from_target(Eagle3Head(target, config.head, vocab), target)
    head.train()
    return head


def _loss_module(head: Eagle3Head, config: Train3Config, ranks: Ranks) -> nn.Module:
    """The training-time test's loss as a module, wrapped in DDP on W > 1 ranks."""
    loss_of = _TTTLoss(head, config)
    if ranks.world > 1:  # gradients averaged over ranks as backward runs (bucketed all-reduce); why DDP: docs/decisions/022-distributed-training.md
        from torch.nn.parallel import DistributedDataParallel

        loss_of = DistributedDataParallel(loss_of)
    return loss_of


def _train_step(loss_of: nn.Module, opt: torch.optim.Optimizer, params: list, batch: Batch3, counts: torch.Tensor,
                step: int, config: Train3Config, ranks: Ranks) -> tuple[float, float]:
    """One optimizer step on this rank's part of step ``step``'s batch (``counts`` [k]: the global batch's
    positions per step); what the log shows: the whole batch's loss and step-0 top-1 accuracy."""
    for group in opt.param_groups:
        group["lr"] = lr_at(step, config)
    # DDP averages the ranks' gradients: scaled by W, they sum to the global batch's gradient
    loss, hits = loss_of(batch, counts, float(ranks.world))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    nn.utils.clip_grad_value_(params, config.grad_clip)
    opt.step()
    # the whole batch's loss and step-0 hits: one small all-reduce, one host sync
    seen = ranks.sum(torch.cat([loss.detach().float().reshape(1) / ranks.world, hits[:1]]).to(ranks.device)).cpu()
    return float(seen[0]), float(seen[1]) / max(1, int(counts[0]))


def _record(result: TrainResult, entry: dict, depth: list[float] | None) -> None:
    """``entry`` and the held-out top-1 per depth into the history; the first depth's is the result's."""
    result.history.append(entry | {"held_out_acc_per_depth": depth})
    result.held_out_accuracy = None if depth is None else depth[0]


def train_head3(target, data: str | os.PathLike | list[Conversation] | ShardedData, out_dir: str | os.PathLike,
                config: Train3Config = Train3Config(), progress=None, log=print, clock=time.monotonic,
                minutes: float | None = None, ranks: Ranks = SOLO) -> TrainResult:
    """Train (or resume) an EAGLE-3 head on ``data`` (a data directory, conversations in memory:
    ``specdec.training.distill``, or a rank's share); checkpoints go to ``out_dir/checkpoint`` and the final
    head to ``out_dir/head`` (vLLM's layout: SPECDEC_EAGLE3_HEAD loads it). ``clock``: seconds, for the
    checkpoint period and ``minutes`` (stop after this long, the head evaluated and saved as at the
    end: a budgeted run). held_out_accuracy: the held-out top-1 of the first step.

    ``ranks`` (``specdec.training.distributed``): with W > 1 this is rank r of a data-parallel run (DDP);
    every rank calls it with the same arguments, rank 0 writes the files. A checkpoint from any W resumes
    under any W: it holds the head, the optimizer and the step, and a step's global batch does not depend
    on W."""
    ckpt = Path(out_dir) / "checkpoint"
    for p in target.parameters():
        p.requires_grad_(False)  # the target's embedding and lm_head are borrowed, frozen
    resume = (ckpt / "train_state.json").is_file()
    layers = config.head.aux_layers or default_aux_layers(text_config(target).num_hidden_layers)
    shard = _data(data, target, tuple(layers), ranks)
    train, held = split_held_out(shard.index, config.held_out)
    if not any(ranks.owns(e.conv) for e in train):
        raise ValueError(f"rank {ranks.rank} of {ranks.world} holds none of the {len(train)} training conversations: "
                         "fewer ranks, or more data")
    schedule = schedule_of(train, config)
    head = _start_head(target, ckpt, train, config, schedule, resume)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=config.lr, betas=config.betas, weight_decay=0.0)
    step, history = load_checkpoint(ckpt, head, opt) if resume else (0, [])
    if resume:
        log(f"resuming from step {step} ({ckpt})")
    loss_of = _loss_module(head, config, ranks)
    result = TrainResult(step, None, history)
    task = progress.add_task("train", total=config.steps, completed=step, loss=float("nan"),
                             acc=float("nan")) if progress is not None else None
    save = lambda: save_checkpoint(ckpt, head, opt, step, result, config, save=save_eagle3, data=schedule)  # noqa: E731
    saved = start = clock()
    while step < config.steps:
        if minutes is not None and ranks.any(clock() - start > 60 * minutes):
            log(f"stopped at step {step} of {config.steps} after {minutes:g} min")
            _record(result, {"step": step, "stopped": True}, _evaluate_sharded(head, shard, held, config, ranks))
            if ranks.lead:
                save()
            break
        batch = _local_batch(head, shard, train, step, config, ranks)
        counts = ranks.sum(step_counts(batch, config.ttt_steps))  # [k] the global batch's positions per step
        loss_value, acc = _train_step(loss_of, opt, params, batch, counts, step, config, ranks)
        step += 1
        if task is not None:
            progress.update(task, completed=step, loss=loss_value, acc=acc)
        if step % config.eval_every == 0 or step == config.steps:
            _record(result, {"step": step, "loss": loss_value, "train_acc": acc},
                    _evaluate_sharded(head, shard, held, config, ranks))
        if ranks.any(clock() - saved >= 60 * config.save_minutes) or step == config.steps:
            if ranks.lead:
                save()
            saved = clock()
    result.step = step
    if ranks.lead:
        save_eagle3(head, Path(out_dir) / "head")
    ranks.barrier()  # no rank returns (and no resume reads) before rank 0's files are complete
    return result


def schedule_note(config: Train3Config) -> str:
    """One line for logs: what a run of ``config`` does."""
    return (f"{config.steps} steps x {config.batch_size} conversations, training-time test of {config.ttt_steps} "
            f"steps (weights {', '.join(f'{config.step_decay ** s:.2f}' for s in range(config.ttt_steps))}), "
            f"draft vocabulary {config.draft_vocab or 'full'}, checkpoint every {config.save_minutes:g} min")
