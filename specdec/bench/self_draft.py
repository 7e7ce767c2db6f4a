"""`specdec bench-scaling --self-draft bfloat16`: what the quantized self-drafter costs on a
higher-precision target of a size no package ships.

    specdec bench-scaling --self-draft bfloat16 --shapes 0.5b,1.5b --tokens 64

Per shape (``specdec.quant.write.SHAPES``), in a fresh process: a random-weight Llama of that shape in
the given dtype, and in one rotation (two rounds, each method decoding the same random prompt, EOS
ignored): the target's plain decoding, ``quant-self@k=3`` (its Q4_0 copy drafting 3 tokens a step), and
the draft model decoding alone (its own step's cost). Random weights agree with their Q4_0 copy less than
trained ones, so the measured tau is not the point; the costs are: a draft step over a target step (c),
a 4-row verify over a target step (v), and the speedup they predict at tau 3 (the issue's bar):
3 / (3 c + v). A real model's tau: ``specdec bench --drafters none,quant-self@k=3 --dtype bfloat16``.
"""

from __future__ import annotations

import time

PREDICT_TAU = 3.0  # the tau the cost model's prediction assumes (the bar for this drafter)
K = 3  # tokens a draft: the fixed setting measured
DRAFT = f"quant-self@k={K}"


def random_model(shape_name: str, dtype_name: str, seed: int = 0):
    """A randomly initialised LlamaForCausalLM of a named shape, built directly in ``dtype_name``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdec.arguments import MODEL_DTYPES
    from specdec.quant.write import SHAPES

    s = SHAPES[shape_name]
    cfg = LlamaConfig(vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.intermediate,
                      num_hidden_layers=s.layers, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                      tie_word_embeddings=s.tied, max_position_embeddings=s.context, rope_theta=s.rope_theta,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    return LlamaForCausalLM._from_config(cfg, dtype=MODEL_DTYPES[dtype_name]).eval()


def measure(shape_name: str, dtype_name: str, prompt: list[int], tokens: int, threads: int, seed: int = 0,
            rounds: int = 2) -> dict:
    """The costs above for one shape (run it in a fresh process: ``scaling.in_fresh_process``)."""
    import torch

    from specdec import SpecDecoder
    from specdec.bench.runner import make_decoder

    torch.set_num_threads(threads)
    model = random_model(shape_name, dtype_name, seed)
    spec = make_decoder(model, DRAFT)
    methods = {"none": SpecDecoder(model, None), DRAFT: spec, "draft alone": SpecDecoder(spec.drafter.draft, None)}
    x = torch.tensor([prompt], dtype=torch.long)
    for d in methods.values():
        d.generate(x, max_new_tokens=4, eos_token_id=[])  # one-off costs: fused copies, kernels' first calls
    seconds = dict.fromkeys(methods, 0.0)
    steps, new, verify = dict.fromkeys(methods, 0), dict.fromkeys(methods, 0), 0.0
    for r in range(rounds):
        for name in list(methods)[r % len(methods):] + list(methods)[:r % len(methods)]:
            events: list[tuple[float, int, float]] = []  # per step: when it ended, its tokens, its verify
            methods[name].generate(x, max_new_tokens=tokens, eos_token_id=[], callback=lambda e: events.append(
                (time.perf_counter(), len(e.tokens), e.stats.verify_time)))
            seconds[name] += events[-1][0] - events[0][0]  # the decode phase: after the prefill's step
            steps[name] += len(events) - 1
            new[name] += sum(n for _, n, _ in events[1:])
            verify += sum(v for _, _, v in events[1:]) if name == DRAFT else 0.0
    ms = {n: 1000 * seconds[n] / steps[n] for n in methods}  # per step (per token without a drafter)
    target, draft = ms["none"], ms["draft alone"]
    verify_ms = 1000 * verify / steps[DRAFT]
    return {"shape": shape_name, "dtype": dtype_name, "tokens": tokens, "prompt_tokens": len(prompt),
            "threads": threads, "target_ms": target, "draft_ms": draft, "verify_ms": verify_ms,
            "c": draft / target, "v": verify_ms / target,
            "predicted_speedup": PREDICT_TAU * target / (K * draft + verify_ms),
            "tau": new[DRAFT] / steps[DRAFT],
            "speedup": (new[DRAFT] / seconds[DRAFT]) / (new["none"] / seconds["none"])}


def table(entries: list[dict]):
    from rich.table import Table

    t = Table(title=f"The quantized self-drafter ({DRAFT}) on random-weight targets: per-step costs "
                    f"(decode phase) and the speedup they predict at tau {PREDICT_TAU:g}")
    # c = draft step / target step, v = 4-row verify / target step; "x none": measured over plain decoding
    for col in ("shape", "dtype", "target ms", "draft ms", "verify ms", "c", "v", f"x at tau {PREDICT_TAU:g}",
                "tau", "x none"):
        t.add_column(col, justify="left" if col in ("shape", "dtype") else "right")
    for e in entries:
        t.add_row(e["shape"], e["dtype"], f"{e['target_ms']:.1f}", f"{e['draft_ms']:.1f}", f"{e['verify_ms']:.1f}",
                  f"{e['c']:.2f}", f"{e['v']:.2f}", f"{e['predicted_speedup']:.2f}x", f"{e['tau']:.2f}",
                  f"{e['speedup']:.2f}x")
    return t
