"""Forwards of a HF causal LM for the decoder: a prefill, and a block of rows laid into a BMC store.

Attention over a ragged batch (rows of different committed lengths) takes one of two shapes, after
BASS (Qian et al., 2024):

    PAD    one batched attention over the store's view of max(lengths) + Q rows; each row's unused
           columns are hidden by the additive bias. Padded work grows with the length spread.
    SPLIT  attention per row over its own lengths[b] + Q columns (no padded work), the linear
           layers still batched. Costs B small attention calls per layer instead of one.

Worked example: lengths [200, 4000], Q = 4. PAD attends 2 x 4004 columns (3800 of row 0's hidden);
SPLIT attends 204 + 4004. SPLIT is registered with transformers' ``AttentionInterface`` and calls
HF's own SDPA function on each row's slice, so the math is HF's.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from specdec.kv.bmc import BMCCache

SPLIT = "specdec_split"  # the attention implementation name SPLIT runs under
_split_ends: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("specdec_split_ends", default=None)


def _split_attention(module, query, key, value, attention_mask, **kwargs):
    """HF's SDPA per batch row over that row's own columns. query [B, Hq, Q, D], key/value
    [B, Hkv, L, D] (the store's view), attention_mask [B, 1, Q, L]; row b attends columns [0, ends[b])."""
    ends = _split_ends.get()
    assert ends is not None and len(ends) == query.shape[0], "SPLIT attention outside forward_block"
    outs = [sdpa_attention_forward(module, query[b : b + 1], key[b : b + 1, :, :e], value[b : b + 1, :, :e],
                                   attention_mask[b : b + 1, :, :, :e], **kwargs)[0]
            for b, e in enumerate(ends)]
    return torch.cat(outs), None  # [B, Q, Hq, D], as HF's SDPA returns it


AttentionInterface.register(SPLIT, _split_attention)


@dataclass(frozen=True)
class BlockOutput:
    logits: torch.Tensor  # [B, Q, V]
    hidden: torch.Tensor | None  # [B, Q, D] last hidden state (after the final norm), if asked


@torch.inference_mode()
def forward_block(model, cache: BMCCache, input_ids: torch.Tensor, block_mask: torch.Tensor | None,
                  depth: torch.Tensor | None, want_hidden: bool = False, split: bool = False) -> BlockOutput:
    """input_ids [B, Q]; block_mask [B, Q, Q] bool; depth [B, Q] position offsets within the block.

    block_mask = depth = None means a causal block (chain, plain decode): the store's fast path.
    split: SPLIT attention (per row over its own length) instead of PAD.
    """
    if block_mask is None:
        inputs = cache.prepare_chain(input_ids.shape[1])
    else:
        inputs = cache.prepare(block_mask, depth)
    if split and cache.batch_size > 1:
        # every attention layer reads the implementation from the shared config at call time
        q = input_ids.shape[1]
        token = _split_ends.set([n + q for n in cache.lengths])
        config = model.config
        saved = config._attn_implementation
        config._attn_implementation = SPLIT
    try:
        out = model(
            input_ids=input_ids.to(model.device),
            position_ids=inputs.position_ids,
            attention_mask=inputs.attention_mask,  # 4D additive bias: HF uses it as given
            past_key_values=cache,
            use_cache=True,
            output_hidden_states=want_hidden,
        )
    finally:
        if split and cache.batch_size > 1:
            config._attn_implementation = saved
            _split_ends.reset(token)
    hidden = out.hidden_states[-1] if want_hidden else None  # HF applies the final norm already
    return BlockOutput(out.logits, hidden)


@dataclass(frozen=True)
class Prefill:
    logits: torch.Tensor  # [G, V] the target's logits after each prompt's last token
    hidden: torch.Tensor | None  # [G, P, D] last hidden states at every prompt position, if asked
    layers: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values) [G, H, P, D]


@torch.inference_mode()
def prefill(model, input_ids: torch.Tensor, want_hidden: bool = False) -> Prefill:
    """G prompts of one length [G, P], exactly as HF ``generate`` prefills an unpadded batch: a
    DynamicCache, no explicit mask (SDPA's causal fast path: a 4D bias at 7k tokens took attention's
    masked path, ~2x HF's time), logits for the last position only (the lm_head over 49k tokens x P
    rows would cost more than the prompt's attention). The caller copies the K/V into its store."""
    cache = DynamicCache()
    out = model(input_ids=input_ids.to(model.device), past_key_values=cache, use_cache=True,
                output_hidden_states=want_hidden, logits_to_keep=1)
    layers = [(layer.keys, layer.values) for layer in cache.layers]
    hidden = out.hidden_states[-1] if want_hidden else None
    return Prefill(out.logits[:, -1], hidden, layers)
