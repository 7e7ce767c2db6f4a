"""Forwards of a HF causal LM for the decoder: a prefill, and a block of rows laid into a BMC store.

Attention over a ragged batch (rows of different committed lengths) takes one of two shapes, after
BASS (Qian et al., 2024):

    PAD    one batched attention over the store's view of max(lengths) + Q rows; each row's unused
           columns are hidden by the additive bias. Padded work grows with the length spread.
    SPLIT  attention per row over its own lengths[b] + Q columns (no padded work), the linear
           layers still batched. Costs B small attention calls per layer instead of one.

Worked example: lengths [200, 4000], Q = 4. PAD attends 2 x 4004 columns (3800 of row 0's hidden);
SPLIT attends 204 + 4004.

Both run through ``grouped_attention`` (registered with transformers' ``AttentionInterface``), not
HF's SDPA function: for a block of Q > 1 rows with a mask, HF copies every K/V head once per query
head sharing it (``repeat_kv``; 3x for the default model's 9 query / 3 KV heads): at 7k tokens
that copy was ~1 GB per step and made a 2-row verify cost 2.2x a 1-row step. Grouping the queries
instead ([B, 9, Q, D] -> [B, 3, 3Q, D], the mask repeated to match) reads the store's K/V in place,
as HF itself does for Q = 1. Where the kernel self-check found it faster, the grouped rows go to
``kernels.attention`` instead of SDPA (the mask then not repeated: grouped rows share their
position's row of it).
"""

from __future__ import annotations

import contextvars
import inspect
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from specdec.runtime import fastpath, kernels
from specdec.kv.bmc import BMCCache

PAD, SPLIT = "specdec_pad", "specdec_split"  # the attention implementation names the blocks run under
_split_ends: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("specdec_split_ends", default=None)
# the mask repeated for grouped queries, made by the forward's first layer and reused by the others
_grouped_masks: contextvars.ContextVar[dict | None] = contextvars.ContextVar("specdec_grouped_masks", default=None)


def grouped_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """SDPA with grouped-query attention by grouping queries, never copying K/V.

    query [B, Hq, Q, D], key/value [B, Hkv, L, D] (a view of the store), attention_mask [B, 1, Q, L]
    additive. Query head h uses KV head h // n (n = Hq / Hkv, HF's ``repeat_kv`` order), so the n heads
    of a group become n x Q query rows of their KV head: row r * Q + i is head r's query i, and the
    mask is repeated n times along the rows. Returns [B, Q, Hq, D], as HF's SDPA function does.
    Example: Hq 9, Hkv 3, Q 4 -> query [B, 3, 12, D] against K/V [B, 3, L, D], mask [B, 1, 12, L].
    """
    B, Hq, Q, D = query.shape
    n = Hq // key.shape[1]
    plain = not (module.training or kwargs.get("sliding_window") or kwargs.get("position_bias") is not None)
    if plain and (attention_mask is not None or Q == 1):  # a causal block without a mask needs SDPA's flag
        mask = attention_mask if attention_mask is None else attention_mask[..., : key.shape[2]]
        out = kernels.attention(query.reshape(B, Hq // n, n * Q, D), key, value, mask,
                                scaling if scaling is not None else D**-0.5)
        if out is not None:  # the kernel, where the self-check found it faster than SDPA
            return out.view(B, Hq, Q, D).transpose(1, 2).contiguous(), None
    if attention_mask is None or n == 1 or not plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    query = query.reshape(B, Hq // n, n * Q, D)
    if Q > 1:  # a [B, 1, 1, L] mask broadcasts over the grouped rows as it is
        cached = _grouped_masks.get()
        # by storage, not id(): SPLIT's per-row slices are new objects whose ids get reused
        key_ = (attention_mask.data_ptr(), attention_mask.shape, attention_mask.stride(), n)
        if cached is not None and key_ in cached:
            attention_mask = cached[key_]
        else:
            repeated = attention_mask.repeat(1, 1, n, 1)
            if cached is not None:
                cached[key_] = repeated
            attention_mask = repeated
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                           scale=scaling)
    return out.view(B, Hq, Q, D).transpose(1, 2).contiguous(), None


def _split_attention(module, query, key, value, attention_mask, **kwargs):
    """``grouped_attention`` per batch row over that row's own columns. query [B, Hq, Q, D], key/value
    [B, Hkv, L, D] (the store's view), attention_mask [B, 1, Q, L]; row b attends columns [0, ends[b])."""
    ends = _split_ends.get()
    assert ends is not None and len(ends) == query.shape[0], "SPLIT attention outside forward_block"
    outs = [grouped_attention(module, query[b : b + 1], key[b : b + 1, :, :e], value[b : b + 1, :, :e],
                              attention_mask[b : b + 1, :, :, :e], **kwargs)[0]
            for b, e in enumerate(ends)]
    return torch.cat(outs), None  # [B, Q, Hq, D], as HF's SDPA returns it


AttentionInterface.register(PAD, grouped_attention)
AttentionInterface.register(SPLIT, _split_attention)


def cache_arg(module) -> str:
    """The name ``module.forward`` takes its KV cache under: ``cache`` from transformers 5.24 on
    (``past_key_values`` there is deprecated, with a FutureWarning per call), ``past_key_values`` before."""
    name = _CACHE_ARG.get(type(module))
    if name is None:
        params = inspect.signature(type(module).forward).parameters
        name = _CACHE_ARG[type(module)] = "cache" if "cache" in params else "past_key_values"
    return name


_CACHE_ARG: dict[type, str] = {}


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
    # every attention layer reads the implementation from the shared config at call time
    config = model.config
    saved = config._attn_implementation
    split = split and cache.batch_size > 1
    ours = split or saved == "sdpa"  # other implementations (flash, flex) are left as the user chose
    path = fastpath.get(model, check=False) if ours else None
    if ours:
        ends = _split_ends.set([n + input_ids.shape[1] for n in cache.lengths] if split else None)
        masks = _grouped_masks.set({})
        if path is None:  # HF's layers look the function up; the lean path is handed it
            config._attn_implementation = SPLIT if split else PAD
    try:
        if path is not None:  # a Llama-shaped target: the same ops without HF's per-module Python
            logits, hidden = path(cache, input_ids.to(model.device), inputs.position_ids, inputs.attention_mask,
                                  _split_attention if split else grouped_attention)
            return BlockOutput(logits, hidden if want_hidden else None)
        out = model(
            input_ids=input_ids.to(model.device),
            position_ids=inputs.position_ids,
            attention_mask=inputs.attention_mask,  # 4D additive bias: HF uses it as given
            use_cache=True,
            **{cache_arg(model): cache},
            output_hidden_states=want_hidden,
        )
    finally:
        if ours:
            config._attn_implementation = saved
            _split_ends.reset(ends)
            _grouped_masks.reset(masks)
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
    path = fastpath.get(model, check=False) if model.config._attn_implementation == "sdpa" else None
    if path is not None:  # the lean forward: the same ops, and the hidden states without keeping every layer's
        cache = DynamicCache(config=model.config)
        G, P = input_ids.shape
        logits, hidden = path(cache, input_ids.to(model.device), torch.arange(P, device=model.device).expand(G, P),
                              None, grouped_attention, logits_rows=1)
        return Prefill(logits[:, -1], hidden if want_hidden else None,
                       [(layer.keys, layer.values) for layer in cache.layers])
    cache = DynamicCache()
    out = model(input_ids=input_ids.to(model.device), use_cache=True, output_hidden_states=want_hidden,
                logits_to_keep=1, **{cache_arg(model): cache})
    layers = [(layer.keys, layer.values) for layer in cache.layers]
    hidden = out.hidden_states[-1] if want_hidden else None
    return Prefill(out.logits[:, -1], hidden, layers)
