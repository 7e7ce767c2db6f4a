"""Attention of decode and verify blocks: the grouped-query kernel or SDPA, PAD or SPLIT.

``grouped_attention`` is SDPA with grouped-query attention done by grouping queries, never copying
K/V: HF's SDPA function copies every K/V head once per query head sharing it (``repeat_kv``) for a
block with a mask. Where the self-check found it faster (docs/decisions/003-attention-kernel.md), the
grouped rows go to the compiled kernel (``csrc/decode_attention.cpp``: up to ATTENTION_ROWS grouped rows
per KV head against a KV store's views) instead of SDPA; ``RuntimeConfig(attention="sdpa")`` keeps
SDPA. ``split_attention`` runs it per batch row over that row's own columns (BASS-SPLIT; PAD vs SPLIT:
docs/decisions/005-pad-vs-split.md).
"""

from __future__ import annotations

import contextvars
import math
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from specdec.runtime import state

# grouped query rows per KV head the kernel takes, and the (rows, keys) points the self-check times it
# at against SDPA; a call takes the verdict of the point with the fewest rows >= its own (the last past
# them) and the nearest number of keys (geometrically)
ATTENTION_ROWS = 64
ATTENTION_POINTS = ((3, 6, 12, 24, 48), (256, 2048))
# what the row and prompt kernels read a store's K/V in: fp32, or bf16 (int8 numerics: quant.numerics.kv_dtype)
STORE_DTYPES = (torch.float32, torch.bfloat16)

# row b of a SPLIT block attends columns [0, ends[b]) (set by ``block_scope``)
_split_ends: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("specdec_split_ends", default=None)
# a target in int8 numerics: every masked (or one-row) block attends a row at a time (``rows_mode``)
_rows: contextvars.ContextVar[bool] = contextvars.ContextVar("specdec_row_attention", default=False)
# a target in int8 numerics prefilling: a prompt's causal attention over itself in bf16 products (``prompt_scope``)
_prompt: contextvars.ContextVar[bool] = contextvars.ContextVar("specdec_prompt_attention", default=False)
# the mask repeated for grouped queries, made by the forward's first layer and reused by the others
_grouped_masks: contextvars.ContextVar[dict | None] = contextvars.ContextVar("specdec_grouped_masks", default=None)


def attention_point(rows: int, keys: int) -> tuple[int, int]:
    """The calibrated point a call of ``rows`` grouped rows over ``keys`` keys takes its route from.
    Example: (9, 300) -> (12, 256); (60, 5000) -> (48, 2048)."""
    grid_rows, grid_keys = ATTENTION_POINTS
    r = next((p for p in grid_rows if p >= rows), grid_rows[-1])
    k = min(grid_keys, key=lambda p: abs(math.log(keys / p)))
    return r, k


@cache
def _supports(ops, query: str, d: int) -> bool:
    """``ops.<query>(d)`` (``attention_supports``, ``prompt_attention_supports``): whether a kernel has a shape
    for head size d, asked once per build and head size (an op call, ~190 a forward)."""
    return getattr(ops, query)(d)


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor | None,
              scale: float) -> torch.Tensor | None:
    """Attention of R grouped query rows per KV head through the kernel, or None where SDPA is the
    route (another dtype or device, more than ATTENTION_ROWS rows, a head size without a shape, K/V
    rows that are not contiguous, a bias of another shape, no kernel, SDPA configured, or the
    self-check found SDPA faster at this size).

    query [B, H, R, D]; key/value [B, H, L, D], views of a store (rows contiguous); bias additive
    [B or 1, 1, Q, L] with R a multiple of Q (row r masked by bias row r % Q: the grouped rows of one
    query position share its mask), or None. Returns [B, H, R, D].
    """
    ops = attention_op(query, key, value, bias)
    return None if ops is None else ops.attention(query, key, value, bias, scale)


class _RowOps:
    """The kernel build seen through ``attention``'s signature, its attention a row at a time
    (``csrc/row_attention.cpp``: batch-invariant, whatever the rows or keys)."""

    def __init__(self, ops) -> None:
        self.ops = ops

    def attention(self, query, key, value, bias, scale):
        return self.ops.row_attention(query, key, value, bias, scale)


def prompt_mode() -> bool:
    """Whether this forward is a prompt's prefill through ``prompt_attention`` (``prompt_scope(True)``)."""
    return _prompt.get()


def rows_mode() -> bool:
    """Whether this forward attends a row at a time (a target in int8 numerics: ``block_scope(rows=True)``)."""
    return _rows.get()


def attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor | None):
    """The compiled ops whose ``attention`` takes this call (``attention``'s arguments, its rules), or
    None for SDPA. A forward whose layers all attend alike asks once (``fastpath``), not per layer.
    In ``rows_mode`` every call takes the row kernel (an error where it cannot: never another arithmetic)."""
    if _rows.get():
        ops = state.active().ops
        if ops is None or query.device.type != "cpu" or query.dtype != torch.float32 or query.shape[-1] % 8:
            raise RuntimeError("numerics='int8' attends with specdec's CPU kernels: fp32 on the CPU, head size a "
                               f"multiple of 8, the kernels built (here: {query.dtype} on {query.device.type}, "
                               f"head size {query.shape[-1]}, kernels {'built' if ops is not None else 'not built'})")
        return _RowOps(ops)
    if (query.device.type != "cpu" or query.dtype != torch.float32 or key.dtype != torch.float32
            or value.dtype != torch.float32 or query.shape[2] > ATTENTION_ROWS
            or key.stride(-1) != 1 or value.stride(-1) != 1
            or (bias is not None and (bias.dtype != torch.float32 or bias.dim() != 4 or bias.shape[-1] != key.shape[2]
                                      or query.shape[2] % bias.shape[2]))
            or (torch.is_grad_enabled() and query.requires_grad)):
        return None
    rt = state.active()
    ops = rt.ops
    if ops is None or rt.config.attention == "sdpa" or not _supports(ops, "attention_supports", query.shape[-1]):
        return None
    points = rt.routes.attention
    if points is not None and not points.get(attention_point(query.shape[2], key.shape[2])):
        return None
    return ops


def grouped_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """SDPA with grouped-query attention by grouping queries, never copying K/V.

    query [B, Hq, Q, D], key/value [B, Hkv, L, D] (a view of the store), attention_mask [B, 1, Q, L]
    additive. Query head h uses KV head h // n (n = Hq / Hkv, HF's ``repeat_kv`` order), so the n heads
    of a group become n x Q query rows of their KV head: row r * Q + i is head r's query i, and the
    mask is repeated n times along the rows. Returns [B, Q, Hq, D], as HF's SDPA function does.
    Example: Hq 9, Hkv 3, Q 4 -> query [B, 3, 12, D] against K/V [B, 3, L, D], mask [B, 1, 12, L].
    A prompt's block without a mask (over the rows before it, if any) inside ``prompt_scope(True)`` goes to
    ``prompt_attention``.
    """
    B, Hq, Q, D = query.shape
    n = Hq // key.shape[1]
    plain = not (module.training or kwargs.get("sliding_window") or kwargs.get("position_bias") is not None)
    if plain and attention_mask is None and _prompt.get():  # a prompt's block: keys before it, then its own
        past = key.shape[2] - Q
        out = prompt_attention(query.reshape(B, Hq // n, n * Q, D), key, value,
                               scaling if scaling is not None else D**-0.5, past)
        if out is not None:
            return out.view(B, Hq, Q, D).transpose(1, 2).contiguous(), None
        if past:  # SDPA's causal flag would align the block to the first key
            raise RuntimeError("a prompt block after earlier rows without a mask needs the prompt attention kernel")
    if plain and (attention_mask is not None or Q == 1):  # a causal block without a mask needs SDPA's flag
        mask = attention_mask if attention_mask is None else attention_mask[..., : key.shape[2]]
        out = attention(query.reshape(B, Hq // n, n * Q, D), key, value, mask,
                        scaling if scaling is not None else D**-0.5)
        if out is not None:  # the kernel, where the self-check found it faster than SDPA
            return out.view(B, Hq, Q, D).transpose(1, 2).contiguous(), None
    if key.dtype != query.dtype:  # a store in bf16 (int8 numerics) read by SDPA: its values in the query's dtype
        key, value = key.to(query.dtype), value.to(query.dtype)
    if attention_mask is None or n == 1 or not plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    query = query.reshape(B, Hq // n, n * Q, D)
    if Q > 1:  # a [B, 1, 1, L] mask broadcasts over the grouped rows as it is
        attention_mask = _repeated_mask(attention_mask, n)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling)
    return out.view(B, Hq, Q, D).transpose(1, 2).contiguous(), None


def prompt_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                     past: int = 0) -> torch.Tensor | None:
    """A prompt's causal attention over itself in bf16 products (``csrc/prompt_attention.cpp``: q, k, v and
    the weights rounded to bf16, fp32 sums and softmax; a row's output depends on its query and the keys up to
    it only), or None where the build has no AVX512-BF16 shape for this call (SDPA's causal path then, as in
    exact numerics). query [B, H, n * Q, D] grouped (row r * Q + i: head r's query at position past + i),
    key / value [B, H, past + Q, D] -> [B, H, n * Q, D]. A row's output does not depend on how the prompt was
    cut into blocks. Why: docs/decisions/019-int8-numerics.md."""
    if not prompt_kernel(query.shape[-1], query.dtype, query.device) or key.dtype not in STORE_DTYPES \
            or value.dtype != key.dtype or key.stride(-1) != 1 or value.stride(-1) != 1:
        return None
    return state.active().ops.prompt_attention(query, key, value, scale, past)


def prompt_kernel(head_dim: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``prompt_attention`` takes a prompt of this head size, dtype and device here."""
    ops = state.active().ops
    return (ops is not None and torch.device(device).type == "cpu" and dtype == torch.float32
            and _supports(ops, "prompt_attention_supports", head_dim))


@contextmanager
def prompt_scope(on: bool) -> Iterator[None]:
    """A prefill's attention: with ``on`` (a target in int8 numerics), a causal block over an empty cache
    attends through ``prompt_attention`` where the build can."""
    token = _prompt.set(on)
    try:
        yield
    finally:
        _prompt.reset(token)


def _repeated_mask(mask: torch.Tensor, n: int) -> torch.Tensor:
    """``mask`` [B, 1, Q, L] repeated n times along its rows [B, 1, nQ, L], made once a forward."""
    cached = _grouped_masks.get()
    # by storage, not id(): SPLIT's per-row slices are new objects whose ids get reused
    key = (mask.data_ptr(), mask.shape, mask.stride(), n)
    if cached is not None and key in cached:
        return cached[key]
    repeated = mask.repeat(1, 1, n, 1)
    if cached is not None:
        cached[key] = repeated
    return repeated


def split_attention(module, query, key, value, attention_mask, **kwargs):
    """``grouped_attention`` per batch row over that row's own columns. query [B, Hq, Q, D], key/value
    [B, Hkv, L, D] (the store's view), attention_mask [B, 1, Q, L]; row b attends columns [0, ends[b])."""
    ends = _split_ends.get()
    assert ends is not None and len(ends) == query.shape[0], "SPLIT attention outside a block_scope"
    outs = [grouped_attention(module, query[b : b + 1], key[b : b + 1, :, :e], value[b : b + 1, :, :e],
                              attention_mask[b : b + 1, :, :, :e], **kwargs)[0]
            for b, e in enumerate(ends)]
    return torch.cat(outs), None  # [B, Q, Hq, D], as HF's SDPA returns it


@contextmanager
def block_scope(split_ends: list[int] | None, rows: bool = False) -> Iterator[None]:
    """One forward's attention state: the columns each row of a SPLIT block attends (None for PAD), the
    grouped masks its layers share, and ``rows``: attention a row at a time (int8 numerics)."""
    ends, masks, by_rows = _split_ends.set(split_ends), _grouped_masks.set({}), _rows.set(rows)
    try:
        yield
    finally:
        _split_ends.reset(ends)
        _grouped_masks.reset(masks)
        _rows.reset(by_rows)
