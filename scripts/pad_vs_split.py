"""PAD vs SPLIT attention for a ragged batch: one verify step's time on the default model.

    python scripts/pad_vs_split.py --lengths 200,200,200,200 200,4000 200,200,200,4000 --q 1,4

Each lengths set is one batch (comma-separated committed lengths per row); the store is filled by a
prefill of random tokens, then a q-token block per row is timed with PAD (one batched attention over
max(lengths) + q columns, masked) and SPLIT (attention per row over its own columns), alternating,
median of --repeats. Prints the padded fraction of PAD's columns (what `auto` decides on) beside the
ratio SPLIT / PAD.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdec.runtime import kernels
from specdec.forward import forward_block, prefill
from specdec.kv.bmc import BMCCache, BMCConfig
from specdec.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", nargs="+", default=["200,200,200,200", "200,4000", "200,200,200,4000",
                                                      "1000,2000", "500,500,500,500,500,500,500,4000"])
    ap.add_argument("--q", default="1,4")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    model = load_model("default").model
    kernels.prepare()
    g = torch.Generator().manual_seed(0)
    print(f"{'lengths':>36} {'q':>3} {'padded':>7} {'PAD ms':>8} {'SPLIT ms':>9} {'SPLIT/PAD':>9}")
    with torch.inference_mode(), kernels.skinny_linears(model):
        for spec in args.lengths:
            lengths = [int(x) for x in spec.split(",")]
            cache = BMCCache.for_model(model, len(lengths), BMCConfig(64))
            for b, n in enumerate(lengths):
                pre = prefill(model, torch.randint(100, 20000, (1, n), generator=g))
                cache.load_prefill(b, [(k[0], v[0]) for k, v in pre.layers], capacity=max(lengths) + 64)
            for q in (int(x) for x in args.q.split(",")):
                ids = torch.randint(100, 20000, (len(lengths), q), generator=g)
                times = {False: [], True: []}
                for r in range(args.repeats + 1):
                    for split in ((False, True) if r % 2 else (True, False)):
                        t = time.perf_counter()
                        forward_block(model, cache, ids, None, None, split=split)
                        dt = time.perf_counter() - t
                        cache.commit([[]] * len(lengths))  # keep nothing: the store is unchanged
                        if r:  # the first round warms up
                            times[split].append(dt)
                pad, split = statistics.median(times[False]), statistics.median(times[True])
                padded = 1 - sum(n + q for n in lengths) / (len(lengths) * (max(lengths) + q))
                print(f"{spec:>36} {q:>3} {padded:>7.2f} {pad * 1e3:>8.1f} {split * 1e3:>9.1f} {split / pad:>9.2f}")


if __name__ == "__main__":
    main()
