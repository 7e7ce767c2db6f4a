"""Quickstart: speed up a HF causal LM with prompt lookup; the output is exactly plain greedy's."""
from specdec import PromptLookupDrafter, SpecDecoder
from specdec.models import load_model

m = load_model("default")  # SmolLM2-135M-Instruct; any HF causal LM + tokenizer works the same way
ids = m.tokenizer.apply_chat_template([{"role": "user", "content": "Repeat twice: the cat sat on the mat."}],
                                      add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
out = SpecDecoder(m.model, PromptLookupDrafter()).generate(ids, max_new_tokens=48)
print(m.tokenizer.decode(out.sequences[0, ids.shape[1]:], skip_special_tokens=True))
print(f"{out.new_tokens} tokens in {len(out.steps)} target forwards ({out.mean_accepted_tokens:.2f} per forward)")
