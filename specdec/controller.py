"""Draft-length control: how many tokens to ask the drafter for at the next step.

Verification is not free on a CPU (a default-model forward over 8 tokens costs ~2.3x one token), so
asking for many tokens pays only while they are accepted. The BASS heuristic (Qian et al., 2024)
follows acceptance: grow by ``step_up`` after a step where some sequence accepted the whole draft,
otherwise shrink by one, never below the best count accepted at that step.
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


class DraftLengthController:
    def __init__(self, config: DraftLengthConfig = DraftLengthConfig()) -> None:
        if not 0 <= config.minimum <= config.initial <= config.maximum:
            raise ValueError(f"need 0 <= minimum <= initial <= maximum, got {config}")
        self.config = config
        self.length = config.initial

    def budget(self) -> int:
        return self.length

    def update(self, num_drafted: list[int], num_accepted: list[int]) -> None:
        """num_drafted, num_accepted: per sequence, for the step just verified."""
        c = self.config
        if not c.adaptive or not any(num_drafted):
            return  # nothing was drafted (e.g. no n-gram match): nothing learned
        if any(d > 0 and a == d for d, a in zip(num_drafted, num_accepted)):
            self.length = min(c.maximum, self.length + c.step_up)
        else:
            self.length = max(c.minimum, max(num_accepted), self.length - 1)
