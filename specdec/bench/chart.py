"""Speedup chart: one group of bars per Spec-Bench task (and overall), one bar per method.

    python -m specdec.bench.chart results/specbench/summary.json [more.json ...] -o speedup.png

Reads the ``summary.json`` of ``specdec specbench`` (methods -> tasks -> speedup) and the ``.json`` of
``specdec bench`` (by_task -> method -> speedup). Baselines (speedup 1 by definition) are left out;
a dashed line marks 1.0x. Needs matplotlib: ``pip install 'specdec[report]'``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specdec.bench.questions import TASKS

BASELINES = {"baseline", "hf-generate"}  # the reference each file's speedups are relative to


def read_speedups(path: str | Path) -> dict[str, dict[str, float]]:
    """method -> {task or "overall": speedup} from one summary file (either format)."""
    s = json.loads(Path(path).read_text())
    out: dict[str, dict[str, float]] = {}
    if "methods" in s:  # specdec specbench
        for m, st in s["methods"].items():
            rows = {t: v["speedup"] for t, v in st["tasks"].items() if v.get("questions")}
            if st["overall"].get("questions"):
                rows["overall"] = st["overall"]["speedup"]
            out[m] = rows
    elif "by_task" in s:  # specdec bench
        for t, per_method in s["by_task"].items():
            for m, v in per_method.items():
                out.setdefault(m, {})[t] = v["speedup"]
        for m, v in s.get("overall", {}).items():
            out.setdefault(m, {})["overall"] = v["speedup"]
    else:
        raise ValueError(f"{path}: not a summary of specdec specbench or specdec bench "
                         "(no 'methods' or 'by_task')")
    return {m: v for m, v in out.items() if m not in BASELINES}


def plot_speedups(summary_json_paths: list[str | Path], out_png: str | Path, title: str | None = None) -> Path:
    """Grouped bar chart of speedup per task per method; returns the PNG's path."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("the chart needs matplotlib: pip install 'specdec[report]'") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    paths = [Path(p) for p in summary_json_paths]
    series: dict[str, dict[str, float]] = {}  # bar label -> {task: speedup}
    for p in paths:
        for m, rows in read_speedups(p).items():
            series[m if len(paths) == 1 else f"{p.parent.name}/{m}"] = rows
    if not series:
        raise ValueError("no method with a speedup in " + ", ".join(map(str, paths)))
    present = {t for rows in series.values() for t in rows}
    tasks = [t for t in TASKS if t in present] + sorted(present - set(TASKS) - {"overall"})
    tasks += ["overall"] if "overall" in present else []

    width = 0.8 / len(series)  # the bars of one task share 80% of the slot
    fig, ax = plt.subplots(figsize=(min(14.0, 2 + len(tasks) * (0.5 + 0.3 * len(series))), 4.2))  # inches
    for i, (label, rows) in enumerate(series.items()):
        xs = [k + (i - (len(series) - 1) / 2) * width for k, t in enumerate(tasks) if t in rows]
        ys = [rows[t] for t in tasks if t in rows]
        bars = ax.bar(xs, ys, width * 0.95, label=label)
        ax.bar_label(bars, labels=[f"{y:.2f}" for y in ys], fontsize=7, padding=2)
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_xticks(range(len(tasks)), tasks, rotation=20, ha="right")
    ax.set_ylabel("speedup over plain decoding (x)")
    ax.set_ylim(0, max(1.2, max(v for rows in series.values() for v in rows.values()) * 1.15))
    ax.set_title(title or "Spec-Bench speedup per task (greedy, lossless)")
    ax.legend(fontsize=8, frameon=False, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specdec.bench.chart", description=__doc__.split("\n")[0])
    p.add_argument("summaries", nargs="+", help="summary.json files")
    p.add_argument("-o", "--out", default="speedup.png")
    p.add_argument("--title", default=None)
    args = p.parse_args(argv)
    print(plot_speedups(args.summaries, args.out, args.title))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
