"""The EAGLE-3 head for Llama-shaped targets: fused features from three target layers, one decoder layer
over [embedding ; hidden], a reduced draft vocabulary. Its files: ``drafters.eagle3_io``.

Reference: Li et al., "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test" (2025); the layouts vLLM (``Eagle3LlamaForCausalLM``), SGLang
(``LlamaForCausalLMEagle3``) and the ``speculators`` project load, whose tensor names it keeps::

    a_t     the residual stream entering target layers aux_layers (default 2, N/2, N-3) at position t,
            concatenated: [3D]  (Capabilities.hidden_layers; HF's hidden_states[j])
    g_t = fc(a_t)                                              [D]  once per committed position
    h   = midlayer(embed(x_t+1), g)                             [D]  the residual stream, before ``norm``
    midlayer: attn(cat[input_layernorm(emb), hidden_norm(g)])   q/k/v take 2D, o gives D
              x = r + attn; out = x + mlp(post_attention_layernorm(x))
              r = g (r = hidden_norm(g) with norm_before_residual)
    logits  = lm_head(norm(h))                                  [M] over the draft vocabulary

A drafted node feeds its parent's ``h`` back in place of ``g`` (no fc): the training-time test trains
exactly that. Draft id i is target id ``i + d2t[i]``; ``t2d`` [V] marks the target ids in the draft
vocabulary (both as vLLM and SGLang store them). The embedding and rotary table are the target's,
frozen, outside the head's weights.

Dimensions: B batch rows, S positions, D hidden size, M draft vocabulary, V target vocabulary.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from specdec.drafters.eagle_head import _decoder, _TargetParts, rows_at
from specdec.forward import cache_arg
from specdec.introspect import text_config, vocab_size_of
from specdec import lean_layer
from specdec.quant.modules import QuantLinear
from specdec.runtime import state
from specdec.runtime.attention import grouped_attention


@dataclass(frozen=True)
class Eagle3HeadConfig:
    # target layers whose inputs are fused (HF's hidden_states[j]: vLLM's meaning of
    # eagle_aux_hidden_state_layer_ids); None: default_aux_layers(N) = (2, N // 2, N - 3), as both engines
    aux_layers: tuple[int, ...] | None = None
    norm_before_residual: bool = False  # the residual is hidden_norm(g), not g (a speculators option)
    fc_bias: bool = False  # vLLM's fc has no bias (SGLang's reads the config's "bias")


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """(2, N // 2, N - 3), as vLLM and SGLang pick them, each clamped into [0, N) for tiny targets."""
    return tuple(min(max(j, 0), num_layers - 1) for j in (2, num_layers // 2, num_layers - 3))


def vocab_maps(draft_ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Target ids of the draft vocabulary [M] (ascending) -> (d2t [M] int64 offsets, t2d [V] bool).
    Example: draft_ids [3, 4, 9] -> d2t [3, 3, 7] (draft id i is target id i + d2t[i]), t2d true at 3, 4, 9."""
    ids = draft_ids.long().reshape(-1)
    if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(f"draft vocabulary ids must lie in [0, {vocab_size})")
    if not bool((ids[1:] > ids[:-1]).all()):
        raise ValueError("draft vocabulary ids must be distinct and ascending (vLLM's and SGLang's d2t order)")
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(ids.numel(), dtype=torch.long), t2d


class _MidLayer(nn.Module):
    """EAGLE-3's decoder layer, built from the target layer's own attention, MLP and norm classes (no
    copied modeling code): q/k/v widened to take [embedding ; hidden], two input norms."""

    def __init__(self, target_layer: nn.Module, cfg, norm_before_residual: bool) -> None:
        super().__init__()
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        norm = type(target_layer.input_layernorm)
        self.norm_before_residual = norm_before_residual
        self.input_layernorm, self.hidden_norm = norm(D, eps=eps), norm(D, eps=eps)
        self.self_attn = type(target_layer.self_attn)(cfg, layer_idx=0)
        for name in ("q_proj", "k_proj", "v_proj"):
            old = getattr(self.self_attn, name)
            setattr(self.self_attn, name, nn.Linear(2 * D, old.out_features, bias=old.bias is not None))
        self.post_attention_layernorm = norm(D, eps=eps)
        self.mlp = type(target_layer.mlp)(cfg)

    def forward(self, emb: torch.Tensor, hidden: torch.Tensor, attention_mask: torch.Tensor, position_ids,
                rope, cache) -> torch.Tensor:
        """emb, hidden [B, S, D] -> the residual stream after the layer [B, S, D]."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(emb), normed], dim=-1)  # [B, S, 2D]
        attn = self.self_attn(hidden_states=x, attention_mask=attention_mask, position_ids=position_ids,
                              position_embeddings=rope, **{cache_arg(self.self_attn): cache})[0]
        x = residual + attn
        return x + self.mlp(self.post_attention_layernorm(x))


class _LeanLayer:
    """``_MidLayer.forward`` by the target's lean ops (``specdec.lean_layer``: the compiled RMSNorm, rotary
    split, SiLU x up; q/k/v and gate/up each one block-kernel call; the attention kernel), for a head
    whose linears are quantized blocks (``drafters.eagle.lean_head``), in place of HF's modules' Python
    (why: docs/decisions/017-eagle3.md). The same math to fp32 rounding; the drafts stay drafts, exactness
    is the verifier's."""

    def __init__(self, layer: _MidLayer) -> None:
        a, mlp = layer.self_attn, layer.mlp
        self.attn, self.norms = a, (layer.input_layernorm, layer.hidden_norm, layer.post_attention_layernorm)
        self.norm_before_residual = layer.norm_before_residual
        self.qkv, self.o = lean_layer.stack_linears(a.q_proj, a.k_proj, a.v_proj), a.o_proj
        self.gate_up, self.down = lean_layer.stack_linears(mlp.gate_proj, mlp.up_proj), mlp.down_proj
        self.hq, self.hkv = a.q_proj.out_features // a.head_dim, a.k_proj.out_features // a.head_dim

    @classmethod
    def of(cls, layer: _MidLayer) -> "_LeanLayer | None":
        """The lean layer, where every linear of ``layer`` is quantized blocks without a bias and every
        norm is an RMSNorm; else None."""
        a, mlp = layer.self_attn, layer.mlp
        linears = (a.q_proj, a.k_proj, a.v_proj, a.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        norms = (layer.input_layernorm, layer.hidden_norm, layer.post_attention_layernorm)
        if (any(type(m) is not QuantLinear or m.bias is not None for m in linears)
                or not all(hasattr(n, "variance_epsilon") for n in norms) or not hasattr(a, "head_dim")):
            return None
        return cls(layer)

    def __call__(self, emb, hidden, attention_mask, rope, cache, last=None) -> torch.Tensor | None:
        """As ``_MidLayer.forward``; None where the fused ops do not take it (not fp32 on CPU, no build).
        ``last`` [B]: every row's K/V into the store, the rest of the layer for row ``last[b]`` of each
        sequence alone ([B, 1, D]: ``Eagle3Head.draft``)."""
        cos, sin = rope
        ops = state.active().ops
        if (ops is None or hidden.dtype != torch.float32 or hidden.device.type != "cpu" or cos.dim() != 3
                or cos.shape[-1] != self.attn.head_dim):
            return None
        ops = lean_layer.fused_ops(ops)
        B, Q, _ = hidden.shape
        hidden, emb = hidden.contiguous(), emb.contiguous()  # the fused ops take whole rows
        n_emb, n_hidden, n_post = self.norms
        normed = ops.norm(hidden, n_hidden.weight, n_hidden.variance_epsilon)
        x = torch.cat([ops.norm(emb, n_emb.weight, n_emb.variance_epsilon), normed], dim=-1)  # [B, Q, 2D]
        q, k, v = ops.rope_split(self.qkv(x), cos.contiguous(), sin.contiguous(), self.hq, self.hkv)
        k, v = cache.update(k, v, 0)  # [B, Hkv, L, Dh] views of the store
        residual = normed if self.norm_before_residual else hidden
        if last is not None:  # a row's K/V need only its input; its output is wanted for `last` alone
            q, attention_mask = rows_at(q, last, 2), rows_at(attention_mask, last, 2)
            residual, Q = rows_at(residual, last), 1
        o, _ = grouped_attention(self.attn, q, k, v, attention_mask, scaling=self.attn.scaling)
        x, h = ops.add_norm(residual.contiguous(), self.o(o.reshape(B, Q, -1)), n_post.weight, n_post.variance_epsilon)
        return x + self.down(ops.silu_mul(self.gate_up(h)))


# what a head's own layer may set apart from its target (a file's config): its width and the rotary
# table's head size stay the target's, since the embedding and the rotary table are the target's
LAYER_KEYS = ("intermediate_size", "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "attention_bias",
              "mlp_bias")


class Eagle3Head(nn.Module):
    """The head for ``target`` (Llama-shaped: decoder layers with self_attn.{q,k,v,o}_proj, mlp, RMS norms).
    ``draft_vocab``: the target ids it drafts from, ascending (None: the whole vocabulary). ``layer``:
    the head's layer config where it differs from the target's (LAYER_KEYS; a file's config.json)."""

    def __init__(self, target, config: Eagle3HeadConfig = Eagle3HeadConfig(),
                 draft_vocab: torch.Tensor | None = None, layer: dict | None = None) -> None:
        super().__init__()
        tcfg = text_config(target)
        D, N = tcfg.hidden_size, tcfg.num_hidden_layers
        V = vocab_size_of(target)
        layers = tuple(int(j) for j in (config.aux_layers or default_aux_layers(N)))
        if len(layers) != 3 or not all(0 <= j < N for j in layers):
            raise ValueError(f"EAGLE-3 fuses 3 target layers in [0, {N}), got aux_layers {layers}")
        layer0 = _decoder(target).layers[0]
        for name in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm"):
            if not hasattr(layer0, name):
                raise ValueError(f"EAGLE-3 heads need a Llama-shaped target: {type(layer0).__name__} has no {name}")
        self.config = config
        self.aux_layers = layers
        self.target_config = tcfg  # for the files: what the head was built for
        self.vocab_size = V
        layer_cfg = copy.deepcopy(tcfg)
        layer_cfg.num_hidden_layers = 1
        if getattr(layer_cfg, "layer_types", None) is not None:
            layer_cfg.layer_types = layer_cfg.layer_types[:1]
        head_dim = getattr(tcfg, "head_dim", None) or D // tcfg.num_attention_heads
        layer_cfg.head_dim = head_dim  # the target's rotary table: fixed whatever the head's head count
        for key, value in (layer or {}).items():
            if key in LAYER_KEYS and value is not None:
                setattr(layer_cfg, key, value)
        if (layer or {}).get("head_dim") not in (None, head_dim):
            raise ValueError(f"EAGLE-3 head of head size {layer['head_dim']} cannot use the target's rotary "
                             f"table (head size {head_dim})")
        self.layer_config = layer_cfg  # the head's own layer, for its files
        self.fc = nn.Linear(3 * D, D, bias=config.fc_bias)
        self.midlayer = _MidLayer(layer0, layer_cfg, config.norm_before_residual)
        self.norm = type(layer0.input_layernorm)(D, eps=tcfg.rms_norm_eps)
        ids = torch.arange(V, dtype=torch.long) if draft_vocab is None else draft_vocab
        d2t, t2d = vocab_maps(ids, V)
        self.lm_head = nn.Linear(D, d2t.numel(), bias=False)
        self.register_buffer("d2t", d2t)  # [M] draft id -> target id offset
        self.register_buffer("t2d", t2d)  # [V] target id is in the draft vocabulary
        self.to(dtype=target.dtype, device=target.device)
        self._target = _TargetParts(target)
        self._lean: _LeanLayer | bool | None = None  # built on the first draft (False: none applies)

    @property
    def hidden_size(self) -> int:
        return self.fc.out_features

    @property
    def feature_size(self) -> int:
        """Width of the target features a committed position carries: 3 layers' hidden states."""
        return self.fc.in_features

    @property
    def draft_vocab(self) -> torch.Tensor:
        """[M] the target id of each draft id (ascending)."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [..., 3D] -> the head's hidden input [..., D]."""
        return self.fc(features)

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """hidden [B, S, D] (fused features, or the head's own outputs), tokens [B, S] (token t follows
        position t), position_ids [B, S], attention_mask [B, 1, S, L] additive (None: causal over the S
        rows) -> the residual stream after the layer [B, S, D] (before ``norm``: what is fed back)."""
        emb, attention_mask, rope = self._target.inputs(hidden, tokens, position_ids, attention_mask)
        return self.midlayer(emb, hidden, attention_mask, position_ids, rope, cache)

    def draft(self, hidden: torch.Tensor, tokens: torch.Tensor, position_ids: torch.Tensor,
              attention_mask: torch.Tensor, cache, last: torch.Tensor | None = None) -> torch.Tensor:
        """``forward`` for drafting (no grad, a store): the layer by the target's lean ops where they take
        it (``_LeanLayer``), else by its modules. ``last`` [B]: only row ``last[b]``'s output is wanted
        ([B, 1, D]); every row still enters the store (the lean path runs the rest of the layer for that
        row alone: a prompt's catch-up costs its K/V, not its attention and MLP)."""
        if self._lean is None:
            self._lean = _LeanLayer.of(self.midlayer) or False
        emb, attention_mask, rope = self._target.inputs(hidden, tokens, position_ids, attention_mask)
        if self._lean and not torch.is_grad_enabled():
            out = self._lean(emb, hidden, attention_mask, rope, cache, last)
            if out is not None:
                return out
        return rows_at(self.midlayer(emb, hidden, attention_mask, position_ids, rope, cache), last)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., D] head outputs -> [..., M] over the draft vocabulary."""
        return self.lm_head(self.norm(hidden))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]
