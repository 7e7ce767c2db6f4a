"""The target's own weights at fewer bits drafting for it: a quantized self-drafter.

No training and no second model: the draft model is a shallow copy of the target whose decoder layers'
linears are the target's weights quantized to Q4_0 blocks (``specdec.quant``), and whose output layer,
where the target's is not quantized already, is a Q8_0 copy of it; the embedding, the norms and the
rotary table are the target's own modules, shared. It is the same model up to rounding, so it agrees
with the target often, and its steps read ~1/7 of an fp32 target's bytes (through the block kernel,
``runtime/qlinear.py``). It pays off for a higher-precision target (fp32, bf16, Q8_0); over a Q4 target
it reads as much as the target itself. Measured: docs/decisions/015-quant-kernels.md.

The registry's ``quant-self`` computes that output layer for the packaged draft vocabulary and the prompt's
ids only (``drafters.vocab``), where the vocabulary fits the target.

It drafts over the target's own K/V rows (``QuantSelfDrafter``, the registry's ``quant-self``): every
committed token's rows are copied from the target's store, as self-speculation does, so the draft never
prefills a prompt or catches up after a pause.

The draft computes in float32 whatever the target's dtype: the block kernel and the lean forward's fused
ops take fp32 rows only, and a bf16 draft would dequantize every matrix in Python at every token
(decision 015, Decision: quantized self-drafter). So for a bf16 / fp16 target the draft's norms and any layer
it keeps unquantized are fp32 copies (small), and the shared embedding's rows are cast as they are
looked up (no copy of the table).
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from specdec.drafters.base import Prompt
from specdec.drafters.self_spec import SelfSpecDrafter
from specdec.drafters.vocab import DraftVocabulary, packaged_vocabulary
from specdec.kv.bmc import BMCCache
from specdec.kv.compressed import CompressedCacheConfig
from specdec.introspect import float_dtype
from specdec.formats import block_format
from specdec.quant.modules import QuantLinear, quantize_blocks

DRAFT_QUANT = "Q4_0"  # the draft's block format: the cheapest one the gguf package writes
# the draft's output layer where the target's is not quantized (why Q8_0: decision 015, Tried and dropped)
HEAD_QUANT = "Q8_0"


def quantized_copy(target: nn.Module, quant: str = DRAFT_QUANT, head: str | None = HEAD_QUANT) -> nn.Module:
    """A view of ``target`` whose decoder layers' linears are ``quant`` blocks of its weights (a quantized
    target's dequantized ones) and whose output layer, if it is a plain nn.Linear, is ``head`` blocks of
    it (None: shared); every other module is the target's own. Layers whose rows are not whole blocks
    stay shared. The target itself is untouched."""
    fmt = block_format(quant)
    inner = target.get_decoder() if hasattr(target, "get_decoder") else target.model
    draft, draft_inner = _shallow(target), _shallow(inner)
    layers = []
    for layer in inner.layers:
        new = _shallow(layer)
        for part, sub in layer.named_children():
            if any(_quantizable(m, fmt) for m in sub.children()):
                new._modules[part] = _shallow(sub)
                for name, m in sub.named_children():
                    if _quantizable(m, fmt):
                        new._modules[part]._modules[name] = _requantized(m, fmt)
        layers.append(new)
    draft_inner._modules["layers"] = nn.ModuleList(layers)
    draft._modules["model"] = draft_inner
    out = target.get_output_embeddings() if hasattr(target, "get_output_embeddings") else None
    name = next((n for n, m in target.named_children() if m is out), None)  # "lm_head"; None: nested, shared
    if head is not None and name is not None and type(out) is nn.Linear and _quantizable(out, block_format(head)):
        draft._modules[name] = _requantized(out, block_format(head))
    if float_dtype(target) != torch.float32:
        _compute_in_float32(draft, draft_inner)
    return draft


class Float32Rows(nn.Module):
    """An embedding looked up in its own dtype and handed on as float32. The table is the target's, held
    outside this module's parameters, so the draft's ``dtype`` (HF's: its first floating parameter,
    which sizes its KV store) is float32."""

    def __init__(self, embedding: nn.Module) -> None:
        super().__init__()
        self._embedding = (embedding,)  # a tuple: not registered as a child

    @property
    def weight(self) -> torch.Tensor:
        return self._embedding[0].weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self._embedding[0](ids).to(torch.float32)


def _compute_in_float32(draft: nn.Module, inner: nn.Module) -> None:
    """Make the draft of a bf16 / fp16 target compute in float32: the embedding's rows cast on lookup, and
    every other module that still holds a non-fp32 floating parameter of its own (norms, layers kept
    unquantized, a shared output layer) an fp32 copy, in the draft's own child tables only."""
    inner._modules["embed_tokens"] = Float32Rows(inner.embed_tokens)

    def visit(parent: nn.Module) -> None:
        for name, m in list(parent._modules.items()):
            if m is None or isinstance(m, (Float32Rows, QuantLinear)):
                continue
            if any(p.is_floating_point() and p.dtype != torch.float32 for p in m.parameters(recurse=False)):
                parent._modules[name] = copy.deepcopy(m).to(torch.float32)
            else:
                if any(p.is_floating_point() and p.dtype != torch.float32 for p in m.parameters()):
                    parent._modules[name] = m = _shallow(m)  # a shared parent: copy its table before editing
                visit(m)

    visit(draft)


def _shallow(module: nn.Module) -> nn.Module:
    """A new module object sharing ``module``'s parameters and children (its own child table)."""
    out = copy.copy(module)
    out._modules = dict(module._modules)
    return out


def _quantizable(m: nn.Module, fmt) -> bool:
    return type(m) in (nn.Linear, QuantLinear) and m.in_features % fmt.block_weights == 0


def _requantized(m: nn.Module, fmt) -> QuantLinear:
    weight = m.weight if type(m) is nn.Linear else m.dequantized()
    return QuantLinear(quantize_blocks(weight, fmt), fmt, m.in_features, m.bias)


class QuantSelfDrafter(SelfSpecDrafter):
    """The quantized copy drafts over the target's own K/V rows, all of them: no prefill of its own and
    no catch-up after a pause (the rows of every committed token are copied from the target's store as
    self-speculation does, ``drafters.self_spec``), and no drift (its only K/V rows of its own are the
    pending token's and the drafts', dropped after each verify). The draft computes in float32 (see the
    module doc), so its store copy is float32. Why not a ``ModelDrafter`` over the copy: decision 015,
    Tried and dropped."""

    compresses = False  # every row: the draft is cheaper by its weights, not by its rows

    def __init__(self, target: nn.Module, quant: str = DRAFT_QUANT, head: str | None = HEAD_QUANT,
                 vocab: DraftVocabulary | None = None) -> None:
        # no compaction: the budget is past any context, so a row is never evicted
        super().__init__(target, CompressedCacheConfig(budget=2**62, overshoot=0), quantized_copy(target, quant, head),
                         vocab)

    def prompt_rows(self, prompt: Prompt, source: BMCCache) -> tuple[list[torch.Tensor], list[int]]:
        L, H = self.num_layers, self.num_kv_heads
        return [torch.arange(n, dtype=torch.long).expand(L, H, n) for n in source.lengths], list(source.lengths)


def quant_self_drafter(target: nn.Module) -> QuantSelfDrafter:
    """The registry's ``quant-self``: Q4_0 layers, and the packaged draft vocabulary where it fits."""
    return QuantSelfDrafter(target, vocab=packaged_vocabulary(target))
