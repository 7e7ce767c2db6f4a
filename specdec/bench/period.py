"""The BMC period sweep: attention-block time per token over T, at several context lengths and batches.

One attention layer shaped like the default model's (9 query heads, 3 KV heads, head dim 64) on
specdec's BMC store: after a prompt of L tokens, a generation of ``--tokens`` tokens by speculative
steps of ``--rows`` rows (a pending token + drafts) of which a seeded random number is kept (the rows
speculated tokens fill are written into the padding, as in the decoder). Per step: the store's
bias mask, the K/V write, grouped attention over the view, the commit; every ``T`` rows a
reallocation. Periods alternate inside each repeat; the figure is the median over repeats, in
microseconds per generated token; beside it the model's choice (``specdec.controller.period``) from the
costs calibrated on this machine (timed too, if outside the sweep), the measured best of the sweep,
and the time at the model's T over the best's.

    specdec bench-period --lengths 1024,2048,4096,8192 --batches 1,8 --out results/period
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from types import SimpleNamespace

from specdec.forward import grouped_attention
from specdec.kv.bmc import BMCCache, BMCConfig
from specdec.controller.period import PeriodModel, calibrate

HQ, HKV, D = 9, 3, 64  # SmolLM2-135M attention shape
PERIODS = (8, 16, 32, 64, 128, 256, 512)
_MODULE = SimpleNamespace(training=False)  # what grouped_attention reads of an attention module


@torch.inference_mode()
def run_once(T: int, B: int, prompt: int, n: int, rows: int, seed: int = 0) -> float:
    """Seconds for a generation of >= n tokens per row (update + attention + commit + growth)."""
    g = torch.Generator().manual_seed(seed)
    cache = BMCCache(1, B, BMCConfig(T))
    kv = torch.randn(B, HKV, prompt, D, generator=g, dtype=torch.float32)
    cache.load_prefill(0, [(kv[0], kv[0])], capacity=prompt)
    for b in range(1, B):
        cache.load_prefill(b, [(kv[b], kv[b])], capacity=prompt)
    q = torch.randn(B, HQ, rows, D, generator=g, dtype=torch.float32)
    new = torch.randn(B, HKV, rows, D, generator=g, dtype=torch.float32)
    keep = torch.randint(0, rows, (n,), generator=g).tolist()  # accepted drafts per step (all rows alike)
    t = time.perf_counter()
    made = 0
    for a in keep:
        inputs = cache.prepare_chain(rows)
        k, v = cache.update(new, new, 0)
        grouped_attention(_MODULE, q, k, v, inputs.attention_mask)
        cache.commit([list(range(a + 1))] * B)
        made += a + 1
        if made >= n:
            break
    return time.perf_counter() - t


def sweep(lengths, batches, periods=PERIODS, n: int = 512, rows: int = 4, repeats: int = 3,
          on_row=None) -> list[dict]:
    out = []
    for B in batches:
        model = PeriodModel(calibrate(B, HKV, D, layers=1))
        for L in lengths:
            chosen = model.period(L + n, L)
            ts = sorted(set(periods) | {chosen})  # the model's T is timed too, swept or not
            times = {T: [] for T in ts}
            for r in range(repeats):
                for T in ts[r % len(ts):] + ts[: r % len(ts)]:  # rotate: noise hits every T
                    times[T].append(run_once(T, B, L, n, rows, seed=r))
            us = {T: statistics.median(v) / n * 1e6 for T, v in times.items()}
            best = min((T for T in periods), key=us.get)  # the best of the sweep's own periods
            row = {"batch": B, "length": L, "tokens": n, "rows": rows, "us_per_token": us, "best": best,
                   "model": chosen, "model_vs_best": us[chosen] / us[best],
                   "c_copy_ns": model.costs.copy * 1e9, "c_pad_ns": model.costs.pad * 1e9}
            out.append(row)
            if on_row:
                on_row(row)
    return out


def add_arguments(p) -> None:
    from specdec.arguments import int_list, positive_int

    p.add_argument("--lengths", type=int_list, default="1024,2048,4096,8192", help="prompt (context) lengths")
    p.add_argument("--batches", type=int_list, default="1,8")
    p.add_argument("--tokens", type=positive_int, default=512, help="generated tokens per run")
    p.add_argument("--rows", type=positive_int, default=4, help="rows per step (pending + drafts)")
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--out", default="results/period", help="writes OUT.json and OUT.png")


def run(args) -> int:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    lengths, batches = args.lengths, args.batches
    rows = sweep(lengths, batches, n=args.tokens, rows=args.rows, repeats=args.repeats,
                 on_row=lambda r: console.print(f"B={r['batch']} L={r['length']}: best T={r['best']}, "
                                                f"model T*={r['model']}"))
    table = Table(title=f"BMC attention block, us per token ({args.tokens} tokens, {args.rows}-row steps, "
                        f"median of {args.repeats})")
    for col in ["B", "L"] + [f"T={T}" for T in PERIODS] + ["best", "model T*", "time at T* / best"]:
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["batch"]), str(r["length"]), *[f"{r['us_per_token'][T]:.0f}" for T in PERIODS],
                      str(r["best"]), str(r["model"]), f"{r['model_vs_best']:.2f}")
    console.print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    _plot(rows, out.with_suffix(".png"))
    console.print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return 0


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(5.5 * len(batches), 4), squeeze=False)
    for ax, B in zip(axes[0], batches):
        for r in (r for r in rows if r["batch"] == B):
            us = {int(T): v for T, v in r["us_per_token"].items()}
            Ts = sorted(us)
            ys = [us[T] / us[r["best"]] for T in Ts]
            line, = ax.plot(Ts, ys, marker="o", label=f"L = {r['length']}")
            ax.plot([r["model"]], [us[r["model"]] / us[r["best"]]], marker="*", markersize=14,
                    color=line.get_color())
        ax.set_xscale("log", base=2)
        ax.set_xlabel("period T (rows per allocation)")
        ax.set_ylabel("time per token / best")
        ax.set_title(f"batch {B} (star: the model's T*)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
