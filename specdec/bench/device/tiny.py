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
