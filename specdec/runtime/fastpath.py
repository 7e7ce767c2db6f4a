"""A lean forward for Llama-family targets: HF's own math and weights, without HF's per-module Python.

A decode or verify step of the default model (30 layers, 1-16 rows, ~20 ms on 2 cores) spent ~3.7 ms
outside the arithmetic: ~300 module calls with their hooks and kwargs plumbing, HF's mask and output
bookkeeping, and three small q/k/v GEMMs (two gate/up ones) where one streams the same bytes.
``FastPath`` runs one block through the same ops in the same order: RMSNorm written as HF writes it,
HF's rotary module and ``apply_rotary_pos_emb``, the cache's own ``update`` (the Cache interface, so a
BMC store and a compressed one both work), the attention function the block would have used
(``forward.grouped_attention`` or SPLIT), and every linear through ``kernels.linear``. q/k/v and
gate/up are each fused into one matrix (copies kept beside the model: ~50% more memory for the
layers' weights; the modules they replace are not packed for the kernel, so the total stays close).

Measured (default model, 300-token context, 2 threads, AVX-512 machine, medians of 60 alternating
steps): 1 row 20.4 -> 16.7 ms, 8 rows 25.7 -> 22.8 ms (unfused: 18.4 and 23.5 ms). Spec-Bench at
batch 1, path on vs off: plain decoding 1.96x vs 1.72x HF ``generate``, prompt lookup 3.06x vs 2.79x
(docs/benchmarks.md, "The lean forward").

fp32 blocks on CPU then run the ops between the matmuls fused (``csrc/layer_ops.cpp``, built with the
kernels): each RMSNorm with the residual add before it, the q/k/v split with the rotary embedding,
SiLU x up; 4 op calls a layer instead of ~35. Each of those small ops cost 5-7 us in place (the weight
stream had just pushed its code and data out of the caches): ~6.9 ms of a 1-row step went to them
on a Xeon, 3.2 ms since (the attention kernel called here too), and whole steps got 15-18% faster
at 1-16 rows at 200 tokens of context, 10-17% at 2,000 (2026-11-25, 2 threads; docs/benchmarks.md,
"Verify cost in place"). The rotary embedding is bit for bit HF's, the norms
and SiLU agree to fp32 rounding (another summation order, Cephes' exp), as the kernels' linears do.
``SPECDEC_FUSED=off`` runs HF's ops one by one (read when a path is built).

Where the cache is a BMC store (``direct_buffers``) the fused loop itself runs as one compiled call
(``csrc/layers.cpp``, ``_one_call``): every layer's ops, linears on the routes ``kernels.plan`` gives,
the store's K/V write and the attention (PAD, or SPLIT per batch row; the kernel or SDPA as the
self-check says), in the same order with the same arguments, so the results are the loop's bit for
bit. The loop made ~10 Python-level calls a layer: one call took a step of the default model 16-26%
faster at 1-16 rows (a Xeon, 2026-11-26) and a ragged B = 8 batch's plain decoding 30%.
``SPECDEC_ONE_CALL=off`` keeps the loop (read when a path is built).

Only plain Llama-shaped decoders take it: ``llama``, and ``mistral`` / ``qwen2`` without a sliding
window (Qwen2's q/k/v biases are fused too); RMSNorm, SiLU-gated MLP, one rotary table, no
tensor-parallel split. Each path is checked against HF's forward once when built (a 5-token block;
logits must agree to fp32 rounding), and anything else, or a disagreeing check, runs HF's forward.
``SPECDEC_FASTPATH=off`` turns it off (to compare, or to rule it out).
"""

from __future__ import annotations

import logging
import os
import weakref
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from specdec.runtime import kernels
from specdec.models import sliding_window

MODEL_TYPES = ("llama", "mistral", "qwen2")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Layer:
    attn: nn.Module  # HF's attention module: what the attention function is handed (scaling, flags)
    norm1: nn.Module  # input RMSNorm
    qkv: torch.Tensor  # [Hq*Dh + 2*Hkv*Dh, C] q, k, v weights stacked
    qkv_bias: torch.Tensor | None  # [Hq*Dh + 2*Hkv*Dh]
    o: nn.Linear
    norm2: nn.Module  # post-attention RMSNorm
    gate_up: torch.Tensor  # [2I, C] gate and up weights stacked
    gate_up_bias: torch.Tensor | None  # [2I]
    down: nn.Linear


def _rms(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """LlamaRMSNorm.forward, op for op (fp32 statistics, the weight applied in the input dtype)."""
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * x.to(dtype)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return kernels.linear(x, weight, bias, kernels.max_rows())  # the decoder's skinny_rows


def _cat_bias(*linears: nn.Linear) -> torch.Tensor | None:
    if all(m.bias is None for m in linears):
        return None
    return torch.cat([m.bias if m.bias is not None else m.weight.new_zeros(m.out_features) for m in linears])


class FastPath:
    """One forward over a block of rows already planned in a cache (``BMCCache.prepare*``)."""

    def __init__(self, model) -> None:
        # no reference to the model itself: the paths are a weak-keyed table of models
        cfg = model.config
        self.decoder, self.head = model.model, model.get_output_embeddings()
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.q_size = cfg.num_attention_heads * self.head_dim
        self.kv_size = cfg.num_key_value_heads * self.head_dim
        self.layers: list[_Layer] = []
        for layer in self.decoder.layers:
            a, mlp = layer.self_attn, layer.mlp
            self.layers.append(_Layer(
                a, layer.input_layernorm,
                torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach(),
                _cat_bias(a.q_proj, a.k_proj, a.v_proj), a.o_proj, layer.post_attention_layernorm,
                torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach(),
                _cat_bias(mlp.gate_proj, mlp.up_proj), mlp.down_proj))
        # the norm after each layer: the next layer's input norm, the model's final norm after the last
        self.next_norms = [layer.norm1 for layer in self.layers[1:]] + [self.decoder.norm]
        self._sources = self._stamp()
        # the fused layer ops (``_fused_layers``) where they apply; False: HF's ops, one by one
        self.fuse = os.environ.get("SPECDEC_FUSED", "on") != "off"
        # the fused layers in one compiled call (``_one_call``) where the store and attention allow; False:
        # the loop in ``_fused_layers``. Per layer: 4 linears, 2 norms (each with its eps) after them
        self.one_call = os.environ.get("SPECDEC_ONE_CALL", "on") != "off"
        self._weights = [w for layer in self.layers for w in (layer.qkv, layer.o.weight, layer.gate_up, layer.down.weight)]
        self._biases = [b for layer in self.layers for b in (layer.qkv_bias, layer.o.bias, layer.gate_up_bias, layer.down.bias)]
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
        return [w for layer in self.layers for w in (layer.qkv, layer.gate_up)]

    def _stamp(self) -> list[tuple[int, int]]:
        """(storage address, version) of every source weight (the fused copies' and the o and down
        projections', whose packed copies ``_one_call`` keeps): a change means the copies are stale."""
        kept = [m for layer in self.layers for m in (layer.o, layer.down)]
        return [(m.weight.data_ptr(), m.weight._version) for m in self.replaced() + kept]

    def stale(self) -> bool:
        return self._stamp() != self._sources

    @torch.inference_mode()
    def __call__(self, cache, input_ids: torch.Tensor, position_ids: torch.Tensor,
                 attention_mask: torch.Tensor | None, attention, logits_rows: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids [B, Q], position_ids [B, Q], attention_mask [B, 1, Q, L] additive, or None for a
        causal block over an empty cache (a prefill: SDPA's causal path, as HF runs it); attention: the HF
        attention function to run; logits_rows: only the last this many rows' logits (a prefill's last).
        Returns (logits [B, Q or logits_rows, V], last hidden state after the norm [B, Q, C])."""
        B, Q = input_ids.shape
        Dh, qs, kvs = self.head_dim, self.q_size, self.kv_size
        x = self.decoder.embed_tokens(input_ids)  # [B, Q, C]
        cos, sin = self.decoder.rotary_emb(x, position_ids)
        ops = self._fused_ops(x, cos)
        if ops is not None:
            hidden = self._fused_layers(ops, cache, x, cos, sin, attention_mask, attention)
            rows = hidden if logits_rows is None else hidden[:, -logits_rows:]
            return _linear(rows, self.head.weight, self.head.bias), hidden
        for i, layer in enumerate(self.layers):
            h = _rms(layer.norm1, x)
            q, k, v = _linear(h, layer.qkv, layer.qkv_bias).split([qs, kvs, kvs], dim=-1)
            q = q.view(B, Q, -1, Dh).transpose(1, 2)  # [B, Hq, Q, Dh]
            k = k.view(B, Q, -1, Dh).transpose(1, 2)  # [B, Hkv, Q, Dh]
            v = v.view(B, Q, -1, Dh).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            k, v = cache.update(k, v, i)  # [B, Hkv, L, Dh] views of the store
            o, _ = attention(layer.attn, q, k, v, attention_mask, dropout=0.0, scaling=layer.attn.scaling)
            x = x + _linear(o.reshape(B, Q, -1), layer.o.weight, layer.o.bias)
            gate, up = _linear(_rms(layer.norm2, x), layer.gate_up, layer.gate_up_bias).chunk(2, dim=-1)
            x = x + _linear(F.silu(gate) * up, layer.down.weight, layer.down.bias)
        hidden = _rms(self.decoder.norm, x)
        rows = hidden if logits_rows is None else hidden[:, -logits_rows:]
        return _linear(rows, self.head.weight, self.head.bias), hidden

    def _fused_ops(self, x: torch.Tensor, cos: torch.Tensor):
        """The kernels' fused layer ops (``csrc/layer_ops.cpp``) if they take this forward (fp32 on CPU,
        the rotary table as wide as a head, the kernels built and on), else None: HF's ops below."""
        if not (self.fuse and x.dtype == torch.float32 and x.device.type == "cpu" and cos.dtype == torch.float32
                and cos.dim() == 3 and cos.shape[-1] == self.head_dim):
            return None
        return kernels.extension()

    def _fused_layers(self, ops, cache, x, cos, sin, attention_mask, attention) -> torch.Tensor:
        """The layers through the fused ops: each norm fused with the residual add before it, q/k/v split
        and rotated in one op, SiLU x up in one; the same math as the loop in ``__call__`` (the rotary
        embedding bit for bit, the norms and SiLU to fp32 rounding). Returns the final norm's output."""
        from specdec.forward import _split_attention, grouped_attention

        B, Q, _ = x.shape
        Dh = self.head_dim
        cos, sin = cos.contiguous(), sin.contiguous()
        hq, hkv = self.q_size // Dh, self.kv_size // Dh
        rows = hq // hkv * Q  # grouped query rows per KV head
        h = ops.rms_norm(x, self.layers[0].norm1.weight, self.layers[0].norm1.variance_epsilon)
        # the attention kernel called here where grouped_attention would call it for every layer alike
        # (a block with a mask, or one row): its route is asked once a forward, the mask cut once
        kernel, direct = None, attention is grouped_attention and (attention_mask is not None or Q == 1)
        if self.one_call and (direct or (attention is _split_attention and attention_mask is not None)):
            out = self._one_call(ops, cache, x, h, cos, sin, attention_mask, split=not direct)
            if out is not None:
                return out
        for i, layer in enumerate(self.layers):
            q, k, v = ops.rope_split(_linear(h, layer.qkv, layer.qkv_bias), cos, sin, hq, hkv)
            k, v = cache.update(k, v, i)  # [B, Hkv, L, Dh] views of the store
            if direct and kernel is None:  # the first layer decides for all that attend as many keys
                keys = k.shape[2]
                mask = None if attention_mask is None else attention_mask[..., :keys]
                kernel = kernels.attention_op(q.view(B, hkv, rows, Dh), k, v, mask)
                direct = kernel is not None
            if direct and k.shape[2] == keys:
                scale = layer.attn.scaling if layer.attn.scaling is not None else Dh**-0.5
                o = kernel.attention(q.view(B, hkv, rows, Dh), k, v, mask, scale)
                o = o.view(B, hq, Q, Dh).transpose(1, 2).reshape(B, Q, -1)
            else:
                o, _ = attention(layer.attn, q, k, v, attention_mask, dropout=0.0, scaling=layer.attn.scaling)
                o = o.reshape(B, Q, -1)
            x, h = ops.add_rms_norm(x, _linear(o, layer.o.weight, layer.o.bias), layer.norm2.weight,
                                    layer.norm2.variance_epsilon)
            mlp = _linear(ops.silu_mul(_linear(h, layer.gate_up, layer.gate_up_bias)), layer.down.weight, layer.down.bias)
            norm = self.next_norms[i]
            x, h = ops.add_rms_norm(x, mlp, norm.weight, norm.variance_epsilon)
        return h

    def _one_call(self, ops, cache, x, h, cos, sin, attention_mask, split: bool = False) -> torch.Tensor | None:
        """The loop of ``_fused_layers`` as one compiled call (``csrc/layers.cpp``: the same ops in the
        same order, the store's write included, bit for bit the loop's results), where the cache hands
        over its buffers (a BMC store); attention as ``grouped_attention`` runs it (PAD), or with
        ``split`` as ``_split_attention`` does (each batch row over its own rows); None otherwise (the
        loop then runs). A 1-row step made ~10 Python-level calls a layer between its linears; at 200
        tokens of context one call took a 1-row step of the default model from 29.2 to 21.5 ms, 8 rows
        from 35.4 to 28.2, 16 rows from 49.0 to 39.3 (the Xeon, 2026-11-26, same process, alternating)."""
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
        rows = [(b, b + 1, starts[b] + Q) for b in range(B)] if split else [(0, B, end)]
        kernel = [kernels.attention_op(probe[a:b], keys[0][a:b, :, :e], values[0][a:b, :, :e],
                                       None if mask is None else mask[a:b, ..., :e]) is ops for a, b, e in rows]
        if not all(kernel) and (mask is None or hq == hkv):  # SDPA's grouped path needs both (grouped_attention)
            return None
        plan = kernels.plan(B * Q, kernels.max_rows())
        packed = self._packed() if any(r in (2, 3) for r in plan[2::3]) else []
        _, h = ops.layers(x, h, self._weights, packed, self._biases, self._norms, self._eps, keys, values, starts,
                          cos, sin, mask, hq, hkv, self._scale, plan, kernel, split)
        return h

    def _packed(self) -> list[torch.Tensor]:
        """``_weights`` packed for the kernel variant in use (made once per variant: ``stale`` rebuilds
        the path if a source weight changes)."""
        v, ops = kernels._in_use()
        packs = self._packs.get(v)
        if packs is None:
            packs = self._packs[v] = [kernels._packed(w, v, ops) for w in self._weights]
        return packs

    def agrees(self, model) -> bool:
        """Run a 5-token block through HF's forward (``model``'s) and through this path; True if the
        logits agree to fp32 rounding."""
        ids = torch.arange(3, 8, device=model.device)[None] % model.config.vocab_size
        Q = ids.shape[1]
        with torch.inference_mode(), kernels.skinny_linears(max_rows=0):  # torch's linears: the math, not the routes
            ref = model(input_ids=ids, use_cache=False).logits.float()
            dtype = self.layers[0].qkv.dtype
            bias = torch.full((Q, Q), torch.finfo(dtype).min, dtype=dtype, device=model.device).triu(1)
            from specdec.forward import grouped_attention

            try:
                out, _ = self(DynamicCache(config=model.config), ids, torch.arange(Q, device=model.device)[None],
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
    if type(model.get_output_embeddings()) is not nn.Linear:
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
        if any(type(m) is not nn.Linear for m in linears):
            return False
        if not all(hasattr(n, "variance_epsilon") for n in (layer.input_layernorm, layer.post_attention_layernorm)):
            return False
    return hasattr(decoder.norm, "variance_epsilon")


_paths: "weakref.WeakKeyDictionary[nn.Module, FastPath | None]" = weakref.WeakKeyDictionary()


def enabled() -> bool:
    v = os.environ.get("SPECDEC_FASTPATH", "on")
    if v not in ("on", "off"):
        raise ValueError(f"SPECDEC_FASTPATH={v!r}: expected on or off")
    return v == "on"


def get(model, check: bool = True) -> FastPath | None:
    """The model's fast path, built and checked against HF's forward at first sight, or None: not a
    supported model, turned off, or its check disagreed. check: rebuild it if the model's weights
    changed since (~150 attribute reads: once per generation, not per step)."""
    if not enabled():
        return None
    if model in _paths:
        path = _paths[model]
        if path is None or not check or not path.stale():
            return path
    elif not supported(model):
        _paths[model] = None
        return None
    with torch.inference_mode(False), torch.no_grad():  # the fused copies: normal tensors, whoever calls
        path = FastPath(model)
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
