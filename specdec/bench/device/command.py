"""`specdec bench-device`: one prepared run on an accelerator, JSON out, within a time budget.

    specdec bench-device --dry-run                       # what it would run, here, in a second
    specdec bench-device --device cuda --out results/device.json --budget-s 450

Parts, in this order, each writing its records into OUT as they come (the file is rewritten whole,
atomically, after every record: a run cut short keeps everything it measured):

    exactness   the tiny-model exactness suite on the device (``exactness.py``), per ``--steps`` kind
    verify      verify-cost curves, random-weight Llama shapes (``costs.verify_curves``), per ``--steps``
                kind: BMC's store, and static steps (``kv.static``, CUDA graphs on a GPU)
    store       BMC vs DynamicCache decode steps at long contexts (``costs.store_steps``)
    price       ``--traces`` (CPU-recorded acceptance) priced by the verify curves (``pricing.py``)

Each part gets a share of ``--budget-s``; a grid point past its part's deadline is recorded as
skipped ("time budget"), so the run ends on time whatever the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from specdec.bench.device import costs, exactness, pricing
from specdec.kv.static import StaticShapes

PARTS = ("exactness", "verify", "store", "price")
STEPS = ("dynamic", "static")
SHARES = {"exactness": 0.2, "verify": 0.55, "store": 0.25}  # of the budget left when the part starts
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DEFAULT_TRACES = Path(__file__).resolve().parents[3] / "data" / "device_traces.json"


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"must be positive integers, got {text!r}")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cuda", help="torch device (cuda, cuda:1, cpu for a small rehearsal)")
    p.add_argument("--out", default="results/device.json", help="JSON written as the run goes")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    p.add_argument("--shapes", default="135M,1B,8B", help=f"of {', '.join(costs.SHAPES)}")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="of the random-weight shapes")
    p.add_argument("--rows", type=_ints, default=costs.ROWS, help="rows per sequence of a verify block")
    p.add_argument("--batches", type=_ints, default=costs.BATCHES)
    p.add_argument("--contexts", type=_ints, default=costs.CONTEXTS)
    p.add_argument("--store-shape", default="1B", help="the shape of the BMC vs DynamicCache steps")
    p.add_argument("--store-batches", type=_ints, default=(16, 32, 64))
    p.add_argument("--store-contexts", type=_ints, default=(8192, 16384, 32768))
    p.add_argument("--samples", type=int, default=exactness.SAMPLES, help="generations per sampling case")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per grid point (median)")
    p.add_argument("--traces", default=str(DEFAULT_TRACES), help="acceptance traces to price (traces.py)")
    p.add_argument("--curves", default=None, help="price by the verify curves of an earlier run's JSON "
                                                  "(--parts price without verify: a GPU's curves, priced anywhere)")
    p.add_argument("--budget-s", type=float, default=450.0, help="seconds the whole run may take")
    p.add_argument("--steps", default="dynamic,static", help=f"of {', '.join(STEPS)}: the target's steps on BMC's "
                   "store, and static ones (kv.static: captured as CUDA graphs on a GPU), for exactness and verify")
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit")


def _check(args) -> list[str]:
    parts = args.parts.split(",")
    if unknown := [x for x in parts if x not in PARTS]:
        raise ValueError(f"--parts: unknown {', '.join(unknown)} (known: {', '.join(PARTS)})")
    shapes = args.shapes.split(",")
    if unknown := [x for x in shapes + [args.store_shape] if x not in costs.SHAPES]:
        raise ValueError(f"--shapes: unknown {', '.join(unknown)} (known: {', '.join(costs.SHAPES)})")
    if "price" in parts and "verify" not in parts and not args.curves:
        raise ValueError("--parts: price needs verify, or --curves from an earlier run (it prices traces by "
                         "the verify curves)")
    if unknown := [x for x in args.steps.split(",") if x not in STEPS]:
        raise ValueError(f"--steps: unknown {', '.join(unknown)} (known: {', '.join(STEPS)})")
    if args.budget_s <= 0 or args.samples < 1 or args.repeats < 1:
        raise ValueError("--budget-s, --samples and --repeats must be positive")
    return parts


def plan(args, parts: list[str]) -> list[str]:
    """Lines saying what the run would do."""
    shapes = args.shapes.split(",")
    lines = [f"device {args.device}, budget {args.budget_s:.0f} s, out {args.out}"]
    if "exactness" in parts:
        names = list(exactness.cases("cpu", args.samples))
        lines.append(f"exactness: {len(names)} cases ({', '.join(names)}), {args.samples} samples per sampling case, "
                     f"steps {args.steps}")
    if "verify" in parts:
        points = len(shapes) * len(args.batches) * len(args.contexts)
        lines.append(f"verify: shapes {', '.join(shapes)} x batch {args.batches} x context {args.contexts} "
                     f"x rows {args.rows} x steps {args.steps} ({points * len(args.rows) * len(args.steps.split(','))} "
                     f"points, {args.dtype}; too big for memory: skipped)")
        for name in shapes:
            s = costs.SHAPES[name]
            big = s.kv_bytes(max(args.batches) * max(args.contexts), DTYPES[args.dtype]) / 2**30
            lines.append(f"  {name}: {s}; K/V at the largest point {big:.0f} GiB")
    if "store" in parts:
        lines.append(f"store: {args.store_shape}, BMC vs DynamicCache decode step, batch {args.store_batches} "
                     f"x context {args.store_contexts}")
    if "price" in parts:
        traces = Path(args.traces)
        what = ", ".join(json.loads(traces.read_text())["methods"]) if traces.is_file() else "MISSING: skipped"
        lines.append(f"price: traces {traces} ({what}) by the verify curves")
    return lines


class Report:
    """The run's JSON document, rewritten atomically after every record."""

    def __init__(self, path: str, header: dict) -> None:
        self.path = Path(path)
        self.doc = {**header, "parts": {}}

    def add(self, part: str, record: dict) -> None:
        self.doc["parts"].setdefault(part, []).append(record)
        print(f"{part}: {json.dumps(record)}", flush=True)
        self.write()

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.doc, indent=1))
        os.replace(tmp, self.path)


def _header(device: torch.device) -> dict:
    info = {"device": str(device), "torch": torch.__version__, "host": platform.processor() or platform.machine(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda)
    return info


def run(args) -> int:
    parts = _check(args)
    if args.dry_run:
        print("\n".join(plan(args, parts)))
        return 0
    device = torch.device(args.device)
    on_device = [p for p in parts if p != "price"]  # pricing is arithmetic: it runs anywhere
    if on_device and device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: CUDA is not available here (--dry-run prints the plan)")
    report = Report(args.out, _header(device if on_device else torch.device("cpu")))
    end = time.perf_counter() + args.budget_s

    def deadline(part: str) -> float:
        later = [p for p in parts[parts.index(part) + 1:] if p in SHARES]
        share = SHARES[part] / (SHARES[part] + sum(SHARES[p] for p in later))
        return time.perf_counter() + share * max(0.0, end - time.perf_counter())

    steps = args.steps.split(",")
    if "exactness" in parts:
        records = [r for kind in steps for r in exactness.run(
            device, samples=args.samples, report=lambda r: report.add("exactness", r),
            static=StaticShapes() if kind == "static" else None)]
        report.doc["exactness_passed"] = all(r["passed"] for r in records)
    if "verify" in parts:
        for r in costs.verify_curves(device, args.shapes.split(","), DTYPES[args.dtype], rows=args.rows, batches=args.batches,
                                     contexts=args.contexts, repeats=args.repeats, deadline=deadline("verify"),
                                     steps=tuple(steps)):
            report.add("verify", r)
    if "store" in parts:
        for r in costs.store_steps(device, args.store_shape, DTYPES[args.dtype], batches=args.store_batches,
                                   contexts=args.store_contexts, repeats=args.repeats, deadline=deadline("store")):
            report.add("store", r)
    if "price" in parts:
        traces = Path(args.traces)
        if traces.is_file():
            methods = json.loads(traces.read_text())["methods"]
            curves = report.doc["parts"].get("verify", [])
            if args.curves:
                source = json.loads(Path(args.curves).read_text())
                curves = source["parts"]["verify"]
                report.doc["curves_from"] = {k: v for k, v in source.items() if k != "parts"}
            for r in pricing.price_all(methods, curves):
                report.add("price", r)
        else:
            report.doc["price_skipped"] = f"no traces at {traces}"
    report.doc["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    report.write()
    return 0 if report.doc.get("exactness_passed", True) else 1
