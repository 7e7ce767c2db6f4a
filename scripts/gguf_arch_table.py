"""The GGUF architecture table of docs/benchmarks.md: per fixture of tests/fixtures/gguf/ (files made by
llama.cpp's converter, scripts/make_gguf_fixtures.py) and per load (fp32, packed): the largest logit
difference from the source model's, how many registered drafters give its greedy continuation exactly
(and how many of them had drafts accepted), and plain specdec decoding's speed over HF generate's on the
same loaded target (one process, the two alternating, fastest of --rounds).

    .venv/bin/python scripts/gguf_arch_table.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    from test_gguf_architectures import DRAFTERS, FIXTURES, NAMES, _stand_in

    from specdec import SpecDecoder
    from specdec.models import load_model

    print("| file (architecture) | load | max abs logit difference | drafters exact (accepting) | specdec none / HF generate |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in NAMES:
            src = Path(tmp) / f"{name}.gguf"
            shutil.copy(FIXTURES / f"{name}.gguf", src)  # a fresh file: converted afresh
            ref = load_file(str(FIXTURES / f"{name}.ref.safetensors"))
            prompt, want = ref["prompt"][None], ref["greedy"].tolist()
            for weights in ("fp32", "packed"):
                model = load_model(str(src), weights=weights).model
                with torch.inference_mode():
                    diff = (model(input_ids=prompt).logits[0].float() - ref["logits"]).abs().max().item()
                exact = accepting = 0
                for d in DRAFTERS:
                    out = SpecDecoder(model, _stand_in(d, model, prompt[0].tolist() + want)).generate(
                        prompt, max_new_tokens=len(want), eos_token_id=None)
                    exact += out.generated(0).tolist() == want
                    accepting += out.accepted_per_sequence[0] > 0
                decoder = SpecDecoder(model, None)
                times = {"hf": [], "none": []}
                for _ in range(args.rounds):
                    for method in ("hf", "none"):
                        t = time.perf_counter()
                        if method == "hf":
                            model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                           max_new_tokens=len(want), min_new_tokens=len(want), eos_token_id=None,
                                           pad_token_id=0)
                        else:
                            decoder.generate(prompt, max_new_tokens=len(want), eos_token_id=None)
                        times[method].append(time.perf_counter() - t)
                ratio = min(times["hf"]) / min(times["none"])
                print(f"| {name} | {weights} | {diff:.1e} | {exact}/{len(DRAFTERS)} ({accepting}) | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
