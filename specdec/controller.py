"""Draft-length control: how many tokens to ask the drafter for at the next step.

Verification is not free on a CPU: a default-model forward over 4 tokens costs ~1.4x one token,
over 8 ~1.8x. So drafting pays only while enough of it is accepted. Two rules:

- BASS (Qian et al., 2024) sets the length K: grow by ``step_up`` after a step where some sequence
  accepted the whole draft, otherwise shrink by one, never below the best count accepted then.
- Cost-aware gating (``cost_aware``) picks how much of K to use, if any. It keeps an estimate of
  the per-token acceptance rate alpha and of the verify time per block size q = 1 + k, both
  measured, and of the drafter's seconds per token d; it drafts the k <= K with the most expected
  tokens per unit of time, (1 + alpha + ... + alpha^k) / ((t(1 + k) + k d) / t(1)), or nothing
  when no k beats plain decoding.
  While drafting is off, a one-token probe every ``explore_every`` steps (doubling while probes
  fail, up to 8x) keeps alpha current (text changes: a summary starts quoting its source).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DraftLengthConfig:
    initial: int = 5  # first step's draft length
    minimum: int = 1  # never ask for fewer (0 would turn drafting off for good)
    maximum: int = 10  # past ~10 tokens a CPU verify forward costs more than it can win
    step_up: int = 2  # BASS: +2 after a step where some sequence accepted everything
    adaptive: bool = True  # False: always ask for `initial`
    cost_aware: bool = True  # draft only when expected gain beats the measured verify cost
    explore_every: int = 8  # while gated off, probe one token every n steps (backs off to 8n)
    decay: float = 0.8  # weight of the past in the running averages (alpha, verify times)


class DraftLengthController:
    def __init__(self, config: DraftLengthConfig = DraftLengthConfig()) -> None:
        if not 0 <= config.minimum <= config.initial <= config.maximum:
            raise ValueError(f"need 0 <= minimum <= initial <= maximum, got {config}")
        self.config = config
        self.length = config.initial
        self.alpha: float | None = None  # per-token acceptance rate, None until measured
        self.step_time: dict[int, float] = {}  # block size q -> running mean verify seconds
        self.draft_time: float = 0.0  # running mean seconds the drafter takes per drafted token
        self._skipped = 0  # steps gated off since the last draft
        self._interval = config.explore_every  # steps between probes; doubles while probes fail

    def expected_tokens(self, k: int) -> float:
        """Tokens one step yields when drafting k: 1 + alpha + alpha^2 + ... + alpha^k."""
        a = self.alpha if self.alpha is not None else 1.0
        return 1.0 + sum(a**i for i in range(1, k + 1))

    def cost_ratio(self, q: int) -> float | None:
        """Measured verify time of a q-row block over a 1-row block; between measured sizes the
        nearest larger one (cost grows with q), past the largest measured the largest. None if no
        multi-row block nor the 1-row block has been timed yet."""
        t1 = self.step_time.get(1)
        sizes = sorted(s for s in self.step_time if s > 1)
        if t1 is None or not sizes:
            return None
        above = [s for s in sizes if s >= q]
        return self.step_time[above[0] if above else sizes[-1]] / t1

    def best_length(self, k_max: int) -> int:
        """The k in [1, k_max] with the most tokens per second, or 0 if none beats not drafting."""
        if self.alpha is None:
            return k_max  # not measured yet: try it
        best, best_gain = 0, 1.0
        for k in range(1, k_max + 1):
            ratio = self.cost_ratio(1 + k)
            if ratio is None:
                return k_max
            t1 = self.step_time[1]
            gain = self.expected_tokens(k) / (ratio + k * self.draft_time / t1)
            if gain > best_gain * 1.001:  # prefer the shorter draft on (near) ties
                best, best_gain = k, gain
        return best

    def budget(self) -> int:
        if not self.config.cost_aware:
            return self.length
        if 1 not in self.step_time:
            return 0  # time one plain step first: every cost below is relative to it
        k = self.best_length(self.length)
        if k > 0:
            self._interval = self.config.explore_every
            return k
        self._skipped += 1
        if self._skipped >= self._interval:  # probe with one token: cheapest way to re-measure alpha
            self._skipped = 0
            self._interval = min(2 * self._interval, 8 * self.config.explore_every)  # back off
            return 1
        return 0

    def update(self, num_drafted: list[int], num_accepted: list[int], verify_time: float | None = None,
               draft_time: float | None = None) -> None:
        """After a verified step: per-sequence drafted and accepted counts, the step's verify and
        draft seconds."""
        c = self.config
        q = 1 + max(num_drafted, default=0)
        if verify_time is not None:
            old = self.step_time.get(q)
            self.step_time[q] = verify_time if old is None else c.decay * old + (1 - c.decay) * verify_time
        if not any(num_drafted):
            return  # nothing was drafted (gated off, or no n-gram match): nothing learned
        if draft_time is not None:
            per_token = draft_time / max(num_drafted)
            self.draft_time = c.decay * self.draft_time + (1 - c.decay) * per_token
        self._skipped = 0
        # alpha: accepted tokens over tokens the target judged (a rejection ends the judging)
        hits = sum(num_accepted)
        trials = sum(a + (1 if a < d else 0) for d, a in zip(num_drafted, num_accepted) if d)
        rate = hits / max(1, trials)
        self.alpha = rate if self.alpha is None else c.decay * self.alpha + (1 - c.decay) * rate
        if not c.adaptive:
            return
        if any(d > 0 and a == d for d, a in zip(num_drafted, num_accepted)):
            self.length = min(c.maximum, self.length + c.step_up)
        else:
            self.length = max(c.minimum, max(num_accepted), self.length - 1)
