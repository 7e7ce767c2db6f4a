"""The controller's cost reasoning as pure functions of measured times and acceptance rates.

Vocabulary: t(q) is the measured seconds of one verify forward over q rows per sequence (the pending
token plus q - 1 drafted nodes) at the live batch size, t(1) a plain decoding step; d(n) the seconds
to draft n nodes; values[n] the expected accepted drafts of the best n-node draft. A step that drafts
n nodes yields 1 + values[n] tokens per sequence in t(1 + n) + d(n) seconds, against 1 token in t(1)
for plain decoding, so every rule below compares *tokens per second* to 1 / t(1):

    rate(n) = (1 + values[n]) / (t(1 + n) + d(n))        (MagicDec's speedup x 1 / t(1))

Parts:
- MagicDec's model with one acceptance rate alpha (``omega``, ``speedup``) and its draft-cost ratio
  for a compressed-cache draft (``read_ratio``, ``shortest_paying_prompt``);
- the acceptance per depth of a chain (``chain_values``) and the budget search over n
  (``best_budget``), Sequoia's hardware-aware step;
- the price tables the search reads (``verify_prices``, ``draft_prices``) and the measured gain of a
  step (``step_gain``, ``shadow_gain``) in plain-step units;
- the BMC store's reallocation period (``optimal_period``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

# ---------------------------------------------------------------------------------------- MagicDec


def omega(gamma: int, alpha: float) -> float:
    """Expected tokens per step when drafting ``gamma`` tokens at acceptance rate ``alpha``:
    1 + alpha + ... + alpha^gamma = (1 - alpha^(gamma + 1)) / (1 - alpha), gamma + 1 at alpha = 1.
    Example: omega(3, 0.8) = 1 + .8 + .64 + .512 = 2.952."""
    if gamma < 0 or not 0.0 <= alpha <= 1.0:
        raise ValueError(f"need gamma >= 0 and 0 <= alpha <= 1, got gamma {gamma}, alpha {alpha}")
    if alpha == 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def speedup(gamma: int, alpha: float, t_target: float, t_draft: float, t_verify: float) -> float:
    """Predicted tokens/s over plain decoding (Chen et al., 2024, "MagicDec", eq. 1):
    Omega(gamma, alpha) * T_target / (gamma * T_draft + T_verify(gamma)); T_verify(0) = T_target, so
    not drafting is speedup 1. Example: alpha .8, gamma 3, T_target 100 ms, T_draft 20 ms,
    T_verify 110 ms -> 2.952 * 100 / (60 + 110) = 1.74."""
    return omega(gamma, alpha) * t_target / (gamma * t_draft + t_verify)


def read_ratio(weight_bytes: int, kv_bytes: int, budget: int, length: int) -> float:
    """Bytes a self-speculation draft token reads over what a target step reads: the weights plus
    ``budget`` compressed KV rows against the weights plus ``length`` rows (``kv_bytes`` per token over
    every layer's K and V; B x that for a batch of B, whose weights are read once). Where memory
    bandwidth bounds a step this is MagicDec's draft cost ratio T_draft / T_target.
    Example: 540 MB of weights, 46 KB a token, 512 rows: 0.89 at 2,048 tokens, 0.65 at 7,000."""
    return (weight_bytes + kv_bytes * budget) / (weight_bytes + kv_bytes * max(length, budget))


def shortest_paying_prompt(weight_bytes: int, kv_bytes: int, budget: int, max_ratio: float) -> int:
    """The shortest prompt at which ``read_ratio`` is at most ``max_ratio``: solving
    (W + kv b) / (W + kv L) <= r for L gives L >= (W (1 - r) + kv b) / (r kv).
    Example: 540 MB, 46 KB, 512, 0.75 -> 4,589."""
    if not 0.0 < max_ratio < 1.0:
        raise ValueError(f"max_ratio must be in (0, 1), got {max_ratio}")
    need = (weight_bytes * (1.0 - max_ratio) + kv_bytes * budget) / (max_ratio * kv_bytes)
    return math.ceil(need)


# ------------------------------------------------------------------------ acceptance -> budget


def chain_values(rates: Sequence[float]) -> list[float]:
    """Expected accepted tokens of a chain of k = 0..len(rates) nodes, rates[d] the acceptance at
    depth d + 1 given the parent's: values[k] = sum over i <= k of rates[0] * ... * rates[i - 1].
    Example: [0.5, 0.8] -> [0, 0.5, 0.5 + 0.4 = 0.9]."""
    values, reach = [0.0], 1.0
    for r in rates:
        reach *= r
        values.append(values[-1] + reach)
    return values


def best_budget(values: Sequence[float], verify_time: Callable[[int], float],
                draft_time: Callable[[int], float], tie: float = 1.001) -> int:
    """The node budget n with the most tokens per second, (1 + values[n]) / (draft_time(n) +
    verify_time(1 + n)); n = 0 is plain decoding. A bigger draft must win by the factor ``tie``
    (near ties go to the smaller, cheaper-when-wrong draft).
    Example: values [0, .8, .9, .9], verify 1.0 s for 1-2 rows and 1.3 s for 3-4, no draft cost ->
    n = 1 (1.8 per s; n = 2 gives 1.9 / 1.3 = 1.46)."""
    best, best_rate = 0, 1.0 / verify_time(1)
    for n in range(1, len(values)):
        rate = (1.0 + values[n]) / (draft_time(n) + verify_time(1 + n))
        if rate > best_rate * tie:
            best, best_rate = n, rate
    return best


def per_row(values: list[float], share: float) -> list[float]:
    """Expected accepted drafts per row of a batch from those of a row that drafts, when only
    ``share`` of the rows draft (the others still pay for the verify rows). Example: [0, .8] at
    0.5 -> [0, .4]; share 1 returns ``values`` itself."""
    return values if share >= 1.0 else [v * share for v in values]


# ------------------------------------------------------------------------------ price tables


def verify_prices(step_time: dict[int, float], q_max: int) -> Callable[[int], float]:
    """t(q) for q <= ``q_max``, tabled once for a budget search: a timed size's own mean, an untimed
    one the nearest smaller timed size's (the cost never falls as q grows, so this is a lower bound:
    the controller is optimistic about an untimed size, drafts it when that would pay, and so times
    it). Needs t(1). Example: timed {1: 1.0, 4: 1.2} -> t(2) = t(3) = 1.0, t(5) = 1.2."""
    table, last = [0.0], step_time[1]
    for q in range(1, q_max + 1):
        last = step_time.get(q, last)
        table.append(last)
    return table.__getitem__


def draft_prices(sizes: dict[int, float], per_token: float) -> Callable[[int], float]:
    """d(n) from the seconds timed per draft size: a timed size's own mean, else the line a + b n
    fitted to the timed sizes (least squares, a, b >= 0: a drafter paying a forward per tree level
    has a large a, one paying a forward per token a ~0), through the origin from one timed size,
    n x ``per_token`` before any. Fitted once per search, not per size asked.
    Example: timed {1: 2 ms, 2: 3 ms} -> d(6) = 1 + 6 x 1 = 7 ms; timed {2: 4 ms} -> d(6) = 12 ms."""
    if not sizes:
        return lambda n: n * per_token
    if len(sizes) == 1:
        (m, t), = sizes.items()
        return lambda n: sizes[n] if n in sizes else t * n / m
    xs, ys = list(sizes), list(sizes.values())
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs))
    a = max(0.0, my - b * mx)
    return lambda n: sizes[n] if n in sizes else a + b * n


def probe_cost(step_time: dict[int, float]) -> float:
    """What a one-token probe adds over a plain step, in plain steps: t(2) / t(1) - 1, at least 0.
    Example: t(2) = 2.2 s, t(1) = 1 s at batch 8 -> 1.2."""
    return max(0.0, step_time[2] / step_time[1] - 1.0)


def probe_spacing(cost: float, catch_up: float, share: float) -> int:
    """Steps between probes so that their extra cost (``cost`` plus the source's ``catch_up``, both in
    plain steps) stays under ``share`` of the run: ceil((cost + catch_up) / share).
    Example: cost 1.2, no catch-up, share 0.02 -> 60."""
    return math.ceil((cost + catch_up) / share - 1e-9)


# ------------------------------------------------------------------------------- measured gain


def step_gain(tokens: int, rows: int, seconds: float, t1: float) -> float:
    """A verified step's gain over plain decoding: tokens it yielded per sequence over its seconds
    in plain steps, (tokens / rows) / (seconds / t(1)); a plain step scores 1.
    Example: batch 1, 3 accepted (4 tokens) in 2 s with t(1) = 1 s -> 2.0."""
    return (tokens / rows) / (seconds / t1)


def shadow_gain(tokens_per_row: float, verify_ratio: float, draft_seconds: float, t1: float) -> float:
    """An unverified draft's would-be gain: tokens per row over t(1 + n) / t(1) + d(n) / t(1).
    Example: 3 tokens, t(4) / t(1) = 1.2, free draft -> 2.5."""
    return tokens_per_row / (verify_ratio + draft_seconds / t1)


# ------------------------------------------------------------------------ BMC store's period T


@dataclass(frozen=True)
class PeriodCosts:
    copy: float  # seconds to copy one cache row (K and V, all layers, every batch row) in a reallocation
    pad: float  # seconds to allocate one padding row (zero-fill, first touch)


def optimal_period(new_rows: int, held_rows: int, costs: PeriodCosts, pad_share: float = 0.125,
                   minimum: int = 64, maximum: int = 4096) -> int:
    """T*, the rows a store adds per reallocation, for a cache holding P = ``held_rows`` that grows by
    N = ``new_rows`` more. Growing T rows at a time copies the cache N / T times, each copy of the
    ~P + N / 2 rows held then, and leaves T / 2 rows allocated past the end on average:

        time(T) = (N / T) (P + N / 2) c_copy + (T / 2) c_pad,  T* = sqrt(2 N (P + N / 2) c_copy / c_pad)

    (BMC, Ruan et al., whose store also attends its padding; this store attends a view of the rows in
    use, so a padding row costs its allocation only). Rounded to a power of two, within [minimum,
    maximum] and at most ``pad_share`` x the rows held (rounded down to a power of two).
    Example: N 512, P 2048, copy 2e-6, pad 1e-6 -> sqrt(2 x 512 x 2304 x 2) = 2172 -> 2048, capped
    at 2048 / 8 = 256."""
    if new_rows < 0 or held_rows < 0:
        raise ValueError(f"rows must be >= 0, got new {new_rows}, held {held_rows}")
    if costs.copy <= 0 or costs.pad <= 0:
        raise ValueError(f"costs must be > 0, got {costs}")
    t = math.sqrt(2.0 * max(new_rows, 1) * (held_rows + new_rows / 2.0) * costs.copy / costs.pad)
    t = 2 ** round(math.log2(max(t, 1.0)))
    cap = 2 ** math.floor(math.log2(max(pad_share * held_rows, 1.0)))
    return int(max(minimum, min(t, cap, maximum)))
