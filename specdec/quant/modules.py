"""Layers whose weights stay packed in GGUF blocks: their reference forward defines the target.

``QuantLinear`` and ``QuantEmbedding`` hold a weight as its blocks (uint8 [N, row_bytes], never an
fp32 copy of the whole matrix) and compute with the reference dequantization of
``specdec.formats``: the reference forward dequantizes the matrix (an embedding: only the rows
it looks up) to fp32 and runs the fp32 op, and defines the layer. A forward over a few fp32 rows on
CPU takes the block kernel instead where the runtime's self-check chose it (``specdec.runtime.qlinear``:
the same weights, the same products, another summation order). So ``target.generate(...)`` on a model
holding them is the exactness reference for every faster path, and since the dequantized values equal
transformers' own GGUF loading bit for bit, that reference computes what the fp32 target computes.

    model = quantize_model(model, "Q8_0")          # any HF model: its nn.Linear layers as Q8_0 blocks
    swap_linear(model, "model.layers.0.mlp.up_proj", QuantLinear(blocks, block_format("Q4_K"), 576))
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from specdec import formats
from specdec.formats import BlockFormat, block_format, dequantize
from specdec.runtime import int8_linear, qlinear

# the formats ``quantize_model`` can write: the gguf package's quantizers and specdec's own Q4_K
# (``specdec.quant.q4k``); the other K formats load from files
QUANTIZE_ON_LOAD = ("Q8_0", "Q4_0", "Q4_1", "Q4_K")
# a tied embedding and output layer's blocks on load, whatever the layers' format: the matrix is both the
# embedding and the output layer, and GGUF files keep it at 8 bits or so (the default model's Q4_1 file: Q8_0)
TIED_QUANT = "Q8_0"


def _check_blocks(blocks: torch.Tensor, fmt: BlockFormat, row_weights: int, what: str, rows: str) -> None:
    """blocks must be uint8 [rows, the bytes of ``row_weights`` weights in ``fmt``]; else a ValueError."""
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != fmt.row_bytes(row_weights):
        raise ValueError(f"{fmt.name} blocks for {what} must be uint8 [{rows}, {fmt.row_bytes(row_weights)}], "
                         f"got {blocks.dtype} {tuple(blocks.shape)}")


def _check_quantizable(fmt: BlockFormat) -> None:
    if fmt.name not in QUANTIZE_ON_LOAD:
        raise ValueError(f"quantizing to {fmt.name} is not supported; on load: {', '.join(QUANTIZE_ON_LOAD)}")


class QuantLinear(nn.Module):
    def __init__(self, blocks: torch.Tensor, fmt: BlockFormat, in_features: int,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__()
        _check_blocks(blocks, fmt, in_features, f"{in_features} input features", "out_features")
        self.fmt = fmt
        self.in_features, self.out_features = in_features, blocks.shape[0]
        self.register_buffer("blocks", blocks, persistent=False)  # [N, row_bytes] uint8
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(torch.float32), requires_grad=False)
        self.numerics = "exact"  # or "int8": the arithmetic this layer computes in (``quant.numerics``)

    def dequantized(self) -> torch.Tensor:
        """The weight the blocks define: float32 [out_features, in_features]."""
        return dequantize(self.blocks, self.fmt)

    def int8_blocks(self) -> torch.Tensor:
        """The blocks in the int8 kernel's interleaved layout (``int8_linear.interleave``): made on first use in
        int8 numerics, again only if ``blocks`` is replaced (a move to another device) or changed in place."""
        made = self.__dict__.get("_int8_blocks")
        if made is None or made[0] is not self.blocks or made[1] != self.blocks._version:
            made = self.__dict__["_int8_blocks"] = (self.blocks, self.blocks._version,
                                                    int8_linear.interleave(self.blocks, self.fmt))
        return made[2]

    def kernel_blocks(self) -> torch.Tensor:
        """The blocks the kernel of this layer's numerics takes: the file's, or int8's interleaved copy."""
        return self.int8_blocks() if self.numerics == "int8" else self.blocks

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., in_features] -> [..., out_features]
        y = qlinear.linear(x, self.kernel_blocks(), self.fmt, self.bias, self.numerics)  # the kernel or the GEMM (qlinear's routes)
        return self.reference(x) if y is None else y

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The forward that defines the layer: dequantize, F.linear."""
        # output features in slices of <= CHUNK_FLOATS dequantized weights (formats.CHUNK_FLOATS)
        step = max(1, formats.CHUNK_FLOATS // self.in_features)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if step >= self.out_features:
            return F.linear(x, self.dequantized().to(x.dtype), bias)
        out = torch.cat([F.linear(x, dequantize(self.blocks[i:i + step], self.fmt).to(x.dtype))
                         for i in range(0, self.out_features, step)], dim=-1)
        return out if bias is None else out + bias

    def extra_repr(self) -> str:
        return f"{self.fmt.name}, in_features={self.in_features}, out_features={self.out_features}"


class QuantEmbedding(nn.Module):
    def __init__(self, blocks: torch.Tensor, fmt: BlockFormat, embedding_dim: int,
                 padding_idx: int | None = None, embed_scale: float | None = None) -> None:
        """embed_scale: what the rows are multiplied by, as a scaled embedding does (Gemma's sqrt(hidden),
        a float32 scalar as transformers keeps it), or None."""
        super().__init__()
        _check_blocks(blocks, fmt, embedding_dim, f"an embedding of {embedding_dim} dimensions", "vocab")
        self.fmt = fmt
        self.num_embeddings, self.embedding_dim = blocks.shape[0], embedding_dim
        self.padding_idx = padding_idx
        self.register_buffer("blocks", blocks, persistent=False)  # [V, row_bytes] uint8
        self.embed_scale = None if embed_scale is None else torch.tensor(float(embed_scale), dtype=torch.float32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids [...] -> [..., embedding_dim] float32
        out = _dequantized_rows(self.blocks, self.fmt, ids.reshape(-1)).reshape(*ids.shape, self.embedding_dim)
        return out if self.embed_scale is None else out * self.embed_scale.to(out.dtype)

    def dequantized(self) -> torch.Tensor:
        return dequantize(self.blocks, self.fmt)


def _dequantized_rows(blocks: torch.Tensor, fmt: BlockFormat, ids: torch.Tensor) -> torch.Tensor:
    """float32 [len(ids), K]: only the rows ``ids`` of ``blocks`` dequantized, by the kernel build's decoder
    (the same values) where built."""
    rows = blocks.index_select(0, ids.to(blocks.device))
    w = qlinear.dequantized(rows, fmt)
    return dequantize(rows, fmt) if w is None else w


def weight_rows(layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of a linear layer's weight [len(ids), in_features]: an nn.Linear's, or a QuantLinear's
    (only those rows dequantized, float32)."""
    if isinstance(layer, QuantLinear):
        return _dequantized_rows(layer.blocks, layer.fmt, ids)
    return layer.weight.detach()[ids.to(layer.weight.device)]


def swap_module(model: nn.Module, path: str, module: nn.Module) -> None:
    """Replace the submodule at dotted ``path`` ("model.layers.0.mlp.up_proj") by ``module``."""
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    if not hasattr(parent, name):
        raise ValueError(f"the model has no module {path!r}")
    setattr(parent, name, module)


def quantize_blocks(weight: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """float [N, K] -> uint8 [N, row_bytes]: the weight quantized to ``fmt`` (QUANTIZE_ON_LOAD)."""
    from specdec.quant.q4k import quantize_rows

    _check_quantizable(fmt)
    packed = quantize_rows(weight.detach().to(torch.float32).cpu().numpy(), fmt.name)
    return torch.from_numpy(np.ascontiguousarray(packed)).reshape(weight.shape[0], fmt.row_bytes(weight.shape[1]))


def quantize_model(model: nn.Module, quant: str, skip: tuple[str, ...] = ()) -> nn.Module:
    """Every nn.Linear of ``model`` becomes a QuantLinear of ``quant`` blocks, in place (aside: names in
    ``skip``, layers whose rows are not whole blocks); an output layer tied to the embedding becomes
    TIED_QUANT blocks that the embedding reads too (a ``QuantEmbedding``), as a GGUF file holds that
    matrix. The fp32 weights are dropped, and with them the checkpoint they were memory-mapped from: what
    stays fp32 (norms) is copied out of it. The user opts into that target: its outputs are the quantized
    model's, exactly, not the fp32 model's."""
    fmt = block_format(quant)
    _check_quantizable(fmt)  # before the loop: a model with no layer to quantize still hears of it
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    tied = type(out) is nn.Linear and type(emb) is nn.Embedding and out.weight is emb.weight
    names = {id(m): name for name, m in model.named_modules()}
    for name, mod in list(model.named_modules()):
        if type(mod) is not nn.Linear or name in skip or mod.in_features % fmt.block_weights or (tied and mod is out):
            continue
        swap_module(model, name, QuantLinear(quantize_blocks(mod.weight, fmt), fmt, mod.in_features, mod.bias))
    head = block_format(TIED_QUANT)
    if tied and names[id(out)] not in skip and out.in_features % head.block_weights == 0:
        blocks = quantize_blocks(out.weight, head)
        swap_module(model, names[id(out)], QuantLinear(blocks, head, out.in_features, out.bias))
        swap_module(model, names[id(emb)], QuantEmbedding(blocks, head, emb.embedding_dim, emb.padding_idx))
    with torch.no_grad():  # a norm viewing the mapped checkpoint kept all of it resident (decision 015)
        for p in model.parameters():
            p.data = p.data.clone()
    return model
