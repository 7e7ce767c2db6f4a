"""GGUF block formats: each one's byte layout and its reference dequantization, in torch.

A quantized weight [N, K] is stored row by row as K / QK blocks of ``block_bytes`` bytes each; a
block holds QK weights. The reference dequantizers here *define* the weights a quantized target
computes with: every faster path (a kernel that dequantizes in registers) is checked against them,
and they equal llama.cpp's definitions (and so transformers' GGUF loading) bit for bit in fp32.

Glossary: d = the block's (or sub-block's) scale, m / dmin = its offset, q = the stored integer.
Layouts (bytes, little-endian; f16 = IEEE half):

    Q8_0  32 weights   d f16 | q int8[32]                      w = d * q
    Q4_0  32 weights   d f16 | q nibbles[16]                   w = d * (q - 8)
    Q4_1  32 weights   d f16 | m f16 | q nibbles[16]           w = d * q + m
          nibbles: byte j holds weight j in its low 4 bits and weight j + 16 in its high 4 bits.
    Q4_K  256 weights  d f16 | dmin f16 | scales[12] | q nibbles[128]
          8 sub-blocks of 32 with 6-bit scale sc and min mn each, packed in the 12 bytes (below);
          w = (d * sc) * q - (dmin * mn). Byte j of the 32-byte group g (g = 0..3) holds weight
          j of sub-block 2g (low nibble) and weight j of sub-block 2g + 1 (high nibble).
    Q5_K  176 bytes    d f16 | dmin f16 | scales[12] | qh[32] | q nibbles[128]
          as Q4_K, plus a fifth bit: bit s of qh[j] is the high bit of weight j of sub-block s.
    Q6_K  210 bytes    ql[128] | qh[64] | scales int8[16] | d f16
          16 sub-blocks of 16, w = (d * scale) * (q - 32) with q = 6 bits: for each half h
          (128 weights), position l (0..31), the four weights l, l+32, l+64, l+96 of that half take
          the low nibble of ql[64h + l], of ql[64h + l + 32], the high nibble of ql[64h + l], of
          ql[64h + l + 32], and bits (0-1, 2-3, 4-5, 6-7) of qh[32h + l] as their top two bits.

The 6-bit scales of the K formats, 12 bytes s[0..11] for sub-blocks 0..7:
    sub-block j < 4:  sc = s[j] & 63,                          mn = s[j + 4] & 63
    sub-block j >= 4: sc = (s[j + 4] & 15) | (s[j - 4] >> 6) << 4,  mn = (s[j + 4] >> 4) | (s[j] >> 6) << 4
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

QK_K = 256  # weights per K-format super-block
# a matrix is dequantized at most this many weights at a time (the 49k-row output layer in fp32 is 113 MB:
# its transient copy never exists whole); both the reference forward and the runtime's GEMM slice by it
CHUNK_FLOATS = 1 << 20


@dataclass(frozen=True)
class BlockFormat:
    name: str  # GGUF's name of the type ("Q4_1")
    ggml_type: int  # GGMLQuantizationType value in the file
    block_weights: int  # weights per block (QK)
    block_bytes: int  # bytes per block
    dequantize: Callable[[torch.Tensor], torch.Tensor]  # uint8 [n, block_bytes] -> float32 [n, QK]
    f16_fields: tuple[int, ...]  # byte offsets of the block's f16 scales and offsets (d, m / dmin)

    def row_bytes(self, k: int) -> int:
        if k % self.block_weights:
            raise ValueError(f"{self.name}: a row of {k} weights is not a whole number of "
                             f"{self.block_weights}-weight blocks")
        return k // self.block_weights * self.block_bytes


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[n, 2] uint8 -> [n, 1] float32: little-endian IEEE halves."""
    return b.contiguous().view(torch.float16).to(torch.float32)


def _nibbles(q: torch.Tensor, groups: int) -> torch.Tensor:
    """[n, groups * 32] uint8 -> [n, groups, 64] uint8: each 32-byte group's low nibbles, then its high ones."""
    q = q.reshape(q.shape[0], groups, 32)
    return torch.cat([q & 15, q >> 4], dim=-1)


def k_scale_bytes(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., 12] uint8 -> (sc, mn), each [..., 8] int64 in 0..63 (the 6-bit packing in the module doc)."""
    s = s.to(torch.int64)
    lo_sc, lo_mn = s[..., 0:4] & 63, s[..., 4:8] & 63
    hi_sc = (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)
    hi_mn = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return torch.cat([lo_sc, hi_sc], -1), torch.cat([lo_mn, hi_mn], -1)


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, 12] uint8 -> (sc, mn), each [n, 8] float32."""
    sc, mn = k_scale_bytes(s)
    return sc.to(torch.float32), mn.to(torch.float32)


def dequantize_q8_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, 0:2])
    q = b[:, 2:34].contiguous().view(torch.int8).to(torch.float32)
    return d * q


def _half_nibbles(q: torch.Tensor) -> torch.Tensor:
    """[n, 16] uint8 -> [n, 32] uint8: byte j's low nibble is weight j, its high nibble weight j + 16."""
    return torch.cat([q & 15, q >> 4], dim=1)


def dequantize_q4_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, 0:2]) * (_half_nibbles(b[:, 2:18]).to(torch.float32) - 8)  # q - 8 is exact in fp32


def dequantize_q4_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    return d * _half_nibbles(b[:, 4:20]).to(torch.float32) + m


def _k_dequantize(d: torch.Tensor, dmin: torch.Tensor, scales: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """q [n, 8, 32] float32 -> [n, 256]: w = (d * sc) * q - (dmin * mn) per sub-block."""
    sc, mn = _k_scales(scales)
    return ((d * sc)[:, :, None] * q - (dmin * mn)[:, :, None]).reshape(q.shape[0], QK_K)


def dequantize_q4_k(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 16:144], 4).reshape(-1, 8, 32).to(torch.float32)
    return _k_dequantize(_f16(b[:, 0:2]), _f16(b[:, 2:4]), b[:, 4:16], q)


def q5_k_codes(b: torch.Tensor) -> torch.Tensor:
    """Q5_K blocks [n, 176] -> their codes [n, 8 sub-blocks, 32] uint8 in 0..31."""
    low = _nibbles(b[:, 48:176], 4).reshape(-1, 8, 32)  # [n, 8 sub-blocks, 32]
    qh = b[:, 16:48]  # [n, 32]: bit s = sub-block s's fifth bit
    high = (qh[:, None, :] >> torch.arange(8, dtype=torch.uint8)[None, :, None]) & 1
    return low | (high << 4)


def q6_k_codes(b: torch.Tensor) -> torch.Tensor:
    """Q6_K blocks [n, 210] -> their codes [n, 16 sub-blocks, 16] uint8 in 0..63 (the weight is d sc (q - 32))."""
    n = b.shape[0]
    ql = b[:, 0:128].reshape(n, 2, 2, 32)  # [n, half, first/second 32 bytes, l]
    qh = b[:, 128:192].reshape(n, 2, 1, 32)  # [n, half, 1, l]
    low = torch.cat([ql & 15, ql >> 4], dim=2)  # [n, half, 4 quarters, 32]: l, l+32, l+64, l+96
    top = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[None, None, :, None]) & 3
    return (low | (top << 4)).reshape(n, 16, 16)


def dequantize_q5_k(b: torch.Tensor) -> torch.Tensor:
    q = q5_k_codes(b).to(torch.float32)
    return _k_dequantize(_f16(b[:, 0:2]), _f16(b[:, 2:4]), b[:, 4:16], q)


def dequantize_q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales = b[:, 192:208].contiguous().view(torch.int8).to(torch.float32)  # [n, 16]
    d = _f16(b[:, 208:210])
    q = q6_k_codes(b).to(torch.float32) - 32  # 16 sub-blocks of 16; q - 32 exact
    return ((d * scales)[:, :, None] * q).reshape(n, QK_K)


FORMATS: dict[str, BlockFormat] = {f.name: f for f in (
    BlockFormat("Q8_0", 8, 32, 34, dequantize_q8_0, (0,)),
    BlockFormat("Q4_0", 2, 32, 18, dequantize_q4_0, (0,)),
    BlockFormat("Q4_1", 3, 32, 20, dequantize_q4_1, (0, 2)),
    BlockFormat("Q4_K", 12, QK_K, 144, dequantize_q4_k, (0, 2)),
    BlockFormat("Q5_K", 13, QK_K, 176, dequantize_q5_k, (0, 2)),
    BlockFormat("Q6_K", 14, QK_K, 210, dequantize_q6_k, (208,)),
)}
BY_GGML_TYPE: dict[int, BlockFormat] = {f.ggml_type: f for f in FORMATS.values()}


def block_format(name_or_type: str | int) -> BlockFormat:
    """The format of a GGUF type name ("Q4_K") or number; a ValueError names the supported ones."""
    fmt = FORMATS.get(name_or_type.upper()) if isinstance(name_or_type, str) else BY_GGML_TYPE.get(int(name_or_type))
    if fmt is None:
        raise ValueError(f"unsupported quantization type {name_or_type!r}: specdec keeps "
                         f"{', '.join(FORMATS)} blocks packed")
    return fmt


def random_blocks(fmt: BlockFormat, rows: int, k: int, generator: torch.Generator, scale: float = 0.05) -> torch.Tensor:
    """uint8 [rows, row_bytes of k weights]: random blocks of ``fmt`` whose f16 fields hold finite values
    ~ N(0, scale) (random bytes there would make infinities and NaNs): weights to check a kernel on."""
    n = rows * k // fmt.block_weights
    raw = torch.randint(0, 256, (n, fmt.block_bytes), generator=generator, dtype=torch.uint8)
    for off in fmt.f16_fields:
        halves = (torch.randn(n, generator=generator, dtype=torch.float32) * scale).to(torch.float16)
        raw[:, off:off + 2] = halves.view(torch.uint8).reshape(n, 2)
    return raw.reshape(rows, fmt.row_bytes(k))


def dequantize(blocks: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """uint8 [N, row_bytes] (N rows of whole blocks) -> float32 [N, K]."""
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] % fmt.block_bytes:
        raise ValueError(f"{fmt.name}: expected uint8 [rows, a multiple of {fmt.block_bytes} bytes], got "
                         f"{blocks.dtype} {tuple(blocks.shape)}")
    N = blocks.shape[0]
    flat = blocks.reshape(-1, fmt.block_bytes)  # [N * blocks per row, block_bytes]
    return fmt.dequantize(flat).reshape(N, -1)
