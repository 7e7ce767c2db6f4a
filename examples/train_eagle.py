"""Train an EAGLE head for a target, offline, then draft with it.

The target writes its own training answers to the project's instruction list (self-distillation;
no dataset text), the head learns to predict the target's next feature and token, and the trained
head drafts EAGLE-2 trees. Everything is resumable: run the same command again after a stop.

    python examples/train_eagle.py --out ~/eagle-smollm2            # small: a few minutes
    python examples/train_eagle.py --out ~/eagle-smollm2 --full     # ~45 min on 2 CPU cores
    python examples/train_eagle.py --out /tmp/e --prompts 4 --steps 4 --answer-tokens 8   # seconds: it runs

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
p.add_argument("--prompts", type=int, default=16, help="instructions answered for training (without --full)")
p.add_argument("--steps", type=int, default=60, help="optimizer steps (without --full)")
p.add_argument("--answer-tokens", type=int, default=64, help="tokens of each training answer (without --full)")
p.add_argument("--max-new-tokens", type=int, default=64, help="of the answer drafted with the trained head")
args = p.parse_args()

m = load_model("default", weights="fp32")  # training reads the target's fp32 output layer
prompts = read_prompts() if args.full else read_prompts()[:args.prompts]
data = DataConfig(max_new_tokens=256 if args.full else args.answer_tokens)
generate_data(m.model, encode_prompts(m.tokenizer, prompts), args.out / "data", data)
train = TrainConfig(steps=800 if args.full else args.steps, draft_vocab=8192)
result = train_head(m.model, args.out / "data", args.out, train)
print(f"trained {result.step} steps; held-out top-1 accuracy {result.held_out_accuracy}")

ids = m.tokenizer.apply_chat_template([{"role": "user", "content": "Name three uses of a paperclip."}],
                                      add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
out = SpecDecoder(m.model, make_eagle(m.model, args.out / "head")).generate(ids, max_new_tokens=args.max_new_tokens)
print(m.tokenizer.decode(out.sequences[0, ids.shape[1]:], skip_special_tokens=True))
print(f"mean accepted tokens per target forward: {out.mean_accepted_tokens:.2f}")
