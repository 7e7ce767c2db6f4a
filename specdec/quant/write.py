"""Random-weight Llama GGUF files of a named shape: targets for scaling benchmarks at sizes no
package ships (``specdec bench-scaling``).

A file carries the default model's tokenizer (its ``tokenizer.*`` keys copied, vocabulary 49,152), so
transformers, specdec and llama.cpp all open it as a Llama with that tokenizer; the weights are
seeded N(0, std) (norms 1), quantized per tensor: Q8_0 / Q4_0 / Q4_1 by the gguf package's
quantizers, Q4_K by ``specdec.quant.q4k``, Q6_K by ``specdec.quant.q6k`` (norms stay F32). ``Q4_K_M``
is a mix as llama.cpp's: Q4_K, with Q6_K for attn_v, ffn_down and the output layer (the embedding where
it is tied). llama.cpp gives Q6_K to attn_v / ffn_down in about half the layers; here all of them (the
writer types tensors by kind, not by layer): a little more Q6_K than its files hold.

    path = cached_random_gguf("0.5b", "Q4_0", cache_dir, tokenizer_from=default_gguf_path())  # written once, reused
    write_f32_gguf(default_gguf_path(), Path("smollm2-f32.gguf"))     # the same weights, every tensor F32

``write_f32_gguf`` (also ``python -m specdec.quant.write --f32 SRC DST``) rewrites a GGUF with each
quantized tensor dequantized to F32 (the gguf package's dequantizer, the values transformers loads):
what another engine needs to run specdec's fp32 target (e.g. llama.cpp's server in `bench-serve`).
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specdec.formats import block_format
from specdec.quant.gguf import open_reader
from specdec.quant.q4k import quantize_rows

WRITER_VERSION = 1  # bump when what a file holds for the same (shape, quant, seed) changes
WRITABLE = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")
# a named mix: its tensors' type, and the kinds that take another ("output" is the embedding where tied)
MIXES = {"Q4_K_M": ("Q4_K", {"attn_v": "Q6_K", "ffn_down": "Q6_K", "output": "Q6_K"})}
# general.file_type: llama.cpp's names; it has no all-Q4_K type, MOSTLY_Q4_K_S (14) is the nearest
FILE_TYPES = {"Q8_0": 7, "Q4_0": 2, "Q4_1": 3, "Q4_K": 14, "Q6_K": 18, "Q4_K_M": 15}


@dataclass(frozen=True)
class LlamaShape:
    hidden: int  # embedding width (a multiple of 256 for Q4_K)
    layers: int  # decoder blocks
    intermediate: int  # MLP width (a multiple of 256 for Q4_K: the down projection's input)
    heads: int  # query heads; head_dim = hidden / heads
    kv_heads: int  # key/value heads (grouped-query attention)
    tied: bool  # the output layer reads the embedding's blocks (no output.weight in the file)
    vocab: int = 49152  # the default model's tokenizer
    context: int = 8192  # llama.context_length
    rope_theta: float = 100000.0  # the default model's

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def params(self) -> int:
        """Weights in the file (norms included)."""
        kv = self.kv_heads * self.head_dim
        layer = self.hidden * (2 * self.hidden + 2 * kv) + 3 * self.hidden * self.intermediate + 2 * self.hidden
        return self.layers * layer + self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    def check(self) -> None:
        if self.hidden % self.heads or self.heads % self.kv_heads or self.head_dim % 2:
            raise ValueError(f"{self}: heads must divide hidden into an even head_dim, kv_heads divide heads")


SHAPES: dict[str, LlamaShape] = {
    # close to Qwen2.5-0.5B / -1.5B with the 49,152-token vocabulary; 0.5b's hidden is 1024, not Qwen's
    # 896, so that every row is whole 256-weight Q4_K super-blocks
    "0.5b": LlamaShape(hidden=1024, layers=24, intermediate=4864, heads=16, kv_heads=2, tied=True),  # ~0.47B
    "1.5b": LlamaShape(hidden=1536, layers=28, intermediate=8960, heads=12, kv_heads=2, tied=False),  # ~1.46B
    "tiny": LlamaShape(hidden=256, layers=2, intermediate=512, heads=4, kv_heads=2, tied=True),  # ~13M: tests
}


def _tensors(shape: LlamaShape):
    """(GGUF name, [rows, columns]) of every tensor, in file order; a norm is [columns] (rows = 0)."""
    h, kv = shape.hidden, shape.kv_heads * shape.head_dim
    yield "token_embd.weight", (shape.vocab, h)
    for i in range(shape.layers):
        yield f"blk.{i}.attn_norm.weight", (0, h)
        for name, rows, cols in (("attn_q", h, h), ("attn_k", kv, h), ("attn_v", kv, h), ("attn_output", h, h)):
            yield f"blk.{i}.{name}.weight", (rows, cols)
        yield f"blk.{i}.ffn_norm.weight", (0, h)
        for name, rows, cols in (("ffn_gate", shape.intermediate, h), ("ffn_up", shape.intermediate, h),
                                 ("ffn_down", h, shape.intermediate)):
            yield f"blk.{i}.{name}.weight", (rows, cols)
    yield "output_norm.weight", (0, h)
    if not shape.tied:
        yield "output.weight", (shape.vocab, h)


@functools.lru_cache(maxsize=2)
def _fields(source: Path, prefix: str = "") -> tuple:
    """``_reader_fields`` of ``source``, read once per process (parsing 49k strings takes seconds)."""
    return _reader_fields(open_reader(source), prefix)


def _reader_fields(reader, prefix: str = "") -> tuple:
    """(key, value, type, element type) of every key of a GGUFReader's file starting with ``prefix`` but
    the reader's own (``GGUF.*``) and the file type (e.g. "tokenizer.": vocabulary, merges, special ids,
    chat template)."""
    from gguf import GGUFValueType

    out = []
    for key, field in reader.fields.items():
        if key.startswith(prefix) and not key.startswith("GGUF.") and key != "general.file_type":
            vtype = field.types[0]
            out.append((key, field.contents(), vtype, field.types[1] if vtype == GGUFValueType.ARRAY else None))
    return tuple(out)


def _check_type(quant: str, shape: LlamaShape) -> str:
    quant = quant.upper()
    if quant not in WRITABLE:
        raise ValueError(f"cannot write {quant!r} weights: writable types are {', '.join(WRITABLE)} "
                         f"(mixes: {', '.join(MIXES)})")
    fmt = block_format(quant)
    if shape.hidden % fmt.block_weights or shape.intermediate % fmt.block_weights:
        raise ValueError(f"{quant} needs rows of whole {fmt.block_weights}-weight blocks: hidden {shape.hidden} "
                         f"and intermediate {shape.intermediate} must be multiples of {fmt.block_weights}")
    return quant


def write_random_gguf(path: Path, shape: LlamaShape, quant: str, seed: int = 0, std: float = 0.02, *,
                      tokenizer_from: Path, overrides: dict[str, str] | None = None) -> Path:
    """Write a random-weight Llama of ``shape`` with every matrix in ``quant`` blocks to ``path``,
    atomically (a temp file beside it, then a rename: a crash leaves no partial file under ``path``).
    tokenizer_from: the GGUF whose ``tokenizer.*`` keys the file copies (the default model's:
    ``models.default_gguf_path()``); overrides: a tensor kind ("token_embd", "attn_q", "ffn_down",
    "output", ...) -> its own type. ``quant`` may name a mix (``MIXES``: "Q4_K_M"), its own overrides
    first."""
    from gguf import GGMLQuantizationType

    shape.check()
    name = quant.upper()
    base, mixed = MIXES.get(name, (name, {}))
    if shape.tied and "output" in mixed:  # the output layer reads the embedding's blocks
        mixed = {("token_embd" if k == "output" else k): t for k, t in mixed.items()}
    quant = _check_type(base, shape)
    types = {kind: _check_type(t, shape) for kind, t in {**mixed, **(overrides or {})}.items()}
    with _gguf_writer(path, "llama") as writer:
        writer.add_name(f"random Llama {shape.params() / 1e9:.2f}B {name} seed {seed}")
        writer.add_context_length(shape.context)
        writer.add_embedding_length(shape.hidden)
        writer.add_block_count(shape.layers)
        writer.add_feed_forward_length(shape.intermediate)
        writer.add_head_count(shape.heads)
        writer.add_head_count_kv(shape.kv_heads)
        writer.add_rope_freq_base(shape.rope_theta)
        writer.add_layer_norm_rms_eps(1e-5)
        writer.add_rope_dimension_count(shape.head_dim)
        writer.add_vocab_size(shape.vocab)
        writer.add_file_type(FILE_TYPES[name if name in MIXES else quant])
        writer.add_quantization_version(2)
        for key, value, vtype, sub in _fields(Path(tokenizer_from), "tokenizer."):
            writer.add_key_value(key, value, vtype, sub_type=sub)
        rng = np.random.default_rng(seed)
        for name, (rows, cols) in _tensors(shape):
            if rows == 0:  # an RMS norm's scale: ones, F32
                writer.add_tensor(name, np.ones(cols, dtype=np.float32))
                continue
            w = rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(std)  # [rows, cols]
            t = types.get(name.split(".")[-2], quant)  # blk.3.ffn_up.weight -> ffn_up
            writer.add_tensor(name, quantize_rows(w, t), raw_dtype=GGMLQuantizationType[t])
    return Path(path)


@contextlib.contextmanager
def _gguf_writer(path: Path, arch: str):
    """A GGUFWriter on a temporary file beside ``path``, written out and renamed to ``path`` when the
    block ends (a crash leaves no partial file under ``path``, and no temporary file)."""
    from gguf import GGUFWriter

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    writer = GGUFWriter(str(tmp), arch)
    try:
        yield writer
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def gguf_opens(path: Path) -> bool:
    """Whether ``path`` reads as a GGUF whose tensors all lie within the file (a truncated or garbled
    file does not)."""
    try:
        return len(open_reader(path).tensors) > 0
    except ValueError:  # any failure to parse means: write it again
        return False


def cached_random_gguf(shape_name: str, quant: str, cache_dir: Path, seed: int = 0, *, tokenizer_from: Path) -> Path:
    """The random GGUF of (shape, quant, seed) under ``cache_dir``: reused when it opens, else (missing,
    truncated, corrupt) written again. The name carries the writer's version: an older writer's file
    is never taken for this one's."""
    if shape_name not in SHAPES:
        raise ValueError(f"unknown shape {shape_name!r}: known shapes are {', '.join(SHAPES)}")
    path = Path(cache_dir) / f"random-llama-{shape_name}-{quant.upper()}-seed{seed}-w{WRITER_VERSION}.gguf"
    if path.is_file() and gguf_opens(path):
        return path
    return write_random_gguf(path, SHAPES[shape_name], quant, seed, tokenizer_from=tokenizer_from)


def write_f32_gguf(source: Path, path: Path) -> Path:
    """``source`` rewritten with every quantized tensor dequantized to F32 (its keys copied, file type
    ALL_F32), atomically as ``write_random_gguf``."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    reader = open_reader(source)
    fields = _reader_fields(reader)  # the reader's own keys: the file is parsed once
    arch = next(v for k, v, _, _ in fields if k == "general.architecture")
    with _gguf_writer(path, arch) as writer:
        for key, value, vtype, sub in fields:
            if key != "general.architecture":  # the writer wrote it
                writer.add_key_value(key, value, vtype, sub_type=sub)
        writer.add_file_type(0)  # ALL_F32
        for t in reader.tensors:
            data = t.data if t.tensor_type == GGMLQuantizationType.F32 else dequantize(t.data, t.tensor_type)
            writer.add_tensor(t.name, np.ascontiguousarray(data, dtype=np.float32))
    return Path(path)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Write a GGUF's weights as F32 (every quantized tensor dequantized).")
    parser.add_argument("--f32", nargs=2, metavar=("SRC", "DST"), required=True)
    src, dst = parser.parse_args().f32
    print(f"wrote {write_f32_gguf(Path(src), Path(dst))}")
