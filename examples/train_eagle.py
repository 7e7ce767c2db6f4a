"""Train an EAGLE head for a target, offline, then draft with it.

The target writes its own training answers to the project's instruction list (self-distillation;
no dataset text), the head learns to predict the target's next feature and token, and the trained
head drafts EAGLE-2 trees. Everything is resumable: run the same command again after a stop.

    python examples/train_eagle.py --out ~/eagle-smollm2            # small: a few minutes
    python examples/train_eagle.py --out ~/eagle-smollm2 --full     # ~45 min on 2 CPU cores

The CLI does the same: ``specdec train-eagle --model default --out DIR --draft-vocab 8192``.
"""
import argparse
from pathlib import Path

from specdec import SpecDecoder
from specdec.drafters.eagle import make_eagle
from specdec.models import load_model
from specdec.training import DataConfig, TrainConfig, encode_prompts, generate_data, read_prompts, train_head

p = argparse.ArgumentParser()
p.add_argument("--out", type=Path, required=True)
p.add_argument("--full", action="store_true", help="all prompts, 256 tokens each, 800 steps")
args = p.parse_args()

m = load_model("default")
prompts = read_prompts() if args.full else read_prompts()[:16]
data = DataConfig(max_new_tokens=256 if args.full else 64)
generate_data(m.model, encode_prompts(m.tokenizer, prompts), args.out / "data", data)
train = TrainConfig(steps=800 if args.full else 60, draft_vocab=8192)
result = train_head(m.model, args.out / "data", args.out, train)
print(f"trained {result.step} steps; held-out top-1 accuracy {result.held_out_accuracy}")

ids = m.tokenizer.apply_chat_template([{"role": "user", "content": "Name three uses of a paperclip."}],
                                      add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
out = SpecDecoder(m.model, make_eagle(m.model, args.out / "head")).generate(ids, max_new_tokens=64)
print(m.tokenizer.decode(out.sequences[0, ids.shape[1]:], skip_special_tokens=True))
print(f"mean accepted tokens per target forward: {out.mean_accepted_tokens:.2f}")
