"""Two commits of specdec in one process: the same decoders, methods alternating, HF generate beside.

    mkdir -p ab-before && git archive OLD specdec data | tar -x -C ab-before
    .venv/bin/python scripts/ab_commits.py --before ab-before --per-category 2 --batch-size 8

The old tree is imported as ``specdec_before`` (a copy with its imports renamed, and its kernels
under an op namespace of their own), the checkout's ``specdec`` beside it, so both run in one
process and machine noise hits both alike. Each code version loads its own copy of the target
(state a package keeps on a model object stays apart); HF generate runs on a third copy. Per
question the order of methods rotates; the summary gives each method's after / before speed with
a 95% bootstrap interval over the questions, and HF's tokens/s of the run. ``identical``: equal to HF's
greedy output, or with ``--numerics int8`` (a target that is its own reference) to the new tree's ``none``,
which the methods then must include.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch


def stage_before(src: Path, dst: Path) -> None:
    """Copy the old ``specdec`` package to ``dst/specdec_before`` with its imports renamed."""
    out = dst / "specdec_before"
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(src / "specdec", out)
    if (dst / "data").exists():
        shutil.rmtree(dst / "data")
    shutil.copytree(src / "data", dst / "data")  # stored answers: found beside the package
    for f in out.rglob("*.py"):
        text = f.read_text()
        text = re.sub(r"\bspecdec\.", "specdec_before.", text)
        text = re.sub(r"\bfrom specdec import\b", "from specdec_before import", text)
        text = re.sub(r"\bimport specdec\b", "import specdec_before", text)
        f.write_text(text)
    # its kernels under their own op namespace (two builds cannot both register specdec_kernels), and a
    # build key of their own (a header line), so a cached build of the original namespace is not reused
    runtime = out / "runtime" if (out / "runtime" / "build.py").exists() else out  # the layout since issue 37
    k = runtime / ("build.py" if runtime is not out else "kernels.py")
    k.write_text(k.read_text().replace('"specdec_kernels_avx2"', '"specdec_kernels_avx2_before"')
                 .replace('"specdec_kernels"', '"specdec_kernels_before"'))
    with open(runtime / "csrc" / "ops.h", "a") as fh:
        fh.write("// staged as specdec_before\n")


def questions(path: str, per_category: int) -> list[dict]:
    seen: dict[str, int] = {}
    out = []
    for line in open(path):
        q = json.loads(line)
        if seen.get(q["category"], 0) < per_category:
            seen[q["category"]] = seen.get(q["category"], 0) + 1
            out.append(q)
    return out


def bootstrap(ratios: list[float], reps: int = 2000) -> tuple[float, float]:
    rng = random.Random(0)
    means = sorted(statistics.fmean(rng.choices(ratios, k=len(ratios))) for _ in range(reps))
    return means[int(0.025 * reps)], means[int(0.975 * reps)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True, help="a checkout (or git archive) of the old commit")
    ap.add_argument("--questions", default="../shared/specbench/question.jsonl")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--methods", default="none,auto")
    ap.add_argument("--batch-size", type=int, default=0, help="also run batches of this size (0: none)")
    ap.add_argument("--no-batch-1", action="store_true", help="only the batches (with --batch-size)")
    ap.add_argument("--weights", default="fp32", help="the targets' weights (load_model's: fp32, packed, q8_0, ...)")
    ap.add_argument("--numerics", default="exact", choices=("exact", "int8"),
                    help="the targets' numerics (int8: outputs compared with the new tree's none, not HF's)")
    ap.add_argument("--out", default="results/ab.jsonl")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(2)
    stage = Path(args.out).parent / "ab-stage"
    stage_before(Path(args.before), stage)
    sys.path.insert(0, str(stage))
    import specdec_before.models as old_models
    import specdec_before.registry as old_registry
    from specdec_before.decoder import SpecDecoder as OldDecoder

    import specdec.models as new_models
    import specdec.registry as new_registry
    from specdec.decoder import SpecDecoder as NewDecoder

    new_cfg = {}
    try:  # the runtime configuration, read once at the edge (since the redesign)
        from specdec.config import RuntimeConfig
        from specdec.decoder import SpecDecoderConfig

        new_cfg = {"config": SpecDecoderConfig(runtime=RuntimeConfig.from_environ())}
    except ImportError:
        pass

    hf = new_models.load_model("default", weights="fp32")
    tok = hf.tokenizer
    eos = hf.model.generation_config.eos_token_id
    old_m = old_models.load_model("default", weights=args.weights, numerics=args.numerics).model
    new_m = new_models.load_model("default", weights=args.weights, numerics=args.numerics).model
    methods = args.methods.split(",")
    if args.numerics == "int8" and "none" not in methods:
        raise SystemExit("--numerics int8: --methods must include none (the target's own reference)")
    decoders = {}
    for name in methods:
        decoders[("before", name)] = OldDecoder(old_m, old_registry.make_drafter(name, old_m))
        decoders[("after", name)] = NewDecoder(new_m, new_registry.make_drafter(name, new_m), **new_cfg)
    for d in decoders.values():
        d.warm_up()
    qs = questions(args.questions, args.per_category)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q["turns"][0]}], add_generation_prompt=True,
                                       return_tensors="pt", return_dict=True)["input_ids"] for q in qs]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    out = open(args.out, "w")
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    print(f"CPU: {cpu}; {len(qs)} questions, {args.max_new_tokens} tokens, methods {methods}", flush=True)
    keys = [("hf", None)] + list(decoders)
    times: dict = {k: [] for k in keys}
    tokens: dict = {k: [] for k in keys}
    same = {k: 0 for k in decoders}
    for i, (q, ids) in enumerate([] if args.no_batch_1 else zip(qs, prompts)):
        order = keys[i % len(keys):] + keys[: i % len(keys)]  # rotate
        ref = None
        results = {}
        for k in order:
            t0 = time.perf_counter()
            if k[0] == "hf":
                seq = hf.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                                        do_sample=False, eos_token_id=eos, pad_token_id=eos)
            else:
                seq = decoders[k].generate(ids, max_new_tokens=args.max_new_tokens, eos_token_id=eos).sequences
            dt = time.perf_counter() - t0
            results[k] = seq[0, ids.shape[1]:].tolist()
            times[k].append(dt)
            tokens[k].append(len(results[k]))
        ref = results[("hf", None) if args.numerics == "exact" else ("after", "none")]
        for k in decoders:
            same[k] += results[k] == ref
        rec = {"question_id": q["question_id"], "category": q["category"],
               "seconds": {f"{a}:{b}": times[(a, b)][-1] for a, b in keys},
               "tokens": {f"{a}:{b}": tokens[(a, b)][-1] for a, b in keys},
               "identical": {f"{a}:{b}": results[(a, b)] == ref for a, b in decoders}}
        out.write(json.dumps(rec) + "\n")
        out.flush()
        print(i, q["category"], {k: round(v, 2) for k, v in rec["seconds"].items()}, flush=True)
    hf_tps = sum(tokens[("hf", None)]) / max(1e-9, sum(times[("hf", None)]))
    if not args.no_batch_1:
        print(f"\nbatch 1: HF generate {hf_tps:.1f} tokens/s")
    for name in methods if not args.no_batch_1 else []:
        b, a = ("before", name), ("after", name)
        ratios = [tb / ta for tb, ta in zip(times[b], times[a])]  # per question: after's speed over before's
        lo, hi = bootstrap(ratios)
        tb, ta = sum(tokens[b]) / sum(times[b]), sum(tokens[a]) / sum(times[a])
        print(f"  {name:14s} before {tb:6.1f} tok/s ({tb / hf_tps:.2f}x HF, {same[b]}/{len(qs)} identical)  "
              f"after {ta:6.1f} tok/s ({ta / hf_tps:.2f}x HF, {same[a]}/{len(qs)} identical)  "
              f"after/before {ta / tb:.3f}, per-question mean {statistics.fmean(ratios):.3f} (95% {lo:.3f}-{hi:.3f})")
    if args.batch_size > 1:
        B = args.batch_size
        groups = [prompts[i:i + B] for i in range(0, len(prompts) - B + 1, B)]
        bt: dict = {k: [] for k in decoders}
        bsame = {k: 0 for k in decoders}
        hf_b: list[float] = []
        for gi, group in enumerate(groups):
            plist = [p[0] for p in group]
            order = list(decoders)[gi % len(decoders):] + list(decoders)[: gi % len(decoders)]
            outs = {}
            for k in order:
                t0 = time.perf_counter()
                o = decoders[k].generate(plist, max_new_tokens=args.max_new_tokens, eos_token_id=eos)
                bt[k].append(time.perf_counter() - t0)
                outs[k] = [o.generated(b).tolist() for b in range(len(plist))]
            width = max(len(p) for p in plist)  # HF's batched generate, left-padded, beside them
            ids = torch.full((len(plist), width), eos, dtype=torch.long)
            mask = torch.zeros(len(plist), width, dtype=torch.long)
            for b, p in enumerate(plist):
                ids[b, width - len(p):], mask[b, width - len(p):] = p, 1
            t0 = time.perf_counter()
            hf.model.generate(ids, attention_mask=mask, max_new_tokens=args.max_new_tokens, do_sample=False,
                              eos_token_id=eos, pad_token_id=eos)
            hf_b.append(time.perf_counter() - t0)
            for name in methods:
                ok = outs[("before", name)] == outs[("after", name)]
                bsame[("after", name)] += ok
            print("batch", gi, {f"{a}:{b}": round(v[-1], 2) for (a, b), v in bt.items()}, "hf", round(hf_b[-1], 2),
                  flush=True)
            out.write(json.dumps({"batch": gi, "hf": hf_b[-1],
                                  "seconds": {f"{a}:{b}": v[-1] for (a, b), v in bt.items()}}) + "\n")
            out.flush()
        print(f"\nbatch {B}: {len(groups)} batches, HF batched generate {sum(hf_b):.1f} s")
        for name in methods:
            b, a = ("before", name), ("after", name)
            ratios = [tb / ta for tb, ta in zip(bt[b], bt[a])]
            print(f"  {name:14s} before {sum(bt[b]):6.1f} s ({sum(hf_b) / sum(bt[b]):.2f}x HF)  after {sum(bt[a]):6.1f} s "
                  f"({sum(hf_b) / sum(bt[a]):.2f}x HF)  after/before speed "
                  f"{sum(bt[b]) / sum(bt[a]):.3f} (per batch {min(ratios):.3f}-{max(ratios):.3f}); "
                  f"rows identical before vs after: {bsame[a]}/{len(groups)} batches")


if __name__ == "__main__":
    main()
