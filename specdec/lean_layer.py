"""One decoder layer of the lean forward (``specdec.fastpath``), in its pieces: the linears and the ops between them.

- Linears: q/k/v and gate/up are each fused into one fp32 matrix (``stack_linears``: copies kept beside the
  model; the modules they replace are not packed for the kernel), or, quantized (``QuantLinear``), run side
  by side on their own blocks (``Stacked``), never copied. ``linear`` runs either kind: an fp32 weight
  through ``runtime.linear.linear``, a module by itself (the block kernel, ``runtime.qlinear``).
- Ops (``LayerOps``): HF's one by one (``HF_OPS``: any dtype; ``RuntimeConfig(fused=False)``), or the
  compiled ones of ``csrc/layer_ops.cpp`` for fp32 on CPU (``fused_ops``): each RMSNorm with the residual
  add before it, the q/k/v split with the rotary embedding, SiLU x up (the rotary embedding bit for bit
  HF's, the norms and SiLU to fp32 rounding: another summation order, Cephes' exp).

``Layer`` is one target layer so planned (``FastPath``'s); EAGLE-3's lean head layer
(``drafters.eagle3_head``) takes the same pieces. Why each exists: docs/decisions/004-lean-forward.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from specdec.quant.modules import QuantLinear
from specdec.runtime import linear as lin
from specdec.runtime import qlinear


class Stacked(nn.Module):
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


def stack_linears(*linears: nn.Module) -> torch.Tensor | Stacked:
    """The fused weight of plain linears ([sum of N, C], stacked), or quantized ones side by side."""
    if all(type(m) is nn.Linear for m in linears):
        return torch.cat([m.weight for m in linears]).detach()
    return Stacked(*linears)


# a linear of the path: an fp32 weight [N, C] (with its bias beside it) through ``runtime.linear``, or a
# module that computes itself (a QuantLinear through the block kernel, or quantized linears Stacked)
Weight = torch.Tensor | nn.Module


@dataclass(frozen=True)
class Layer:
    attn: nn.Module  # HF's attention module: what the attention function is handed (scaling, flags)
    norm1: nn.Module  # input RMSNorm
    qkv: Weight  # [Hq*Dh + 2*Hkv*Dh, C] q, k, v weights stacked
    qkv_bias: torch.Tensor | None  # [Hq*Dh + 2*Hkv*Dh] (a module's bias is its own: None)
    o: nn.Module  # nn.Linear or QuantLinear
    norm2: nn.Module  # post-attention RMSNorm
    gate_up: Weight  # [2I, C] gate and up weights stacked
    gate_up_bias: torch.Tensor | None  # [2I]
    down: nn.Module

    @classmethod
    def of(cls, layer: nn.Module) -> Layer:
        """An HF decoder layer (Llama-shaped: ``fastpath.supported``) as the lean forward runs it."""
        a, mlp = layer.self_attn, layer.mlp
        return cls(a, layer.input_layernorm, stack_linears(a.q_proj, a.k_proj, a.v_proj),
                   _cat_bias(a.q_proj, a.k_proj, a.v_proj), a.o_proj, layer.post_attention_layernorm,
                   stack_linears(mlp.gate_proj, mlp.up_proj), _cat_bias(mlp.gate_proj, mlp.up_proj), mlp.down_proj)


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


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., C] through a fused weight or a module (``Weight``)."""
    if isinstance(weight, nn.Module):  # quantized: the module routes itself (runtime.qlinear)
        return weight(x)
    return lin.linear(x, weight, bias, lin.max_rows())  # the decoder's skinny_rows


def apply(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A layer of the model (nn.Linear or QuantLinear) on x, by ``linear``."""
    return linear(x, m.weight, m.bias) if type(m) is nn.Linear else m(x)


def _joined_bias(linears) -> torch.Tensor | None:
    """The linears' biases end to end (zeros for one without) [sum of out_features], or None if none has one."""
    some = next((m.bias for m in linears if m.bias is not None), None)
    if some is None:
        return None
    return torch.cat([m.bias if m.bias is not None else some.new_zeros(m.out_features) for m in linears]).detach()


def _cat_bias(*linears: nn.Module) -> torch.Tensor | None:
    """The fused bias of plain linears (a quantized layer's bias is its module's own: None)."""
    return None if any(type(m) is not nn.Linear for m in linears) else _joined_bias(linears)
