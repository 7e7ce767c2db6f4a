"""A Q6_K quantizer (the gguf package has none): float rows -> llama.cpp's ``block_q6_K`` bytes, so the
random files of ``specdec.quant.write`` can mix Q6_K into some tensors as llama.cpp's Q4_K_M does.

The layout is the one ``specdec.formats`` documents and dequantizes: w = (d * sc) * (q - 32) per 16-weight
sub-block, 16 sub-blocks per 256-weight super-block, sc a signed byte, q 6 bits. The rule is the plain
one, not llama.cpp's search for the scale that minimises the error:

1. per sub-block: the step max|x| / 31, so that q - 32 in [-31, 31] spans it;
2. per super-block: d = max step / 127, rounded to f16;
3. sc = ceil(step / d) (<= 127): the decoded range still covers every weight;
4. q = round(x / (d * sc)) + 32 in 1..63: the error is at most half a decoded step.

Bits (``formats.dequantize_q6_k``): weight i = 128 h + 32 u + l (half h, quarter u, lane l) keeps its low
4 bits in byte 64 h + 32 (u % 2) + l of ql (the low nibble for u < 2, the high one else) and its top 2 bits
at bits 2u of byte 32 h + l of qh.
"""

from __future__ import annotations

import numpy as np

from specdec.formats import QK_K

SUB = 16  # weights per sub-block
BLOCK_BYTES = 210  # ql[128] | qh[64] | scales int8[16] | d f16


def quantize_q6_k(weight: np.ndarray) -> np.ndarray:
    """float [N, K] (K a multiple of 256) -> uint8 [N, K / 256 * 210]: Q6_K blocks of each row."""
    N, K = weight.shape
    if K % QK_K:
        raise ValueError(f"Q6_K: a row of {K} weights is not a whole number of {QK_K}-weight super-blocks")
    x = np.asarray(weight, dtype=np.float32).reshape(-1, QK_K // SUB, SUB)  # [n super-blocks, 16, 16]
    n = x.shape[0]
    step = np.abs(x).max(axis=2) / 31  # [n, 16]
    d = (step.max(axis=1) / 127).astype(np.float16).astype(np.float32)  # [n], as stored
    safe_d = np.where(d > 0, d, 1.0)[:, None]
    sc = np.clip(np.ceil(step / safe_d), 0, 127)  # [n, 16]
    ds = (d[:, None] * sc)[:, :, None]  # [n, 16, 1] as decoded
    q = np.clip(np.rint(x / np.where(ds > 0, ds, 1.0)) + 32, 0, 63).astype(np.uint8).reshape(n, 2, 4, 32)
    low, top = q & 15, q >> 4  # [n, half, quarter, lane]
    ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=2)  # [n, 2, 64]
    qh = top[:, :, 0] | (top[:, :, 1] << 2) | (top[:, :, 2] << 4) | (top[:, :, 3] << 6)  # [n, 2, 32]
    blocks = np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc.astype(np.int8).view(np.uint8),
                             d.astype(np.float16).view(np.uint8).reshape(n, 2)], axis=1)  # [n, 210]
    return blocks.reshape(N, K // QK_K * BLOCK_BYTES)
