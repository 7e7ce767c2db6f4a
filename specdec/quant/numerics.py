"""Which arithmetic a quantized target computes in: ``exact`` or ``int8``.

- ``exact`` (the default): the blocks decoded to the reference's fp32 values, fp32 products; the same
  outputs as the dequantized model up to summation order (``QuantLinear.reference`` defines it).
- ``int8``: every linear layer (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K) rounds its input per row to 8-bit blocks of 32
  and multiplies the blocks' codes by them as integers, fp32 scales (``runtime/csrc/int8_linear.cpp``),
  and attention runs one query row at a time over the keys that row sees (``runtime/csrc/row_attention.cpp``), which
  its K/V store holds in bf16 (``kv_dtype``: each value rounded once, as written, then read exactly). A target in int8
  numerics is its own reference: both ops are batch-invariant (a row's outputs are bit-equal computed
  alone, at any place in a block of any size, in a ragged batch, with any thread count), the norms,
  rotary and elementwise ops are per row, so a verify's rows are bit-equal to plain decoding's and
  speculation stays exactly lossless against the same target's plain decoding (specdec's ``none``; HF
  ``generate`` on it runs HF's attention, another arithmetic). A prompt's attention over itself (the
  prefill, which every decoding of the prompt shares) takes bf16 products where the build has AVX512-BF16
  (``runtime/csrc/prompt_attention.cpp``), else SDPA's causal path as in exact numerics.
  Why and what it is worth: docs/decisions/019-int8-numerics.md.

    set_numerics(model, "int8")     # a packed GGUF or a model quantized on load (Q4_0 / Q4_1 / Q8_0 / Q4_K)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from enum import Enum

import torch
import torch.nn as nn

from specdec.quant.modules import QuantLinear
from specdec.runtime.int8_linear import INT8_FORMATS  # what csrc/int8_linear.cpp multiplies

class Numerics(str, Enum):
    """Which arithmetic a quantized target computes in; ``load_model``'s ``numerics`` and the commands'
    ``--numerics`` (``arguments``). One rule for the commands' default, ``AUTO`` (``resolve``). A member
    equals its name as a string: Numerics.INT8 == "int8"."""

    EXACT = "exact"  # the blocks' fp32 values, fp32 products: token-identical to HF on the dequantized model
    INT8 = "int8"  # rows rounded to 8-bit blocks, integer products: batch-invariant, its own reference
    AUTO = "auto"  # the commands' default: INT8 where the target can take it, else EXACT

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: "Numerics | str") -> "Numerics":
        """``value`` as a Numerics (a member, or its name); a ValueError names the choices.
        Example: "int8" -> Numerics.INT8."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"numerics={value!r}: expected one of {', '.join(n.value for n in cls)}") from None

    def resolve(self, model: nn.Module) -> "Numerics":
        """The numerics ``model`` computes in for this choice: AUTO is INT8 where every linear layer is in
        INT8_FORMATS (a GGUF kept packed, or quantized on load), else EXACT (docs/decisions/019-int8-numerics.md:
        int8 is the faster one and its perplexity within 0.4% of exact's; exact is the one token-identical
        to HF); any other choice is itself."""
        if self is not Numerics.AUTO:
            return self
        return Numerics.INT8 if int8_problem(model) is None else Numerics.EXACT


NUMERICS = (Numerics.EXACT, Numerics.INT8)  # what a model computes in (AUTO is a choice, resolved per model)
_ATTR = "specdec_numerics"  # the model's attribute, read by the forward (``numerics_of``)


def numerics_of(model) -> Numerics:
    """The numerics a model computes in (EXACT unless ``set_numerics`` said otherwise)."""
    return getattr(model, _ATTR, Numerics.EXACT)


def kv_dtype(model) -> torch.dtype | None:
    """The dtype a K/V store holds ``model``'s keys and values in: bf16 in int8 numerics (half the bytes a
    step's attention reads; the values are rounded once, as written, and attended in fp32: docs/decisions/
    019-int8-numerics.md), else None: the model's own."""
    return torch.bfloat16 if numerics_of(model) is Numerics.INT8 else None


def int8_problem(model: nn.Module) -> str | None:
    """Why ``model`` cannot compute in int8 numerics (its first linear layer that is fp32 or in a format
    outside INT8_FORMATS), or None where it can."""
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            return (f"numerics='int8' needs every linear layer quantized; {name} holds fp32 weights (load a GGUF "
                    f"packed, or quantize on load: weights='q8_0', 'q4_0', 'q4_1' or 'q4_k')")
        if isinstance(mod, QuantLinear) and mod.fmt.name not in INT8_FORMATS:
            return (f"numerics='int8' multiplies {', '.join(INT8_FORMATS)} blocks; {name} is {mod.fmt.name} (use "
                    f"numerics='exact' for this model)")
    return None


def set_numerics(model: nn.Module, numerics: Numerics | str) -> nn.Module:
    """Make ``model`` compute in ``numerics`` (EXACT or INT8, or its name; in place). INT8 needs every linear
    layer of the model in blocks of INT8_FORMATS (a ValueError names the first that is not: an fp32 layer,
    or another format), and specdec's CPU kernels (checked at the first forward)."""
    if numerics not in NUMERICS:  # AUTO too: a choice, not an arithmetic (``resolve`` it first)
        raise ValueError(f"numerics={str(numerics)!r}: expected one of {', '.join(n.value for n in NUMERICS)}"
                         + (" (a choice to resolve first: Numerics.resolve)" if numerics == Numerics.AUTO else ""))
    numerics = Numerics(numerics)
    if numerics is Numerics.INT8 and (problem := int8_problem(model)) is not None:
        raise ValueError(problem)
    for mod in model.modules():
        if isinstance(mod, QuantLinear):
            mod.numerics = numerics
    setattr(model, _ATTR, numerics)
    return model


@contextmanager
def exact_numerics(model: nn.Module) -> Iterator[None]:
    """Within: ``model`` computes in exact numerics, then in what it computed in before. For checks of a
    forward's structure against HF's (``specdec.fastpath``): int8 rounding turns a last-bit difference
    of two equivalent forwards (another summation order) into a step of its 8-bit grid, which says
    nothing about whether they compute the same model."""
    before = numerics_of(model)
    if before == "exact":
        yield
        return
    set_numerics(model, "exact")
    try:
        yield
    finally:
        set_numerics(model, before)
