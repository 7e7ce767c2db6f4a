"""A self-speculative draft over part of the vocabulary (``drafters.vocab``): its output layer computes the
frequent ids and the prompt's only, it never proposes another id, and the output stays the target's."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn as nn
from transformers import LlamaConfig

from conftest import hf_greedy, sampled_pairs, tiny_llama
from specdec.bench.device.tiny import peaked
from specdec import SpecDecoder, SpecDecoderConfig
from specdec.controller import DraftLengthConfig
from specdec.drafters.quant_self import QuantSelfDrafter
from specdec.drafters.self_spec import SnapKVDrafter, StreamingDrafter
from specdec.drafters.vocab import DraftVocabulary, VocabHead, packaged_vocabulary
from specdec.quant import FORMATS, QuantLinear
from specdec.formats import random_blocks
from test_quant import tiny_quant_llama

ALWAYS_DRAFT = SpecDecoderConfig(draft_length=DraftLengthConfig(cost_aware=False, initial=3))


@pytest.mark.parametrize("kind", ["linear", "Q8_0"])
def test_vocab_head_is_the_full_layer_at_its_ids_and_minus_inf_elsewhere(kind):
    g = torch.Generator().manual_seed(0)
    if kind == "linear":
        head = nn.Linear(64, 50, bias=True)
    else:
        head = QuantLinear(random_blocks(FORMATS["Q8_0"], 50, 64, g), FORMATS["Q8_0"], 64)
    ids = torch.tensor([0, 3, 17, 49])
    x = torch.randn(2, 3, 64, generator=g)
    with torch.inference_mode():
        full, sub = head(x), VocabHead(head, ids)(x)
        restricted = VocabHead(head, ids).restrict(full)
    assert sub.shape == full.shape
    assert torch.allclose(sub[..., ids], full[..., ids], rtol=1e-5, atol=1e-5)
    off = torch.ones(50, dtype=torch.bool)
    off[ids] = False
    assert torch.isneginf(sub[..., off]).all() and torch.isneginf(restricted[..., off]).all()
    assert torch.equal(restricted[..., ids], full[..., ids])


def test_a_draft_vocabulary_adds_each_prompts_ids_and_refuses_ids_outside_the_target():
    vocab = DraftVocabulary(torch.tensor([9, 2, 2, 5]), vocab_size=12)
    assert vocab.frequent.tolist() == [2, 5, 9]
    assert vocab.ids_for(torch.tensor([[7, 2], [11, 0]])).tolist() == [0, 2, 5, 7, 9, 11]
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 12\)"):
        DraftVocabulary(torch.tensor([3, 12]), vocab_size=12)
    with pytest.raises(ValueError, match="non-empty 1-D tensor of token ids"):
        DraftVocabulary(torch.tensor([0.5]), vocab_size=12)


def test_the_packaged_vocabulary_fits_the_default_models_shape_only():
    default = LlamaConfig(vocab_size=49152, hidden_size=576, num_hidden_layers=30)
    vocab = packaged_vocabulary(types.SimpleNamespace(config=default))
    assert vocab is not None and vocab.frequent.numel() == 8192 and int(vocab.frequent.max()) < 49152
    assert packaged_vocabulary(tiny_llama(0)) is None


def _drafted_ids(drafter) -> list[int]:
    """Spy on ``drafter.propose``: every id it drafts lands in the returned list."""
    seen: list[int] = []
    real = drafter.propose

    def propose(budget):
        tree = real(budget)
        seen.extend(tree.tokens.reshape(-1).tolist())
        return tree

    drafter.propose = propose
    return seen


MAKERS = {
    "streaming": lambda target, vocab: StreamingDrafter(target, budget=12, sink=2, overshoot=4, vocab=vocab),
    "snapkv": lambda target, vocab: SnapKVDrafter(target, budget=12, window=4, kernel=3, overshoot=4, vocab=vocab),
    "quant-self": lambda target, vocab: QuantSelfDrafter(target, vocab=vocab),
}


@pytest.mark.parametrize("kind", [*MAKERS, "streaming-eager"])
def test_a_draft_over_its_vocabulary_proposes_only_those_ids_and_stays_the_targets_greedy(kind):
    """The lean forward computing the head for the ids only (a float64 target for the compressed drafters, a
    Q4_1 one for quant-self), and HF's forward restricting its logits (eager attention); drafts partly
    accepted."""
    target = tiny_quant_llama("Q4_1") if kind == "quant-self" else tiny_llama(3, layers=2)
    if kind == "streaming-eager":
        target.config._attn_implementation = "eager"  # forward_block leaves it to HF's forward
        kind = "streaming"
    V = target.config.vocab_size
    ids = torch.randint(1, V, (1, 40), generator=torch.Generator().manual_seed(5))
    want = hf_greedy(target, ids, 24)
    vocab = DraftVocabulary(torch.arange(0, V, 3), V)  # a third of the ids, and the prompt's
    allowed = set(vocab.ids_for(ids).tolist())
    full = MAKERS[kind](target, None)
    drafted_full = _drafted_ids(full)
    SpecDecoder(target, full, ALWAYS_DRAFT).generate(ids, max_new_tokens=24)
    assert set(drafted_full) - allowed  # without the vocabulary the draft proposes other ids too
    drafter = MAKERS[kind](target, vocab)
    drafted = _drafted_ids(drafter)
    out = SpecDecoder(target, drafter, ALWAYS_DRAFT).generate(ids, max_new_tokens=24)
    assert torch.equal(out.sequences, want)
    assert drafted and set(drafted) <= allowed
    assert 0 < sum(sum(s.num_accepted) for s in out.steps) < sum(sum(s.num_drafted) for s in out.steps)


def test_streaming_over_a_vocabulary_samples_as_the_target_does():
    """Sampled: q is the restricted draft's (zero off the vocabulary), and the first two new tokens follow
    the target's own joint distribution (20,000 samples; ids outside the vocabulary among them)."""
    from specdec.bench.distribution import pair_mismatch, two_token_tables
    from specdec.sampling import SamplingParams

    target = peaked(7)
    V = target.config.vocab_size
    prompt = torch.tensor([[1, 5, 7, 5, 7, 9]])
    with torch.inference_mode():
        p1, p2 = two_token_tables(target, prompt, SamplingParams.resolve(target, temperature=0.8))
    vocab = DraftVocabulary(torch.arange(0, V, 2), V)  # the even ids, and the prompt's
    pairs, drafted, _ = sampled_pairs(target, StreamingDrafter(target, budget=3, sink=1, overshoot=1, vocab=vocab),
                                      prompt)
    assert drafted > 0
    off = ~torch.isin(pairs[:, 1], vocab.ids_for(prompt))
    assert off.any()  # the target's own tokens off the vocabulary still come (the residual)
    mismatch = pair_mismatch(pairs, p1[:, None] * p2)
    assert mismatch is None, mismatch
