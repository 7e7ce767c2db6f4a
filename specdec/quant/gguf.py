"""A GGUF file as a target whose quantized weights stay in their blocks.

The fp32 model transformers builds from the file gives the structure, the norms and the tokenizer;
then each quantized tensor of the file replaces its fp32 layer by a ``QuantLinear`` /
``QuantEmbedding`` over the file's own blocks (memory-mapped: the pages are the file's), and the
fp32 copy is dropped. Tensor names follow llama.cpp's (``blk.N.attn_q.weight``); in the ``llama`` family the q and
k projections are stored with their rows permuted for llama.cpp's rotary layout, which is undone
here as a row gather of whole blocks (the same permutation transformers undoes on load, so the
dequantized weights equal its fp32 ones bit for bit); other families keep HF's row order. What each
family needs: ``specdec.quant.gguf_arch``.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from specdec.formats import BY_GGML_TYPE, FORMATS, block_format
from specdec.quant.gguf_arch import ARCHITECTURES, Architecture, architecture_of
from specdec.quant.modules import QuantEmbedding, QuantLinear, swap_module

_FLOAT_TYPES = {0, 1, 30}  # F32, F16, BF16: loaded as transformers loads them (fp32 layers)


def hf_module_name(gguf_name: str, arch: Architecture = ARCHITECTURES["llama"]) -> str | None:
    """``blk.3.ffn_up.weight`` -> ``model.layers.3.mlp.up_proj``; ``token_embd.weight`` ->
    ``model.embed_tokens``; ``output.weight`` -> ``lm_head``; None for a tensor kept as loaded.
    ``arch``: the file's family (its layer tensor names, ``gguf_arch``)."""
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens"
    if gguf_name == "output.weight":
        return "lm_head"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", gguf_name)
    if m and m.group(2) in arch.layer_tensors:
        return f"model.layers.{m.group(1)}.{arch.layer_tensors[m.group(2)]}"
    return None


def rotary_rows(n_rows: int, n_heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's q/k permutation: [n_rows] int64 indices into the file's rows.

    llama.cpp stores each head's rows interleaved (pairs of the two rotary halves); with n_heads = 1
    and 4 rows the file holds HF rows [0, 2, 1, 3], and this returns [0, 2, 1, 3] (its own inverse
    for 2 x 2). In general: rows viewed as [heads, head_dim / 2, 2], swap the last two axes."""
    half = n_rows // n_heads // 2
    return torch.arange(n_rows, dtype=torch.int64).reshape(n_heads, half, 2).transpose(1, 2).reshape(-1)


def _blocks(tensor) -> torch.Tensor:
    with warnings.catch_warnings():  # the file's pages are read-only: nothing writes the blocks
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.asarray(tensor.data))


def open_reader(gguf_path: str | Path):
    """The file parsed by the gguf package (its tokenizer arrays make this seconds for a 49k vocabulary:
    parse once, pass the reader on); a truncated or corrupt file is named."""
    from gguf import GGUFReader

    try:
        return GGUFReader(str(gguf_path))
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"could not read GGUF file {gguf_path}: {e}") from e


def pack_gguf_weights(model: nn.Module, gguf_path: str | Path, reader=None) -> nn.Module:
    """Replace ``model``'s layers (the HF model of the same file) by the file's quantized blocks, in
    place. An architecture or a quantized type specdec does not keep packed is named with the supported
    list; a float tensor stays as loaded. ``reader``: the file already parsed (``open_reader``, or the lean
    ``gguf_index.open_index``: this reads only the tensor table and the architecture)."""
    if reader is None:
        from specdec.quant.gguf_index import open_index

        reader = open_index(gguf_path)
    arch = architecture_of(reader, gguf_path)
    cfg = model.config
    heads = {"attn_q": cfg.num_attention_heads, "attn_k": getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads}
    tied = model.get_output_embeddings() is not None and \
        model.get_output_embeddings().weight is model.get_input_embeddings().weight
    for t in reader.tensors:
        name = hf_module_name(t.name, arch)
        if name is None or int(t.tensor_type) in _FLOAT_TYPES:
            continue
        if int(t.tensor_type) not in BY_GGML_TYPE:
            raise ValueError(f"{gguf_path}: tensor {t.name} is {t.tensor_type.name}, which specdec does not keep "
                             f"packed (supported: {', '.join(FORMATS)})")
        fmt = block_format(int(t.tensor_type))
        blocks = _blocks(t)  # [rows, row_bytes] uint8
        k = int(t.shape[0])  # GGUF lists dimensions innermost first: [in_features, out_features]
        kind = t.name.split(".")[2] if t.name.startswith("blk.") else None
        if arch.permuted_qk and kind in heads:  # a gather of whole rows: the one copy of a packed load
            # by numpy: torch's index_select over these uint8 rows took ~8 ms a tensor (0.2-0.5 s a load of
            # the default model), numpy's take 0.1 ms
            rows = rotary_rows(blocks.shape[0], heads[kind]).numpy()
            blocks = torch.from_numpy(np.take(blocks.numpy(), rows, axis=0))
        if name == "model.embed_tokens":
            old = model.get_input_embeddings()
            emb = QuantEmbedding(blocks, fmt, k, old.padding_idx, getattr(old, "scalar_embed_scale", None))
            swap_module(model, name, emb)
            if tied:  # the output layer reads the same blocks
                swap_module(model, "lm_head", QuantLinear(blocks, fmt, k))
        else:
            old = model.get_submodule(name)
            swap_module(model, name, QuantLinear(blocks, fmt, k, old.bias))
    return model


def float_tensors(model: nn.Module, gguf_path: str | Path, architecture: str, reader=None) -> dict[str, torch.Tensor]:
    """The file's float tensors (F32 / F16 / BF16: norms, and any matrix stored unquantized) under
    ``model``'s parameter names, as transformers' GGUF loading reads them (its name map and its
    per-architecture processing, e.g. llama's q/k row order), without dequantizing any quantized
    tensor. ``model``: the HF model of the file's config, still unpacked (on the meta device is fine);
    ``reader``: the file already parsed (``open_reader``)."""
    from gguf.quants import dequantize
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=model.config.to_dict())
    names = get_gguf_hf_weights_map(model, processor)  # GGUF name -> HF parameter name
    out = {}
    for t in (open_reader(gguf_path) if reader is None else reader).tensors:
        if int(t.tensor_type) not in _FLOAT_TYPES:
            continue
        result = processor.process(weights=dequantize(t.data, t.tensor_type), name=t.name,
                                   tensor_key_mapping=names, parsed_parameters={"config": model.config.to_dict()})
        if result.name in names:
            out[names[result.name]] = torch.from_numpy(np.array(result.weights, dtype=np.float32))
    return out
