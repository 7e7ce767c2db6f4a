"""Acceptance traces recorded on the CPU with the real model, for ``pricing.py`` to price on a GPU.

    python -m specdec.bench.device.traces --answers results/specbench_answers.jsonl \\
        --recordings results/streaming7k.jsonl --out data/device_traces.json

Inputs are the target's own greedy answers, so no model runs here:
- ``--answers``: token-id JSONL of greedy answers (``specdec bench --save-answers``, Spec-Bench
  questions). Prompt lookup is driven along each answer: after every answer token s it drafts a
  chain of ``--depth`` tokens, and runs[s] is how many of them the answer continues with (a chain
  trace). Suffix trees and auto's text sources (prompt lookup + suffix over the project's stored
  answers) are replayed (``bench.replay``) at a fixed tree size: (nodes, accepted) per step.
- ``--recordings``: ``specdec bench-controller`` recordings (StreamingLLM at 7k tokens): their
  runs[s] are already a chain trace; the draft reads a KV budget (priced as self-speculation).
The output is small JSON: {"methods": {name: trace}} (trace kinds: ``pricing.py``).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from specdec.bench.policy import Recording, _leading
from specdec.bench.replay import replay
from specdec.bench.runner import fixed_setting
from specdec.controller import DraftLengthController
from specdec.drafters import PromptLookupDrafter, Sources, SuffixDrafter
from specdec.drafters.base import Commit, Prompt
from specdec.drafters.corpus import CorpusDoc, read_token_jsonl


def chain_runs(drafter, prompt: list[int], answer: list[int], depth: int) -> dict:
    """A text drafter driven along ``answer``: {"runs", "sizes"} per answer token after the first."""
    drafter.begin(Prompt(torch.tensor([prompt]), torch.tensor([len(prompt)])))
    one = lambda t: Commit(torch.tensor([[t]]), torch.tensor([1]), torch.tensor([0]))  # noqa: E731
    drafter.accept(one(answer[0]))
    runs, sizes = [], []
    for s in range(len(answer) - 1):
        tree = drafter.propose(depth)
        chain = tree.tokens[0, : int(tree.num_nodes[0])].tolist() if tree.width else []
        runs.append(_leading(chain, answer[s + 1:]))
        sizes.append(len(chain))
        drafter.accept(one(answer[s + 1]))
    return {"runs": runs, "sizes": sizes}


def tree_steps(make, docs: list[CorpusDoc], setting: str) -> list[list[list[int]]]:
    """(nodes, accepted) per step of each answer replayed with drafters from ``make()`` at ``setting``."""
    controller = DraftLengthController(fixed_setting(setting).draft_length)
    out = []
    for d in docs:
        steps: list[list[int]] = []
        replay(make(), list(d.ids[: d.prompt_len]), list(d.ids[d.prompt_len:]), controller=controller,
               on_step=lambda n, a: steps.append([n, a]))
        out.append(steps)
    return out


def from_answers(docs: list[CorpusDoc], corpus: list[CorpusDoc], depth: int, tree_size: int) -> dict:
    """Traces of the text drafters over greedy answers ``docs`` (``corpus``: what suffix-corpus searches)."""
    from specdec.drafters.corpus import SuffixCorpus

    context = round(sum(len(d.ids) for d in docs) / len(docs))
    chains = [chain_runs(PromptLookupDrafter(), list(d.ids[: d.prompt_len]), list(d.ids[d.prompt_len:]), depth)
              for d in docs]
    shared = SuffixCorpus(corpus)
    setting = f"n={tree_size}"
    makers = {"suffix": SuffixDrafter,
              "suffix-corpus": lambda: SuffixDrafter(corpus=shared),
              "auto-text": lambda: Sources({"lookup": PromptLookupDrafter(), "suffix": SuffixDrafter(corpus=shared)})}
    methods = {"prompt-lookup": {"kind": "chain", "depth": depth, "answers": chains, "context": context}}
    for name, make in makers.items():
        methods[f"{name} {setting}"] = {"kind": "steps", "setting": setting, "answers": tree_steps(make, docs, setting),
                                        "context": context}
    return methods


def from_recordings(path: Path) -> dict:
    """Chain traces of ``bench-controller`` recordings, one method per drafter recorded."""
    methods: dict = {}
    for line in path.read_text().splitlines():
        rec = Recording.from_json(json.loads(line))
        name = rec.drafter or "recorded"
        m = methods.setdefault(name, {"kind": "chain", "depth": max(rec.sizes, default=0), "answers": []})
        m["answers"].append({"runs": rec.runs, "sizes": rec.sizes})
        if "@" in name:  # self-speculation at a KV budget: "streaming@512"
            m["draft_budget"] = int(name.split("@")[1])
    return methods


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--answers", help="greedy answers (token-id JSONL with prompt_len)")
    p.add_argument("--corpus", default=None, help="what suffix-corpus searches (default: the stored answers)")
    p.add_argument("--recordings", help="bench-controller recordings (JSONL)")
    p.add_argument("--depth", type=int, default=10, help="chain length drafted at every answer token")
    p.add_argument("--tree-size", type=int, default=8, help="nodes of the replayed trees")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    methods: dict = {}
    if args.answers:
        from specdec.drafters.corpus import default_answers_path

        docs = [CorpusDoc(d.ids[: d.prompt_len + args.max_new_tokens], d.prompt_len)
                for d in read_token_jsonl(args.answers) if len(d.ids) > d.prompt_len + 1]
        corpus = read_token_jsonl(args.corpus or default_answers_path())
        methods.update(from_answers(docs, corpus, args.depth, args.tree_size))
    if args.recordings:
        methods.update(from_recordings(Path(args.recordings)))
    if not methods:
        p.error("give --answers and/or --recordings")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps({"methods": methods}, separators=(",", ":")))
    os.replace(tmp, out)
    for name, m in methods.items():
        print(f"{name}: {m['kind']}, {len(m['answers'])} answers")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
