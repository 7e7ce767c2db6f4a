"""All layers of a lean forward in one compiled call (``csrc/layers.cpp``): its arguments, and the call.

``layers`` runs ``FastPath``'s layer loop on the fused ops without Python: the same ops in the same order
with the same arguments, the store's write and the attention included, so bit for bit the loop's results.
It takes a block where the cache hands over its buffers (a BMC store: ``direct_buffers``) and every layer
scales attention alike; else ``OneCall`` declines and the loop runs. Besides the block it is passed, made
once per path (a changed source weight rebuilds the path: ``FastPath.stale``):

- per layer 4 linears (qkv, o, gate_up, down): an fp32 target's weights and biases, with the weights
  packed for the kernel variant in use where its routes take them; or a quantized target's every part's
  blocks and per linear its part count then each part's GGML type (``quant_layout``: all its linears
  quantized and without biases, else no one call), for int8 numerics the parts' interleaved copies;
- per layer 2 norms after those linears (post-attention, then the next layer's input norm or the final
  norm), each with its eps.

``RuntimeConfig(one_call=False)`` keeps the loop. Why: docs/decisions/004-lean-forward.md; quantized
targets: docs/decisions/015-quant-kernels.md, Decision: the lean forward and the one call.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from specdec.lean_layer import Layer, Stacked, Weight
from specdec.quant.modules import QuantLinear
from specdec.runtime import attention as attn
from specdec.runtime import int8_linear
from specdec.runtime import linear as lin
from specdec.runtime import qlinear
from specdec.runtime import state
from specdec.runtime.state import KERNEL_ROUTES, ROUTES


def _parts(w: Weight) -> list[QuantLinear] | None:
    """A path linear's quantized parts (one QuantLinear, or Stacked ones), or None (an fp32 weight)."""
    if isinstance(w, Stacked):
        return w.parts
    return [w] if isinstance(w, QuantLinear) else None


def quant_layout(parts: list[list[QuantLinear] | None]):
    """The one call's view of quantized linears: (every part's blocks in order, per linear its part count
    then each part's GGML type, the formats used), or None where a linear is fp32 or has a bias."""
    if any(p is None or any(m.bias is not None for m in p) for p in parts):
        return None
    blocks = [m.blocks for p in parts for m in p]
    layout = [x for p in parts for x in (len(p), *(m.fmt.ggml_type for m in p))]
    formats = {m.fmt.name: m.fmt for p in parts for m in p}
    return blocks, layout, list(formats.values())


class OneCall:
    """The one call over a path's layers: their arguments, made once, and the call (``__call__``)."""

    def __init__(self, layers: list[Layer], next_norms: list[nn.Module], head_dim: int, hq: int, hkv: int,
                 parts: list[list[QuantLinear]] | None) -> None:
        """next_norms: the norm after each layer; parts: per linear its quantized parts (None: fp32 layers)."""
        self.head_dim, self.hq, self.hkv = head_dim, hq, hkv
        self._quant = None if parts is None else quant_layout(parts)  # (blocks, [count, types...] per linear)
        self._quant_parts = parts or []
        quantized = parts is not None
        self._weights = [] if quantized else [
            w for layer in layers for w in (layer.qkv, layer.o.weight, layer.gate_up, layer.down.weight)]
        self._biases = [] if quantized else [
            b for layer in layers for b in (layer.qkv_bias, layer.o.bias, layer.gate_up_bias, layer.down.bias)]
        norms = [n for layer, nxt in zip(layers, next_norms) for n in (layer.norm2, nxt)]
        self._norms, self._eps = [n.weight for n in norms], [float(n.variance_epsilon) for n in norms]
        scales = {head_dim**-0.5 if layer.attn.scaling is None else layer.attn.scaling for layer in layers}
        self._scale = float(scales.pop()) if len(scales) == 1 else None  # one for all layers, or no one call
        self._packs: dict[str, list[torch.Tensor]] = {}  # kernel variant -> self._weights packed for it
        self._int8: tuple[list[torch.Tensor], list[int]] | None = None  # ``_int8_layout``, once made

    @classmethod
    def of(cls, layers: list[Layer], next_norms: list[nn.Module], head_dim: int, hq: int, hkv: int
           ) -> OneCall | None:
        """The one call over ``layers``, or None for a quantized target with an fp32 or biased linear (the loop)."""
        parts = [_parts(w) for layer in layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        if not any(p is not None for p in parts):
            return cls(layers, next_norms, head_dim, hq, hkv, None)
        return cls(layers, next_norms, head_dim, hq, hkv, parts) if quant_layout(parts) is not None else None

    def __call__(self, ops, cache, x, h, cos, sin, attention_mask, split: bool = False, keep: tuple[int, ...] = ()
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The loop of ``FastPath._layers`` on the fused ops ``ops`` as one compiled call (a quantized
        target's linears by the same routes, a draft's int8 one inside ``int8_linear.approximate()`` too: bit
        for bit the loop's results), where the cache hands over its buffers (a BMC store); attention as
        ``grouped_attention`` runs it (PAD), or with ``split`` as ``split_attention`` does (each batch row over
        its own rows); None otherwise (the loop then runs). x [B, Q, C] the residual stream, h [B, Q, C] its
        first input norm. Returns (the last norm's output [B, Q, C], the inputs of the ``keep`` layers
        concatenated [B, Q, C * len(keep)])."""
        rows = attn.rows_mode()  # int8 numerics: every linear int8, attention a row at a time (quant.numerics)
        buffers = getattr(cache, "direct_buffers", None)
        buffers = buffers() if buffers is not None and self._scale is not None else None
        if buffers is None:
            return None
        keys, values, starts = buffers
        B, Q, _ = x.shape
        Dh, hq, hkv = self.head_dim, self.hq, self.hkv
        end = max(starts) + Q
        mask = None if attention_mask is None else attention_mask[..., :end]
        probe = x.new_empty(B, hkv, hq // hkv * Q, Dh)  # the kernel's rules read shapes, not values
        # per attention call (the block, or each row alone): the kernel, or SDPA where the self-check says
        groups = [(b, b + 1, starts[b] + Q) for b in range(B)] if split else [(0, B, end)]
        if rows:  # the int8 kernel and the row attention take every block: no routes to ask
            if self._quant is None:
                return None
            blocks, layout = self._int8_layout()
            _, h, inputs = ops.layers(x, h, [], blocks, [], self._norms, self._eps, keys, values, starts, cos, sin,
                                      mask, hq, hkv, self._scale, [0, B * Q, 0], [True] * len(groups), split, layout,
                                      keep, False, True)
            return h, inputs
        kernel = [attn.attention_op(probe[a:b], keys[0][a:b, :, :e], values[0][a:b, :, :e],
                                    None if mask is None else mask[a:b, ..., :e]) is ops for a, b, e in groups]
        if not all(kernel) and (mask is None or hq == hkv):  # SDPA's grouped path needs both (grouped_attention)
            return None
        if self._quant is not None:  # every linear by the block kernel, where its routes take B * Q rows
            blocks, layout, formats = self._quant
            if not all(qlinear.takes(fmt, B * Q) for fmt in formats):
                return None
            plan, packed = [0, B * Q, 0], blocks  # the plan: unused (the kernel's passes split the rows)
            approx = int8_linear.by_int8(formats, B * Q)  # a draft's forward: the int8 route, as the loop's linears
        else:
            plan, layout, approx = lin.plan(B * Q, lin.max_rows()), [], False
            kernel_ids = [ROUTES.index(r) for r in KERNEL_ROUTES]
            packed = self._packed() if any(r in kernel_ids for r in plan[2::3]) else []
        _, h, inputs = ops.layers(x, h, self._weights, packed, self._biases, self._norms, self._eps, keys, values,
                                  starts, cos, sin, mask, hq, hkv, self._scale, plan, kernel, split, layout, keep,
                                  approx)
        return h, inputs

    def _int8_layout(self) -> tuple[list[torch.Tensor], list[int]]:
        """``_quant``'s blocks and layout for int8 numerics: each part's interleaved copy, its format code
        flagged (``int8_linear.interleave``); made once (changed blocks make the path ``stale``)."""
        if self._int8 is None:
            blocks = [m.int8_blocks() for p in self._quant_parts for m in p]
            layout = [x for p in self._quant_parts for x in (len(p), *(m.fmt.ggml_type | int8_linear.INTERLEAVED
                                                                       for m in p))]
            self._int8 = (blocks, layout)
        return self._int8

    def _packed(self) -> list[torch.Tensor]:
        """``_weights`` packed for the kernel variant in use (made once per variant: ``stale`` rebuilds
        the path if a source weight changes)."""
        rt = state.active()
        packs = self._packs.get(rt.config.kernel)
        if packs is None:
            packs = self._packs[rt.config.kernel] = [lin.pack(w, rt) for w in self._weights]
        return packs
