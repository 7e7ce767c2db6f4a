"""A lean forward for Llama-family targets: HF's own math and weights, without HF's per-module Python.

``FastPath`` runs one block through the same ops in the same order as HF's modules: RMSNorm written as
HF writes it, HF's rotary module and ``apply_rotary_pos_emb``, the cache's own ``update`` (the Cache
interface, so a BMC store and a compressed one both work), the attention function the block would have
used (``runtime.attention``: ``grouped_attention``, PAD, or ``split_attention``, SPLIT), and every linear
through ``runtime.linear.linear``, or, quantized (``QuantLinear``), by itself (the block kernel,
``runtime.qlinear``).

One layer loop (``_layers``) over the layers as ``specdec.lean_layer`` plans them (q/k/v and gate/up each
fused into one matrix, or quantized side by side), its ops between the linears a parameter chosen once a
forward (``LayerOps``: HF's, or for fp32 on CPU the fused ops of ``csrc/layer_ops.cpp``). With the fused
ops, where the cache hands over its buffers (a BMC store), the whole loop runs as one compiled call
(``specdec.one_call``: bit for bit the loop's results; a quantized target only where its layers are all
quantized and have no biases: docs/decisions/015-quant-kernels.md, Decision: the lean forward and the one
call). Why each exists and what it was worth: docs/decisions/004-lean-forward.md.

Only plain Llama-shaped decoders take it: ``llama``, and ``mistral`` / ``qwen2`` without a sliding
window (Qwen2's q/k/v biases are fused too); RMSNorm, SiLU-gated MLP, one rotary table, no
tensor-parallel split. Each path is checked against HF's forward once when built (a 5-token block;
logits must agree to fp32 rounding), and anything else, or a disagreeing check, runs HF's forward.
``RuntimeConfig(fastpath=False)`` turns it off (to compare, or to rule it out).
"""

from __future__ import annotations

import logging
import weakref

import torch
import torch.nn as nn
from transformers import DynamicCache

from specdec.config import RuntimeConfig
from specdec.introspect import sliding_window
from specdec.lean_layer import HF_OPS, Layer, LayerOps, apply, fused_ops, linear
from specdec.one_call import OneCall
from specdec.patch import skinny_linears
from specdec.quant.modules import QuantLinear
from specdec.quant.numerics import exact_numerics
from specdec.runtime import attention as attn
from specdec.runtime import int8_linear, state
from specdec.runtime.attention import grouped_attention, split_attention

MODEL_TYPES = ("llama", "mistral", "qwen2")
log = logging.getLogger(__name__)


class _Attention:
    """A forward's attention for every layer: ``attention`` (HF's signature), or the kernel called
    directly where ``grouped_attention`` would call it for every layer alike (a block with a mask, or
    one row): its route asked once a forward (by the first layer), the mask cut once."""

    def __init__(self, attention, mask: torch.Tensor | None, Q: int, hq: int, hkv: int) -> None:
        self.attention, self.full_mask, self.hq, self.hkv = attention, mask, hq, hkv
        # a prompt's block in int8 numerics goes to grouped_attention's prompt path, one row or many
        self.direct = attention is grouped_attention and (mask is not None or Q == 1) and not attn.prompt_mode()
        self.kernel, self.keys, self.mask = None, 0, None

    def __call__(self, layer: Layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
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
        self.layers = [Layer.of(layer) for layer in self.decoder.layers]
        # the norm after each layer: the next layer's input norm, the model's final norm after the last
        self.next_norms = [layer.norm1 for layer in self.layers[1:]] + [self.decoder.norm]
        self._sources = self._stamp()
        self.fuse = config.fused  # the fused layer ops where they apply; False: HF's ops, one by one
        # the fused layers in one compiled call where the store and attention allow (None: the loop only;
        # a quantized target takes it where all its layers are quantized and have no biases)
        hq, hkv = self.q_size // self.head_dim, self.kv_size // self.head_dim
        self.compiled_layers = (OneCall.of(self.layers, self.next_norms, self.head_dim, hq, hkv)
                                if config.one_call else None)
        self.one_call = self.compiled_layers is not None  # the switch (False: the loop, to compare)

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
        projections', whose packed copies ``OneCall`` keeps; a quantized layer's blocks): a change
        means the copies are stale."""
        kept = [m for layer in self.layers for m in (layer.o, layer.down)]
        sources = [m.weight if type(m) is nn.Linear else m.blocks for m in self.replaced() + kept]
        return [(w.data_ptr(), w._version) for w in sources]

    def stale(self) -> bool:
        return self._stamp() != self._sources

    @torch.inference_mode()
    def __call__(self, cache, input_ids: torch.Tensor, position_ids: torch.Tensor,
                 attention_mask: torch.Tensor | None, attention, logits_rows: int | None = None,
                 keep: tuple[int, ...] = (), head: nn.Module | None = None,
                 unread: torch.Tensor | None = None,
                 vocab: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids [B, Q], position_ids [B, Q], attention_mask [B, 1, Q, L] additive, or None for a
        causal block over an empty cache (a prefill: SDPA's causal path, as HF runs it); attention: the HF
        attention function to run; logits_rows: only the last this many rows' logits (a prefill's last);
        keep: layers whose inputs to return instead of the last hidden state (``forward.hidden_of``);
        head: an output layer in the model's place (a module: a draft's ``drafters.vocab.VocabHead``).
        unread: [B, Q] bool, rows whose logits nobody reads (a grammar allows one token there): the output
        layer skips them and their logits are zeros.
        vocab: int64 [G], the groups of 16 token ids whose logits are read (``_output``).
        Returns (logits [B, Q or logits_rows, V], last hidden state after the norm [B, Q, C], or the
        kept layers' inputs [B, Q, C * len(keep)])."""
        x = self.decoder.embed_tokens(input_ids)  # [B, Q, C]
        cos, sin = self.decoder.rotary_emb(x, position_ids)
        ops = self._fused_ops(x, cos)
        kept: dict[int, torch.Tensor | None] = dict.fromkeys(keep)  # filled by the loop
        hidden = self._layers(HF_OPS if ops is None else ops, cache, x, cos, sin, attention_mask, attention, kept)
        rows = hidden if logits_rows is None else hidden[:, -logits_rows:]
        if head is not None:
            logits = head(rows)
        elif unread is not None and logits_rows is None and bool(unread.any()):
            logits = self._read_rows(rows, ~unread.to(rows.device), vocab)
        else:
            logits = self._output(rows, vocab)
        return logits, torch.cat([kept[j] for j in keep], -1) if keep else hidden

    def _read_rows(self, rows: torch.Tensor, read: torch.Tensor, vocab: torch.Tensor | None = None) -> torch.Tensor:
        """The output layer over the rows ``read`` [B, Q] names of rows [B, Q, C]; zeros elsewhere -> [B, Q, V].
        A row's logits are what the whole block would give it wherever the layer is batch-invariant (int8
        numerics); elsewhere up to summation order, as any block's. vocab: ``_output``'s."""
        B, Q, _ = rows.shape
        out = torch.zeros(B, Q, self.head.out_features, dtype=rows.dtype, device=rows.device)
        if bool(read.any()):
            out[read] = self._output(rows[read][None], vocab)[0]
        return out

    def _output(self, rows: torch.Tensor, vocab: torch.Tensor | None = None) -> torch.Tensor:
        """The output layer over rows [..., C] -> [..., V]. With ``vocab`` (int64 [G], groups of 16 token ids) and
        an int8 layer (``quant.numerics``), only those groups' logits, zeros elsewhere: the layer's groups of 16
        features side by side (``int8_linear.interleave``) taken alone; each logit is its own feature's integer
        dot product, so it has the bits the whole layer gives it. Why: docs/decisions/020-constraints.md."""
        head = self.head
        G = int8_linear.GROUP
        if vocab is None or not (isinstance(head, QuantLinear) and head.numerics == "int8"
                                 and head.out_features % G == 0):
            return apply(head, rows)
        blocks = head.int8_blocks()
        part = blocks.view(-1, G, blocks.shape[-1]).index_select(0, vocab).reshape(-1, blocks.shape[-1])
        cols = (vocab[:, None] * G + torch.arange(G, dtype=torch.long)).reshape(-1)
        bias = None if head.bias is None else head.bias.index_select(0, cols)
        out = torch.zeros(*rows.shape[:-1], head.out_features, dtype=rows.dtype, device=rows.device)
        return out.index_copy_(-1, cols, int8_linear.linear(rows, [part], [head.fmt], bias))

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
        With compiled ops, the one call (``OneCall``) where it takes the block. ``kept`` (layer index ->
        None): filled in with the input of each layer it names, [B, Q, C]."""
        B, Q, _ = x.shape
        cos, sin = cos.contiguous(), sin.contiguous()
        hq, hkv = self.q_size // self.head_dim, self.kv_size // self.head_dim
        first = self.layers[0].norm1
        h = ops.norm(x, first.weight, first.variance_epsilon)
        attend = _Attention(attention, attention_mask, Q, hq, hkv)
        if ops.compiled is not None and self.one_call and (
                attend.direct or (attention is split_attention and attention_mask is not None)):
            keep = tuple(kept) if kept else ()
            out = self.compiled_layers(ops.compiled, cache, x, h, cos, sin, attention_mask, not attend.direct, keep)
            if out is not None:
                h, inputs = out
                for j, part in zip(keep, inputs.split(x.shape[-1], dim=-1) if keep else ()):
                    kept[j] = part
                return h
        for i, layer in enumerate(self.layers):
            if kept and i in kept:
                kept[i] = x  # the residual stream entering layer i (add_norm returns new tensors)
            q, k, v = ops.rope_split(linear(h, layer.qkv, layer.qkv_bias), cos, sin, hq, hkv)
            k, v = cache.update(k, v, i)  # [B, Hkv, L, Dh] views of the store
            o = attend(layer, q, k, v)
            x, h = ops.add_norm(x, apply(layer.o, o), layer.norm2.weight, layer.norm2.variance_epsilon)
            mlp = apply(layer.down, ops.silu_mul(linear(h, layer.gate_up, layer.gate_up_bias)))
            norm = self.next_norms[i]
            x, h = ops.add_norm(x, mlp, norm.weight, norm.variance_epsilon)
        return h

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
