"""Tiny randomly initialised Llama models: the exactness suite's targets (the tests' too)."""

from __future__ import annotations

import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(seed: int = 0, vocab: int = 128, layers: int = 2, max_pos: int = 512,
               dtype: torch.dtype = torch.float64, device: torch.device | str = "cpu",
               kv_heads: int = 2) -> LlamaForCausalLM:
    """A randomly initialised Llama-style model; float64 so greedy argmax has no float ties."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=max_pos,
                      bos_token_id=0, eos_token_id=None, pad_token_id=0)
    return LlamaForCausalLM(cfg).to(dtype=dtype, device=device).eval()


def perturbed(model: LlamaForCausalLM, scale: float, seed: int = 1) -> LlamaForCausalLM:
    """A copy of ``model`` with noise on every weight: a drafter that agrees only partly."""
    g = torch.Generator().manual_seed(seed)
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            noise = torch.randn(p.shape, generator=g, dtype=p.dtype).to(p.device)  # the same noise on any device
            p.add_(noise * scale * p.std())
    return other


def peaked(seed: int, vocab: int = 32, device: torch.device | str = "cpu") -> LlamaForCausalLM:
    """A tiny random Llama whose logits are spread enough (entropy ~1.5 nats) to have structure: a
    fresh init gives near-uniform distributions, under which every sampling rule looks right."""
    m = tiny_llama(seed, vocab=vocab, device=device)
    with torch.no_grad():
        m.lm_head.weight.mul_(20)
    return m


def hf_greedy(model, ids: torch.Tensor, max_new_tokens: int, eos_token_id=None) -> torch.Tensor:
    """HF ``generate``'s greedy output for ``ids`` [B, P] (unpadded) on the model's device, on the host."""
    ids = ids.to(model.device)
    return model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos_token_id,
                          pad_token_id=0, attention_mask=torch.ones_like(ids)).cpu()


def tiny_tokenizer(merges: int = 43):
    """A byte-level BPE tokenizer of 256 byte tokens, ``<eos>`` (id 256) and ``merges`` merges of common
    JSON and English pairs (ids 257...): what a grammar needs to read tokens as bytes, built in-process.
    Pair it with ``tiny_llama(vocab=len(tok))``; the model's EOS is ``tok.eos_token_id``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab["<eos>"] = len(vocab)
    pairs = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("{", '"'), ('"', ":"), ('"', ","), ("Ġ", "a"), ("i", "n"),
             ("e", "r"), ("o", "n"), ("r", "e"), ("a", "t"), ("e", "n"), ("Ġ", "s"), ("e", "s"), ("o", "r"),
             ("a", "n"), ("Ġ", "w"), ("Ġ", "o"), ("i", "s"), ("Ġ", "c"), ("e", "d"), ("Ġ", "b"), ("a", "r"),
             ("Ġ", "f"), ("Ġ", "p"), ("a", "l"), ("i", "t"), ("Ġ", "m"), ("l", "e"), ("o", "u"), ('"', "}"),
             ("n", "a"), ("m", "e"), ("na", "me"), ("a", "g"), ("ag", "e"), ("1", "2"), ("Ġ", "1"), ("t", "r"),
             ("tr", "u"), ("tru", "e"), ("u", "e")][:merges]
    for a, b in pairs:
        vocab[a + b] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=pairs))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>")
