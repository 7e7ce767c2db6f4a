"""Where a decoding step's time goes, by how many tokens it verified: `bench-structured`'s JSON-schema answers
(20 questions, greedy) decoded with one method, each step timed whole and in its parts, medians per drafted
count, and the mean of every step. Parts: the draft (``draft``: the sources' classes, the controller's plans,
the drafts, shadows included), the grammar's cut of it (``constrain``), the target's forward (``forward_block``;
within it the lean forward, and the layers without the output layer), the verdict on the processed rows
(``judge``), the commit, what the controller learns (``learn``). ``step`` minus ``forward`` is the step's
bookkeeping.

    .venv/bin/python scripts/step_split.py --drafter auto      # and --drafter none: plain decoding's steps

Wraps the session's and the lean forward's functions in place (this process only); figures in
docs/benchmarks.md, "Structured output".
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import specdec.fastpath as fastpath
import specdec.session as session
from specdec.bench.questions import load_questions
from specdec.bench.structured import TASKS
from specdec.decoder import SpecDecoder
from specdec.models import load_model
from specdec.processing import Constraint
from specdec.prompting import encode_prompt
from specdec.registry import make_drafter

PARTS = ("step", "draft", "constrain", "forward", "lean", "layers", "judge", "commit", "learn")


def timing(part: str, step: dict, fn):
    """fn, its seconds added to the step under way's ``step["parts"][part]``."""
    def timed(*args, **kwargs):
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        step["parts"][part] = step["parts"].get(part, 0.0) + time.perf_counter() - t
        return out
    return timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafter", default="auto")
    ap.add_argument("--questions", default="../shared/specbench/question.jsonl")
    ap.add_argument("--per-task", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=200)
    ap.add_argument("--numerics", default="int8", choices=("exact", "int8"))
    args = ap.parse_args()

    times: dict = collections.defaultdict(lambda: collections.defaultdict(list))  # part -> drafted -> seconds
    step = {"n": -1, "parts": {}}  # the step under way: its drafted tokens (set by its forward), its parts
    forward_block, session_step = session.forward_block, session.DecodeSession.step

    def forward(model, cache, block_ids, *rest, **kw):
        step["n"] = block_ids.shape[1] - 1
        return forward_block(model, cache, block_ids, *rest, **kw)

    def whole_step(self):
        step["parts"] = {}
        out = timing("step", step, session_step)(self)
        for part, seconds in step["parts"].items():
            times[part][step["n"]].append(seconds)
        return out

    session.forward_block = timing("forward", step, forward)
    session.draft_step = timing("draft", step, session.draft_step)
    session.constrain = timing("constrain", step, session.constrain)
    session.judge_processed = timing("judge", step, session.judge_processed)
    session.make_commit = timing("commit", step, session.make_commit)
    session.learn_step = timing("learn", step, session.learn_step)
    session.DecodeSession.step = whole_step
    fastpath.FastPath.__call__ = timing("lean", step, fastpath.FastPath.__call__)
    fastpath.FastPath._layers = timing("layers", step, fastpath.FastPath._layers)

    loaded = load_model("default", weights="packed", numerics=args.numerics)
    model, tok = loaded.model, loaded.tokenizer
    decoder = SpecDecoder(model, None if args.drafter == "none" else make_drafter(args.drafter, model))
    decoder.warm_up()
    questions = load_questions(args.questions)
    for task in TASKS.values():
        grammar = decoder.processing(Constraint.json_schema(task["schema"]), tok).grammar
        for q in [q for q in questions if q.category in task["categories"]][: args.per_task]:
            decoder.generate(encode_prompt(tok, task["instruction"] + q.turns[0]),
                             max_new_tokens=args.max_new_tokens, constraint=grammar)
    print(f"{loaded.name}, {args.numerics}, {args.drafter}: median ms a step by drafted tokens")
    print("drafted  steps " + " ".join(f"{p:>9}" for p in PARTS))
    for n in sorted(k for k in times["forward"] if k >= 0):
        if len(times["forward"][n]) >= 5:
            cells = " ".join(f"{1e3 * statistics.median(times[p][n]) if times[p][n] else 0:9.2f}" for p in PARTS)
            print(f"{n:7d} {len(times['forward'][n]):6d} {cells}")
    every = {p: [s for n in times[p] for s in times[p][n]] for p in PARTS}
    steps = len(every["step"])
    print("   mean " + f"{steps:6d} " + " ".join(f"{1e3 * sum(every[p]) / steps:9.2f}" for p in PARTS))


if __name__ == "__main__":
    main()
