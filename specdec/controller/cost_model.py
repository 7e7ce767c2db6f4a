"""MagicDec's cost model of speculative decoding, as pure functions of measured times.

One step drafts gamma tokens (gamma draft forwards) and verifies them in one target forward over
gamma + 1 rows; with a per-token acceptance rate alpha it yields on average

    Omega(gamma, alpha) = 1 + alpha + ... + alpha^gamma = (1 - alpha^(gamma + 1)) / (1 - alpha)

tokens (gamma + 1 at alpha = 1), against one token per plain step of T_target seconds, so

    speedup(gamma) = Omega(gamma, alpha) * T_target / (gamma * T_draft + T_verify(gamma))

(Chen et al., 2024, "MagicDec", eq. 1; T_verify(0) = T_target, so not drafting is speedup 1).
Worked example: alpha 0.8, gamma 3, T_target 100 ms, T_draft 20 ms, T_verify(3) 110 ms ->
Omega = 1 + .8 + .64 + .512 = 2.952, speedup = 2.952 * 100 / (60 + 110) = 1.74.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable


def omega(gamma: int, alpha: float) -> float:
    """Expected tokens per step when drafting ``gamma`` tokens at acceptance rate ``alpha``."""
    if gamma < 0 or not 0.0 <= alpha <= 1.0:
        raise ValueError(f"need gamma >= 0 and 0 <= alpha <= 1, got gamma {gamma}, alpha {alpha}")
    if alpha == 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def speedup(gamma: int, alpha: float, t_target: float, t_draft: float, t_verify: float) -> float:
    """Predicted tokens/s over plain decoding: Omega * T_target / (gamma * T_draft + T_verify)."""
    return omega(gamma, alpha) * t_target / (gamma * t_draft + t_verify)


@dataclass(frozen=True)
class GammaChoice:
    gamma: int  # tokens to draft per step; 0 = do not draft
    speedup: float  # predicted over plain decoding (1.0 at gamma 0)


def best_gamma(alpha: float, t_target: float, t_draft: float, t_verify: Callable[[int], float],
               max_gamma: int, tie: float = 1.001) -> GammaChoice:
    """The gamma in [0, max_gamma] with the highest predicted speedup; a longer draft must beat a
    shorter one by the factor ``tie`` (near ties go to the shorter, cheaper-when-wrong draft).

    t_verify(gamma): seconds of a target forward over gamma + 1 rows.
    """
    best = GammaChoice(0, 1.0)
    for g in range(1, max_gamma + 1):
        s = speedup(g, alpha, t_target, t_draft, t_verify(g))
        if s > best.speedup * tie:
            best = GammaChoice(g, s)
    return best


def read_ratio(weight_bytes: int, kv_bytes: int, budget: int, length: int) -> float:
    """Bytes a self-speculation draft token reads over what a target step reads: the weights plus
    ``budget`` compressed KV rows against the weights plus ``length`` rows (``kv_bytes`` per token over
    every layer's K and V; B x that for a batch of B, whose weights are read once). A decode step
    streams both, so this is MagicDec's draft cost ratio T_draft / T_target wherever memory
    bandwidth bounds a step.
    Example: 540 MB of weights, 46 KB a token, 512 rows: 0.89 at 2,048 tokens, 0.65 at 7,000."""
    return (weight_bytes + kv_bytes * budget) / (weight_bytes + kv_bytes * max(length, budget))


def shortest_paying_prompt(weight_bytes: int, kv_bytes: int, budget: int, max_ratio: float) -> int:
    """The shortest prompt at which ``read_ratio`` is at most ``max_ratio`` (below it a compressed-cache
    draft costs too close to a target step to win). Example: 540 MB, 46 KB, 512, 0.75 -> 4,589."""
    if not 0.0 < max_ratio < 1.0:
        raise ValueError(f"max_ratio must be in (0, 1), got {max_ratio}")
    need = (weight_bytes * (1.0 - max_ratio) + kv_bytes * budget) / (max_ratio * kv_bytes)
    return math.ceil(need)
