"""A draft *model*: any causal LM that shares the target's vocabulary drafts K tokens per step.

Here the draft model is the target's own first 10 of 30 layers (early exit: no extra weights, same
vocabulary by construction). With a separate small model it is the same line:
``ModelDrafter(AutoModelForCausalLM.from_pretrained(small_model_dir))``.

    python examples/model_drafter.py [--layers 10] [--max-new-tokens 64]
"""
import argparse
import time

from specdec import ModelDrafter, SpecDecoder
from specdec.drafters.early_exit import early_exit_model
from specdec.models import load_model

p = argparse.ArgumentParser()
p.add_argument("--layers", type=int, default=10, help="target layers the draft model keeps")
p.add_argument("--max-new-tokens", type=int, default=64)
args = p.parse_args()

m = load_model("default")
draft_model = early_exit_model(m.model, args.layers)  # shares every tensor with the target
ids = m.tokenizer.apply_chat_template([{"role": "user", "content": "List three uses of a paperclip."}],
                                      add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
SpecDecoder(m.model).generate(ids, max_new_tokens=2)  # warm-up: first calls pay one-off costs

for name, drafter in [("no drafter", None), (f"early exit ({args.layers} layers)", ModelDrafter(draft_model))]:
    t = time.perf_counter()
    out = SpecDecoder(m.model, drafter).generate(ids, max_new_tokens=args.max_new_tokens)
    dt = time.perf_counter() - t
    drafted = sum(s.num_drafted[0] for s in out.steps)
    accepted = sum(s.num_accepted[0] for s in out.steps)
    print(f"{name:26s} {out.new_tokens / dt:6.1f} tokens/s  {out.mean_accepted_tokens:.2f} tokens per forward"
          f"  ({accepted}/{drafted} drafted tokens accepted)")
print(m.tokenizer.decode(out.sequences[0, ids.shape[1]:], skip_special_tokens=True))
