"""EAGLE-3 tree shapes under the controller, against plain decoding, in one process.

    python scripts/eagle3_tree_sweep.py --questions ../shared/specbench/question.jsonl --per-category 1 \
        --shapes 6,3,3 8,4,3 10,4,3 [--max-new-tokens 256] [--out FILE]

Each shape is (nodes, depth, top-k) of ``EagleConfig``: the most nodes a tree gets, its levels (one head
forward each after the first), the children per expanded node. Every decoder runs with the controller
(it gates and sizes the trees, as ``specdec bench`` runs ``eagle3``); methods rotate per question, after
one untimed warm-up each (``specdec.bench.generation.run_bench``). Reported per shape: tokens/s, its
ratio to plain decoding (``none``) of the same run, tau, and the draft and verify milliseconds of an
average step; every output must be the target's greedy output (identical to ``none``'s).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import _bench_setup

from specdec import SpecDecoder
from specdec.bench.generation import Method, run_bench, summarize
from specdec.bench.runner import make_decoder
from specdec.decoder import SpecDecoderConfig
from specdec.drafters.eagle import EagleConfig
from specdec.drafters.eagle3 import make_eagle3


def shape_of(text: str) -> tuple[int, int, int]:
    nodes, depth, top_k = (int(x) for x in text.split(","))
    return nodes, depth, top_k


def timed_method(name: str, decoder: SpecDecoder, eos, times: dict) -> Method:
    """A Method whose steps' draft and verify seconds add up in ``times[name]``."""
    times[name] = [0.0, 0.0, 0]

    def go(ids, n):
        out = decoder.generate(ids, max_new_tokens=n, eos_token_id=eos)
        t = times[name]
        t[0] += sum(s.draft_time for s in out.steps)
        t[1] += sum(s.verify_time for s in out.steps)
        t[2] += len(out.steps)
        return out.sequences, len(out.steps)

    return Method(name, go)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _bench_setup.add_arguments(ap)
    ap.add_argument("--shapes", nargs="+", required=True, help="NODES,DEPTH,TOP_K")
    args = ap.parse_args(argv)
    target, tok, eos, questions = _bench_setup.load(args)
    times: dict = {}
    methods = [timed_method("none", make_decoder(target, "none"), eos, times)]
    for text in args.shapes:
        nodes, depth, top_k = shape_of(text)
        drafter = make_eagle3(target, config=EagleConfig(total_tokens=nodes, depth=depth, top_k=top_k))
        methods.append(timed_method(f"eagle3 {text}", SpecDecoder(target, drafter, SpecDecoderConfig()), eos, times))
    records = run_bench(target, tok, questions, methods, args.max_new_tokens, None,
                        progress=lambda: print(".", end="", flush=True))
    overall = summarize(records, "none", lambda c: c)["overall"]
    print(f"\n{len(questions)} questions, up to {args.max_new_tokens} new tokens, greedy, the controller on\n")
    print("| method | tokens/s | x none | tau | draft / verify ms a step | identical |")
    print("|---|---|---|---|---|---|")
    for m in methods:
        r, (draft, verify, steps) = overall[m.name], times[m.name]
        print(f"| {m.name} | {r['tokens_per_s']:.1f} | {r['speedup']:.3f} | {r['tau']:.2f} | "
              f"{1e3 * draft / steps:.1f} / {1e3 * verify / steps:.1f} | {r['identical']}/{r['questions']} |")
    if any(r["identical"] != r["questions"] for r in overall.values()):
        sys.exit("an output differs from plain decoding's (all must be the target's greedy output)")
    if args.out:
        Path(args.out).write_text(json.dumps({"overall": overall, "times": times}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
