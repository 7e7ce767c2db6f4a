"""A Q4_K quantizer (the gguf package has none): float rows -> llama.cpp's ``block_q4_K`` bytes.

The layout is the one ``specdec.formats`` documents and dequantizes (w = (d * sc) * q - (dmin * mn)
per 32-weight sub-block, 8 sub-blocks per 256-weight super-block). The rule here is the plain one,
not llama.cpp's iterative search for the scale that minimises the error:

1. per sub-block: mins = -min(x, 0) >= 0 (the offset is never above zero, as llama.cpp keeps it) and
   the step range / 15 that spans [min(x, 0), max(x)];
2. per super-block: d = max step / 63, dmin = max mins / 63, both rounded to f16;
3. the 6-bit sc and mn are rounded *up* against those f16 values (ceil), so the decoded range
   [-dmin * mn, -dmin * mn + 15 * d * sc] still covers every weight of the sub-block;
4. q = round((x + dmin * mn) / (d * sc)) in 0..15: the error is at most half a decoded step.

A worked sub-block: x spans [-0.3, 0.9] in a super-block whose d = dmin = 0.01 (say): mn = ceil(0.3 / 0.01)
= 30, sc = ceil((0.9 + 0.3) / 15 / 0.01) = 8, so the decoded weights are 0.08 * q - 0.3 for q in 0..15.
"""

from __future__ import annotations

import numpy as np

from specdec.formats import QK_K

SUB = 32  # weights per sub-block
BLOCK_BYTES = 144  # d f16 | dmin f16 | scales[12] | nibbles[128]


def _pack_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """sc, mn uint8 [n, 8] (6 bits each) -> [n, 12]: the packing ``formats._k_scales`` reads.

    Sub-blocks 0-3 take the low 6 bits of bytes 0-3 (sc) and 4-7 (mn); sub-blocks 4-7 keep their low
    4 bits in bytes 8-11 (sc low nibble, mn high nibble) and their top 2 bits in bits 6-7 of bytes 0-7."""
    lo_sc, hi_sc, lo_mn, hi_mn = sc[:, :4], sc[:, 4:], mn[:, :4], mn[:, 4:]
    return np.concatenate([lo_sc | ((hi_sc >> 4) << 6), lo_mn | ((hi_mn >> 4) << 6),
                           (hi_sc & 15) | ((hi_mn & 15) << 4)], axis=1).astype(np.uint8)


def _f16(x: np.ndarray) -> np.ndarray:
    """float32 [n] -> float32 [n]: the value its f16 storage gives back."""
    return x.astype(np.float16).astype(np.float32)


def quantize_q4_k(weight: np.ndarray) -> np.ndarray:
    """float [N, K] (K a multiple of 256) -> uint8 [N, K / 256 * 144]: Q4_K blocks of each row."""
    N, K = weight.shape
    if K % QK_K:
        raise ValueError(f"Q4_K: a row of {K} weights is not a whole number of {QK_K}-weight super-blocks")
    x = np.asarray(weight, dtype=np.float32).reshape(-1, QK_K // SUB, SUB)  # [n super-blocks, 8, 32]
    lo, hi = np.minimum(x.min(axis=2), 0.0), x.max(axis=2)  # [n, 8]
    mins, step = -lo, (hi - lo) / 15
    d, dmin = _f16(step.max(axis=1) / 63), _f16(mins.max(axis=1) / 63)  # [n]
    safe_d, safe_dmin = np.where(d > 0, d, 1.0)[:, None], np.where(dmin > 0, dmin, 1.0)[:, None]
    mn = np.clip(np.ceil(mins / safe_dmin), 0, 63)  # [n, 8]: -dmin * mn <= min(x, 0)
    sc = np.clip(np.ceil((hi + dmin[:, None] * mn) / 15 / safe_d), 0, 63)  # top of the range covered
    ds, dm = (d[:, None] * sc)[:, :, None], (dmin[:, None] * mn)[:, :, None]  # [n, 8, 1] as decoded
    q = np.clip(np.rint((x + dm) / np.where(ds > 0, ds, 1.0)), 0, 15).astype(np.uint8)  # [n, 8, 32]
    nibbles = q[:, 0::2] | (q[:, 1::2] << 4)  # [n, 4, 32]: group g = sub-block 2g low, 2g + 1 high
    n = x.shape[0]
    halves = np.stack([d, dmin], axis=1).astype(np.float16).view(np.uint8)  # [n, 4]
    blocks = np.concatenate([halves, _pack_scales(sc.astype(np.uint8), mn.astype(np.uint8)),
                             nibbles.reshape(n, 128)], axis=1)  # [n, 144]
    return blocks.reshape(N, K // QK_K * BLOCK_BYTES)


def quantize_rows(weight: np.ndarray, quant: str) -> np.ndarray:
    """float32 [N, K] -> uint8 [N, row bytes] of GGUF type ``quant``: Q4_K here, Q6_K by ``quant.q6k``, the
    rest by the gguf package's quantizers (llama.cpp's reference rules, ported to numpy)."""
    if quant == "Q4_K":
        return quantize_q4_k(weight)
    if quant == "Q6_K":
        from specdec.quant.q6k import quantize_q6_k

        return quantize_q6_k(weight)
    from gguf import GGMLQuantizationType, quants

    return quants.quantize(np.ascontiguousarray(weight, dtype=np.float32), GGMLQuantizationType[quant])
