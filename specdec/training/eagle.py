"""EAGLE's objective and a resumable training loop for its head (Li et al., 2024, "EAGLE").

    result = train_head(target, "DIR/data", "DIR", TrainConfig())   # DIR/checkpoint, then DIR/head

The head learns to predict the next feature (smooth-L1, weight 1.0) and the target's next-token
distribution (cross-entropy against softmax(lm_head(next feature)), weight 0.1), from the features
with uniform noise, as EAGLE trains; AdamW, linear warmup and decay, gradient values clipped at 0.5.
A checkpoint (head, optimizer, step) is written every ``save_every`` steps; held-out top-1 accuracy
(the head's token == the target's greedy token, teacher-forced features) every ``eval_every``.
Batches are a pure function of (seed, step), so a resumed run equals an uninterrupted one. Nothing
here reads or writes pickles. The data it trains on: specdec.training.eagle_data.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from array import array
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from specdec.drafters.eagle import EagleHead, EagleHeadConfig, causal_bias, load_head, save_head
from specdec.introspect import text_config
from specdec.training.eagle_data import Conversation, load_data

STATE_FORMAT = 1


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 800  # optimizer steps in total (~20 epochs of the packaged prompts' answers)
    batch_size: int = 4  # conversations per step
    lr: float = 3e-4  # peak learning rate (EAGLE: 3e-5 on millions of tokens; ours has far fewer)
    warmup: int = 100  # linear warmup steps, then linear decay to 0 at `steps`
    betas: tuple[float, float] = (0.9, 0.95)  # AdamW, as EAGLE
    v_weight: float = 1.0  # feature regression (smooth-L1), EAGLE's v_w
    p_weight: float = 0.1  # token cross-entropy vs the target's distribution, EAGLE's p_w
    grad_clip: float = 0.5  # clip gradient values (EAGLE)
    max_len: int = 1024  # tokens per conversation seen in training (longer ones are cut)
    loss_on_prompt: bool = False  # False: learn on the answer positions only, as EAGLE
    held_out: float = 0.05  # fraction of prompts whose answers are kept for the accuracy report
    save_every: int = 100  # checkpoint period in steps
    eval_every: int = 100  # held-out accuracy period in steps
    draft_vocab: int | None = None  # draft from the M most frequent training tokens; None = all
    seed: int = 0  # batch order and initial weights
    head: EagleHeadConfig = EagleHeadConfig()


@dataclass
class TrainResult:
    step: int
    held_out_accuracy: float | None  # top-1, teacher-forced; None without held-out data
    history: list[dict] = field(default_factory=list)  # per eval: step, loss, accuracy


# ----------------------------------------------------------------------------------- 2. train

def split_held_out(convs: list[Conversation], fraction: float) -> tuple[list[Conversation], list[Conversation]]:
    """Hold out every conversation of a ``fraction`` of the distinct prompts: those whose ids hash lowest.
    Several answers to one prompt (greedy and sampled) never sit on both sides, and a prompt's side
    depends on the set of prompts, not on the order of the data (files read in another order, sampled
    answers added after greedy ones, keep the held-out set)."""
    keys = [tuple(c.ids[: c.prompt_len].tolist()) for c in convs]
    prompts = list(dict.fromkeys(keys))
    n_eval = min(len(prompts) - 1, math.ceil(len(prompts) * fraction)) if fraction > 0 else 0
    rank = sorted(prompts, key=lambda k: hashlib.blake2b(array("q", k).tobytes(), digest_size=8).digest())
    held_prompts = set(rank[:n_eval])
    split = [k in held_prompts for k in keys]
    return [c for c, h in zip(convs, split) if not h], [c for c, h in zip(convs, split) if h]


def lr_at(step: int, config: TrainConfig) -> float:
    """Linear warmup over ``warmup`` steps, then linear decay to 0 at ``steps``."""
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    return config.lr * max(0.0, (config.steps - step) / max(1, config.steps - config.warmup))


def batch_indices(step: int, n: int, config: TrainConfig) -> list[int]:
    """Conversations of a step: epochs of seeded permutations, so resuming changes nothing."""
    out = []
    for j in range(config.batch_size):
        i = step * config.batch_size + j
        epoch, pos = divmod(i, n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(config.seed * 7919 + epoch))
        out.append(int(perm[pos]))
    return out


@dataclass(frozen=True)
class Batch:
    feats: torch.Tensor  # [B, S, D] f_0..f_S-1 (S = longest length - 1)
    tokens: torch.Tensor  # [B, S] x_1..x_S: token t follows feature t
    target: torch.Tensor  # [B, S, D] f_1..f_S, what each row should predict
    mask: torch.Tensor  # [B, S] bool positions that count in the loss
    lengths: torch.Tensor  # [B] valid rows per sequence (n - 1)


def make_batch(convs: list[Conversation], config: TrainConfig, dtype, device) -> Batch:
    B = len(convs)
    n = [min(len(c.ids), config.max_len) for c in convs]
    S = max(n) - 1
    D = convs[0].hidden.shape[1]
    feats = torch.zeros(B, S + 1, D, dtype=dtype)
    ids = torch.zeros(B, S + 1, dtype=torch.long)
    mask = torch.zeros(B, S, dtype=torch.bool)
    for b, (c, k) in enumerate(zip(convs, n)):
        feats[b, :k] = c.hidden[:k].to(dtype)
        ids[b, :k] = c.ids[:k]
        # row t predicts f_t+1 and (through it) x_t+2; rows up to k - 2 have a target
        first = 0 if config.loss_on_prompt else max(0, c.prompt_len - 2)
        mask[b, first : k - 1] = True
    return Batch(feats[:, :S].to(device), ids[:, 1:].to(device), feats[:, 1:].to(device), mask.to(device),
                 torch.tensor([k - 1 for k in n], device=device))


def head_losses(head: EagleHead, batch: Batch, noise: float, generator: torch.Generator | None = None,
                full_vocab_hits: bool = False):
    """(feature loss, token loss, top-1 hits, counted positions) for one batch; EAGLE's objective.

    Hits compare the head's token with the target's greedy token: over the draft vocabulary while
    training (the target's full lm_head would cost as much as the head's own), over the full one
    when ``full_vocab_hits`` (the held-out report).
    """
    B, S, D = batch.feats.shape
    feats = batch.feats
    if noise > 0:  # EAGLE: uniform noise on the input features, robustness to its own drift
        u = torch.rand(feats.shape, generator=generator, dtype=feats.dtype).to(feats.device)
        feats = feats + (u - 0.5) * noise
    pos = torch.arange(S, device=feats.device).expand(B, S)
    bias = causal_bias(B, S, feats.dtype, feats.device, batch.lengths)
    pred = head(feats, batch.tokens, pos, bias)  # [B, S, D]
    m = batch.mask
    count = m.sum().clamp(min=1)
    vloss = (nn.functional.smooth_l1_loss(pred, batch.target, reduction="none").mean(-1) * m).sum() / count
    logp = torch.log_softmax(head.logits(pred).float(), dim=-1)  # [B, S, M]
    with torch.no_grad():
        tlogits = head.target_logits(batch.target, full_vocab=full_vocab_hits).float()  # [B, S, M or V]
        if full_vocab_hits and head.draft_vocab is not None:
            target_next, tlogits = tlogits.argmax(-1), tlogits[..., head.draft_vocab]
        else:
            target_next = head.to_target_ids(tlogits.argmax(-1))
        p = torch.softmax(tlogits, dim=-1)
    ploss = (-(p * logp).sum(-1) * m).sum() / count
    hits = ((head.to_target_ids(logp.detach().argmax(-1)) == target_next) & m).sum()
    return vloss, ploss, int(hits), int(m.sum())


@torch.no_grad()
def evaluate(head: EagleHead, convs: list[Conversation], config: TrainConfig) -> float | None:
    """Held-out top-1 accuracy, teacher-forced: head token == target greedy token."""
    if not convs:
        return None
    head.eval()
    p = head.fc.weight
    hits = total = 0
    for i in range(0, len(convs), config.batch_size):
        batch = make_batch(convs[i : i + config.batch_size], config, p.dtype, p.device)
        _, _, h, n = head_losses(head, batch, 0.0, full_vocab_hits=True)
        hits, total = hits + h, total + n
    head.train()
    return hits / max(1, total)


def top_tokens(convs: list[Conversation], vocab: int, m: int) -> torch.Tensor:
    """The ``m`` most frequent token ids of the data (ties: smaller id), sorted by id."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for c in convs:
        counts += torch.bincount(c.ids, minlength=vocab)[:vocab]
    order = torch.sort(counts, descending=True, stable=True).indices[: min(m, vocab)]
    return torch.sort(order).values


def save_checkpoint(d: Path, head, opt: torch.optim.Optimizer, step: int, result: TrainResult, config,
                    save=save_head, data: dict | None = None) -> None:
    """The head (by ``save``: EAGLE's files, or EAGLE-3's), the optimizer's state and the step (with
    ``data``: what the batch schedule ran over, checked on resume), each file written atomically."""
    from safetensors.torch import save_file

    save(head, d)
    # optimizer state without pickle: tensors to safetensors, the rest to JSON
    sd = opt.state_dict()
    tensors = {f"{i}.{k}": (v if torch.is_tensor(v) else torch.tensor(v)).detach().cpu().contiguous()
               for i, st in sd["state"].items() for k, v in st.items()}
    tmp = d / "optimizer.safetensors.tmp"
    save_file(tensors, str(tmp))
    os.replace(tmp, d / "optimizer.safetensors")
    state = {"format": STATE_FORMAT, "step": step, "param_groups": sd["param_groups"],
             "history": result.history, "config": _jsonable(asdict(config)), "data": data}
    tmp = d / "train_state.json.tmp"
    tmp.write_text(json.dumps(state, indent=1))
    os.replace(tmp, d / "train_state.json")


def load_checkpoint(d: Path, head, opt: torch.optim.Optimizer) -> tuple[int, list[dict]]:
    """Restore the optimizer's state into ``opt`` (the head is loaded by the caller): (step, history)."""
    from safetensors.torch import load_file

    state = json.loads((d / "train_state.json").read_text())
    if state.get("format") != STATE_FORMAT:
        raise ValueError(f"{d}: checkpoint format {state.get('format')}, expected {STATE_FORMAT}")
    tensors = load_file(str(d / "optimizer.safetensors"))
    per_param: dict[int, dict] = {}
    for name, t in tensors.items():
        i, k = name.split(".", 1)
        per_param.setdefault(int(i), {})[k] = t.to(head.fc.weight.device)
    opt.load_state_dict({"state": per_param, "param_groups": state["param_groups"]})
    return int(state["step"]), list(state.get("history", []))


def _jsonable(x):
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def train_head(target, data_dir: str | os.PathLike, out_dir: str | os.PathLike,
               config: TrainConfig = TrainConfig(), progress=None, log=print) -> TrainResult:
    """Train (or resume training) a head on the conversations in ``data_dir``; checkpoints go to
    ``out_dir/checkpoint`` and the final head to ``out_dir/head``."""
    convs = load_data(data_dir)
    D = text_config(target).hidden_size
    if convs[0].hidden.shape[1] != D:
        raise ValueError(f"{data_dir} holds features of width {convs[0].hidden.shape[1]}, the target's are {D}: "
                         "the data was made by another model")
    train, held = split_held_out(convs, config.held_out)
    ckpt = Path(out_dir) / "checkpoint"
    for p in target.parameters():
        p.requires_grad_(False)  # the target's embedding and lm_head are borrowed, frozen
    V = target.get_output_embeddings().weight.shape[0]
    if (ckpt / "train_state.json").is_file():
        head = load_head(ckpt, target)
    else:
        torch.manual_seed(config.seed)
        vocab = top_tokens(train, V, config.draft_vocab) if config.draft_vocab else None
        head = EagleHead(target, config.head, vocab)
    head.train()
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=config.lr, betas=config.betas, weight_decay=0.0)
    step, history = 0, []
    if (ckpt / "train_state.json").is_file():
        step, history = load_checkpoint(ckpt, head, opt)
        log(f"resuming from step {step} ({ckpt})")
    result = TrainResult(step, None, history)
    dtype, device = head.fc.weight.dtype, head.fc.weight.device
    task = progress.add_task("train", total=config.steps, completed=step, loss=float("nan"),
                             acc=float("nan")) if progress is not None else None
    while step < config.steps:
        batch = make_batch([train[i] for i in batch_indices(step, len(train), config)], config, dtype, device)
        g = torch.Generator().manual_seed(config.seed * 104729 + step)  # the noise too is per step
        for group in opt.param_groups:
            group["lr"] = lr_at(step, config)
        vloss, ploss, hits, n = head_losses(head, batch, config.head.feature_noise, g)
        loss = config.v_weight * vloss + config.p_weight * ploss
        loss_value = float(loss.detach())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_value_(params, config.grad_clip)
        opt.step()
        step += 1
        if task is not None:
            progress.update(task, completed=step, loss=loss_value, acc=hits / max(1, n))
        if step % config.eval_every == 0 or step == config.steps:
            acc = evaluate(head, held, config)
            result.history.append({"step": step, "loss": loss_value, "train_acc": hits / max(1, n),
                                   "held_out_acc": acc})
            result.held_out_accuracy = acc
        if step % config.save_every == 0 or step == config.steps:
            save_checkpoint(ckpt, head, opt, step, result, config)
    result.step = step
    if result.held_out_accuracy is None:
        result.held_out_accuracy = evaluate(head, held, config)
    save_head(head, Path(out_dir) / "head")
    return result
