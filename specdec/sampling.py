"""Sampling: the target's processed distribution (HF's logits processors) and lossless acceptance.

    SamplingParams(temperature=0.7, top_p=0.9)   what the user asks for; None in the decoder = greedy
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # > 0; divides the logits (HF's TemperatureLogitsWarper)
    top_k: int = 0  # keep the k most likely tokens; 0 = off (HF's TopKLogitsWarper)
    top_p: float = 1.0  # keep the smallest set with this much mass, in (0, 1]; 1 = off (TopPLogitsWarper)
