"""Several prompts at once: each sequence accepts its own number of drafted tokens per step (BASS),
stops on its own, and leaves the batch when done. Every answer equals HF greedy of its prompt alone.

    python examples/batch.py [--max-new-tokens 64]
"""
import argparse
import time

import torch

from specdec import PromptLookupDrafter, SpecDecoder
from specdec.models import load_model

p = argparse.ArgumentParser()
p.add_argument("--max-new-tokens", type=int, default=64)
args = p.parse_args()

m = load_model("default")
questions = ["Summarize: the meeting moved from Monday to Tuesday, and the room moved from A to B.",
             "Name three primary colours.",
             "Write a Python function that returns the square of a number.",
             "Translate to French: good morning, how are you?"]
prompts = [m.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)["input_ids"][0] for q in questions]

decoder = SpecDecoder(m.model, PromptLookupDrafter())
t = time.perf_counter()
out = decoder.generate(prompts, max_new_tokens=args.max_new_tokens)  # a list of 1-D prompts; or padded ids + attention_mask
dt = time.perf_counter() - t
for b, q in enumerate(questions):
    print(f"--- {q}\n{m.tokenizer.decode(out.generated(b), skip_special_tokens=True)}")
    print(f"    ({out.num_new[b]} tokens, {out.steps_per_sequence[b]} target forwards, "
          f"{out.accepted_per_sequence[b]} drafted tokens accepted)")
print(f"{out.new_tokens} tokens in {dt:.1f} s = {out.new_tokens / dt:.1f} tokens/s for the batch")

alone = SpecDecoder(m.model).generate(prompts[1], max_new_tokens=args.max_new_tokens)  # one prompt, no drafter
print("the second answer equals its prompt's alone:", torch.equal(out.generated(1), alone.generated(0)))
