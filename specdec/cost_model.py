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
