"""Is a sample drawn from a given distribution? Pearson's chi-square and the total variation distance,
for the sampling tests (tests/test_sampling.py) and the device exactness suite."""

from __future__ import annotations

import math

import torch

ALPHA = 1e-3  # chi-square significance: a correct rule fails a given seed with probability 1e-3
TV_FACTOR = 3.0  # TV bound = this x the TV that sampling noise alone gives (normal approximation)


@torch.no_grad()
def two_token_tables(model, prompt: torch.Tensor, params) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's exact distribution of the first two tokens after ``prompt`` [1, P]: p(x) [V] and
    p(y | x) [V, V] (one forward per first token, batched), processed by ``params``
    (``sampling.SamplingParams``) as the decoder processes them; on the model's device."""
    from specdec.sampling import target_probs

    prompt = prompt.to(model.device)
    V = model.config.vocab_size
    first = target_probs(model(prompt).logits[:, -1:], params)[0, 0]
    ids = torch.cat([prompt.expand(V, -1), torch.arange(V, device=model.device)[:, None]], dim=1)  # [V, P + 1]
    second = target_probs(model(ids).logits[:, -1:], params)[:, 0]
    return first, second


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of counts [M] against probs [M]; bins expecting < 5 are merged into one.
    A count in a bin of probability 0 gives p-value 0."""
    counts, probs = counts.double().cpu(), probs.double().cpu()
    n = counts.sum()
    expected = n * probs
    if bool((counts[probs == 0] > 0).any()):
        return 0.0
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = torch.tensor(float(len(obs) - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, stat / 2))


def tv_distance(counts: torch.Tensor, probs: torch.Tensor) -> float:
    counts, probs = counts.double().cpu(), probs.double().cpu()
    return 0.5 * float((counts / counts.sum() - probs).abs().sum())


def tv_noise(probs: torch.Tensor, n: int) -> float:
    """TV expected from n exact samples: 0.5 * sum E|freq - p| ~ 0.5 * sum sqrt(2 p (1 - p) / (pi n))."""
    probs = probs.double().cpu()
    return 0.5 * float((2 * probs * (1 - probs) / (math.pi * n)).sqrt().sum())


def pair_mismatch(pairs: torch.Tensor, joint: torch.Tensor) -> str | None:
    """pairs [n, 2] sampled token pairs vs the exact joint [V, V]: None if they match (chi-square
    p-value > ALPHA and TV under TV_FACTOR x its noise), else a line saying how they differ."""
    V = joint.shape[0]
    pairs = pairs.cpu()
    counts = torch.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V)
    probs = joint.reshape(-1)
    pval, tv = chi_square_pvalue(counts, probs), tv_distance(counts, probs)
    bound = TV_FACTOR * tv_noise(probs, len(pairs))
    if pval > ALPHA and tv < bound:
        return None
    return f"chi-square p-value {pval:.2e} (needs > {ALPHA}), TV {tv:.4f} (bound {bound:.4f})"
