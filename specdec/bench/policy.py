"""`specdec bench-controller`: the draft-length controller against every fixed length, on replays.

A timed A/B of a controller change at 7k tokens moves 3-5% from run to run on a shared 2-core
machine, as much as the change itself, and every answer has its own pattern of easy and hard text.
So each prompt is recorded once and replayed under any policy, with no timing noise:

- **Recording** (one generation of plain steps, then a short timed one): after every answer token s
  the chain drafter drafts ``depth`` tokens from the state the decoder would give it there, and the
  recording keeps ``runs[s]``, how many of them the target's greedy answer accepts, and the draft
  class the drafter reported. For a chain drafter this is what any step starting at s accepts:
  a k-token draft is the first k tokens of that chain, so it accepts min(k, runs[s]) where the
  drafter's state is a function of the text alone (prompt lookup; StreamingLLM compacted every
  step: the tests check every decoder step against the recording). With an ``overshoot`` the
  StreamingLLM window holds budget .. budget + overshoot rows by where its last compaction fell, so
  a draft can differ by a token: at 7k tokens, budget 512, three decoder runs (fixed k = 1, 2 and the
  controller, ~300 steps) matched the recording at every step. A second generation cycles the draft
  length over 0..depth to time a verify per block size t(1 + k) and a k-token draft d(k) at this
  context (medians).
- **Replay**: the decoder's loop without the model. A policy (the controller, or a fixed k) picks
  k; the step accepts min(k, runs[s]), costs t(1 + k) + d(k), and the controller is told what the
  decoder would tell it (for a free drafter, prompt lookup, also the shadow draft of a class it
  gated off, scored against the one token the plain step commits). ``--noise`` multiplies every
  step's timings by a lognormal factor (the machine's noise, which the controller reads and reacts
  to), over ``--seeds`` replays.

    specdec bench-controller --books 3 --lengths 2048,7000 --instruction both --out results/policy

Prints, per prompt, each fixed k's speedup over plain decoding, the best, and the controller's
(noise-free, and mean / worst over the noisy replays), then their geometric means over the prompts.
Recordings go to OUT.jsonl as each prompt is recorded, per drafter and target weights (a rerun replays
them without recording again); ``--weights packed`` records on a GGUF's blocks, whose verify costs
climb faster with the rows than fp32's (docs/benchmarks.md, verify cost).
"""

from __future__ import annotations

import itertools
import json
import math
import random
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specdec.controller.plan import Plan
from specdec.drafters.base import Commit, Drafter, Prompt
from specdec.tree import DraftTree


@dataclass(frozen=True)
class Recording:
    prompt: str  # the prompt's key
    tokens: list[int]  # the greedy answer
    runs: list[int]  # runs[s]: tokens of a depth-token chain drafted after answer token s the target accepts
    sizes: list[int]  # sizes[s]: tokens the drafter drafted there (fewer than depth: a copy that ran out)
    classes: list  # classes[s]: the drafter's draft class there (JSON-able: tuples become lists)
    verify: dict[int, float]  # rows per sequence (1 + k) -> seconds of a verify step
    draft: dict[int, float]  # k -> seconds of a k-token draft
    drafter: str = ""  # the --drafter it was recorded with (streaming at a budget: "streaming@512")
    free: bool = False  # its drafts cost nothing and change nothing (``Capabilities.free_drafts``)

    @staticmethod
    def from_json(d: dict) -> "Recording":
        return Recording(d["prompt"], d["tokens"], d["runs"], d["sizes"],
                         [tuple(c) if isinstance(c, list) else c for c in d["classes"]],
                         {int(q): t for q, t in d["verify"].items()}, {int(k): t for k, t in d["draft"].items()},
                         d.get("drafter", ""), d.get("free", False))


class _Recorder(Drafter):
    """Wraps a chain drafter: at every step drafts ``depth`` tokens and keeps them, verifies nothing."""

    def __init__(self, inner: Drafter, depth: int) -> None:
        self.inner, self.depth = inner, depth
        self.drafts: list[list[int]] = []
        self.classes: list = []

    def begin(self, prompt: Prompt) -> None:
        self.inner.begin(prompt)

    def propose(self, budget: int) -> DraftTree:
        self.classes.append(self.inner.draft_class())
        tree = self.inner.propose(self.depth)
        self.drafts.append(tree.tokens[0, : int(tree.num_nodes[0])].tolist())
        return DraftTree.empty(1)

    def accept(self, commit: Commit) -> None:
        self.inner.accept(commit)


def _leading(draft: list[int], truth: list[int]) -> int:
    """How many of draft's first tokens match truth's. Example: [3, 4, 5], [3, 4, 9] -> 2."""
    return next((i for i, (a, b) in enumerate(zip(draft, truth)) if a != b), min(len(draft), len(truth)))


def record(model, make_drafter, ids: torch.Tensor, max_new_tokens: int, eos, key: str = "",
           depth: int = 10, timed_tokens: int = 200, drafter: str = "") -> Recording:
    """One prompt's recording (module doc). ``make_drafter()`` makes a fresh chain drafter; ``ids``
    [1, P]."""
    from specdec.bench.runner import fixed_setting
    from specdec.decoder import SpecDecoder

    probe = _Recorder(make_drafter(), depth)
    if probe.inner.capabilities.sizes_own_tree:
        raise ValueError(f"{type(probe.inner).__name__} sizes its own trees: bench-controller replays chain drafters")
    # every step asks for a draft (fixed k = 1); the recorder drafts depth tokens and verifies none
    out = SpecDecoder(model, probe, fixed_setting("k=1")).generate(ids, max_new_tokens=max_new_tokens,
                                                                   eos_token_id=eos)
    answer = out.generated(0).tolist()
    runs = [_leading(d, answer[s + 1:]) for s, d in enumerate(probe.drafts)]
    # timings: one generation cycling k over 0..depth (its answer is the same: greedy is lossless)
    timed = SpecDecoder(model, make_drafter(), fixed_setting(f"k={depth}"))
    cycle = itertools.cycle(range(depth + 1))
    timed.controller.plan = lambda key=None, cap=None, tree=False: Plan(key, min(next(cycle), cap))
    steps = timed.generate(ids, max_new_tokens=min(max_new_tokens, timed_tokens), eos_token_id=eos).steps[1:]
    verify: dict[int, list[float]] = {}
    draft: dict[int, list[float]] = {}
    for s in steps:
        k = s.num_drafted[0]
        verify.setdefault(1 + k, []).append(s.verify_time)
        draft.setdefault(k, []).append(s.draft_time)
    return Recording(key, answer, runs, [len(d) for d in probe.drafts], probe.classes,
                     {q: statistics.median(v) for q, v in sorted(verify.items())},
                     {k: statistics.median(v) for k, v in sorted(draft.items())}, drafter,
                     probe.inner.capabilities.free_drafts)


def replay(rec: Recording, controller=None, k: int = 0, noise: float = 0.0, seed: int = 0,
           shadows: bool = True) -> tuple[float, int]:
    """(seconds, steps) of the answer's decode phase under ``controller`` (a DraftLengthController,
    told what the decoder tells it) or a fixed ``k`` (0: plain decoding); ``noise``: the sigma of a
    lognormal factor on each step's verify and draft seconds. A size not timed costs the nearest timed
    one's (verify) or scales the longest timed draft.
    Example: runs [2, 0, 0, 0], verify {1: 1, 3: 1.2}, draft {2: 0.5}, k = 2 -> the step at token 0
    accepts 2 (1.7 s), the one at token 3 is capped at the 0 tokens still wanted (1 s): (2.7, 2)."""
    rng = random.Random(seed)
    t_max, d_max = max(rec.verify), max((d for d in rec.draft if d), default=0)

    def verify_time(q: int) -> float:
        return rec.verify[min((s for s in rec.verify if s >= q), default=t_max)]

    def draft_time(n: int) -> float:
        return 0.0 if n == 0 else rec.draft.get(n, rec.draft.get(d_max, 0.0) * n / max(d_max, 1))

    if controller is not None:
        controller.new_run(1)
    pos, seconds, steps = 0, 0.0, 0
    n = len(rec.tokens)
    while pos < n - 1:
        wanted = n - pos - 2  # tokens some sequence still wants after this step's bonus token
        key = rec.classes[pos] if pos < len(rec.classes) else None
        size = rec.sizes[pos] if pos < len(rec.sizes) else 0
        run = rec.runs[pos] if pos < len(rec.runs) else 0
        budget = _take(controller, controller.plan(key)).size if controller is not None else k
        drafted = min(budget, wanted, size)
        accepted = min(drafted, run)
        vt, dt = verify_time(1 + drafted), draft_time(drafted)
        if noise:
            vt, dt = vt * rng.lognormvariate(0, noise), dt * rng.lognormvariate(0, noise)
        shadow = 0
        if controller is not None and drafted == 0 and rec.free and shadows:
            # the decoder's shadow draft of a free drafter's gated-off class, scored against the one
            # token the plain step commits
            shadow = min(_take(controller, controller.plan_shadow(wanted, key)).size, size)
        if controller is not None:
            controller.update([drafted], [accepted], vt, dt, key)
            if drafted:
                controller.observe_tree([list(range(-1, drafted - 1))], [list(range(accepted))], key)
            if shadow > 0:
                controller.observe_shadow([list(range(-1, shadow - 1))], [list(range(min(1, run)))], [1],
                                          draft_time(shadow), key)
        seconds, steps, pos = seconds + vt + dt, steps + 1, pos + 1 + accepted
    return seconds, steps


def _take(controller, plan: Plan) -> Plan:
    """The decoder's way with a controller's plan: follow it (``observe``), then draft it."""
    controller.observe(plan)
    return plan


def compare(rec: Recording, make_controller, max_k: int = 10, noise: float = 0.05, seeds: int = 10) -> dict:
    """Speedups over plain decoding on one recording: every fixed k in 1..max_k, the best of them, the
    controller noise-free, and its mean and worst over ``seeds`` noisy replays."""
    plain = replay(rec)[0]
    fixed = {k: plain / replay(rec, k=k)[0] for k in range(1, max_k + 1)}
    best = max(fixed, key=fixed.get)
    noisy = [plain / replay(rec, make_controller(), noise=noise, seed=s)[0] for s in range(seeds)]
    return {"prompt": rec.prompt, "fixed": fixed, "best_k": best, "best": fixed[best],
            "controller": plain / replay(rec, make_controller())[0],
            "noisy_mean": statistics.mean(noisy) if noisy else None, "noisy_worst": min(noisy, default=None)}


def overall(rows: list[dict]) -> dict:
    """The geometric mean of each column over the prompts: a fixed k is one setting for every prompt,
    "best" the best fixed k of each prompt (a bound no single setting reaches)."""
    def gmean(values) -> float | None:
        values = [v for v in values if v]
        return math.exp(sum(map(math.log, values)) / len(values)) if values else None

    ks = rows[0]["fixed"]
    fixed = {k: gmean(r["fixed"][k] for r in rows) for k in ks}
    return {"prompt": f"all {len(rows)} (geomean)", "fixed": fixed, "best_k": max(fixed, key=fixed.get),
            **{c: gmean(r[c] for r in rows) for c in ("best", "controller", "noisy_mean", "noisy_worst")}}


def add_arguments(p) -> None:
    from specdec.bench.longctx import add_prompt_arguments
    from specdec.arguments import non_negative_float, non_negative_int, positive_int
    from specdec.models import WEIGHTS

    add_prompt_arguments(p, "2048,7000", 256)
    p.add_argument("--drafter", default="streaming", help="a chain drafter: streaming, snapkv (at --budget), "
                                                          "or a registry name (prompt-lookup; not a tree drafter)")
    p.add_argument("--budget", type=positive_int, default=512, help="KV rows of streaming / snapkv")
    p.add_argument("--depth", type=positive_int, default=10, help="tokens drafted per position (the longest fixed k)")
    p.add_argument("--noise", type=non_negative_float, default=0.05,
                   help="sigma of the lognormal noise on step timings")
    p.add_argument("--seeds", type=non_negative_int, default=10, help="noisy replays per prompt")
    p.add_argument("--weights", choices=WEIGHTS, default="fp32",
                   help="the target's weights, as for `specdec generate` (packed: a GGUF's blocks kept packed)")
    p.add_argument("--out", default="results/policy", help="appends OUT.jsonl (recordings); writes OUT.json")


def run(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from specdec.bench.books import BOOKS, INSTRUCTIONS, build_prompts, prompt_key, read_books
    from specdec.bench.longctx import make_drafter, make_methods
    from specdec.controller import DraftLengthController
    from specdec.decoder import SpecDecoderConfig
    from specdec.models import load_model

    lengths = args.lengths  # int_list: positive lengths, checked while parsing
    spec = make_methods([args.drafter], [args.budget])[0]
    if spec.drafter in (None, "none"):
        raise ValueError(f"--drafter {args.drafter!r}: name a chain drafter")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    log = out.with_suffix(".jsonl")
    recordings = {}
    if log.exists():
        for i, line in enumerate(log.read_text().splitlines(), 1):
            if line.strip():
                try:
                    r = Recording.from_json(json.loads(line))
                except (ValueError, KeyError, TypeError, AttributeError) as e:
                    raise ValueError(f"{log}:{i}: not a recording ({type(e).__name__}: {e}); move the file "
                                     "aside to record again") from None
                recordings[r.prompt, r.drafter] = r
    instructions = list(INSTRUCTIONS) if args.instruction == "both" else [args.instruction]
    books = read_books(Path(args.questions) if args.questions else BOOKS)[: args.books]
    keys = [prompt_key((b["id"],), n, ins) for b in books for n in lengths for ins in instructions]
    console = Console(width=max(120, Console().width))
    # recordings are the drafter's on these weights: a packed target's verify costs are another curve
    name = spec.name if args.weights == "fp32" else f"{spec.name} ({args.weights})"
    if any((key, name) not in recordings for key in keys):
        loaded = load_model(args.model, weights=args.weights)
        model = loaded.model
        eos = model.generation_config.eos_token_id
        for prompt in build_prompts(loaded.tokenizer, books, lengths, instructions):
            if (prompt.key, name) in recordings:
                continue
            console.log(f"recording {prompt.key} ({prompt.tokens} tokens), {name}")
            with torch.inference_mode():
                rec = record(model, lambda: make_drafter(spec, model), prompt.input_ids, args.max_new_tokens,
                             eos, prompt.key, args.depth, drafter=name)
            with open(log, "a") as f:
                f.write(json.dumps(asdict(rec)) + "\n")
            recordings[rec.prompt, rec.drafter] = rec
    rows = [compare(recordings[key, name], lambda: DraftLengthController(SpecDecoderConfig().draft_length),
                    args.depth, args.noise, args.seeds) for key in keys]
    rows.append(overall(rows))
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    console.print(table(rows, args, Table))
    return 0


def table(rows: list[dict], args, Table):
    t = Table(title=f"{args.drafter} (budget {args.budget}, {args.weights} weights): speedup over plain decoding "
                    f"on replayed steps (noise sigma {args.noise}, {args.seeds} seeds)")
    for col in ["prompt", *(f"k={k}" for k in range(1, args.depth + 1)), "best", "controller", "vs best",
                "noisy mean", "noisy worst"]:
        t.add_column(col, justify="left" if col == "prompt" else "right")
    for r in rows:
        best = f"{r['best']:.3f}" if r["prompt"].startswith("all") else f"k={r['best_k']}"  # overall: a bound
        t.add_row(r["prompt"], *(f"{r['fixed'][k]:.2f}" for k in range(1, args.depth + 1)), best,
                  f"{r['controller']:.3f}", f"{r['controller'] / r['best'] - 1:+.1%}",
                  f"{r['noisy_mean']:.3f}" if r["noisy_mean"] else "-",
                  f"{r['noisy_worst']:.3f}" if r["noisy_worst"] else "-")
    return t
