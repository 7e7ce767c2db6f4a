"""EAGLE heads side by side on text none of them learned from: acceptance per draft depth and top-1.

    python scripts/compare_eagle_heads.py --questions ../shared/specbench/question.jsonl --per-category 1 \
        --heads eagle:packaged eagle3:packaged eagle3:DIR [--nodes 6] [--max-new-tokens 256]

Each head drafts EAGLE-2 trees of ``--nodes`` nodes on every step (no controller: its gate would hide a
head's quality behind its cost) over the first turn of the chosen questions, greedy. Reported per head:
tau (tokens per target forward) and the share of drafting steps that accepted at least d tokens, d = 1..
the tree's depth (the acceptance per depth). Then the target's answers of that run are the held-out
text of a teacher-forced top-1 per depth: an EAGLE-3 head's training-time-test rows (its own outputs fed
back), an EAGLE-1 head's depth 1. Every run's output must equal the first head's (all are the target's
greedy output); a difference stops the script. Speed is not measured here (``specdec bench`` does).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import _bench_setup
import torch

from specdec import SpecDecoder
from specdec.bench.runner import fixed_setting
from specdec.drafters.eagle import PACKAGED_HEAD, EagleConfig, load_head, make_eagle
from specdec.drafters.eagle3 import PACKAGED_HEAD3, make_eagle3
from specdec.drafters.eagle3_head import default_aux_layers
from specdec.drafters.eagle3_io import load_eagle3
from specdec.introspect import text_config
from specdec.prompting import chat_ids, user_turn
from specdec.training.distill import features
from specdec.training.eagle import TrainConfig, evaluate
from specdec.training.eagle3 import Train3Config, evaluate3


def head_path(kind: str, where: str) -> Path:
    return Path({"eagle": PACKAGED_HEAD, "eagle3": PACKAGED_HEAD3}[kind]) if where == "packaged" else Path(where)


def drafter_of(target, kind: str, path: Path, nodes: int):
    depth = max(1, min(nodes, EagleConfig.depth))
    cfg = EagleConfig(total_tokens=nodes, depth=depth)
    return (make_eagle if kind == "eagle" else make_eagle3)(target, path, cfg)


def acceptance(steps, depth: int) -> tuple[list[float], int]:
    """Share of drafting steps with >= d accepted tokens, d = 1..depth; and how many steps drafted."""
    accepted = [a for s in steps if s.num_drafted and s.num_drafted[0] > 0 for a in s.num_accepted]
    return [sum(a >= d for a in accepted) / max(1, len(accepted)) for d in range(1, depth + 1)], len(accepted)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _bench_setup.add_arguments(ap)
    ap.add_argument("--heads", nargs="+", required=True, help="KIND:PATH, KIND eagle or eagle3, PATH a dir or 'packaged'")
    ap.add_argument("--nodes", type=int, default=6)
    args = ap.parse_args(argv)
    target, tok, eos, questions = _bench_setup.load(args)
    prompts = [chat_ids(tok, user_turn(q.turns[0])) for q in questions]
    heads = [(spec, *spec.split(":", 1)) for spec in args.heads]
    rows, answers = {}, None
    for spec, kind, where in heads:
        path = head_path(kind, where)
        decoder = SpecDecoder(target, drafter_of(target, kind, path, args.nodes), fixed_setting(f"n={args.nodes}"))
        outs, steps = [], []
        for ids in prompts:
            out = decoder.generate(ids, max_new_tokens=args.max_new_tokens, eos_token_id=eos)
            outs.append(out.sequences[0].tolist())
            steps += out.steps
        if answers is None:
            answers = outs
        elif outs != answers:
            sys.exit(f"{spec}: output differs from {heads[0][0]}'s (all must be the target's greedy output)")
        new = sum(len(o) - len(p[0]) for o, p in zip(outs, prompts))
        depth = max(1, min(args.nodes, EagleConfig.depth))
        per_depth, drafted = acceptance(steps, depth)
        rows[spec] = {"tau": new / max(1, len(steps)), "accept_at_least": per_depth, "drafting_steps": drafted}
        print(spec, json.dumps(rows[spec]), flush=True)
    held = [(i, len(p[0]), o) for i, (p, o) in enumerate(zip(prompts, answers))]
    layers = default_aux_layers(text_config(target).num_hidden_layers)
    convs = features(target, held, layers, dtype=torch.float32)
    for spec, kind, where in heads:
        path = head_path(kind, where)
        if kind == "eagle3":
            top1 = evaluate3(load_eagle3(path, target).float(), convs, Train3Config(batch_size=4))
        else:
            top1 = [evaluate(load_head(path, target).float(), convs, TrainConfig(batch_size=4))]
        rows[spec]["held_out_top1"] = top1
        print(spec, "top-1 per depth", [round(x, 4) for x in top1], flush=True)
    print(f"\n{len(questions)} questions, {sum(len(o) - len(p[0]) for o, p in zip(answers, prompts))} new tokens, "
          f"trees of {args.nodes} nodes every step\n")
    depth = len(next(iter(rows.values()))["accept_at_least"])
    print("| head | tau | " + " | ".join(f">= {d} accepted" for d in range(1, depth + 1))
          + " | top-1 (depth 1 / 2 / 3) |")
    print("|---|---|" + "---|" * depth + "---|")
    for spec, r in rows.items():
        print(f"| {spec} | {r['tau']:.2f} | " + " | ".join(f"{x:.1%}" for x in r["accept_at_least"])
              + " | " + " / ".join(f"{x:.1%}" for x in r["held_out_top1"]) + " |")
    if args.out:
        Path(args.out).write_text(json.dumps({"questions": len(questions), "nodes": args.nodes, "heads": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
