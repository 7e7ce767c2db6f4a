"""Verify-cost curve: one target forward over q tokens at a fixed context, relative to q = 1.

What a drafted token costs to check decides how many are worth drafting (the controller measures the
same curve at run time). Methods, each over the same context of ``--context`` tokens:

    hf          plain HF forward on a DynamicCache, causal mask (a copy of the context's cache per call)
    bmc-chain   specdec's verify forward on the BMC store, causal fast path (chains)
    bmc-tree    the same with a tree's general mask (the ancestor mask of a chain, built per call)
    skinny-chain, skinny-tree   the same two with specdec.runtime.kernels' few-row linear path (what
                SpecDecoder runs on CPU): the "after" of the curve, the three above its "before"

Methods and block sizes alternate inside each repeat; figures are medians over repeats.

``--in-decoder`` measures the same curve in place: ``SpecDecoder.generate`` on a batch of ``--batch``
prompts of ``--context`` tokens with a drafter that proposes a fixed draft of q - 1 tokens per row
every step (a chain, or with ``--tree`` a star: every node a child of the pending token, the general
mask path), so each step's verify time is everything a real step pays besides drafting: the mask,
the forward, the lm_head, the verification and the commit. ``--profile`` adds the top ops per step.
``--weights`` loads the target as ``specdec generate`` does (``packed``: a GGUF's blocks through the
block kernel), in place only: the single-forward methods above are fp32 paths.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from specdec.config import current as current_runtime
from specdec.config import use
from specdec.patch import skinny_linears
from specdec.runtime import kernels
from specdec.controller import DraftLengthConfig
from specdec.drafters.base import Capabilities, Drafter
from specdec.forward import cache_arg, forward_block
from specdec.kv.bmc import BMCCache
from specdec.tree import DraftTree, chain_mask

SIZES = (1, 2, 4, 8, 16, 32)
METHODS = ("hf", "bmc-chain", "bmc-tree", "skinny-chain", "skinny-tree")


def _context(model, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(100, model.config.vocab_size - 1, (1, n), generator=g).to(model.device)


@torch.inference_mode()
def measure(model, context: int = 200, sizes=SIZES, repeats: int = 20) -> dict:
    """Median seconds of one forward over q tokens after `context` tokens, per method and q."""
    ids = _context(model, context + max(sizes))
    prompt, block = ids[:, :context], ids[:, context:]
    hf_cache = DynamicCache()
    model(input_ids=prompt, use_cache=True, **{cache_arg(model): hf_cache})
    bmc = BMCCache.for_model(model, 1)
    forward_block(model, bmc, prompt, None, None)
    bmc.commit([list(range(context))])

    def hf(q):
        cache = copy.deepcopy(hf_cache)  # a fresh context each call (crop is not on every layer type)
        t = time.perf_counter()
        model(input_ids=block[:, :q], use_cache=True, **{cache_arg(model): cache})
        return time.perf_counter() - t

    def chain(q):
        t = time.perf_counter()
        forward_block(model, bmc, block[:, :q], None, None)
        t = time.perf_counter() - t
        bmc.rollback([context])
        return t

    def tree(q):
        t = time.perf_counter()
        mask = chain_mask(1, q, model.device)
        forward_block(model, bmc, block[:, :q], mask, torch.arange(q, device=model.device)[None])
        t = time.perf_counter() - t
        bmc.rollback([context])
        return t

    def skinny(f):
        def g(q):
            with skinny_linears(model):
                return f(q)
        return g

    run = {"hf": hf, "bmc-chain": chain, "bmc-tree": tree, "skinny-chain": skinny(chain), "skinny-tree": skinny(tree)}
    times = {m: {q: [] for q in sizes} for m in METHODS}
    for m in METHODS:  # warm-up
        for q in sizes:
            run[m](q)
    for r in range(repeats):
        for q in (sizes if r % 2 == 0 else sizes[::-1]):
            for m in (METHODS if r % 2 == 0 else METHODS[::-1]):
                times[m][q].append(run[m](q))
    return {m: {q: statistics.median(ts) for q, ts in per.items()} for m, per in times.items()}


class FixedDraft(Drafter):
    """Proposes the same q - 1 tokens for every row at every step (a chain or a star): a drafter whose
    only effect is the verify block's size, for timing it inside the decoder."""

    capabilities = Capabilities(sizes_own_tree=True, batches=True)

    def __init__(self, nodes: int, tree: bool = False, token: int = 17) -> None:
        self.nodes, self.tree, self.token, self.rows = nodes, tree, token, 0

    def begin(self, prompt) -> None:
        self.rows = len(prompt.lengths)

    def propose(self, budget: int) -> DraftTree:
        n = min(self.nodes, budget)
        tokens = torch.full((self.rows, n), self.token, dtype=torch.long)
        if not self.tree:
            return DraftTree.chain(tokens)
        parents = torch.full((self.rows, n), -1, dtype=torch.long)
        return DraftTree(tokens, parents, torch.full((self.rows,), n, dtype=torch.long))

    def accept(self, commit) -> None:
        pass

    def select(self, rows: list[int]) -> None:
        self.rows = len(rows)


@torch.inference_mode()
def measure_in_decoder(model, context: int = 200, sizes=SIZES, repeats: int = 3, batch: int = 1,
                       steps: int = 16, tree: bool = False, profile_top: int = 0, say=print) -> dict:
    """Median verify seconds of a decoder step with q - 1 drafted tokens per row, per q (sizes
    alternate within each repeat); with profile_top, the ops that take the most time per step."""
    from specdec.decoder import SpecDecoder, SpecDecoderConfig

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, model.config.vocab_size - 1, (context,), generator=g) for _ in range(batch)]
    config = SpecDecoderConfig(draft_length=DraftLengthConfig(cost_aware=False, adaptive=False))
    decoders = {q: SpecDecoder(model, FixedDraft(q - 1, tree) if q > 1 else None, config) for q in sizes}
    times: dict[int, list[float]] = {q: [] for q in sizes}
    for r in range(repeats + 1):  # the first round warms up
        for q in (sizes if r % 2 == 0 else sizes[::-1]):
            out = decoders[q].generate(prompts, max_new_tokens=steps * q, eos_token_id=[-1])
            if r:
                times[q].extend(s.verify_time for s in out.steps[2:])  # past the prefill and first step
    if profile_top:
        from torch.profiler import ProfilerActivity, profile

        for q in sizes:
            prof, started = profile(activities=[ProfilerActivity.CPU]), []

            def start(_event):
                if not started:  # after the prefill: only decode steps are profiled
                    prof.start()
                    started.append(True)

            out = decoders[q].generate(prompts, max_new_tokens=steps * q, eos_token_id=[-1], callback=start)
            prof.stop()
            n = len(out.steps) - 1
            top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:profile_top]
            say(f"q = {q}: " + ", ".join(f"{e.key} {e.self_cpu_time_total / 1e3 / n:.1f} ms" for e in top))
    return {q: statistics.median(ts) for q, ts in times.items()}


def add_arguments(p) -> None:
    from specdec.arguments import add_numerics_argument, non_negative_int, positive_int
    from specdec.models import WEIGHTS

    p.add_argument("--model", default="default", help="'default', a .gguf file or a HF model directory")
    p.add_argument("--weights", choices=WEIGHTS, default="fp32",
                   help="the target's weights, as for `specdec generate` (packed: a GGUF's blocks kept "
                        "packed); other than fp32 only with --in-decoder")
    add_numerics_argument(p)
    p.add_argument("--context", type=non_negative_int, default=200, help="tokens already in the cache")
    p.add_argument("--repeats", type=positive_int, default=20)
    p.add_argument("--sizes", default=",".join(map(str, SIZES)), help="block sizes q, comma-separated")
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    p.add_argument("--kernel", default=None, choices=["native", "avx2", "off"],
                   help="kernel variant (SPECDEC_KERNEL): avx2 builds the 8-float shape even on AVX-512")
    p.add_argument("--in-decoder", action="store_true",
                   help="time whole decoder steps with q - 1 drafted tokens per row (the curve in place)")
    p.add_argument("--batch", type=positive_int, default=1, help="--in-decoder: sequences per batch")
    p.add_argument("--tree", action="store_true", help="--in-decoder: a star-shaped tree (general mask path)")
    p.add_argument("--profile", type=non_negative_int, default=0, metavar="N", help="--in-decoder: print the top N ops per step")


def run(args) -> int:
    runtime = current_runtime()
    if args.kernel:  # this command's variant: the runtime the rest runs under
        runtime = dataclasses.replace(runtime, kernel=args.kernel)
    with use(runtime):
        return _run(args)


def _run(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from specdec.models import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    try:  # before the model loads: a typo should not cost a load
        sizes = tuple(int(q) for q in args.sizes.split(","))
        if min(sizes) < 1:
            raise ValueError
    except ValueError:
        raise ValueError(f"--sizes: positive block sizes, comma-separated (got {args.sizes!r})") from None
    if args.weights != "fp32" and not args.in_decoder:
        raise ValueError(f"--weights {args.weights}: only with --in-decoder (the single-forward methods are "
                         "fp32 paths)")
    model = load_model(args.model, weights=args.weights, numerics=args.numerics).model.eval()
    kernels.prepare()
    routes = kernels.routes()
    if args.in_decoder:
        return _run_in_decoder(model, args, sizes)
    med = measure(model, args.context, sizes, args.repeats)
    table = Table(title=f"target forward over q tokens, {args.context}-token context, "
                        f"{torch.get_num_threads()} threads (median of {args.repeats}; ratio = time over "
                        f"hf's 1-token forward)")
    table.add_column("q", justify="right")
    for m in METHODS:
        table.add_column(f"{m} ms", justify="right")
        table.add_column("ratio", justify="right")
    base = med["hf"][1]
    for q in sizes:
        table.add_row(str(q), *[x for m in METHODS for x in (f"{med[m][q] * 1e3:.1f}", f"{med[m][q] / base:.2f}x")])
    Console(width=200).print(table)
    Console(width=200).print(f"kernel {kernels.variant()} (lanes "
                             f"{kernels.extension().lanes() if kernels.extension() else '-'}); routes per "
                             f"block size 1..{kernels.MAX_ROWS} after the self-check: {' '.join(routes)}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"context": args.context, "threads": torch.get_num_threads(),
                                              "repeats": args.repeats, "kernel": kernels.variant(),
                                              "routes": routes, "seconds": med}, indent=1))
    return 0


def _run_in_decoder(model, args, sizes) -> int:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=200)
    repeats = min(args.repeats, 5)  # each repeat is a whole generation per size
    med = measure_in_decoder(model, args.context, sizes, repeats, args.batch, tree=args.tree,
                             profile_top=args.profile, say=console.print)
    shape = "star tree" if args.tree else "chain"
    table = Table(title=f"decoder step with q - 1 drafted tokens ({shape}) per row, batch {args.batch}, "
                        f"{args.weights} weights, {args.context}-token context, {torch.get_num_threads()} threads "
                        f"(median over {repeats} runs; ratio = over the q = 1 step)")
    for col in ("q", "rows", "verify ms", "ratio"):
        table.add_column(col, justify="right")
    base = med[sizes[0]] if sizes[0] == 1 else None
    for q in sizes:
        table.add_row(str(q), str(q * args.batch), f"{med[q] * 1e3:.1f}", "-" if base is None else f"{med[q] / base:.2f}x")
    console.print(table)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"in_decoder": True, "weights": args.weights, "context": args.context,
                                              "batch": args.batch, "tree": args.tree,
                                              "threads": torch.get_num_threads(), "routes": kernels.routes(),
                                              "seconds": med}, indent=1))
    return 0
