"""EAGLE's training data: the target answers instructions and each conversation is stored with the
target's last hidden states (the features the head learns to predict), resumably.

    prompts = encode_prompts(tokenizer, read_prompts())           # the project's instructions
    generate_data(target, prompts, "DIR/data", DataConfig())      # conv_00012.safetensors, ...
    save_answers("DIR/data", "answers.jsonl")                     # token ids only, ~1 KB each
    restore_answers(target, "answers.jsonl", "OTHER/data")        # features again, one forward each
    convs = load_data("DIR/data")                                 # [Conversation(ids, hidden, prompt_len, aux)]
    shard = load_shard("DIR/data", owns=lambda conv: conv % W == r)  # every conversation's ids, rank r's features

Sharded (torchrun, specdec.training.distributed): conversation i belongs to rank i % W. Each rank answers
and writes its own conversations (``generate_data(..., shard=(r, W))``) and reads their features, while
every rank reads every conversation's ids (the held-out split, the draft vocabulary and the batch
schedule are the same on every rank). Files are named by conversation, so any other rank count reads
the same directory. Each file is written to a temporary name and renamed (complete or absent), carries
a digest of its tensors, and is checked before use: a file made for other layers or another width is
answered again by the data stage and refused, by name, by training.

With ``DataConfig.aux_layers`` (EAGLE-3) each file also holds the inputs of those target layers,
concatenated (``aux``), from the same forward.

Nothing here reads or writes pickles. The objective and the training loop: specdec.training.eagle.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specdec.forward import hidden_of
from specdec.introspect import text_config
from specdec.jsonl import read_jsonl
from specdec.prompting import encode_prompt, eos_ids

PROMPTS_FILE = Path(__file__).resolve().parents[1] / "data" / "eagle_prompts.txt"


@dataclass(frozen=True)
class DataConfig:
    max_new_tokens: int = 256  # answer length per prompt (the head learns from answers)
    temperature: float = 0.0  # 0: greedy answers (what greedy decoding will meet); > 0: sampled
    seed: int = 0  # sampling seed; a batch starting at conversation i uses seed + i
    batch_size: int = 8  # prompts answered together
    # EAGLE-3: also store the inputs of these target layers (HF's hidden_states[j]) concatenated; ():
    # the last hidden state only (EAGLE-1/2)
    aux_layers: tuple[int, ...] = ()


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
    return [encode_prompt(tokenizer, p).tolist() for p in prompts]


@torch.inference_mode()
def answer_batch(target, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
                 seed: int = 0) -> list[list[int]]:
    """The target's answers to ``prompts`` (token ids) generated together (HF ``generate``, left-padded),
    each cut after its first end-of-sequence token: greedy at ``temperature`` 0, else sampled from the
    target's own distribution at that temperature (no top-k / top-p), seeded by ``seed``."""
    pad, eos, device = _pad_id(target), set(eos_ids(target)), target.device
    width = max(len(p) for p in prompts)
    x = torch.full((len(prompts), width), pad, dtype=torch.long, device=device)
    mask = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
    for row, p in enumerate(prompts):
        x[row, width - len(p):] = torch.tensor(p, dtype=torch.long, device=device)
        mask[row, width - len(p):] = 1
    sample = temperature > 0
    if sample:
        torch.manual_seed(seed)
    out = target.generate(x, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=sample,
                          temperature=temperature if sample else None, top_p=None, top_k=None,
                          pad_token_id=pad).tolist()
    answers = []
    for row in out:
        answer = row[width:]
        ends = [k for k, t in enumerate(answer) if t in eos]
        answers.append(answer[: ends[0] + 1] if ends else answer)
    return answers


def _conv_path(data_dir: Path, i: int) -> Path:
    return data_dir / f"conv_{i:05d}.safetensors"


@torch.no_grad()
def generate_data(target, prompts: list[list[int]], data_dir: str | os.PathLike,
                  config: DataConfig = DataConfig(), progress=None, shard: tuple[int, int] = (0, 1)) -> int:
    """Answer each prompt with the target and store ids + last hidden states; skips files that are done
    and pass ``check_conv`` (one made for other layers or another width is answered again). ``shard``
    (rank r, ranks W): only conversations i with i % W == r. Returns the number written by this call.

    Prompts are answered ``config.batch_size`` at a time (left-padded HF ``generate``: on a CPU a
    batch of 8 costs little more per step than one sequence); each answer is cut after its first
    EOS and its features come from a forward over that conversation alone, unpadded, as the head
    will meet them when drafting."""
    d = Path(data_dir)
    d.mkdir(parents=True, exist_ok=True)
    r, W = shard
    D = text_config(target).hidden_size
    mine = [i for i in range(len(prompts)) if i % W == r]
    todo = [i for i in mine if check_conv(_conv_path(d, i), D, config.aux_layers) is not None]
    task = progress.add_task("data", total=len(mine), completed=len(mine) - len(todo)) \
        if progress is not None else None
    for start in range(0, len(todo), config.batch_size):
        chunk = todo[start : start + config.batch_size]
        answers = answer_batch(target, [prompts[i] for i in chunk], config.max_new_tokens, config.temperature,
                               config.seed + chunk[0])
        for i, answer in zip(chunk, answers):
            _write_conv(target, _conv_path(d, i), prompts[i] + answer, len(prompts[i]), config.aux_layers)
            if task is not None:
                progress.advance(task)
    return len(todo)


@torch.no_grad()
def _write_conv(target, path: Path, ids: list[int], prompt_len: int, aux_layers: tuple[int, ...] = ()) -> None:
    """One conversation file: its ids and the target's last hidden states (one forward over it), and
    the inputs of ``aux_layers`` concatenated (EAGLE-3's features)."""
    from safetensors.torch import save_file

    x = torch.tensor([ids], device=target.device)
    states = target(x, output_hidden_states=True).hidden_states
    tensors = {"input_ids": x[0].cpu(), "hidden": states[-1][0].float().cpu().contiguous()}  # [n, D] after the norm
    if aux_layers:
        tensors["aux"] = hidden_of(states, aux_layers)[0].float().cpu().contiguous()  # [n, D * len(aux_layers)]
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata={"prompt_len": str(prompt_len),
                                           "aux_layers": ",".join(map(str, aux_layers)),
                                           "digest": _digest(tensors)})
    os.replace(tmp, path)  # a conversation file is complete or absent, never half written


# Answers are the costly part of the data (one decode step per token); features cost one forward per
# conversation. So a file of answers (token ids only, ~1 KB a conversation) carries a dataset across
# machines and sessions, and each session can add to it.

def _digest(tensors: dict[str, torch.Tensor]) -> str:
    """blake2b of the tensors' names, dtypes, shapes and bytes, in name order (what ``check_conv`` and
    ``load_shard`` compare a file's contents with)."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def check_conv(path: Path, width: int, aux_layers: tuple[int, ...]) -> str | None:
    """What is wrong with conversation file ``path`` for features of ``width`` and ``aux_layers`` (its
    header only: the names, shapes and metadata), or None if it is fit to use. The contents' digest is
    compared when the features are read (``load_shard``)."""
    from safetensors import safe_open

    if not path.is_file():
        return "missing"
    try:
        with safe_open(str(path), framework="pt") as sf:
            meta, keys = sf.metadata() or {}, set(sf.keys())
            shapes = {k: tuple(sf.get_slice(k).get_shape()) for k in keys}
    except Exception as e:  # noqa: BLE001 - a file safetensors cannot parse is named, whatever the parser raised
        return f"unreadable ({e})"
    layers = tuple(int(j) for j in meta.get("aux_layers", "").split(",") if j)
    n = shapes.get("input_ids", (0,))[0]
    if layers != tuple(aux_layers):
        return f"features of layers {layers}, not {tuple(aux_layers)}"
    if shapes.get("hidden") != (n, width):
        return f"hidden {shapes.get('hidden')}, expected ({n}, {width})"
    if aux_layers and shapes.get("aux") != (n, width * len(aux_layers)):
        return f"aux {shapes.get('aux')}, expected ({n}, {width * len(aux_layers)})"
    if not 0 <= int(meta.get("prompt_len", 0)) < n:
        return f"prompt_len {meta.get('prompt_len')} of {n} ids"
    return None


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


def restore_answers(target, path: str | os.PathLike, data_dir: str | os.PathLike, progress=None,
                    aux_layers: tuple[int, ...] = (), shard: tuple[int, int] = (0, 1)) -> int:
    """Rebuild the conversation files of an answers file that ``data_dir`` lacks (features by one
    target forward each; with ``aux_layers``, EAGLE-3's too); ``shard`` (r, W): conversations i % W == r
    only. Returns how many were written."""
    d = Path(data_dir)
    d.mkdir(parents=True, exist_ok=True)
    r, W = shard
    todo = [a for a in read_answers(path) if a[0] % W == r and not _conv_path(d, a[0]).exists()]
    task = progress.add_task("answers", total=len(todo)) if progress is not None else None
    for conv, p, ids in todo:
        _write_conv(target, _conv_path(d, conv), ids, p, aux_layers)
        if task is not None:
            progress.advance(task)
    return len(todo)


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
    aux: torch.Tensor | None = None  # [n, D * len(aux_layers)] float32 inputs of the aux layers (EAGLE-3)
    aux_layers: tuple[int, ...] = ()  # which layers ``aux`` holds


@dataclass(frozen=True)
class Entry:
    """A conversation's ids without its features: what every rank knows of every conversation."""
    conv: int  # its number (file conv_00012 -> 12; a line's "conv" in an answers file)
    ids: torch.Tensor  # [n] int64
    prompt_len: int


@dataclass(frozen=True)
class ShardedData:
    """Training data as a rank holds it: every conversation's ids, and the features of its own shard."""
    index: list[Entry]  # every conversation, by conv ascending
    features: dict[int, Conversation] = field(default_factory=dict)  # conv -> features: this rank's only


def sharded(convs: list[Conversation]) -> ShardedData:
    """Conversations in memory as one rank's data holding them all (conv = position)."""
    return ShardedData([Entry(i, c.ids, c.prompt_len) for i, c in enumerate(convs)], dict(enumerate(convs)))


def _files(data_dir: str | os.PathLike) -> list[Path]:
    files = sorted(Path(data_dir).glob("conv_*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no training conversations in {data_dir} (run the data stage first)")
    return files


def _read_conv(f: Path) -> Conversation:
    """A conversation file's contents, its digest compared (files from before digests are read unchecked)."""
    from safetensors import safe_open

    with safe_open(str(f), framework="pt") as sf:
        meta = sf.metadata() or {}
        tensors = {k: sf.get_tensor(k) for k in sf.keys()}
    if "digest" in meta and _digest(tensors) != meta["digest"]:
        raise ValueError(f"{f}: contents differ from the digest written with them (a damaged file: delete it "
                         "and rerun the data stage)")
    layers = tuple(int(j) for j in meta.get("aux_layers", "").split(",") if j)
    return Conversation(tensors["input_ids"], tensors["hidden"], int(meta.get("prompt_len", 0)), tensors.get("aux"),
                        layers)


def load_data(data_dir: str | os.PathLike) -> list[Conversation]:
    return [_read_conv(f) for f in _files(data_dir)]


def load_shard(data_dir: str | os.PathLike, owns=lambda conv: True) -> ShardedData:
    """Every conversation's ids (one small tensor read per file) and the features of those ``owns(conv)``
    accepts, each checked against its digest."""
    from safetensors import safe_open

    index, features = [], {}
    for f in _files(data_dir):
        conv = int(f.stem.split("_")[1])
        if owns(conv):
            c = features[conv] = _read_conv(f)
            index.append(Entry(conv, c.ids, c.prompt_len))
            continue
        with safe_open(str(f), framework="pt") as sf:
            index.append(Entry(conv, sf.get_tensor("input_ids"), int((sf.metadata() or {}).get("prompt_len", 0))))
    return ShardedData(index, features)
