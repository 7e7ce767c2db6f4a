"""Markdown tables of a `specdec bench-device` JSON (what docs/benchmarks.md shows).

    python -m specdec.bench.device.summary docs/device/h200-verify-curves.json [--priced results/priced.json]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict


def verify_table(records: list[dict], points: list[tuple[str, int, int]] | None = None) -> str:
    """Verify seconds over the one-row step's, per (shape, batch, context, steps kind) and rows
    (``points``: (shape, batch, context) to show, each with every steps kind measured)."""
    table: dict[tuple, dict[int, float]] = defaultdict(dict)
    for r in records:
        if "seconds" in r:
            table[(r["shape"], r["batch"], r["context"], r.get("steps", "dynamic"))][r["rows"]] = r["seconds"]
    keys = sorted(table) if points is None else [k for p in points for k in sorted(table) if k[:3] == tuple(p)]
    rows = sorted({q for k in keys for q in table[k]})
    lines = ["| shape | batch | context | steps | 1 row (ms) | " + " | ".join(f"{q} rows" for q in rows[1:]) + " |",
             "|---|---|---|---|---|" + "---|" * (len(rows) - 1)]
    for k in keys:
        t = table[k]
        cells = " | ".join(f"{t[q] / t[rows[0]]:.2f}" if q in t else "" for q in rows[1:])
        lines.append(f"| {k[0]} | {k[1]} | {k[2]} | {k[3]} | {t[rows[0]] * 1e3:.1f} | {cells} |")
    return "\n".join(lines)


def store_table(records: list[dict]) -> str:
    lines = ["| shape | batch | context | BMC step (ms) | DynamicCache step (ms) | DynamicCache / BMC |",
             "|---|---|---|---|---|---|"]
    for r in records:
        if "bmc_seconds" in r:
            lines.append(f"| {r['shape']} | {r['batch']} | {r['context']} | {r['bmc_seconds'] * 1e3:.1f} | "
                         f"{r['dynamic_seconds'] * 1e3:.1f} | {r['dynamic_over_bmc']:.2f} |")
    return "\n".join(lines)


def price_table(records: list[dict], shapes=("8B",), batches=(1, 8, 16, 32, 64)) -> str:
    lines = ["| method | shape | batch | context | steps | best fixed k | tokens / step | verify / plain step | speedup |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        if r["shape"] in shapes and r["batch"] in batches:
            lines.append(f"| {r['method']} | {r['shape']} | {r['batch']} | {r['context']} | "
                         f"{r.get('steps', 'dynamic')} | {r['k']} | "
                         f"{r['tokens_per_step']:.2f} | {r['verify_over_plain']:.2f} | {r['speedup']:.2f}x |")
    return "\n".join(lines)


def exactness_line(records: list[dict]) -> str:
    failed = [f"{r['case']} ({r.get('steps', 'dynamic')})" for r in records if not r["passed"]]
    return f"{len(records) - len(failed)}/{len(records)} exactness cases passed" + \
        (f"; failed: {', '.join(failed)}" if failed else "")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run", help="a bench-device JSON")
    p.add_argument("--priced", help="a bench-device JSON with a price part (else the run's own)")
    args = p.parse_args(argv)
    doc = json.loads(open(args.run).read())
    parts = doc["parts"]
    print(f"{doc.get('gpu', doc['device'])}, torch {doc['torch']}, {doc['started']}")
    if "exactness" in parts:
        print(exactness_line(parts["exactness"]) + "\n")
    if "verify" in parts:
        print(verify_table(parts["verify"]) + "\n")
    if "store" in parts:
        print(store_table(parts["store"]) + "\n")
    priced = json.loads(open(args.priced).read())["parts"] if args.priced else parts
    if "price" in priced:
        print(price_table(priced["price"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
