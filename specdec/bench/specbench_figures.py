"""Spec-Bench's figures (its ``evaluation/speed.py`` definitions), per task and overall, from answer
records in its format; pure functions of the records, and the table ``specdec specbench`` prints.

    speedup                mean over questions of tokens/s of the method, over the same mean for the
                           baseline (tokens/s of a question = its new tokens / its seconds, all turns)
    mean accepted tokens   total new tokens / total target forwards (= mean of accept_lengths)
    identical              every answer token-identical to the baseline's (the lossless check)
"""

from __future__ import annotations

from specdec.bench.questions import TASKS, Question, task_of

BASELINE = "baseline"  # plain HF generate, greedy


def _question_speed(rec: dict) -> float:
    c = rec["choices"][0]
    return sum(c["new_tokens"]) / max(sum(c["wall_time"]), 1e-9)


def method_stats(records: list[dict], baseline: list[dict]) -> dict:
    """Spec-Bench's figures for one method over questions answered by it and the baseline (same order)."""
    assert len(records) == len(baseline), "pair each record with the baseline's for the same question"
    if not records:
        return {"questions": 0}
    speeds = [_question_speed(r) for r in records]
    base_speeds = [_question_speed(r) for r in baseline]
    tokens = sum(sum(r["choices"][0]["new_tokens"]) for r in records)
    steps = sum(sum(r["choices"][0]["decoding_steps"]) for r in records)
    mismatched = [r["question_id"] for r, b in zip(records, baseline)
                  if r["choices"][0].get("token_ids") != b["choices"][0].get("token_ids")
                  or "token_ids" not in r["choices"][0]]
    tps, base_tps = sum(speeds) / len(speeds), sum(base_speeds) / len(base_speeds)
    return {"questions": len(records), "new_tokens": tokens, "decoding_steps": steps,
            "tokens_per_second": tps, "baseline_tokens_per_second": base_tps, "speedup": tps / base_tps,
            "mean_accepted_tokens": tokens / max(steps, 1), "identical": not mismatched,
            "mismatched_questions": mismatched}


def summarize(answers: dict[str, dict], questions: list[Question], baseline: str = BASELINE,
              temperature: float = 0.0) -> dict:
    """answers: method -> {question_id: record}. Per method, per task (Spec-Bench order) and overall,
    over the selected questions that both the method and the baseline have answered. When sampling
    (temperature > 0) answers are not compared: "identical" is None."""
    base = answers[baseline]
    tasks = [t for t in TASKS if any(task_of(q.category) == t for q in questions)]
    tasks += sorted({task_of(q.category) for q in questions} - set(tasks))
    mode = "greedy" if not temperature else f"do_sample=True, temperature {temperature}"
    out: dict = {"baseline": f"{baseline} (HF generate, {mode})", "tasks": tasks, "methods": {}}
    for m, recs in answers.items():
        done = [q for q in questions if q.question_id in recs and q.question_id in base]
        per_task = {}
        for t in tasks:
            qs = [q for q in done if task_of(q.category) == t]
            per_task[t] = method_stats([recs[q.question_id] for q in qs], [base[q.question_id] for q in qs])
        out["methods"][m] = {"overall": method_stats([recs[q.question_id] for q in done],
                                                     [base[q.question_id] for q in done]),
                             "tasks": per_task}
    if temperature:
        for m in out["methods"].values():
            for s in [m["overall"], *m["tasks"].values()]:
                s["identical"], s["mismatched_questions"] = None, None
    return out


def print_summary(console, summary: dict, title: str) -> None:
    """Rows: tasks then overall. Per drafter: speedup, tau (mean accepted tokens), lossless mark."""
    from rich.table import Table

    drafters = [m for m in summary["methods"] if m != BASELINE]
    table = Table(title=title, caption="speedup over HF generate (Spec-Bench's: ratio of mean tokens/s) · "
                  "tau: mean accepted tokens per target forward · ✓: token-identical to HF generate")
    for col in ("task", "n", "HF tok/s", *drafters):
        table.add_column(col, justify="left" if col == "task" else "right", no_wrap=True)
    base = summary["methods"][BASELINE]
    for t in [*summary["tasks"], "overall"]:
        b = base["overall"] if t == "overall" else base["tasks"][t]
        if not b["questions"]:
            continue
        row = ["[bold]overall[/bold]" if t == "overall" else t, str(b["questions"]),
               f"{b['tokens_per_second']:.1f}"]
        for d in drafters:
            s = summary["methods"][d]
            s = s["overall"] if t == "overall" else s["tasks"][t]
            if not s["questions"]:
                row.append("-")
                continue
            if s["identical"] is None:  # sampling: answers differ by design
                same = ""
            else:
                same = " [green]✓[/green]" if s["identical"] else f" [red]✗{len(s['mismatched_questions'])}[/red]"
            row.append(f"{s['speedup']:.2f}x τ{s['mean_accepted_tokens']:.2f}{same}")
        table.add_row(*row)
    console.print(table)
