"""Structured output: an answer constrained to a JSON schema, with its logprobs, drafted by ``auto`` (whose
grammar source drafts the tokens the schema forces and the copies it allows) and token-identical to
constrained plain decoding.

    python examples/structured_output.py [--max-new-tokens 96]
"""
import argparse
import json

from specdec import Constraint, SpecDecoder
from specdec.models import load_model
from specdec.registry import make_drafter

p = argparse.ArgumentParser()
p.add_argument("--max-new-tokens", type=int, default=96)
args = p.parse_args()

m = load_model("default")
schema = {"type": "object", "additionalProperties": False, "required": ["city", "country", "population"],
          "properties": {"city": {"type": "string", "maxLength": 40}, "country": {"type": "string", "maxLength": 40},
                         "population": {"type": "integer"}}}
question = "Give the largest city of Japan, its country and its population as JSON."
ids = m.tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
kw = dict(max_new_tokens=args.max_new_tokens, constraint=Constraint.json_schema(schema), tokenizer=m.tokenizer)
fast = SpecDecoder(m.model, make_drafter("auto", m.model)).generate(ids, logprobs=2, **kw)
plain = SpecDecoder(m.model, None).generate(ids, **kw)
text = m.tokenizer.decode(fast.generated(0), skip_special_tokens=True)
print(text)
if fast.num_new[0] < args.max_new_tokens:  # it ended: the grammar let it end only on a whole object
    print("parsed:", json.loads(text))
print("identical to constrained plain decoding:", fast.generated(0).tolist() == plain.generated(0).tolist())
first = fast.logprobs[0][0]
print(f"first token {m.tokenizer.decode([first.token])!r}: logprob {first.logprob:.3f}, "
      f"top {[(m.tokenizer.decode([t]), round(lp, 3)) for t, lp in first.top]}")
print(f"tokens per target forward: {fast.mean_accepted_tokens:.2f}")
