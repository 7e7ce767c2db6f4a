"""EAGLE-2 trees from the head packaged for the default model, checked against plain greedy decoding.

The default tree is small (3 nodes, depth 2, top-k 3: it verifies in 4 rows, specdec.kernels' fast
path); bigger ones accept a little more and cost more on a CPU (sweep in docs/benchmarks.md).
For another target, train a head first (examples/train_eagle.py) and load it with make_eagle(target, DIR).
"""
import torch

from specdec import SpecDecoder
from specdec.drafters.eagle import EagleConfig, EagleDrafter
from specdec.models import load_model

m = load_model("default")
ids = m.tokenizer.apply_chat_template([{"role": "user", "content": "Explain what a hash map is, with an example."}],
                                      add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
drafter = EagleDrafter.default(m.model, EagleConfig(total_tokens=3, depth=2, top_k=3))
out = SpecDecoder(m.model, drafter).generate(ids, max_new_tokens=128)
ref = m.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=128, do_sample=False)
print(m.tokenizer.decode(out.sequences[0, ids.shape[1]:], skip_special_tokens=True))
print(f"identical to greedy: {torch.equal(out.sequences, ref)}; "
      f"{out.mean_accepted_tokens:.2f} tokens per target forward")
