"""A lean forward for Llama-family targets: HF's own math and weights, without HF's per-module Python.

``FastPath`` runs one block through the same ops in the same order as HF's modules: RMSNorm written as
HF writes it, HF's rotary module and ``apply_rotary_pos_emb``, the cache's own ``update`` (the Cache
interface, so a BMC store and a compressed one both work), the attention function the block would have
used (``runtime.attention``: ``grouped_attention``, PAD, or ``split_attention``, SPLIT), and every linear
through ``runtime.linear.linear``. q/k/v and gate/up are each fused into one matrix (copies kept beside
the model; the modules they replace are not packed for the kernel). Quantized layers (``QuantLinear``)
run themselves (the block kernel, ``runtime.qlinear``), q/k/v and gate/up side by side on their own
blocks, never copied; a target whose layers are all quantized and have no biases takes the one call too,
others the loop (docs/decisions/015-quant-kernels.md, Decision: the lean forward and the one call).

One layer loop (``_layers``) with its ops between the linears as a parameter (``LayerOps``, chosen once
a forward):

- ``HF_OPS``: HF's ops one by one (any dtype; ``RuntimeConfig(fused=False)``);
- the fused ops of ``csrc/layer_ops.cpp`` for fp32 on CPU: each RMSNorm with the residual add before
  it, the q/k/v split with the rotary embedding, SiLU x up (the rotary embedding bit for bit HF's, the
  norms and SiLU to fp32 rounding: another summation order, Cephes' exp);
- with the fused ops, where the cache hands over its buffers (a BMC store: ``direct_buffers``), the
  whole loop as one compiled call (``csrc/layers.cpp``: the same ops in the same order with the same
  arguments, the store's write and the attention included, so bit for bit the loop's results;
  ``RuntimeConfig(one_call=False)`` keeps the loop).

Why each exists and what it was worth: docs/decisions/004-lean-forward.md.

Only plain Llama-shaped decoders take it: ``llama``, and ``mistral`` / ``qwen2`` without a sliding
window (Qwen2's q/k/v biases are fused too); RMSNorm, SiLU-gated MLP, one rotary table, no
tensor-parallel split. Each path is checked against HF's forward once when built (a 5-token block;
logits must agree to fp32 rounding), and anything else, or a disagreeing check, runs HF's forward.
``RuntimeConfig(fastpath=False)`` turns it off (to compare, or to rule it out).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from specdec.config import RuntimeConfig
from specdec.introspect import sliding_window
from specdec.patch import skinny_linears
from specdec.quant.modules import QuantLinear
from specdec.quant.numerics import exact_numerics
from specdec.runtime import attention as attn
from specdec.runtime import linear as lin
from specdec.runtime import qlinear
from specdec.runtime import state
from specdec.runtime.attention import grouped_attention, split_attention
from specdec.runtime.state import KERNEL_ROUTES, ROUTES

MODEL_TYPES = ("llama", "mistral", "qwen2")
log = logging.getLogger(__name__)


class _Stacked(nn.Module):
    """Quantized linears side by side, one input: their outputs concatenated (q, k, v; gate, up). Their
    blocks are not copied into one matrix: a GGUF's blocks are the file's pages, and a copy would hold the
    weights twice; the block kernel takes the parts in one call, the GEMM dequantizes them together
    (``qlinear.linear_parts``), else each part's reference runs."""

    def __init__(self, *parts: QuantLinear) -> None:
        super().__init__()
        self.parts = list(parts)  # not registered: the model holds them
        self.bias = _joined_bias(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., C] -> [..., sum of out_features]
        y = qlinear.linear_parts(x, [m.kernel_blocks() for m in self.parts], [m.fmt for m in self.parts], self.bias,
                                 self.parts[0].numerics)  # set_numerics sets every layer of a model alike
        return torch.cat([m(x) for m in self.parts], dim=-1) if y is None else y


def stack_linears(*linears: nn.Module) -> torch.Tensor | _Stacked:
    """The fused weight of plain linears ([sum of N, C], stacked), or quantized ones side by side."""
    if all(type(m) is nn.Linear for m in linears):
        return torch.cat([m.weight for m in linears]).detach()
    return _Stacked(*linears)


def _parts(w) -> list[QuantLinear] | None:
    """A path linear's quantized parts (one QuantLinear, or _Stacked ones), or None (an fp32 weight)."""
    if isinstance(w, _Stacked):
        return w.parts
    return [w] if isinstance(w, QuantLinear) else None


def _quant_layout(parts: list[list[QuantLinear] | None]):
    """The one call's view of quantized linears: (every part's blocks in order, per linear its part count
    then each part's GGML type, the formats used), or None where a linear is fp32 or has a bias."""
    if any(p is None or any(m.bias is not None for m in p) for p in parts):
        return None
    blocks = [m.blocks for p in parts for m in p]
    layout = [x for p in parts for x in (len(p), *(m.fmt.ggml_type for m in p))]
    formats = {m.fmt.name: m.fmt for p in parts for m in p}
    return blocks, layout, list(formats.values())


# a linear of the path: an fp32 weight [N, C] (with its bias beside it) through ``runtime.linear``, or a
# module that computes itself (a QuantLinear through the block kernel, or quantized linears _Stacked)
Weight = torch.Tensor | nn.Module


@dataclass(frozen=True)
class _Layer:
    attn: nn.Module  # HF's attention module: what the attention function is handed (scaling, flags)
    norm1: nn.Module  # input RMSNorm
    qkv: Weight  # [Hq*Dh + 2*Hkv*Dh, C] q, k, v weights stacked
    qkv_bias: torch.Tensor | None  # [Hq*Dh + 2*Hkv*Dh] (a module's bias is its own: None)
    o: nn.Module  # nn.Linear or QuantLinear
    norm2: nn.Module  # post-attention RMSNorm
    gate_up: Weight  # [2I, C] gate and up weights stacked
    gate_up_bias: torch.Tensor | None  # [2I]
    down: nn.Module


@dataclass(frozen=True)
class LayerOps:
    """The ops between a layer's linears. x, y [B, Q, C]; qkv [B, Q, (Hq + 2 Hkv) Dh]; gate_up [B, Q, 2I]."""

    norm: Callable  # (x, weight, eps) -> RMSNorm(x)
    add_norm: Callable  # (x, y, weight, eps) -> (x + y, RMSNorm(x + y))
    # (qkv, cos, sin, Hq, Hkv) -> q [B, Hq, Q, Dh], k [B, Hkv, Q, Dh] (both rotated), v [B, Hkv, Q, Dh]
    rope_split: Callable
    silu_mul: Callable  # (gate_up) -> SiLU(gate) * up [B, Q, I]
    compiled: object | None = None  # the compiled ops these are (whose ``layers`` runs the one call), or None


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm.forward, op for op (fp32 statistics, the weight applied in the input dtype)."""
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def _add_rms(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float):
    x = x + y
    return x, _rms(x, weight, eps)


def _rope_split(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, hq: int, hkv: int):
    B, Q, _ = qkv.shape
    Dh = qkv.shape[-1] // (hq + 2 * hkv)
    q, k, v = qkv.split([hq * Dh, hkv * Dh, hkv * Dh], dim=-1)
    q = q.view(B, Q, -1, Dh).transpose(1, 2)  # [B, Hq, Q, Dh]
    k = k.view(B, Q, -1, Dh).transpose(1, 2)  # [B, Hkv, Q, Dh]
    v = v.view(B, Q, -1, Dh).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    return q, k, v


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


HF_OPS = LayerOps(_rms, _add_rms, _rope_split, _silu_mul)


@cache
def fused_ops(ops) -> LayerOps:
    """The compiled layer ops (``csrc/layer_ops.cpp``) of a kernel build."""
    return LayerOps(ops.rms_norm, ops.add_rms_norm, ops.rope_split, ops.silu_mul, ops)


def _linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(weight, nn.Module):  # quantized: the module routes itself (runtime.qlinear)
        return weight(x)
    return lin.linear(x, weight, bias, lin.max_rows())  # the decoder's skinny_rows


def _apply(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A layer of the model (nn.Linear or QuantLinear) on x, by ``_linear``."""
    return _linear(x, m.weight, m.bias) if type(m) is nn.Linear else m(x)


def _joined_bias(linears) -> torch.Tensor | None:
    """The linears' biases end to end (zeros for one without) [sum of out_features], or None if none has one."""
    some = next((m.bias for m in linears if m.bias is not None), None)
    if some is None:
        return None
    return torch.cat([m.bias if m.bias is not None else some.new_zeros(m.out_features) for m in linears]).detach()


def _cat_bias(*linears: nn.Module) -> torch.Tensor | None:
    """The fused bias of plain linears (a quantized layer's bias is its module's own: None)."""
    return None if any(type(m) is not nn.Linear for m in linears) else _joined_bias(linears)


class _Attention:
    """A forward's attention for every layer: ``attention`` (HF's signature), or the kernel called
    directly where ``grouped_attention`` would call it for every layer alike (a block with a mask, or
    one row): its route asked once a forward (by the first layer), the mask cut once."""

    def __init__(self, attention, mask: torch.Tensor | None, Q: int, hq: int, hkv: int) -> None:
        self.attention, self.full_mask, self.hq, self.hkv = attention, mask, hq, hkv
        self.direct = attention is grouped_attention and (mask is not None or Q == 1)
        self.kernel, self.keys, self.mask = None, 0, None

    def __call__(self, layer: _Layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [B, Hq, Q, Dh], k/v [B, Hkv, L, Dh] views of the store -> o [B, Q, Hq*Dh]."""
        B, _, Q, Dh = q.shape
        rows = self.hq // self.hkv * Q  # grouped query rows per KV head
        if self.direct and self.kernel is None:  # the first layer decides for all that attend as many keys
            self.keys = k.shape[2]
            self.mask = None if self.full_mask is None else self.full_mask[..., :self.keys]
            self.kernel = attn.attention_op(q.reshape(B, self.hkv, rows, Dh), k, v, self.mask)
            self.direct = self.kernel is not None
        if self.direct and k.shape[2] == self.keys:
            scale = layer.attn.scaling if layer.attn.scaling is not None else Dh**-0.5
            o = self.kernel.attention(q.reshape(B, self.hkv, rows, Dh), k, v, self.mask, scale)
            return o.view(B, self.hq, Q, Dh).transpose(1, 2).reshape(B, Q, -1)
        o, _ = self.attention(layer.attn, q, k, v, self.full_mask, dropout=0.0, scaling=layer.attn.scaling)
        return o.reshape(B, Q, -1)


class FastPath:
    """One forward over a block of rows already planned in a cache (``BMCCache.prepare*``)."""

    def __init__(self, model, config: RuntimeConfig = RuntimeConfig()) -> None:
        # no reference to the model itself: the paths are a weak-keyed table of models
        cfg = model.config
        self.config = config  # the runtime this path was built and checked under
        self.decoder, self.head = model.model, model.get_output_embeddings()
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.q_size = cfg.num_attention_heads * self.head_dim
        self.kv_size = cfg.num_key_value_heads * self.head_dim
        self.layers: list[_Layer] = []
        for layer in self.decoder.layers:
            a, mlp = layer.self_attn, layer.mlp
            self.layers.append(_Layer(
                a, layer.input_layernorm, stack_linears(a.q_proj, a.k_proj, a.v_proj),
                _cat_bias(a.q_proj, a.k_proj, a.v_proj), a.o_proj, layer.post_attention_layernorm,
                stack_linears(mlp.gate_proj, mlp.up_proj), _cat_bias(mlp.gate_proj, mlp.up_proj), mlp.down_proj))
        # the norm after each layer: the next layer's input norm, the model's final norm after the last
        self.next_norms = [layer.norm1 for layer in self.layers[1:]] + [self.decoder.norm]
        self._sources = self._stamp()
        self.fuse = config.fused  # the fused layer ops where they apply; False: HF's ops, one by one
        # the fused layers in one compiled call where the store and attention allow; False: the loop.
        # Per layer: 4 linears, 2 norms (each with its eps) after them. A quantized target's linears go
        # in as their parts' blocks (``_quant``), all layers quantized and without biases, or it takes the loop.
        parts = [_parts(w) for layer in self.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        quantized = any(p is not None for p in parts)
        self._quant = _quant_layout(parts) if quantized else None  # (blocks, [count, types...] per linear)
        self._quant_parts = parts if self._quant is not None else []
        self.one_call = config.one_call and (not quantized or self._quant is not None)
        self._weights = [] if not self.one_call or quantized else [
            w for layer in self.layers for w in (layer.qkv, layer.o.weight, layer.gate_up, layer.down.weight)]
        self._biases = [] if not self.one_call or quantized else [
            b for layer in self.layers for b in (layer.qkv_bias, layer.o.bias, layer.gate_up_bias, layer.down.bias)]
        norms = [n for layer, nxt in zip(self.layers, self.next_norms) for n in (layer.norm2, nxt)]
        self._norms, self._eps = [n.weight for n in norms], [float(n.variance_epsilon) for n in norms]
        scales = {self.head_dim**-0.5 if layer.attn.scaling is None else layer.attn.scaling for layer in self.layers}
        self._scale = float(scales.pop()) if len(scales) == 1 else None  # one for all layers, or no one call
        self._packs: dict[str, list[torch.Tensor]] = {}  # kernel variant -> self._weights packed for it

    def replaced(self) -> list[nn.Module]:
        """The linears whose weights live on in the fused copies (never called by this path)."""
        return [m for layer in self.decoder.layers
                for m in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                          layer.mlp.gate_proj, layer.mlp.up_proj)]

    def fused_weights(self) -> list[torch.Tensor]:
        """The fp32 fused copies (for the kernel's packing; quantized layers have none)."""
        return [w for layer in self.layers for w in (layer.qkv, layer.gate_up) if isinstance(w, torch.Tensor)]

    def _stamp(self) -> list[tuple[int, int]]:
        """(storage address, version) of every source weight (the fused copies' and the o and down
        projections', whose packed copies ``_one_call`` keeps; a quantized layer's blocks): a change
        means the copies are stale."""
        kept = [m for layer in self.layers for m in (layer.o, layer.down)]
        sources = [m.weight if type(m) is nn.Linear else m.blocks for m in self.replaced() + kept]
        return [(w.data_ptr(), w._version) for w in sources]

    def stale(self) -> bool:
        return self._stamp() != self._sources

    @torch.inference_mode()
    def __call__(self, cache, input_ids: torch.Tensor, position_ids: torch.Tensor,
                 attention_mask: torch.Tensor | None, attention, logits_rows: int | None = None,
                 keep: tuple[int, ...] = (), head: nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids [B, Q], position_ids [B, Q], attention_mask [B, 1, Q, L] additive, or None for a
        causal block over an empty cache (a prefill: SDPA's causal path, as HF runs it); attention: the HF
        attention function to run; logits_rows: only the last this many rows' logits (a prefill's last);
        keep: layers whose inputs to return instead of the last hidden state (``forward.hidden_of``);
        head: an output layer in the model's place (a module: a draft's ``drafters.vocab.VocabHead``).
        Returns (logits [B, Q or logits_rows, V], last hidden state after the norm [B, Q, C], or the
        kept layers' inputs [B, Q, C * len(keep)])."""
        x = self.decoder.embed_tokens(input_ids)  # [B, Q, C]
        cos, sin = self.decoder.rotary_emb(x, position_ids)
        ops = self._fused_ops(x, cos)
        kept: dict[int, torch.Tensor | None] = dict.fromkeys(keep)  # filled by the loop
        hidden = self._layers(HF_OPS if ops is None else ops, cache, x, cos, sin, attention_mask, attention, kept)
        rows = hidden if logits_rows is None else hidden[:, -logits_rows:]
        logits = _apply(self.head, rows) if head is None else head(rows)
        return logits, torch.cat([kept[j] for j in keep], -1) if keep else hidden

    def _fused_ops(self, x: torch.Tensor, cos: torch.Tensor) -> LayerOps | None:
        """The kernels' fused layer ops if they take this forward (fp32 on CPU, the rotary table as wide
        as a head, the kernels built and on), else None: HF's ops."""
        if not (self.fuse and x.dtype == torch.float32 and x.device.type == "cpu" and cos.dtype == torch.float32
                and cos.dim() == 3 and cos.shape[-1] == self.head_dim):
            return None
        ops = state.active().ops
        return None if ops is None else fused_ops(ops)

    def _layers(self, ops: LayerOps, cache, x, cos, sin, attention_mask, attention,
                kept: dict[int, torch.Tensor | None] | None = None) -> torch.Tensor:
        """Every layer by ``ops``, x [B, Q, C] -> the final norm's output [B, Q, C]: per layer the input
        norm (fused with the residual add before it), q/k/v, their split and rotation, the cache's
        update, attention, o, the post-attention norm (with its residual add), gate/up, SiLU x up, down.
        With compiled ops, the one call where it takes the block. ``kept`` (layer index -> None): filled
        in with the input of each layer it names, [B, Q, C]."""
        B, Q, _ = x.shape
        cos, sin = cos.contiguous(), sin.contiguous()
        hq, hkv = self.q_size // self.head_dim, self.kv_size // self.head_dim
        first = self.layers[0].norm1
        h = ops.norm(x, first.weight, first.variance_epsilon)
        attend = _Attention(attention, attention_mask, Q, hq, hkv)
        if ops.compiled is not None and self.one_call and (
                attend.direct or (attention is split_attention and attention_mask is not None)):
            keep = tuple(kept) if kept else ()
            out = self._one_call(ops.compiled, cache, x, h, cos, sin, attention_mask, not attend.direct, keep)
            if out is not None:
                h, inputs = out
                for j, part in zip(keep, inputs.split(x.shape[-1], dim=-1) if keep else ()):
                    kept[j] = part
                return h
        for i, layer in enumerate(self.layers):
            if kept and i in kept:
                kept[i] = x  # the residual stream entering layer i (add_norm returns new tensors)
            q, k, v = ops.rope_split(_linear(h, layer.qkv, layer.qkv_bias), cos, sin, hq, hkv)
            k, v = cache.update(k, v, i)  # [B, Hkv, L, Dh] views of the store
            o = attend(layer, q, k, v)
            x, h = ops.add_norm(x, _apply(layer.o, o), layer.norm2.weight, layer.norm2.variance_epsilon)
            mlp = _apply(layer.down, ops.silu_mul(_linear(h, layer.gate_up, layer.gate_up_bias)))
            norm = self.next_norms[i]
            x, h = ops.add_norm(x, mlp, norm.weight, norm.variance_epsilon)
        return h

    def _one_call(self, ops, cache, x, h, cos, sin, attention_mask, split: bool = False, keep: tuple[int, ...] = ()
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The loop of ``_layers`` on the fused ops as one compiled call (``csrc/layers.cpp``: the same ops
        in the same order, the store's write included, and a quantized target's linears by the same routes,
        a draft's int8 one inside ``qlinear.approximate()`` too: bit for bit the loop's results), where the cache
        hands over its buffers (a BMC store); attention as ``grouped_attention`` runs it (PAD), or with
        ``split`` as ``split_attention`` does (each batch row over its own rows); None otherwise (the
        loop then runs). Returns (the last norm's output, the inputs of the ``keep`` layers concatenated)."""
        rows = attn.rows_mode()  # int8 numerics: every linear int8, attention a row at a time (quant.numerics)
        buffers = getattr(cache, "direct_buffers", None)
        buffers = buffers() if buffers is not None and self._scale is not None else None
        if buffers is None:
            return None
        keys, values, starts = buffers
        B, Q, _ = x.shape
        Dh = self.head_dim
        hq, hkv = self.q_size // Dh, self.kv_size // Dh
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
            approx = qlinear.by_int8(formats, B * Q)  # a draft's forward: the int8 route, as the loop's linears
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
        flagged (``qlinear.interleave``); made once per path (changed blocks make the path ``stale``)."""
        made = self.__dict__.get("_int8_made")
        if made is None:
            blocks = [m.int8_blocks() for p in self._quant_parts for m in p]
            layout = [x for p in self._quant_parts for x in (len(p), *(m.fmt.ggml_type | qlinear.INTERLEAVED
                                                                       for m in p))]
            made = self.__dict__["_int8_made"] = (blocks, layout)
        return made

    def _packed(self) -> list[torch.Tensor]:
        """``_weights`` packed for the kernel variant in use (made once per variant: ``stale`` rebuilds
        the path if a source weight changes)."""
        rt = state.active()
        packs = self._packs.get(rt.config.kernel)
        if packs is None:
            packs = self._packs[rt.config.kernel] = [lin.pack(w, rt) for w in self._weights]
        return packs

    def agrees(self, model) -> bool:
        """Run a 5-token block through HF's forward (``model``'s) and through this path; True if the
        logits agree to fp32 rounding."""
        device = model.device
        ids = torch.arange(3, 8, dtype=torch.long, device=device)[None] % model.config.vocab_size
        Q = ids.shape[1]
        # torch's linears: the math, not the routes
        with torch.inference_mode(), skinny_linears(max_rows=0, runtime=self.config):
            ref = model(input_ids=ids, use_cache=False).logits.float()
            dtype = self.decoder.norm.weight.dtype
            bias = torch.full((Q, Q), torch.finfo(dtype).min, dtype=dtype, device=device).triu(1)
            try:
                out, _ = self(DynamicCache(config=model.config), ids, torch.arange(Q, dtype=torch.long, device=device)[None],
                              bias[None, None], grouped_attention)
            except RuntimeError as e:  # e.g. a fused op that refuses this model's shapes
                log.warning("specdec: the lean forward failed on %s (%s)", type(model).__name__, str(e).splitlines()[0])
                return False
        err = (out.float() - ref).abs().max().item()
        return err <= 1e-3 * max(1.0, ref.abs().max().item())


def supported(model) -> bool:
    """A Llama-shaped decoder this path reproduces (see the module doc)."""
    cfg = getattr(model, "config", None)
    decoder = getattr(model, "model", None)
    if cfg is None or decoder is None or getattr(cfg, "model_type", None) not in MODEL_TYPES:
        return False
    if getattr(cfg, "pretraining_tp", 1) != 1 or getattr(cfg, "hidden_act", None) != "silu":
        return False
    if sliding_window(cfg) is not None:  # the path attends to every row
        return False
    if type(model.get_output_embeddings()) not in (nn.Linear, QuantLinear):
        return False
    for name in ("embed_tokens", "rotary_emb", "norm", "layers"):
        if not hasattr(decoder, name):
            return False
    for layer in decoder.layers:
        a, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if a is None or mlp is None or getattr(a, "q_norm", None) is not None:
            return False
        linears = [getattr(a, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        linears += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        if any(type(m) not in (nn.Linear, QuantLinear) for m in linears):
            return False
        if not all(hasattr(n, "variance_epsilon") for n in (layer.input_layernorm, layer.post_attention_layernorm)):
            return False
    return hasattr(decoder.norm, "variance_epsilon")


_paths: "weakref.WeakKeyDictionary[nn.Module, FastPath | None]" = weakref.WeakKeyDictionary()


def get(model, runtime: RuntimeConfig | None = None, check: bool = True) -> FastPath | None:
    """The model's fast path under ``runtime`` (default: the configuration in force), built and checked
    against HF's forward at first sight, or None: not a supported model, turned off, or its check
    disagreed. check: rebuild it if the model's weights changed since (~150 attribute reads: once per
    generation, not per step); a path built under another configuration is rebuilt too."""
    config = state.config() if runtime is None else runtime
    if not config.fastpath:
        return None
    if model in _paths:
        path = _paths[model]
        if path is None or ((path.config is config or path.config == config) and (not check or not path.stale())):
            return path
    elif not supported(model):
        _paths[model] = None
        return None
    with torch.inference_mode(False), torch.no_grad():  # the fused copies: normal tensors, whoever calls
        path = FastPath(model, config)
    with exact_numerics(model):  # the check is of the forward's structure (quant.numerics.exact_numerics)
        ok = path.agrees(model)
        if not ok and path.fuse:  # the fused layer ops may be what disagrees: the path without them
            path.fuse = False
            ok = path.agrees(model)
            if ok:
                log.warning("specdec: the fused layer ops disagree with HF's forward for %s; running its ops one "
                            "by one", type(model).__name__)
    if not ok:
        log.warning("specdec: the lean forward disagrees with HF's forward for %s; using HF's",
                    type(model).__name__)
        path = None
    _paths[model] = path
    return path
