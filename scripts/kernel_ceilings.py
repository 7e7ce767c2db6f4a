"""What bounds an int8 step on this machine: each op alone, in a loop, with the figures decision 019 cites.

    .venv/bin/python scripts/kernel_ceilings.py --threads 2                  # every part
    .venv/bin/python scripts/kernel_ceilings.py --parts int8 --threads 1     # the int8 kernel per core

- ``int8``: ``quant_linear_i8`` on interleaved random blocks (the default model's and a 0.5B model's shapes,
  and one group of 16 features over 4,864 inputs: the rounding of the rows) at 1, 8 and 64 rows: GMAC/s and
  GB/s of blocks. The weights are reused call after call, so they sit in
  cache: a ceiling of the arithmetic, not of the memory.
- ``kformats``: Q4_K, Q5_K, Q6_K (what Q4_K_M / Q5_K_M files hold) at a 0.5B model's MLP down shape, 1 and
  8 rows, the exact kernel against the int8 one, weights streamed (30 copies or more, past 96 MB, one a call; each
  timed for 3 s).
- ``row-attention``: the int8 numerics' attention of one layer, 3 grouped rows (a decode step), 6, 12 and 24
  (verifies of 2, 4 and 8 rows), 3 KV heads x 64, over 200 keys and a causal draft block, and 3 and 24 rows over
  7,000 keys; K/V in bf16, as the store holds them: microseconds a call (in cache: the same layer every call).
- ``stream``: a 0.5B decode step's linears (``bench-scaling``'s ``0.5b`` shape: per layer q/k/v 1280 x 1024, o
  1024 x 1024, gate/up 9728 x 1024, down 1024 x 4864, 24 layers, then the tied 49,152 x 1024 output layer; random
  Q4_0 and Q4_K blocks, interleaved) at one row, each call on its own weights as a step streams them, beside a
  plain read of as many bytes (torch's sum over 256 MB of float32: what this machine's memory gives these
  threads): ms a step and GB/s of blocks. Where the kernel's GB/s meet the read's, the step's linears are at
  the memory's limit, and what is left of a step is outside them.
- ``calls``: what a ``quant_linear_i8`` call costs besides its products: 1 and 8 rows over 16 features (one unit,
  no fork of the pool), 32 (two units: the pool forks) and 576 / 1,536 features of 576 inputs (Q4_1), beside
  torch's add of two 8 x 576 tensors (the dispatch floor): microseconds a call, best of five loops.
- ``layer-ops``: the small ops between a layer's linears (``add_rms_norm`` twice, ``silu_mul``, ``rope_split``; the
  default model's widths) on 8, 59 and 1,024 rows: microseconds a layer (a verify's rows, a short prompt's, a long
  prompt's chunk).
- ``masks``: a constrained block's -inf where the grammar forbids (1-33 rows of a 49,152-token vocabulary, a
  random bitmask as llguidance fills them): torch's masked_fill over the unpacked bools, llguidance's
  ``apply_token_bitmask_inplace``, the build's ``mask_rows_`` over the words: microseconds a call.
- ``peak``: what the vector units give at most (``scripts/cpu_peak.cpp``, compiled here with ``c++ -O2
  -march=native``; one copy a thread, ``--threads`` of them): multiply-adds a second of 512- and 256-bit VNNI alone,
  of 512-bit fp32 FMA alone, and of the int8 kernel's own arithmetic per row and block (8 vpdpbusd, a convert, a
  product, two FMAs) with every operand in L1: the ceiling the ``int8`` part's figures are a share of. Needs a
  CPU with AVX512-VNNI.
- ``prompt``: torch's SDPA over a 7,000-token prompt, 9 query heads on 3 KV heads of 64 (the default
  model's shape), causal, fp32 / bf16 / fp16 and fp32 without the causal flag, and int8 numerics' bf16 prompt
  attention (``prompt_attention``, where the build has AVX512-BF16): seconds for 30 layers.

Another build to compare (an older commit's kernels): ``--against DIR`` builds DIR's kernel sources (a
``specdec/runtime/csrc`` of that checkout) under their own op namespace, with this variant's flags, and runs
each part on both builds in turn, three times, in this one process: a host's drift between two processes (here
up to a third of a call's time) then falls on both alike. Rows say which build ("this" / "against").

    git worktree add /tmp/before COMMIT
    .venv/bin/python scripts/kernel_ceilings.py --parts row-attention --against /tmp/before/specdec/runtime/csrc
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec.config import RuntimeConfig, current
from specdec.runtime import kernels
from specdec.runtime.build import build_other

# the last, one group of 16 features over 4,864 inputs, is mostly the rounding of the rows (round_rows)
SHAPES = (("Q4_1", 1536, 576), ("Q4_1", 576, 1536), ("Q4_0", 4864, 896), ("Q8_0", 4864, 896), ("Q4_0", 16, 4864))


def timed(fn, calls: int) -> float:
    """Seconds a call of ``fn``, over ``calls`` calls after three to warm up."""
    for _ in range(3):
        fn()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls


def timed_for(fn, seconds: float) -> float:
    """Seconds a call of ``fn``, calling it for ``seconds`` after a pass to warm up."""
    for _ in range(3):
        fn()
    n, t = 0, time.perf_counter()
    while time.perf_counter() - t < seconds:
        fn()
        n += 1
    return (time.perf_counter() - t) / n


def int8(ops) -> list[dict]:
    from specdec.formats import FORMATS, random_blocks  # here: the other parts run from older checkouts too
    try:
        from specdec.runtime.int8_linear import INTERLEAVED, interleave
    except ImportError:  # a checkout from before int8_linear.py split from qlinear.py
        from specdec.runtime.qlinear import INTERLEAVED, interleave

    g = torch.Generator().manual_seed(0)
    rows = []
    for name, n, k in SHAPES:
        fmt = FORMATS[name]
        blocks = interleave(random_blocks(fmt, n, k, g), fmt)
        code = fmt.ggml_type | INTERLEAVED
        for m in (1, 8, 64):
            x = torch.randn(m, k, generator=g)
            s = timed(lambda: ops.quant_linear_i8(x, [blocks], [code]), max(20, 2000 // m))
            rows.append({"format": name, "features": n, "inputs": k, "rows": m, "us": s * 1e6,
                         "gmac_s": m * n * k / s / 1e9, "gb_s": blocks.numel() / s / 1e9})
    return rows


def kformats(ops) -> list[dict]:
    """The K formats of Q4_K_M / Q5_K_M files (a 0.5B model's MLP down shape, 896 x 4864) through the exact
    kernel (file layout) and the int8 kernel (interleaved copy, whole-byte codes for Q5_K / Q6_K) at 1 and
    8 rows, each call on the next of enough distinct copies to pass 96 MB: weights streamed from memory,
    as a decode step streams them, not sitting in cache."""
    from specdec.formats import FORMATS, random_blocks
    from specdec.runtime.int8_linear import INTERLEAVED, interleave

    g = torch.Generator().manual_seed(0)
    n, k = 896, 4864
    out = []
    for name in ("Q4_K", "Q5_K", "Q6_K"):
        fmt = FORMATS[name]
        one = random_blocks(fmt, n, k, g)
        copies = max(30, -(-96 * 2**20 // one.numel()))
        files = [random_blocks(fmt, n, k, g) for _ in range(copies)]
        inter = [interleave(w, fmt) for w in files]
        for m in (1, 8):
            x = torch.randn(m, k, generator=g)
            turn = {"exact": 0, "int8": 0}

            def exact():
                turn["exact"] = (turn["exact"] + 1) % copies
                ops.quant_linear(x, files[turn["exact"]], fmt.ggml_type)

            def int8_call():
                turn["int8"] = (turn["int8"] + 1) % copies
                ops.quant_linear_i8(x, [inter[turn["int8"]]], [fmt.ggml_type | INTERLEAVED])

            e, i = timed_for(exact, 3.0), timed_for(int8_call, 3.0)  # seconds-long: shorter loops hid a 1.4x
            out.append({"format": name, "rows": m, "exact_us": e * 1e6, "int8_us": i * 1e6, "exact_over_int8": e / i,
                        "file_bytes": one.numel(), "int8_bytes": inter[0].numel()})
    return out


STEP_05B = ((1280, 1024), (1024, 1024), (9728, 1024), (1024, 4864))  # one layer's linears (q|k|v, o, gate|up, down)


def stream(ops) -> list[dict]:
    from specdec.formats import FORMATS, random_blocks
    from specdec.runtime.int8_linear import INTERLEAVED, interleave

    g = torch.Generator().manual_seed(0)
    big = torch.randn(64_000_000, generator=g)  # 256 MB
    read = timed_for(big.sum, 3.0)
    out = [{"op": "read (torch.sum)", "ms": read * 1e3, "gb_s": big.numel() * 4 / read / 1e9}]
    del big
    xs = {k: torch.randn(1, k, generator=g) for k in (1024, 4864)}
    for name in ("Q4_0", "Q4_K"):
        fmt = FORMATS[name]
        code = fmt.ggml_type | INTERLEAVED
        calls = [(xs[k], interleave(random_blocks(fmt, n, k, g), fmt)) for _ in range(24) for n, k in STEP_05B]
        calls.append((xs[1024], interleave(random_blocks(fmt, 49152, 1024, g), fmt)))

        def step():
            for x, w in calls:
                ops.quant_linear_i8(x, [w], [code])

        s = timed_for(step, 3.0)
        total = sum(w.numel() for _, w in calls)
        out.append({"op": f"int8 {name} step, 1 row", "ms": s * 1e3, "gb_s": total / s / 1e9, "mb": total / 1e6})
    return out


def masks(ops) -> list[dict]:
    import llguidance.torch as llg

    from specdec.processing.grammar import unpack_bitmask

    g = torch.Generator().manual_seed(0)
    V, out = 49152, []
    for rows in (1, 4, 12, 33):
        bits = torch.randint(-2**31, 2**31 - 1, (rows, V // 32), dtype=torch.int32, generator=g)
        x = torch.randn(rows, V, generator=g)
        allowed = unpack_bitmask(bits, V)
        ways = {"masked_fill": lambda: x.masked_fill_(~allowed, float("-inf")),
                "llguidance": lambda: llg.apply_token_bitmask_inplace(x, bits),
                "mask_rows_": lambda: ops.mask_rows_(x, bits)}
        out += [{"rows": rows, "way": name, "us": timed(fn, 200) * 1e6} for name, fn in ways.items()]
    return out


def calls(ops) -> list[dict]:
    from specdec.formats import FORMATS, random_blocks
    from specdec.runtime.int8_linear import INTERLEAVED, interleave

    g = torch.Generator().manual_seed(0)
    fmt = FORMATS["Q4_1"]
    code = fmt.ggml_type | INTERLEAVED

    def best(fn, n=2000):
        for _ in range(100):
            fn()
        return min(timed(fn, n) for _ in range(5)) * 1e6

    e = torch.randn(8, 576, generator=g)
    out = [{"op": "torch.add 8 x 576", "us": best(lambda: torch.add(e, e))}]
    for n in (16, 32, 576, 1536):
        w = interleave(random_blocks(fmt, n, 576, g), fmt)
        for m in (1, 8):
            x = torch.randn(m, 576, generator=g)
            out.append({"op": f"quant_linear_i8 {n} x 576", "rows": m,
                        "us": best(lambda: ops.quant_linear_i8(x, [w], [code]))})
    return out


def layer_ops(ops) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for rows in (8, 59, 1024):
        x, d, w = (torch.randn(1, rows, 576, generator=g), torch.randn(1, rows, 576, generator=g),
                   torch.randn(576, generator=g))
        gu, qkv = torch.randn(1, rows, 2 * 1536, generator=g), torch.randn(1, rows, 960, generator=g)
        cos, sin = torch.randn(1, rows, 64, generator=g), torch.randn(1, rows, 64, generator=g)
        n = max(5, 2000 // rows)  # calls timed
        norm = timed(lambda: ops.add_rms_norm(x, d, w, 1e-5), n)
        silu = timed(lambda: ops.silu_mul(gu), n)
        rope = timed(lambda: ops.rope_split(qkv, cos, sin, 9, 3), n)
        out.append({"rows": rows, "add_rms_norm_us": norm * 1e6, "silu_mul_us": silu * 1e6,
                    "rope_split_us": rope * 1e6, "layer_us": (2 * norm + silu + rope) * 1e6})
    return out


def row_attention(ops) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    # 3 query heads per KV head x 1, 2, 4 or 8 rows after 200 keys; 1 and 8 rows after 7,000 (a long context)
    for grouped, past in ((3, 200), (6, 200), (12, 200), (24, 200), (3, 7000), (24, 7000)):
        q_rows = grouped // 3
        keys = past + q_rows
        q = torch.randn(1, 3, grouped, 64, generator=g)
        # K/V as an int8 target's store holds them (bf16), in a buffer with room past the rows in use
        k, v = (torch.randn(1, 3, keys + 56, 64, generator=g).to(torch.bfloat16)[:, :, :keys] for _ in range(2))
        bias = torch.zeros(1, 1, q_rows, keys)
        for i in range(q_rows):
            bias[0, 0, i, past + i + 1:] = float("-inf")  # a chain of drafts: each row sees the rows before it
        s = timed(lambda: ops.row_attention(q, k, v, bias, 0.125), 300 if past < 1000 else 30)
        out.append({"grouped_rows": grouped, "keys": keys, "us": s * 1e6, "ms_30_layers": s * 30e3})
    return out


def peak(ops) -> list[dict]:
    """GMAC/s at 1 and ``torch.get_num_threads()`` threads of each test in scripts/cpu_peak.cpp (``ops`` unused:
    the program is its own build)."""
    import subprocess
    import tempfile

    source = Path(__file__).with_name("cpu_peak.cpp")
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "cpu_peak"
        subprocess.run(["c++", "-O2", "-march=native", "-pthread", str(source), "-o", str(exe)], check=True)
        out = []
        for threads in sorted({1, torch.get_num_threads()}):
            lines = subprocess.run([str(exe), str(threads)], check=True, capture_output=True, text=True).stdout
            out += [{"test": name, "threads": threads, "gmac_s": float(v)}
                    for name, v in (line.split() for line in lines.splitlines())]
    return out


def prompt(ops) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for dtype, causal in ((torch.float32, True), (torch.bfloat16, True), (torch.float16, True),
                          (torch.float32, False)):
        q = torch.randn(1, 9, 7000, 64, generator=g).to(dtype)
        k, v = (torch.randn(1, 3, 7000, 64, generator=g).to(dtype) for _ in range(2))
        s = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True), 2)
        out.append({"op": "sdpa", "dtype": str(dtype).removeprefix("torch."), "causal": causal, "s_30_layers": s * 30})
    if ops.prompt_attention_supports(64):
        q = torch.randn(1, 3, 3 * 7000, 64, generator=g)  # grouped: the 3 heads of a KV head as its rows
        k, v = (torch.randn(1, 3, 7000, 64, generator=g) for _ in range(2))
        s = timed(lambda: ops.prompt_attention(q, k, v, 0.125), 2)
        out.append({"op": "prompt_attention", "dtype": "bf16 products", "causal": True, "s_30_layers": s * 30})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="int8,kformats,row-attention,prompt")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kernel", default="native", choices=("native", "avx2"))
    ap.add_argument("--out", default=None, help="JSON file for the figures")
    ap.add_argument("--against", default=None, metavar="CSRC",
                    help="another checkout's specdec/runtime/csrc: its build timed beside this one, in turn")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ops = kernels.extension(RuntimeConfig(kernel=args.kernel))
    if ops is None:
        raise SystemExit(f"the {args.kernel} kernel build is not available here")
    builds = {"this": ops}
    if args.against:
        try:
            builds["against"] = build_other(Path(args.against), args.kernel, "specdec_against", current().cache_dir)
        except FileNotFoundError as e:
            raise SystemExit(f"--against: {e}") from None
    parts = {"int8": int8, "kformats": kformats, "row-attention": row_attention, "prompt": prompt, "stream": stream,
             "masks": masks, "peak": peak, "layer-ops": layer_ops, "calls": calls}
    figures = {}
    for name in args.parts.split(","):
        if name not in parts:
            raise SystemExit(f"--parts: unknown part {name!r} (known: {', '.join(parts)})")
        figures[name] = []
        for _ in range(3 if args.against else 1):
            for label, build in builds.items():
                rows = [{**row, "build": label} if args.against else row for row in parts[name](build)]
                figures[name] += rows
                for row in rows:
                    print(name, {k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()})
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"threads": args.threads, "kernel": args.kernel, **figures}, f, indent=1)


if __name__ == "__main__":
    main()
