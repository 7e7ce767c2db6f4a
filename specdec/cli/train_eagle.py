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

Batches are a pure function of (seed, step), so a resumed run equals an uninterrupted one.
Nothing here reads or writes pickles.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from specdec.drafters.eagle import EagleHead, EagleHeadConfig, causal_bias, load_head, save_head
from specdec.jsonl import read_jsonl
from specdec.models import text_config

PROMPTS_FILE = Path(__file__).resolve().parents[1] / "data" / "eagle_prompts.txt"
STATE_FORMAT = 1


@dataclass(frozen=True)
class DataConfig:
    max_new_tokens: int = 256  # answer length per prompt (the head learns from answers)
    temperature: float = 0.0  # 0: greedy answers (what greedy decoding will meet); > 0: sampled
    seed: int = 0  # sampling seed; a batch starting at conversation i uses seed + i
    batch_size: int = 8  # prompts answered together


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


# ------------------------------------------------------------------------------------ 1. data

def read_prompts(path: str | os.PathLike = PROMPTS_FILE) -> list[str]:
    """Instructions from a text file (one per line, '#' starts a comment) or, for instructions that
    span lines (a passage to summarize), a ``.jsonl`` file of {"prompt": "..."} lines."""
    if str(path).endswith(".jsonl"):
        prompts = read_jsonl(path, _prompt_of, 'a {"prompt": "..."}')
        if not prompts:
            raise ValueError(f'no prompts in {path} (one {{"prompt": "..."}} object per line)')
        return prompts
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    prompts = [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    if not prompts:
        raise ValueError(f"no prompts in {path} (one instruction per line, '#' starts a comment)")
    return prompts


def _prompt_of(obj) -> str:
    p = obj["prompt"]
    if not isinstance(p, str) or not p.strip():
        raise ValueError("empty or not a string")
    return p.strip()


def encode_prompts(tokenizer, prompts: list[str]) -> list[list[int]]:
    """Token ids per prompt, through the tokenizer's chat template when it has one."""
    out = []
    for p in prompts:
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                tokenize=True, return_dict=False)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
        else:
            ids = tokenizer(p)["input_ids"]
        out.append([int(t) for t in ids])
    return out


def _conv_path(data_dir: Path, i: int) -> Path:
    return data_dir / f"conv_{i:05d}.safetensors"


@torch.no_grad()
def generate_data(target, prompts: list[list[int]], data_dir: str | os.PathLike,
                  config: DataConfig = DataConfig(), progress=None) -> int:
    """Answer each prompt with the target and store ids + last hidden states; skips done files.
    Returns the number of conversations written by this call.

    Prompts are answered ``config.batch_size`` at a time (left-padded HF ``generate``: on a CPU a
    batch of 8 costs little more per step than one sequence); each answer is cut after its first
    EOS and its features come from a forward over that conversation alone, unpadded, as the head
    will meet them when drafting."""
    d = Path(data_dir)
    d.mkdir(parents=True, exist_ok=True)
    todo = [i for i in range(len(prompts)) if not _conv_path(d, i).exists()]
    task = progress.add_task("data", total=len(prompts), completed=len(prompts) - len(todo)) \
        if progress is not None else None
    pad, eos = _pad_id(target), _eos_ids(target)
    sample = config.temperature > 0
    for start in range(0, len(todo), config.batch_size):
        chunk = todo[start : start + config.batch_size]
        width = max(len(prompts[i]) for i in chunk)
        x = torch.tensor([[pad] * (width - len(prompts[i])) + prompts[i] for i in chunk], device=target.device)
        mask = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in chunk],
                            device=target.device)
        if sample:
            torch.manual_seed(config.seed + chunk[0])
        out = target.generate(x, attention_mask=mask, max_new_tokens=config.max_new_tokens,
                              do_sample=sample, temperature=config.temperature if sample else None,
                              top_p=None, top_k=None, pad_token_id=pad)
        for row, i in enumerate(chunk):
            answer = out[row, width:].tolist()
            ends = [k for k, t in enumerate(answer) if t in eos]
            answer = answer[: ends[0] + 1] if ends else answer
            _write_conv(target, _conv_path(d, i), prompts[i] + answer, len(prompts[i]))
            if task is not None:
                progress.advance(task)
    return len(todo)


@torch.no_grad()
def _write_conv(target, path: Path, ids: list[int], prompt_len: int) -> None:
    """One conversation file: its ids and the target's last hidden states (one forward over it)."""
    from safetensors.torch import save_file

    x = torch.tensor([ids], device=target.device)
    hidden = target(x, output_hidden_states=True).hidden_states[-1][0]  # [n, D], after the final norm
    tmp = path.with_suffix(".tmp")
    save_file({"input_ids": x[0].cpu(), "hidden": hidden.float().cpu().contiguous()}, str(tmp),
              metadata={"prompt_len": str(prompt_len)})
    os.replace(tmp, path)  # a conversation file is complete or absent, never half written


# Answers are the costly part of the data (one decode step per token); features cost one forward per
# conversation. So a file of answers (token ids only, ~1 KB a conversation) carries a dataset across
# machines and sessions, and each session can add to it.

def save_answers(data_dir: str | os.PathLike, path: str | os.PathLike) -> int:
    """Write every conversation in ``data_dir`` as a JSONL line {"conv", "prompt_len", "ids"}."""
    from safetensors import safe_open

    files = sorted(Path(data_dir).glob("conv_*.safetensors"))
    tmp = Path(str(path) + ".tmp")
    with open(tmp, "w") as f:
        for file in files:
            with safe_open(str(file), framework="pt") as sf:
                p = int((sf.metadata() or {}).get("prompt_len", 0))
                ids = sf.get_tensor("input_ids").tolist()
            f.write(json.dumps({"conv": int(file.stem.split("_")[1]), "prompt_len": p, "ids": ids}) + "\n")
    os.replace(tmp, path)
    return len(files)


def read_answers(path: str | os.PathLike) -> list[tuple[int, int, list[int]]]:
    """(conv, prompt_len, ids) per line of an answers file; a malformed line is named."""
    return read_jsonl(path, _answer_of, "an answer")


def _answer_of(r) -> tuple[int, int, list[int]]:
    conv, p, ids = int(r["conv"]), int(r["prompt_len"]), [int(t) for t in r["ids"]]
    if conv < 0 or not 0 < p < len(ids):
        raise ValueError(f"conv {conv}, prompt_len {p}, {len(ids)} ids")
    return conv, p, ids


def restore_answers(target, path: str | os.PathLike, data_dir: str | os.PathLike, progress=None) -> int:
    """Rebuild the conversation files of an answers file that ``data_dir`` lacks (features by one
    target forward each). Returns how many were written."""
    d = Path(data_dir)
    d.mkdir(parents=True, exist_ok=True)
    todo = [r for r in read_answers(path) if not _conv_path(d, r[0]).exists()]
    task = progress.add_task("answers", total=len(todo)) if progress is not None else None
    for conv, p, ids in todo:
        _write_conv(target, _conv_path(d, conv), ids, p)
        if task is not None:
            progress.advance(task)
    return len(todo)


def _eos_ids(target) -> set[int]:
    eos = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
    if eos is None:
        return set()
    return {eos} if isinstance(eos, int) else set(eos)


def _pad_id(target) -> int:
    gen = getattr(target, "generation_config", None)
    for name in ("pad_token_id", "eos_token_id"):
        v = getattr(gen, name, None)
        if v is not None:
            return v if isinstance(v, int) else int(v[0])
    return 0


@dataclass(frozen=True)
class Conversation:
    ids: torch.Tensor  # [n] int64
    hidden: torch.Tensor  # [n, D] float32 target last hidden states
    prompt_len: int


def load_data(data_dir: str | os.PathLike) -> list[Conversation]:
    from safetensors import safe_open

    files = sorted(Path(data_dir).glob("conv_*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no training conversations in {data_dir} (run the data stage first)")
    convs = []
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            meta = sf.metadata() or {}
            convs.append(Conversation(sf.get_tensor("input_ids"), sf.get_tensor("hidden"),
                                      int(meta.get("prompt_len", 0))))
    return convs


# ----------------------------------------------------------------------------------- 2. train

def split_held_out(convs: list[Conversation], fraction: float) -> tuple[list[Conversation], list[Conversation]]:
    """Hold out every conversation of the last ``fraction`` of distinct prompts (in order of first
    appearance): several answers to one prompt (sampled data) never sit on both sides."""
    keys = [tuple(c.ids[: c.prompt_len].tolist()) for c in convs]
    prompts = list(dict.fromkeys(keys))
    n_eval = min(len(prompts) - 1, math.ceil(len(prompts) * fraction)) if fraction > 0 else 0
    held_prompts = set(prompts[len(prompts) - n_eval :])
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


def _save_checkpoint(d: Path, head: EagleHead, opt: torch.optim.Optimizer, step: int,
                     result: TrainResult, config: TrainConfig) -> None:
    from safetensors.torch import save_file

    save_head(head, d)
    # optimizer state without pickle: tensors to safetensors, the rest to JSON
    sd = opt.state_dict()
    tensors = {f"{i}.{k}": (v if torch.is_tensor(v) else torch.tensor(v)).detach().cpu().contiguous()
               for i, st in sd["state"].items() for k, v in st.items()}
    tmp = d / "optimizer.safetensors.tmp"
    save_file(tensors, str(tmp))
    os.replace(tmp, d / "optimizer.safetensors")
    state = {"format": STATE_FORMAT, "step": step, "param_groups": sd["param_groups"],
             "history": result.history, "config": _jsonable(asdict(config))}
    tmp = d / "train_state.json.tmp"
    tmp.write_text(json.dumps(state, indent=1))
    os.replace(tmp, d / "train_state.json")


def _load_checkpoint(d: Path, head: EagleHead, opt: torch.optim.Optimizer) -> tuple[int, list[dict]]:
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
        step, history = _load_checkpoint(ckpt, head, opt)
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
            _save_checkpoint(ckpt, head, opt, step, result, config)
    result.step = step
    if result.held_out_accuracy is None:
        result.held_out_accuracy = evaluate(head, held, config)
    save_head(head, Path(out_dir) / "head")
    return result


# --------------------------------------------------------------------------------------- CLI

def add_arguments(parser) -> None:
    parser.add_argument("--model", default="default", help="target: 'default', a .gguf file or a HF dir")
    parser.add_argument("--out", required=True, help="output directory (data/, checkpoint/, head/)")
    parser.add_argument("--prompts", default=str(PROMPTS_FILE), help="instructions, one per line")
    parser.add_argument("--num-prompts", type=int, default=None, help="use only the first N prompts")
    parser.add_argument("--max-new-tokens", type=int, default=DataConfig.max_new_tokens)
    parser.add_argument("--temperature", type=float, default=DataConfig.temperature,
                        help="0: greedy answers; > 0: sampled")
    parser.add_argument("--data-batch-size", type=int, default=DataConfig.batch_size,
                        help="prompts the target answers together in the data stage")
    parser.add_argument("--steps", type=int, default=TrainConfig.steps)
    parser.add_argument("--batch-size", type=int, default=TrainConfig.batch_size)
    parser.add_argument("--lr", type=float, default=TrainConfig.lr)
    parser.add_argument("--warmup", type=int, default=TrainConfig.warmup)
    parser.add_argument("--max-len", type=int, default=TrainConfig.max_len)
    parser.add_argument("--save-every", type=int, default=TrainConfig.save_every)
    parser.add_argument("--eval-every", type=int, default=TrainConfig.eval_every)
    parser.add_argument("--draft-vocab", type=int, default=None,
                        help="draft from the M most frequent tokens of the data (default: full vocab)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stage", choices=["all", "data", "train"], default="all")
    parser.add_argument("--answers", default=None, metavar="FILE",
                        help="answers file (token ids, JSONL): the data stage first rebuilds the "
                             "conversations it holds, then writes every conversation back to it")
    parser.add_argument("--export-eagle", default=None, metavar="DIR",
                        help="also write the head in EAGLE's checkpoint layout to DIR")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def run(args) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from specdec.drafters.eagle import export_eagle
    from specdec.models import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    console = Console(stderr=True, quiet=args.quiet)
    out = Path(args.out)
    t0 = time.time()
    loaded = load_model(args.model)
    target = loaded.model.eval()
    console.print(f"target {loaded.name} loaded in {time.time() - t0:.1f} s")
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[loss]:.3f} loss  {task.fields[acc]:.1%} acc", justify="right"),
               TimeRemainingColumn()]
    data_cfg = DataConfig(args.max_new_tokens, args.temperature, args.seed, args.data_batch_size)
    train_cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, warmup=args.warmup,
                            max_len=args.max_len, save_every=args.save_every, eval_every=args.eval_every,
                            draft_vocab=args.draft_vocab, seed=args.seed)
    if args.stage in ("all", "data"):
        if loaded.tokenizer is None:
            raise ValueError(f"{args.model} has no tokenizer: train-eagle needs one to encode its prompts")
        prompts = read_prompts(args.prompts)[: args.num_prompts]
        ids = encode_prompts(loaded.tokenizer, prompts)
        with Progress(*columns[:3], TimeRemainingColumn(), console=console, disable=args.quiet) as prog:
            if args.answers and Path(args.answers).exists():
                k = restore_answers(target, args.answers, out / "data", prog)
                console.print(f"answers: {k} conversations rebuilt from {args.answers}")
            n = generate_data(target, ids, out / "data", data_cfg, prog)
        console.print(f"data: {n} new conversations, {len(ids)} in {out / 'data'}")
        if args.answers:
            k = save_answers(out / "data", args.answers)
            console.print(f"answers: {k} conversations written to {args.answers}")
    if args.stage in ("all", "train"):
        with Progress(*columns, console=console, disable=args.quiet) as prog:
            res = train_head(target, out / "data", out, train_cfg, prog, log=console.print)
        acc = "n/a" if res.held_out_accuracy is None else f"{res.held_out_accuracy:.1%}"
        console.print(f"head after {res.step} steps in {out / 'head'}; held-out top-1 accuracy {acc}")
        print(json.dumps({"step": res.step, "held_out_accuracy": res.held_out_accuracy,
                          "head": str(out / "head")}))
        if args.export_eagle:
            export_eagle(load_head(out / "head", target), args.export_eagle)
            console.print(f"EAGLE layout written to {args.export_eagle}")
    return 0
