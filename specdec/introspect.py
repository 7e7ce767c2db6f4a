"""What a loaded model is, read off the module and its config: the language part's config, the
vocabulary its logits cover, its float dtype, one token's K/V shape, its attention window. The
runtime, the session, the drafters and the KV store ask these; loading a model is ``specdec.models``.
"""

from __future__ import annotations

import torch


def text_config(model):
    """The config of a model's language part (a multimodal model's text config; else its own)."""
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def vocab_size_of(model) -> int:
    """Rows of the output layer (an nn.Linear or a quantized one): the id space a model's logits cover."""
    out = model.get_output_embeddings()
    return out.out_features if out is not None else model.config.vocab_size


def float_dtype(model, default: torch.dtype = torch.float32) -> torch.dtype:
    """The dtype of a model's first floating parameter (HF's ``model.dtype``, for any module), or ``default``."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), default)


def attention_shape(model) -> tuple[int, int, int]:
    """(layers, K/V heads, head dim) of a model's attention: what one token's K/V rows are."""
    cfg = text_config(model)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return cfg.num_hidden_layers, kv_heads, head_dim


def sliding_window(cfg) -> int | None:
    """The window of a model whose attention (in any layer) sees only its last W tokens, or None."""
    w = getattr(cfg, "sliding_window", None)
    if w is None or getattr(cfg, "use_sliding_window", True) is False:
        return None
    types = getattr(cfg, "layer_types", None)
    return int(w) if types is None or "sliding_attention" in types else None
