"""Sampling: the target's processed distribution, exactly as HF ``generate(do_sample=True)`` makes it.

    params = SamplingParams.resolve(model, temperature=0.7, top_p=0.9)  # unset args as HF fills them
    probs = target_probs(logits, params)       # logits [B, Q, V] -> probs [B, Q, V] float64

"The target's distribution" means what a user gets from ``model.generate(do_sample=True, ...)`` with
the same arguments. transformers 5.23 (``GenerationMixin._get_logits_processor``) builds, when
sampling and with one beam, in this order, skipping each at its neutral value:

    TemperatureLogitsWarper(t)   unless t == 1.0
    TopKLogitsWarper(k)          unless k is None or 0     (GenerationConfig's default: k = 50!)
    TopPLogitsWarper(p)          unless p is None or p >= 1.0
    (then min_p, typical_p, epsilon, eta: not supported here, refused by ``resolve``)

on the last row's logits cast to float32, then ``softmax``. Unset arguments come from the model's
``generation_config``, then from HF's global defaults (temperature 1.0, top_k 50, top_p 1.0); so
``generate(do_sample=True)`` with nothing else samples from the 50 most likely tokens, here as there.
The lossless acceptance rules over these probabilities live in ``specdec.verifiers.sampling``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

# HF's global defaults for the three arguments (GenerationConfig._get_default_generation_params)
HF_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0}
# generation_config fields that would change the sampled distribution in ways we do not reproduce,
# with their neutral values: a target whose config sets one otherwise is refused, not silently changed
_UNSUPPORTED = {"min_p": None, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "top_h": None,
                "no_repeat_ngram_size": 0, "suppress_tokens": None,
                "bad_words_ids": None, "sequence_bias": None}


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # > 0; divides the logits (HF's TemperatureLogitsWarper); 1 = off
    top_k: int = 0  # keep the k most likely tokens; 0 = off (HF's TopKLogitsWarper)
    top_p: float = 1.0  # keep the smallest set with this much mass, in (0, 1]; 1 = off (TopPLogitsWarper)

    def __post_init__(self) -> None:
        if not self.temperature > 0:  # also catches NaN
            raise ValueError(f"temperature must be > 0 when sampling, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if int(self.top_k) != self.top_k or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k}")

    @staticmethod
    def resolve(model=None, temperature: float | None = None, top_k: int | None = None,
                top_p: float | None = None) -> "SamplingParams":
        """The params HF ``model.generate(do_sample=True, ...)`` would use: an argument given here
        wins, then the model's ``generation_config``, then HF's defaults (top_k 50)."""
        given = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
        config = getattr(model, "generation_config", None)
        for name, neutral in _UNSUPPORTED.items():
            value = getattr(config, name, neutral)
            if value is not None and value != neutral:
                raise ValueError(f"the target's generation_config sets {name}={value}, which specdec's "
                                 f"sampling does not apply (set it to {neutral} to sample)")
        resolved = {}
        for name, value in given.items():
            if value is None:
                value = getattr(config, name, None)
            resolved[name] = HF_DEFAULTS[name] if value is None else value
        return SamplingParams(float(resolved["temperature"]), int(resolved["top_k"]), float(resolved["top_p"]))

    def hf_kwargs(self) -> dict:
        """Arguments for ``model.generate`` that sample from the same distribution."""
        return {"do_sample": True, "temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p}


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)``, the first maximum on ties as argmax takes it, through ``max``'s indices:
    torch's CPU kernel for those is ~3x faster (16 rows x 49k tokens, 2 threads: 0.19 vs 0.60 ms, ~1%
    of a 16-row verify; 2026-11-25, a Xeon)."""
    return logits.max(-1).indices


def uniforms(shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device | str) -> torch.Tensor:
    """Float64 uniforms in [0, 1) drawn from ``generator`` (a CPU generator, or torch's default one)
    and placed on ``device``: the same seed gives the same draws on every device, and a CUDA run
    needs no CUDA generator."""
    return torch.rand(shape, dtype=torch.float64, generator=generator).to(device)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One sample per row of probs [B, V] (rows need not be normalised) -> [B] int64, by the
    inverse CDF of one uniform per row (``uniforms``), on probs' device. A token of probability 0
    is never drawn: its slice of the CDF is empty. Example: probs [[0, .5, .5]], u 0.7 -> [2]."""
    cdf = probs.to(torch.float64).cumsum(-1)  # [B, V]
    u = uniforms((probs.shape[0], 1), generator, probs.device) * cdf[:, -1:]
    idx = torch.searchsorted(cdf, u, right=True)[:, 0].clamp(max=probs.shape[-1] - 1)
    # u * total rounds up to total only with probability ~2^-53; then take the last token with mass
    last = (probs > 0).to(torch.long).cumsum(-1).argmax(-1)
    return torch.where(probs.gather(1, idx[:, None])[:, 0] > 0, idx, last)


def sampling_kwargs(model, temperature: float) -> dict:
    """``generate()`` arguments shared by HF and SpecDecoder (the benches' ``--temperature``): greedy
    at 0, else do_sample with every argument resolved as HF resolves it, so both sample one p."""
    if not temperature >= 0:
        raise ValueError(f"--temperature must be >= 0 (0 = greedy), got {temperature}")
    return {"do_sample": False} if temperature == 0 else SamplingParams.resolve(model, temperature).hf_kwargs()


def logits_processors(params: SamplingParams) -> LogitsProcessorList:
    """transformers' own warpers for ``params``, in ``_get_logits_processor``'s order and with its
    skips (temperature 1.0, top_k 0, top_p 1.0 add nothing); min_tokens_to_keep = 1 as with one beam."""
    procs = LogitsProcessorList()
    if params.temperature != 1.0:
        procs.append(TemperatureLogitsWarper(params.temperature))
    if params.top_k != 0:
        procs.append(TopKLogitsWarper(top_k=params.top_k, min_tokens_to_keep=1))
    if params.top_p < 1.0:
        procs.append(TopPLogitsWarper(top_p=params.top_p, min_tokens_to_keep=1))
    return procs


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [B, Q, V] -> probs [B, Q, V] float64: each row processed as HF processes one step's
    logits (cast to float32 first, as ``_sample`` does), then softmax. Float64 out so the acceptance
    ratios and residuals downstream lose nothing; filtered tokens get probability exactly 0."""
    B, Q, V = logits.shape
    scores = logits.reshape(B * Q, V).to(torch.float32)  # [B * Q, V]; HF samples from float32 scores
    no_ids = torch.zeros(B * Q, 0, dtype=torch.long, device=logits.device)  # the warpers ignore input_ids
    scores = logits_processors(params)(no_ids, scores)
    return torch.softmax(scores.to(torch.float64), dim=-1).reshape(B, Q, V)
