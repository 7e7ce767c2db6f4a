"""EAGLE-2 trees from the head packaged for the default model, checked against plain greedy decoding.

The default tree is small (6 nodes, depth 3, top-k 3: it verifies in 7 rows, which specdec.runtime.kernels
makes cheap); deeper ones accept a little more and cost a head forward per level (sweep in
docs/benchmarks.md).
For another target, train a head first (examples/train_eagle.py) and load it with make_eagle(target, DIR).

    python examples/eagle.py [--max-new-tokens 128]
"""
import argparse

import torch

from specdec import SpecDecoder
from specdec.drafters.eagle import EagleConfig, EagleDrafter
from specdec.models import load_model

p = argparse.ArgumentParser()
p.add_argument("--max-new-tokens", type=int, default=128)
args = p.parse_args()

m = load_model("default")
ids = m.tokenizer.apply_chat_template([{"role": "user", "content": "Explain what a hash map is, with an example."}],
                                      add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
drafter = EagleDrafter.default(m.model, EagleConfig(total_tokens=6, depth=3, top_k=3))
out = SpecDecoder(m.model, drafter).generate(ids, max_new_tokens=args.max_new_tokens)
ref = m.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens, do_sample=False)
print(m.tokenizer.decode(out.sequences[0, ids.shape[1]:], skip_special_tokens=True))
print(f"identical to greedy: {torch.equal(out.sequences, ref)}; "
      f"{out.mean_accepted_tokens:.2f} tokens per target forward")
