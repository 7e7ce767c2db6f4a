"""Is one method faster than another beyond the noise? Paired speed ratios with bootstrap intervals.

    python -m specdec.bench.compare results/bench.jsonl auto prompt-lookup,suffix,suffix-corpus
    python -m specdec.bench.compare results/longctx.jsonl auto suffix,prompt-lookup --decode

Reads the records of ``specdec bench`` (one per question and method) or ``specdec bench-longctx``
(one per prompt and method) and, per Spec-Bench task (or prompt length) and overall, prints method
A's speed over each other method's, both timed on the same questions in the same process:
sum(tokens) / sum(seconds) of A over the same for B, with a 95% interval from resampling the
questions (a percentile bootstrap, seeded). The interval holds what one run can say about the
questions' spread, not the machine's drift between runs: on the Xeon, `auto` over suffix-corpus on
rag and summarization went from -6% to +1% between two runs of the same code (3 and 4 questions a
task). ``--best`` compares A with the fastest of the others in each group (chosen on the whole
sample, which favours it).
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path

from specdec.bench.questions import task_of


@dataclass(frozen=True)
class Ratio:
    group: str
    other: str
    units: int  # questions (prompts) both methods ran
    ratio: float  # A's tokens per second over the other's
    low: float  # 95% bootstrap interval
    high: float

    @property
    def verdict(self) -> str:
        return "faster" if self.low > 1 else "slower" if self.high < 1 else "level"


def _speed(units) -> float:
    units = list(units)
    return sum(t for t, _ in units) / sum(s for _, s in units)


def speed_ratio(a: list[tuple[int, float]], b: list[tuple[int, float]]) -> float:
    """(tokens, seconds) per unit, paired: A's total tokens/s over B's. Example: a [(10, 1), (10, 1)],
    b [(10, 2), (10, 2)] -> 2.0."""
    return _speed(a) / _speed(b)


def paired_ratio(a: list[tuple[int, float]], b: list[tuple[int, float]], resamples: int = 2000,
                 seed: int = 0) -> tuple[float, float, float]:
    """``speed_ratio`` and its 95% percentile-bootstrap interval: the units (questions) are drawn with
    replacement, the same draw for both methods (they are paired)."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired_ratio needs the same non-zero number of units, got {len(a)} and {len(b)}")
    rng, n = random.Random(seed), len(a)
    draws = []
    for _ in range(resamples):
        idx = [rng.randrange(n) for _ in range(n)]
        draws.append(speed_ratio([a[i] for i in idx], [b[i] for i in idx]))
    draws.sort()
    return speed_ratio(a, b), draws[int(0.025 * (resamples - 1))], draws[int(0.975 * (resamples - 1))]


def read_records(path: str | Path, decode: bool = False) -> dict[str, dict[str, dict[str, tuple[int, float]]]]:
    """group -> method -> unit -> (tokens, seconds) from a ``specdec bench`` or ``bench-longctx`` .jsonl
    (``decode``: seconds after the first token, long-context records only). Only a bench's first pass."""
    out: dict[str, dict[str, dict[str, tuple[int, float]]]] = {}
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            if "question_id" in r:  # specdec bench
                if r.get("pass", 1) != 1:
                    continue
                group, unit, seconds = task_of(r["category"]), str(r["question_id"]), r["seconds"]
            else:  # specdec bench-longctx
                group, unit = f"{r['length']} tokens", f"{r['prompt']}/{r['batch']}"
                seconds = r["seconds"] - r["ttft"] if decode else r["seconds"]
            out.setdefault(group, {}).setdefault(r["method"], {})[unit] = (r["new_tokens"], seconds)
        except (KeyError, TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}:{i}: not a record of specdec bench or bench-longctx ({e!r})") from None
    if not out:
        raise ValueError(f"{path}: no records")
    return out


def compare(groups: dict[str, dict[str, dict[str, tuple[int, float]]]], a: str, others: list[str],
            best: bool = False, resamples: int = 2000, seed: int = 0) -> list[Ratio]:
    """A against each of ``others`` (or, ``best``, the fastest of them) per group and overall, on the
    units both ran."""
    methods = {m for per in groups.values() for m in per}
    missing = [m for m in [a, *others] if m not in methods]
    if missing:
        raise ValueError(f"no records of {', '.join(missing)}; the file has {', '.join(sorted(methods))}")
    overall: dict[str, dict[str, tuple[int, float]]] = {}
    for g, per in groups.items():
        for m, units in per.items():
            overall.setdefault(m, {}).update({f"{g}/{u}": v for u, v in units.items()})
    out = []
    for g, per in [*sorted(groups.items()), ("overall", overall)]:
        if a not in per:
            continue
        cands = [m for m in others if m in per]
        if best and cands:
            cands = [max(cands, key=lambda m: _speed(per[m].values()))]
        for m in cands:
            units = sorted(set(per[a]) & set(per[m]))
            if not units:
                continue
            r, lo, hi = paired_ratio([per[a][u] for u in units], [per[m][u] for u in units], resamples, seed)
            out.append(Ratio(g, m, len(units), r, lo, hi))
    return out


def main(argv: list[str] | None = None) -> int:
    from specdec.arguments import positive_int

    p = argparse.ArgumentParser(prog="python -m specdec.bench.compare", description=__doc__.split("\n")[0])
    p.add_argument("records", help="a .jsonl of specdec bench or specdec bench-longctx")
    p.add_argument("method", help="method A, e.g. auto")
    p.add_argument("others", help="comma-separated methods to compare A with")
    p.add_argument("--best", action="store_true", help="per group, only the fastest of the others")
    p.add_argument("--decode", action="store_true", help="long-context records: decode-phase seconds")
    p.add_argument("--resamples", type=positive_int, default=2000)
    args = p.parse_args(argv)
    from rich.console import Console
    from rich.table import Table

    rows = compare(read_records(args.records, args.decode), args.method, args.others.split(","), args.best,
                   args.resamples)
    table = Table(title=f"{args.method}'s tokens/s over the other's, same questions (95% bootstrap interval)")
    for col in ("group", "vs", "units", "ratio", "interval", "verdict"):
        table.add_column(col, justify="right" if col in ("units", "ratio") else "left")
    for r in rows:
        table.add_row(r.group, r.other, str(r.units), f"{r.ratio:.3f}", f"{r.low:.3f}-{r.high:.3f}", r.verdict)
    Console().print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
