"""CPU-recorded acceptance priced by accelerator step costs: the speedup a regime would give.

Acceptance is a property of the target, the drafter and the text, not of the machine; the step's
cost is the machine's. So a trace recorded once on the CPU with the real model (``traces.py``) and
a verify-cost curve measured on a GPU with random weights (``costs.verify_curves``) give the speedup
that drafter would reach on that GPU:

    speedup(k) = E[tokens a step gains] * t(1 row) / (t(1 + k rows) + draft(k))

at each (shape, batch, context) of the curve, for the fixed draft length k that is best there (an
oracle fixed k, which the controller approaches; k = 0 is plain decoding, speedup 1). Every row of a
batch verifies the same 1 + k rows and gains its own accepted tokens (BASS's ragged acceptance),
so the per-row expectation prices any batch size. Two kinds of trace:

    chain   per answer position s, runs[s]: how many tokens of a depth-d chain drafted there the
            target accepts (prompt lookup, StreamingLLM self-speculation): any k <= d is priced
    steps   per step of a replay at a fixed tree size: (nodes verified, tokens accepted) (suffix
            trees, auto's text sources): priced at that size only

Drafts cost nothing for text drafters (host-side, overlapped with nothing: a lower bound on their
cost); self-speculation's k draft steps each cost a one-row forward over its KV budget, priced from
the curve's shortest context (an upper bound when the budget is shorter).
Worked example: runs [3, 0, 5, ...] at k = 2 gain 3, 1, 3, ... tokens per step.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdec.bench.replay import step_cost

# what the papers report for the regimes priced here, printed beside the figures
PAPERS = {
    "magicdec": "MagicDec (Chen et al. 2024): up to ~2x with StreamingLLM self-speculation, 7-8B targets, "
                "batch 32-256, contexts 8k-32k (A100s)",
    "bass": "BASS (Qian et al. 2024): 2.15x at batch 8 with a draft model, 7B-class targets (A100)",
}


LONG = 8  # self-speculation is priced where the context is at least this many times its KV budget


@dataclass(frozen=True)
class Curve:
    """Verify seconds per (batch, context, rows) of one shape, linear in rows between measured sizes."""

    seconds: dict[tuple[int, int], dict[int, float]]  # (batch, context) -> rows -> seconds

    @classmethod
    def from_records(cls, records: list[dict], shape: str) -> "Curve":
        table: dict[tuple[int, int], dict[int, float]] = {}
        for r in records:
            if r.get("shape") == shape and "seconds" in r:
                table.setdefault((r["batch"], r["context"]), {})[r["rows"]] = r["seconds"]
        return cls(table)

    def points(self) -> list[tuple[int, int]]:
        return sorted(self.seconds)

    def at(self, batch: int, context: int, rows: int) -> float:
        """Seconds of a verify of ``rows`` rows; between measured sizes linear, past the largest flat
        per row beyond it (proportional). Example: {1: 1.0, 4: 1.3}, rows 2 -> 1.1."""
        curve = self.seconds[(batch, context)]
        largest = max(curve)
        return curve[largest] * rows / largest if rows > largest else step_cost(curve, rows)


def chain_gain(answers: list[dict], k: int) -> tuple[int, int]:
    """(tokens, steps) of replaying every answer with chains of k, the prefill counted as a step
    (as tau counts it). runs[s]: tokens of a chain drafted after answer token s that the target
    accepts; a step there gains min(k, runs[s], sizes[s]) + 1. Example: runs [3, 0, 5, 1] (an answer
    of 5 tokens), k = 2 -> the prefill, a step at s = 0 (gain 3), one at s = 3 (gain 2): (5, 3)."""
    tokens = steps = 0
    for answer in answers:
        runs = answer["runs"]
        sizes = answer.get("sizes") or [k] * len(runs)
        n = len(runs) + 1
        s, steps = 0, steps + 1
        while s < n - 1:
            s += min(k, runs[s], sizes[s]) + 1
            steps += 1
        tokens += n
    return tokens, steps


def step_gain(answers: list[list[list[int]]]) -> tuple[int, int, float]:
    """(tokens, steps, mean verified rows) of replayed steps [(nodes, accepted), ...] per answer."""
    tokens = sum(a + 1 for answer in answers for _, a in answer)
    steps = sum(len(answer) for answer in answers)
    rows = sum(1 + n for answer in answers for n, _ in answer) / max(1, steps)
    return tokens, steps, rows


def price(trace: dict, curve: Curve, batch: int, context: int) -> dict:
    """The best fixed setting of one traced method at one (batch, context) of a curve:
    {"k", "tokens_per_step", "speedup", "verify_over_plain"}."""
    plain = curve.at(batch, context, 1)
    if trace["kind"] == "steps":
        tokens, steps, rows = step_gain(trace["answers"])
        cost = curve.at(batch, context, round(rows))
        return {"k": trace.get("setting", ""), "tokens_per_step": tokens / steps,
                "speedup": tokens / steps * plain / cost, "verify_over_plain": cost / plain}
    budget = trace.get("draft_budget")  # self-speculation: a k-token draft is k one-row forwards over the budget
    draft_context = min(c for b, c in curve.points() if b == batch) if budget else None
    best = {"k": 0, "tokens_per_step": 1.0, "speedup": 1.0, "verify_over_plain": 1.0}
    for k in range(1, trace["depth"] + 1):
        tokens, steps = chain_gain(trace["answers"], k)
        draft = k * curve.at(batch, draft_context, 1) if budget else 0.0
        cost = curve.at(batch, context, 1 + k) + draft
        speedup = tokens / steps * plain / cost
        if speedup > best["speedup"]:
            best = {"k": k, "tokens_per_step": tokens / steps, "speedup": speedup,
                    "verify_over_plain": curve.at(batch, context, 1 + k) / plain}
    return best


def price_all(traces: dict, records: list[dict]) -> list[dict]:
    """Every traced method on every measured (shape, batch, context) its regime prices: self-speculation
    at the long contexts (MagicDec's regime), text drafters at the shortest (Spec-Bench prompts,
    BASS's regime), by the curve of each steps kind measured (dynamic, static). One record each, the
    paper's figure beside it."""
    out = []
    for steps, shape in sorted({(r.get("steps", "dynamic"), r["shape"]) for r in records if "seconds" in r}):
        curve = Curve.from_records([r for r in records if r.get("steps", "dynamic") == steps], shape)
        contexts = sorted({c for _, c in curve.points()})
        for name, trace in traces.items():
            regime = "magicdec" if trace.get("draft_budget") else "bass"
            for batch, context in curve.points():
                if regime == "magicdec" and context < LONG * trace["draft_budget"]:
                    continue  # not long context: the target's K/V reads do not dominate its step
                if regime == "bass" and context != contexts[0]:
                    continue
                out.append({"method": name, "shape": shape, "batch": batch, "context": context, "steps": steps,
                            **price(trace, curve, batch, context), "regime": regime, "paper": PAPERS[regime]})
    return out
