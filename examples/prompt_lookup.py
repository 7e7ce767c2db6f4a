"""Prompt lookup vs plain HF generate on a task whose answer copies its input (an edit).

Prompt lookup drafts the tokens that followed the last occurrence of the current n-gram in the text
so far: free drafts, no second model. Both runs are greedy, so the outputs must be identical.

    python examples/prompt_lookup.py [--max-new-tokens 96]
"""
import argparse
import time

import torch

from specdec import PromptLookupDrafter, SpecDecoder
from specdec.drafters.prompt_lookup import PromptLookupConfig
from specdec.models import load_model

TEXT = ("Our team meets every Monday at 10 am in room 4B. Please bring your weekly report, "
        "your questions for the group, and any blockers you want to discuss.")

p = argparse.ArgumentParser()
p.add_argument("--max-new-tokens", type=int, default=96)
args = p.parse_args()

m = load_model("default")
messages = [{"role": "user", "content": f"Rewrite this note, replacing Monday with Tuesday:\n\n{TEXT}"}]
ids = m.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                      return_dict=True)["input_ids"]
eos = m.model.generation_config.eos_token_id
SpecDecoder(m.model).generate(ids, max_new_tokens=2)  # warm-up: first calls pay one-off costs

t = time.perf_counter()
ref = m.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                       do_sample=False, eos_token_id=eos, pad_token_id=eos)
t_hf = time.perf_counter() - t

drafter = PromptLookupDrafter(PromptLookupConfig(max_ngram=3, max_draft=10))  # the defaults, spelled out
t = time.perf_counter()
out = SpecDecoder(m.model, drafter).generate(ids, max_new_tokens=args.max_new_tokens, eos_token_id=eos)
t_pl = time.perf_counter() - t

print(m.tokenizer.decode(out.sequences[0, ids.shape[1]:], skip_special_tokens=True))
print(f"HF generate    {t_hf:6.2f} s")
print(f"prompt lookup  {t_pl:6.2f} s  ({t_hf / t_pl:.2f}x, {out.mean_accepted_tokens:.2f} tokens per forward)")
print("identical to HF generate:", torch.equal(out.sequences, ref))
