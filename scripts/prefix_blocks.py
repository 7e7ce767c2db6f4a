"""What the prefix cache's block size costs a prefill that reuses nothing, and what a reuse saves
(docs/decisions/021-prefix-cache.md): seconds to prefill one prompt of --tokens tokens of the default model
in one forward (no cache) and in aligned blocks of each --blocks size, cold and with all its whole blocks
before the last reused; the fastest of --repeats each, on an otherwise idle machine.

    python scripts/prefix_blocks.py --tokens 1600 --blocks 32,64,128,256 --weights packed --threads 2
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from specdec.decoder import SpecDecoder
from specdec.forward import prefill, prefill_aligned
from specdec.models import load_model


def fastest(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--weights", default="packed")
    ap.add_argument("--tokens", type=int, default=1600)
    ap.add_argument("--blocks", default="32,64,128,256")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="JSON file for the figures")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model, weights=args.weights).model
    vocab = model.get_input_embeddings().weight.shape[0] if hasattr(model.get_input_embeddings(), "weight") else 32000
    ids = torch.randint(1, min(vocab, 32000), (args.tokens,), generator=torch.Generator().manual_seed(0))
    decoder = SpecDecoder(model)
    rows = {}
    with decoder.running():
        prefill(model, ids[None, :64])  # first calls (kernel builds, route checks) out of the timings
        rows["one forward"] = {"cold_s": fastest(lambda: prefill(model, ids[None]), args.repeats)}
        for block in (int(b) for b in args.blocks.split(",")):
            cold = prefill_aligned(model, ids, block)
            n = (args.tokens - 1) // block * block
            hit = [(k[0, :, :n], v[0, :, :n]) for k, v in cold.layers]
            rows[f"blocks of {block}"] = {
                "cold_s": fastest(lambda: prefill_aligned(model, ids, block), args.repeats),
                "reused_tokens": n,
                "warm_s": fastest(lambda: prefill_aligned(model, ids, block, hit), args.repeats)}
    for name, r in rows.items():
        warm = f", {r['reused_tokens']} reused: {r['warm_s']:.3f} s" if "warm_s" in r else ""
        print(f"{name:>14}: cold {r['cold_s']:.3f} s{warm}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"config": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
