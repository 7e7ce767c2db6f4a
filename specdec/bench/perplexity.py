"""``specdec perplexity``: the quality of a target's numerics, as perplexity on held-out book text.

Each book excerpt (``../shared/longctx/books.jsonl``) is cut to its first ``--tokens`` tokens and scored
in one forward per book (the decoder's prefill: ``forward.prompt_logits``), or with ``--path decode`` in verify
blocks of ``--block`` rows over the K/V store (what decoding reads: in int8 numerics the store's bf16 K/V and the
row attention), every position predicting the next; the
perplexity is exp of the mean negative log-likelihood over all scored tokens of all books. One row per
numerics (``--numerics exact,int8``: the same file loaded each way), so their ratio says what int8's
rounding costs (docs/decisions/019-int8-numerics.md). With ``--peer-python`` (an interpreter with
llama-cpp-python), llama.cpp scores the same token ids from the same GGUF file in its own process: the
anchor row. Results are written as JSON as each row finishes; a rerun with ``--resume`` skips what the file
holds.

    specdec perplexity --model default --numerics exact,int8 --tokens 1024 --books 12 [--peer-python PY]
    specdec perplexity --numerics exact,int8 --path decode      # rows "exact, decode", "int8, decode"
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch


PATHS = ("prefill", "decode")  # how a book is scored (``book_nll``)


def add_arguments(p) -> None:
    from specdec.arguments import positive_int
    from specdec.bench.books import BOOKS
    from specdec.models import WEIGHTS

    p.add_argument("--model", default="default", help="'default', a .gguf file or a HF model directory")
    p.add_argument("--weights", choices=WEIGHTS, default="packed", help="as for `specdec generate`")
    p.add_argument("--numerics", default="exact,int8", help="comma-separated: exact, int8")
    p.add_argument("--books", type=positive_int, default=12, help="how many book excerpts")
    p.add_argument("--tokens", type=positive_int, default=1024, help="tokens scored per book (its first ones)")
    p.add_argument("--data", default=str(BOOKS), help="the books' JSONL")
    p.add_argument("--path", choices=PATHS, default="prefill",
                   help="prefill: one forward a book (the decoder's prefill); decode: verify blocks over the K/V store")
    p.add_argument("--block", type=positive_int, default=16, help="rows a verify block scores (--path decode)")
    p.add_argument("--out", default="results/perplexity.json")
    p.add_argument("--resume", action="store_true", help="keep the rows already in --out")
    p.add_argument("--peer-python", default=None,
                   help="an interpreter with llama-cpp-python: adds llama.cpp's perplexity on the same file and ids")


@torch.inference_mode()
def book_nll(model, ids: torch.Tensor, path: str = "prefill", block: int = 16) -> tuple[float, int]:
    """(sum of -log p(next token), tokens scored) over ids [1, T]: T - 1 predictions, each position's logits
    as the decoder's prefill computes them (``forward.prompt_logits``), or with ``path="decode"`` as its verify
    blocks of ``block`` rows compute them over the K/V store (``store_logits``)."""
    from specdec.forward import prompt_logits

    logits = prompt_logits(model, ids) if path == "prefill" else store_logits(model, ids, block)
    nll = torch.nn.functional.cross_entropy(logits[0, :-1].double(), ids[0, 1:], reduction="sum")
    return float(nll), ids.shape[1] - 1


def store_logits(model, ids: torch.Tensor, block: int) -> torch.Tensor:
    """Every position's logits [1, T, V] for ids [1, T], ``block`` rows a forward over a BMC store holding the
    rows before them (``forward_block``, as a verify block of a chain runs)."""
    from specdec.forward import forward_block
    from specdec.kv.bmc import BMCCache, BMCConfig

    cache = BMCCache.for_model(model, 1, BMCConfig(64))
    out = []
    for s in range(0, ids.shape[1], block):
        chunk = ids[:, s : s + block].to(model.device)
        out.append(forward_block(model, cache, chunk, None, None).logits)
        cache.commit([list(range(chunk.shape[1]))])
    return torch.cat(out, 1)


PEER_ROW = "llama.cpp"


def _peer(args):
    """The llama.cpp peer's setup for ``--peer-python`` (None without it); a model that is not a GGUF
    file, or an interpreter that is not there, is named here."""
    if args.peer_python is None:
        return None
    from specdec.bench.peers import peer_setup

    return peer_setup("llama.cpp", args.peer_python, args.model)


def peer_perplexity(setup, texts: list[list[int]], threads: int) -> dict:
    """llama.cpp's perplexity over ``texts`` (token ids), in its own process: a row as specdec's."""
    from specdec.bench.peers import call_peer

    result = call_peer(setup, {"texts": texts, "threads": threads, "modes": ["nll"]})
    nll, n = sum(r["sum"] for r in result["nll"]), sum(r["scored"] for r in result["nll"])
    return {"perplexity": math.exp(nll / n), "tokens": n, "books": len(texts), "version": result["version"]}


def _token_ids(tokenizer, books: list[dict], tokens: int) -> list[torch.Tensor]:
    """Each book's first ``tokens`` token ids, [1, T] each."""
    return [tokenizer(b["text"], return_tensors="pt")["input_ids"][:, :tokens] for b in books]


def _write(out: Path, args, rows: dict) -> None:
    """The rows so far, atomically: a crash leaves the last complete file."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps({"model": args.model, "weights": args.weights, "rows": rows}, indent=1))
    tmp.replace(out)


def run(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from specdec.bench.books import read_books
    from specdec.bench.peers import PeerUnavailable
    from specdec.models import load_model
    from specdec.quant.numerics import NUMERICS

    wanted = [n for n in args.numerics.split(",") if n]
    bad = [n for n in wanted if n not in NUMERICS]
    if bad or not wanted:
        raise ValueError(f"--numerics {args.numerics!r}: expected a comma-separated list of {', '.join(NUMERICS)}")
    peer = _peer(args)  # bad input named before any model loads
    out = Path(args.out)
    rows = json.loads(out.read_text())["rows"] if args.resume and out.exists() else {}
    books = read_books(Path(args.data))[: args.books]
    texts = None
    suffix = "" if args.path == "prefill" else f", {args.path}"  # a row's name: its numerics and path
    for numerics in wanted:
        if numerics + suffix in rows:
            continue
        loaded = load_model(args.model, weights=args.weights, numerics=numerics)
        texts = _token_ids(loaded.tokenizer, books, args.tokens)
        nll, n = 0.0, 0
        for ids in texts:
            s, k = book_nll(loaded.model, ids, args.path, args.block)
            nll, n = nll + s, n + k
        rows[numerics + suffix] = {"perplexity": math.exp(nll / n), "tokens": n, "books": len(books)}
        _write(out, args, rows)
    if peer is not None and PEER_ROW not in rows:
        if texts is None:  # every specdec row resumed: the tokenizer alone
            texts = _token_ids(load_model(args.model, weights=args.weights).tokenizer, books, args.tokens)
        try:
            rows[PEER_ROW] = peer_perplexity(peer, [t[0].tolist() for t in texts], torch.get_num_threads())
            _write(out, args, rows)
        except PeerUnavailable as e:
            print(e)
    table = Table(title=f"{args.model} ({args.weights}): perplexity on {len(books)} books x {args.tokens} tokens")
    for col in ("numerics (or engine)", "perplexity", "x exact", "tokens"):
        table.add_column(col, justify="right")
    for name, r in rows.items():  # each row against exact's on its own path (llama.cpp's against the prefill's)
        base = rows.get("exact" + (name[name.index(","):] if "," in name else ""), {}).get("perplexity")
        table.add_row(name, f"{r['perplexity']:.4f}", "-" if base is None else f"{r['perplexity'] / base:.4f}",
                      str(r["tokens"]))
    Console().print(table)
    return 0
