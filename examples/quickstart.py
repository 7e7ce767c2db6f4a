"""Quickstart: speed up a HF causal LM with prompt lookup; the output is exactly plain greedy's.

    python examples/quickstart.py [--max-new-tokens 48]
"""
import argparse

import torch

from specdec import PromptLookupDrafter, SpecDecoder
from specdec.models import load_model

p = argparse.ArgumentParser()
p.add_argument("--max-new-tokens", type=int, default=48)
args = p.parse_args()

m = load_model("default")  # SmolLM2-135M-Instruct; any HF causal LM + tokenizer works the same way
ids = m.tokenizer.apply_chat_template([{"role": "user", "content": "Repeat twice: the cat sat on the mat."}],
                                      add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
out = SpecDecoder(m.model, PromptLookupDrafter()).generate(ids, max_new_tokens=args.max_new_tokens)
print(m.tokenizer.decode(out.generated(0), skip_special_tokens=True))
print(f"{out.new_tokens} tokens in {len(out.steps)} target forwards ({out.mean_accepted_tokens:.2f} per forward)")

ref = m.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens, do_sample=False)
print("identical to HF greedy:", torch.equal(out.sequences, ref))
