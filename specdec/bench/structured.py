"""`specdec bench-structured`: answers constrained to a JSON schema, plain decoding vs a drafter, in one
process, alternating methods per question.

    specdec bench-structured --questions ../shared/specbench/question.jsonl --per-task 10

Two tasks: ``extract`` (a GSM8K question's quantities as {"quantities": [{"name", "value"}], "asks"})
and ``answer`` (a Spec-Bench question answered as {"answer", "topic", "confidence"}). Each answer is
checked twice: token-identical between the two methods (greedy), and valid against its schema by an
independent check (``valid``). The speedup is plain decoding's seconds over the drafter's, per task and
over all; HF ``generate``'s tokens/s on the same model, unconstrained, before and after, says how fast the
machine ran. With ``--repeats N`` each question is timed N times a method (the order alternating each time) and
its median kept: a question's time is then less a draw of the machine's noise. Answers go to ``--out`` (JSONL) as
they come; a run with the same file resumes.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from specdec.arguments import add_weights_argument, positive_int, weights_for
from specdec.registry import DRAFTERS

TASKS = {
    "extract": {
        "categories": ("math_reasoning",),
        "instruction": "List every quantity in this problem as JSON: each with a short name and its number, "
                       "then what the problem asks for.\n\nProblem: ",
        "schema": {"type": "object", "additionalProperties": False, "required": ["quantities", "asks"],
                   "properties": {"quantities": {"type": "array", "maxItems": 8, "items": {
                       "type": "object", "additionalProperties": False, "required": ["name", "value"],
                       "properties": {"name": {"type": "string", "maxLength": 40}, "value": {"type": "number"}}}},
                       "asks": {"type": "string", "maxLength": 120}}},
    },
    "answer": {
        "categories": ("qa",),
        "instruction": "Answer as JSON with the answer, its topic and how confident you are.\n\nQuestion: ",
        "schema": {"type": "object", "additionalProperties": False, "required": ["answer", "topic", "confidence"],
                   "properties": {"answer": {"type": "string", "maxLength": 200},
                                  "topic": {"type": "string", "maxLength": 30},
                                  "confidence": {"enum": ["low", "medium", "high"]}}},
    },
}


def add_arguments(p) -> None:
    p.add_argument("--model", default="default")
    add_weights_argument(p, numerics="exact")
    p.add_argument("--drafter", default="auto", choices=sorted(DRAFTERS))
    p.add_argument("--questions", default=None, help="a Spec-Bench question.jsonl (default: the shipped set)")
    p.add_argument("--per-task", type=positive_int, default=10, help="questions per task")
    p.add_argument("--max-new-tokens", type=positive_int, default=160)
    p.add_argument("--repeats", type=positive_int, default=1,
                   help="times each method decodes each question (alternating order); the median time is kept")
    p.add_argument("--out", default=None, help="JSONL of answers, written as they come; resumed if it exists")


def valid(task: str, text: str) -> bool:
    """An answer checked against its task's schema by hand (not by the grammar that made it)."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return False
    if not isinstance(obj, dict):
        return False
    if task == "extract":
        qs = obj.get("quantities")
        return (set(obj) == {"quantities", "asks"} and isinstance(obj["asks"], str) and len(obj["asks"]) <= 120
                and isinstance(qs, list) and len(qs) <= 8
                and all(isinstance(q, dict) and set(q) == {"name", "value"} and isinstance(q["name"], str)
                        and len(q["name"]) <= 40 and isinstance(q["value"], (int, float))
                        and not isinstance(q["value"], bool) for q in qs))
    return (set(obj) == {"answer", "topic", "confidence"} and isinstance(obj["answer"], str)
            and len(obj["answer"]) <= 200 and isinstance(obj["topic"], str) and len(obj["topic"]) <= 30
            and obj["confidence"] in ("low", "medium", "high"))


def _done(path: Path | None) -> dict:
    """Answers already in ``--out``, by (task, question id): a resumed run skips them."""
    if path is None or not path.exists():
        return {}
    out = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            r = json.loads(line)
            out[(r["task"], r["question_id"])] = r
        except (json.JSONDecodeError, KeyError):
            continue  # a line cut by a crash: that question runs again
    return out


def _hf_tokens_per_second(model, ids: torch.Tensor, n: int = 64) -> float:
    t = time.perf_counter()
    out = model.generate(ids[None], max_new_tokens=n, do_sample=False, attention_mask=torch.ones_like(ids[None]))
    return (out.shape[1] - len(ids)) / (time.perf_counter() - t)


def _table(rows: list[dict], title: str, drafter: str) -> Table:
    """Per task and over all: tokens/s of both methods, the speedup, tau, answers identical, and valid
    answers among those that ended within the token budget."""
    table = Table(title=title)
    for col in ("task", "questions", "tokens", "plain tok/s", f"{drafter} tok/s", "speedup", "tau",
                "identical", "valid (ended)"):
        table.add_column(col)
    for name in (*TASKS, "all"):
        rs = [r for r in rows if name in ("all", r["task"])]
        tokens, ps, ss = sum(r["tokens"] for r in rs), sum(r["plain_s"] for r in rs), sum(r["spec_s"] for r in rs)
        ended = [r for r in rs if r["ended"]]
        table.add_row(name, str(len(rs)), str(tokens), f"{tokens / ps:.1f}", f"{tokens / ss:.1f}", f"{ps / ss:.2f}x",
                      f"{sum(r['tau'] * r['tokens'] for r in rs) / max(1, tokens):.2f}",
                      f"{sum(r['identical'] for r in rs)}/{len(rs)}",
                      f"{sum(r['valid'] for r in ended)}/{len(ended)}")
    return table


def run(args) -> int:
    from specdec.bench.questions import load_questions
    from specdec.decoder import SpecDecoder
    from specdec.models import load_model
    from specdec.processing import Constraint
    from specdec.prompting import encode_prompt
    from specdec.registry import make_drafter

    console = Console()
    loaded = load_model(args.model, weights=weights_for(args.model, args.weights), numerics=args.numerics)
    model, tok = loaded.model, loaded.tokenizer
    questions = load_questions(args.questions)
    plain, spec = SpecDecoder(model, None), SpecDecoder(model, make_drafter(args.drafter, model))
    plain.warm_up()
    spec.warm_up()
    grammars = {name: plain.processing(Constraint.json_schema(t["schema"]), tok).grammar for name, t in TASKS.items()}
    out_path = Path(args.out) if args.out else None
    done = _done(out_path)
    probe = encode_prompt(tok, "Say something about the sea.")
    hf_before = _hf_tokens_per_second(model, probe)
    rows = []
    for name, task in TASKS.items():
        chosen = [q for q in questions if q.category in task["categories"]][: args.per_task]
        for i, q in enumerate(chosen):
            if (name, q.question_id) in done:
                rows.append(done[(name, q.question_id)])
                continue
            ids = encode_prompt(tok, task["instruction"] + q.turns[0])
            kw = dict(max_new_tokens=args.max_new_tokens, constraint=grammars[name])
            times, outs = {"plain": [], "spec": []}, {}
            for r in range(args.repeats):
                for method in (("plain", "spec") if (i + r) % 2 == 0 else ("spec", "plain")):  # alternating
                    decoder = plain if method == "plain" else spec
                    t = time.perf_counter()
                    outs[method] = decoder.generate(ids, **kw)  # greedy: the same answer every time
                    times[method].append(time.perf_counter() - t)
            text = tok.decode(outs["spec"].generated(0), skip_special_tokens=True)
            row = {"task": name, "question_id": q.question_id, "tokens": outs["spec"].new_tokens,
                   "plain_s": statistics.median(times["plain"]), "spec_s": statistics.median(times["spec"]),
                   "tau": outs["spec"].mean_accepted_tokens,
                   "identical": outs["spec"].generated(0).tolist() == outs["plain"].generated(0).tolist(),
                   "valid": valid(name, text), "ended": outs["spec"].new_tokens < args.max_new_tokens, "text": text}
            rows.append(row)
            if out_path is not None:
                with open(out_path, "a", encoding="utf-8") as f:
                    f.write(json.dumps(row) + "\n")
    hf_after = _hf_tokens_per_second(model, probe)
    console.print(_table(rows, f"{loaded.name}: JSON-schema answers, plain decoding vs {args.drafter} (greedy)",
                         args.drafter))
    console.print(f"HF generate (unconstrained, greedy, 64 tokens): {hf_before:.1f} tokens/s before, "
                  f"{hf_after:.1f} after")
    return 0 if all(r["identical"] and (r["valid"] or not r["ended"]) for r in rows) else 1
