"""Sampling: temperature, top-k and top-p as HF ``generate`` takes them. Drafts are accepted by rejection
sampling against the target's processed distribution, so samples are distributed exactly as the target's
own; a seed repeats a sample where the drafts repeat too (a controller that sizes drafts by the draft
lengths alone, not by timings).

    python examples/sampling.py [--max-new-tokens 48]
"""
import argparse

from specdec import PromptLookupDrafter, SpecDecoder, SpecDecoderConfig
from specdec.controller import DraftLengthConfig
from specdec.models import load_model

p = argparse.ArgumentParser()
p.add_argument("--max-new-tokens", type=int, default=48)
args = p.parse_args()

m = load_model("default")
ids = m.tokenizer.apply_chat_template([{"role": "user", "content": "Write a one-line poem about the sea."}],
                                      add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
repeatable = SpecDecoderConfig(draft_length=DraftLengthConfig(cost_aware=False))  # drafts sized without timings


def sample(seed: int) -> str:
    decoder = SpecDecoder(m.model, PromptLookupDrafter(), repeatable)
    out = decoder.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=True, temperature=0.8, top_k=50,
                           top_p=0.95, seed=seed)
    return m.tokenizer.decode(out.generated(0), skip_special_tokens=True)


first, other, again = sample(1), sample(2), sample(1)
print(f"seed 1: {first}\nseed 2: {other}")
print("seed 1 again gives the same text:", again == first)
