"""`specdec bench-scaling`: step time and memory of packed GGUF targets at Llama sizes no package
ships, beside llama.cpp on the same files.

    specdec bench-scaling --shapes 0.5b,1.5b --quants q4_0,q4_k --tokens 64 --peer-python PYTHON

For each shape x quant: a random-weight GGUF (``specdec.quant.write``, written once into the cache
folder); then, in a fresh process each (so its RSS is that model's alone; ``--in-process``: in this
one, a quick check of the harness), specdec loads it packed and
decodes N tokens greedily without a drafter (plain decoding through SpecDecoder, EOS ignored so both
engines decode the same count), and llama.cpp decodes the same prompt ids in its own process. RSS is
read before the load (torch, transformers and specdec already imported), after it, after a warm-up
and after the N tokens (and, a diagnostic outside the budget, after glibc's malloc_trim: freed heap
that glibc keeps). ``rss_ok``: the growth from before the load to the end is at most
RSS_BUDGET x the file's size plus the KV store (layers x 2 x kv_heads x head_dim x 4 bytes x tokens).
Each entry is written to --out as it finishes; a rerun skips entries already there for the same file.
``--self-draft bfloat16``: instead, the quantized self-drafter's costs on random-weight targets of each
shape in that dtype (``specdec.bench.self_draft``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from specdec.arguments import name_list, positive_int

RSS_BUDGET = 1.3  # the bound: RSS growth <= 1.3 x file + KV store
WARM_UP_TOKENS = 4  # the first generation pays one-off costs (kernels checked, buffers) that are not speed


def rss_bytes(field: str = "VmRSS") -> int:
    """A field of /proc/self/status in bytes: VmRSS (resident), RssAnon (of it: not file pages)."""
    from specdec.bench.peer_llamacpp import vm_rss_kib

    return vm_rss_kib(field) * 1024


def measure_specdec(gguf: str, prompt: list[int], tokens: int, threads: int, numerics: str = "exact") -> dict:
    """In a fresh process: RSS around loading ``gguf`` packed and decoding ``tokens`` tokens after
    ``prompt`` with no drafter, and the decode rate (after the first token: the prompt's prefill apart)."""
    import torch
    import transformers  # noqa: F401 - imported before the baseline: the load, not the library, is measured
    from transformers.models.llama import modeling_llama  # noqa: F401

    from specdec import SpecDecoder
    from specdec.introspect import attention_shape
    from specdec.models import load_model
    from specdec.runtime.memory import malloc_trim

    torch.set_num_threads(threads)
    rss, anon = {}, {}  # VmRSS; RssAnon (the rest: the file's pages and the libraries')

    def note(when: str) -> None:
        rss[when], anon[when] = rss_bytes(), rss_bytes("RssAnon")

    note("before_load")
    loaded = load_model(gguf, weights="packed", numerics=numerics)
    note("after_load")
    decoder = SpecDecoder(loaded.model, None)
    x = torch.tensor([prompt], dtype=torch.long)  # [1, P]
    decoder.generate(x, max_new_tokens=WARM_UP_TOKENS, eos_token_id=[])
    note("after_warm_up")
    stamps: list[float] = []  # one per step (no drafter: one token each)
    start = time.perf_counter()
    out = decoder.generate(x, max_new_tokens=tokens, eos_token_id=[], callback=lambda e: stamps.append(time.perf_counter()))
    note("after_decode")
    trim = malloc_trim()
    if trim is not None:
        trim()
    note("after_trim")  # diagnostic, not in the budget: what of the growth was freed heap glibc kept
    layers, kv_heads, head_dim = attention_shape(loaded.model)
    decode_s = stamps[-1] - stamps[0]
    return {"rss": rss, "rss_anon": anon, "new_tokens": int(out.generated(0).numel()), "seconds": stamps[-1] - start,
            "prefill_seconds": stamps[0] - start,
            "decode_tokens_per_s": (len(stamps) - 1) / decode_s if decode_s > 0 else None,
            "ms_per_step": 1000 * decode_s / (len(stamps) - 1) if len(stamps) > 1 else None,
            "kv_bytes": layers * 2 * kv_heads * head_dim * 4 * (len(prompt) + tokens)}


def _child(fn, args, runtime, q) -> None:
    from specdec.config import use

    with use(runtime):  # a spawned process: the parent's runtime, handed over
        try:
            q.put(("ok", fn(*args)))
        except Exception as e:  # noqa: BLE001 - reported to the parent by name
            q.put(("error", f"{type(e).__name__}: {e}"))


def in_fresh_process(fn, *args):
    """``fn(*args)`` in a new spawned process (nothing of this one's memory in it); its error, or its
    death (killed for memory), raised here as a RuntimeError."""
    import multiprocessing as mp
    import queue

    from specdec.config import current

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(fn, args, current(), q))
    p.start()
    while True:
        try:
            status, value = q.get(timeout=5)
            break
        except queue.Empty:
            if not p.is_alive():
                raise RuntimeError(f"the process measuring {args[0]} exited with code {p.exitcode}") from None
    p.join()
    if status == "error":
        raise RuntimeError(value)
    return value


def in_this_process(fn, *args):
    """``fn(*args)`` here, torch's thread count restored after (the measurement sets its own): quick, but
    the RSS then counts whatever this process already held (a check of the harness, not a figure)."""
    import torch

    threads = torch.get_num_threads()
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(threads)


def measure_peer(python: str, gguf: Path, prompt: list[int], tokens: int, threads: int) -> dict:
    """llama.cpp's plain decoding of the same ids in its own process, or {"skipped": why}."""
    from specdec.bench.peers import LLAMA_CPP, PeerSetup, PeerUnavailable, call_peer

    request = {"prompts": [prompt], "eos": [], "max_new_tokens": tokens, "threads": threads,
               "lookup_tokens": 0, "modes": ["plain"]}
    try:
        result = call_peer(PeerSetup(LLAMA_CPP, Path(python), gguf), request)
    except PeerUnavailable as e:
        return {"skipped": str(e)}
    run, rss = result["modes"]["plain"][0], result["rss_kib"]["plain"]
    decode_s = run["seconds"] - run["first_seconds"]
    return {"version": result["version"], "new_tokens": len(run["ids"]), "seconds": run["seconds"],
            "decode_tokens_per_s": (len(run["ids"]) - 1) / decode_s if decode_s > 0 else None,
            "rss": {k: v * 1024 for k, v in rss.items()}}


def entry_for(shape: str, quant: str, gguf: Path, prompt: list[int], tokens: int, threads: int,
              peer_python: str | None, isolate=in_fresh_process, numerics: str = "exact") -> dict:
    """isolate: how specdec's measurement runs (``in_fresh_process``, or ``in_this_process``); numerics:
    the target's (``quant.numerics``)."""
    from specdec.quant.write import SHAPES

    size = gguf.stat().st_size
    ours = isolate(measure_specdec, str(gguf), prompt, tokens, threads, numerics)
    growth = ours["rss"]["after_decode"] - ours["rss"]["before_load"]
    entry = {"shape": shape, "quant": quant, "params": SHAPES[shape].params(), "file": gguf.name,
             "file_bytes": size, "tokens": tokens, "prompt_tokens": len(prompt), "threads": threads, "numerics": numerics,
             "specdec": ours, "rss_growth_bytes": growth,
             "rss_ok": growth <= RSS_BUDGET * size + ours["kv_bytes"],
             # diagnostic: the growth once glibc has returned freed heap (one-off warm-up buffers it kept)
             "rss_growth_after_trim_bytes": ours["rss"]["after_trim"] - ours["rss"]["before_load"]}
    entry["llama.cpp"] = (measure_peer(peer_python, gguf, prompt, tokens, threads) if peer_python
                          else {"skipped": "no --peer-python given"})
    return entry


def add_arguments(p) -> None:
    p.add_argument("--shapes", type=name_list, default="0.5b,1.5b", help="named shapes (specdec.quant.write.SHAPES)")
    p.add_argument("--quants", type=name_list, default="q4_0,q4_k", help="q8_0, q4_0, q4_1, q4_k, q6_k, q4_k_m (Q4_K with Q6_K "
                   "attn_v, ffn_down and output, as llama.cpp's mix)")
    p.add_argument("--tokens", type=positive_int, default=64, help="new tokens decoded (EOS ignored)")
    p.add_argument("--numerics", default="exact", help="comma-separated: exact, int8 (int8: Q4_0/Q4_1/Q8_0/Q4_K files)")
    p.add_argument("--prompt-tokens", type=positive_int, default=128, help="random prompt ids before them")
    p.add_argument("--seed", type=int, default=0, help="the weights' seed (and the prompt's)")
    p.add_argument("--peer-python", default=None,
                   help="an interpreter with llama-cpp-python: llama.cpp on the same files (skipped without)")
    p.add_argument("--cache-dir", default=None, help="where the random GGUFs are kept (default: specdec's cache)")
    p.add_argument("--max-seconds", type=positive_int, default=None,
                   help="start no new (shape, quant) after this many seconds")
    p.add_argument("--in-process", action="store_true",
                   help="measure specdec in this process, not a fresh one: quicker, but its RSS then counts what "
                        "this process already held (checks the harness; not for figures)")
    p.add_argument("--self-draft", default=None, choices=("float32", "bfloat16"), metavar="DTYPE",
                   help="instead of GGUF files: random-weight targets of each shape in DTYPE, their plain decoding "
                        "beside the quantized self-drafter's (its step costs; specdec.bench.self_draft)")
    p.add_argument("--out", default="results/scaling.json")


def _read(out: Path, key: str = "entries") -> list[dict]:
    """The entries under ``key`` ("entries": the GGUF files'; "self_draft") of the results file, or []."""
    return json.loads(out.read_text(encoding="utf-8")).get(key, []) if out.is_file() else []


def _write(out: Path, key: str, entries: list[dict]) -> None:
    """``entries`` under ``key`` in the results file, atomically, the other key's entries kept."""
    from specdec.bench.peer_llamacpp import write_json

    doc = json.loads(out.read_text(encoding="utf-8")) if out.is_file() else {}
    write_json(out, {**doc, key: entries})


def run(args) -> int:
    import torch
    from rich.console import Console

    from specdec.models import default_gguf_path
    from specdec.quant.write import MIXES, SHAPES, WRITABLE, cached_random_gguf

    for s in args.shapes:
        if s not in SHAPES:
            raise ValueError(f"unknown shape {s!r}: known shapes are {', '.join(SHAPES)}")
    quants = [q.upper() for q in args.quants]
    for q in quants:
        if q not in WRITABLE and q not in MIXES:
            raise ValueError(f"--quants {q.lower()!r}: expected some of "
                             f"{', '.join(w.lower() for w in (*WRITABLE, *MIXES))}")
    cache = Path(args.cache_dir).expanduser() if args.cache_dir else args.runtime.cache_dir / "random-gguf"
    out, console, started = Path(args.out), Console(), time.monotonic()
    out.parent.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(args.seed)
    vocab = min(SHAPES[s].vocab for s in args.shapes)
    prompt = torch.randint(17, vocab, (args.prompt_tokens,), generator=g).tolist()  # past the 17 special ids
    isolate = in_this_process if args.in_process else in_fresh_process
    numerics_list = args.numerics.split(",")
    if any(n not in ("exact", "int8") for n in numerics_list):
        raise ValueError(f"--numerics {args.numerics!r}: expected a comma-separated list of exact, int8")
    if args.self_draft is not None:
        return _self_draft(args, prompt, isolate, out, console)
    entries = _read(out)
    for shape, quant, numerics in ((s, q, n) for s in args.shapes for q in quants for n in numerics_list):
        if args.max_seconds is not None and time.monotonic() - started > args.max_seconds:
            console.print(f"--max-seconds {args.max_seconds} reached: {shape} {quant} and later not run")
            return _finish(console, entries)
        gguf = cached_random_gguf(shape, quant, cache, args.seed, tokenizer_from=default_gguf_path())
        done = [e for e in entries if e["file"] == gguf.name and e["file_bytes"] == gguf.stat().st_size
                and e["tokens"] == args.tokens and e["prompt_tokens"] == args.prompt_tokens
                and e.get("numerics", "exact") == numerics]
        if done:
            console.print(f"{shape} {quant} {numerics}: already in {out}, skipped")
            continue
        entry = entry_for(shape, quant, gguf, prompt, args.tokens, args.runtime.bench_threads, args.peer_python,
                          isolate, numerics)
        if "skipped" in entry["llama.cpp"]:
            console.print(entry["llama.cpp"]["skipped"])
        entries.append(entry)
        _write(out, "entries", entries)
    return _finish(console, entries)


def _self_draft(args, prompt: list[int], isolate, out: Path, console) -> int:
    from specdec.bench import self_draft

    entries = _read(out, "self_draft")
    for shape in args.shapes:
        if any(e["shape"] == shape and e["dtype"] == args.self_draft and e["tokens"] == args.tokens
               and e["prompt_tokens"] == args.prompt_tokens for e in entries):
            console.print(f"{shape} {args.self_draft}: already in {out}, skipped")
            continue
        entries.append(isolate(self_draft.measure, shape, args.self_draft, prompt, args.tokens,
                               args.runtime.bench_threads, args.seed))
        _write(out, "self_draft", entries)
    console.print(self_draft.table(entries))
    return 0


def _finish(console, entries: list[dict]) -> int:
    console.print(table(entries))
    return 0


def table(entries: list[dict]):
    from rich.table import Table

    def mb(b):
        return "-" if b is None else f"{b / 2**20:.0f}"

    def f(x, spec=".1f"):
        return "-" if x is None else format(x, spec)

    t = Table(title="Packed GGUF targets by size: plain decoding (no drafter), RSS grown from before the load")
    for col in ("shape", "quant", "numerics", "params", "file MB", "KV MB", "RSS+ MB", "RSS+ / (file+KV)", "ok",
                "tok/s", "ms/step", "llama.cpp tok/s", "llama.cpp RSS MB"):
        t.add_column(col, justify="left" if col in ("shape", "quant") else "right")
    for e in entries:
        s, peer = e["specdec"], e["llama.cpp"]
        t.add_row(e["shape"], e["quant"], e.get("numerics", "exact"), f"{e['params'] / 1e9:.2f}B", mb(e["file_bytes"]), mb(s["kv_bytes"]),
                  mb(e["rss_growth_bytes"]), f(e["rss_growth_bytes"] / (e["file_bytes"] + s["kv_bytes"]), ".2f"),
                  str(e["rss_ok"]), f(s["decode_tokens_per_s"]), f(s["ms_per_step"]),
                  f(peer.get("decode_tokens_per_s")), mb(peer.get("rss", {}).get("after")))
    return t
