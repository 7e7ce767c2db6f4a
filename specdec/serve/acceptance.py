"""Per-request acceptance for a live batch: greedy rows and seeded sampled rows side by side.

A sampled row follows the Gumbel-max rule with noise fixed per (request seed, position): the token at
position t is ``argmax_v(log p_t(v) + G_t(v))``, where p_t is the target's processed distribution
(temperature, top-k, top-p, as HF applies them) after the committed prefix and G_t is i.i.d. Gumbel
noise, the t-th draw of the request's own generator. Each token is then exactly a sample of p_t, and
the whole answer is a function of the seed and the prompt alone: verifying a draft is the greedy walk
over the perturbed scores, so neither the drafts nor the batch mates change what a seed yields
(rejection sampling draws a varying number of uniforms per step, so its samples shift with the
drafts). A deterministic draft token x is accepted with probability p_t(x), as under rejection
sampling. Why: docs/decisions/016-server.md.

Worked example, one row, pending token at position 10, a chain draft [a, b]: block rows predict
positions 10, 11, 12 (offsets 0, 1, 2: the tree depths with the pending row at 0); noise rows 0-2 of
the row's stream are added to the three rows' log-probabilities; the walk accepts a if a is the
perturbed argmax at row 0, and so on; with one draft accepted, positions 10 and 11 are committed and
the stream moves on by 2 (noise row 2 is kept: it is position 12's whatever the next draft is).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.sampling import SamplingParams, target_probs, uniforms
from specdec.tree import DraftTree, node_depths
from specdec.verifiers.tree import Verification, verify_greedy


class GumbelStream:
    """Gumbel noise for positions 0, 1, 2, ... of one answer: row t is the t-th draw [V] of a generator
    seeded with the request's seed, whatever order the rows are asked for in."""

    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(int(seed))
        self.rows: list[torch.Tensor] = []  # drawn, not yet committed: position start + i

    def take(self, n: int, vocab: int) -> torch.Tensor:
        """Noise [n, V] float64 for the next n uncommitted positions."""
        while len(self.rows) < n:
            u = uniforms((vocab,), self.generator, "cpu")
            # float64 uniforms: u = 0 (noise -inf) has probability 2^-53 per token
            self.rows.append(-torch.log(-torch.log(u)))
        return torch.stack(self.rows[:n])

    def advance(self, n: int) -> None:
        """n positions were committed."""
        del self.rows[:n]


def gumbel_scores(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """log p + G: probs [Q, V] (0 for filtered tokens: -inf, never chosen), noise [Q, V] -> [Q, V]."""
    return probs.log() + noise


@dataclass
class RowRule:
    """How one row is judged: greedy (``sampling`` None), or sampled with its own noise stream."""

    sampling: SamplingParams | None = None
    noise: GumbelStream | None = None

    @classmethod
    def make(cls, sampling: SamplingParams | None, seed: int | None) -> "RowRule":
        if sampling is None:
            return cls()
        seed = int(torch.randint(2**62, ())) if seed is None else seed
        return cls(sampling, GumbelStream(seed))


class RowAcceptance:
    """The session's acceptance rule with one ``RowRule`` per live row (``DecodeSession``'s judge).
    Drafters begin greedy (``sampling`` None): their drafts are deterministic, which this rule
    verifies losslessly for any row."""

    sampling = None  # what drafters are told: draft deterministically
    generator = None

    def __init__(self, rules: list[RowRule]) -> None:
        self.rules = list(rules)

    @property
    def greedy(self) -> bool:
        return all(r.sampling is None for r in self.rules)

    def sampling_of(self, row: int) -> SamplingParams | None:
        """Row ``row``'s sampling (None: greedy): how its logprobs are read."""
        return self.rules[row].sampling

    def __call__(self, logits: torch.Tensor, tree: DraftTree) -> Verification:
        """logits [B, 1 + N, V] at the pending row and every node."""
        # on the host: the noise streams are CPU generators, a verdict is read there anyway
        logits, tree = logits.float().cpu(), tree.to(torch.device("cpu"))
        B, Q, V = logits.shape
        assert B == len(self.rules), f"{B} rows of logits, {len(self.rules)} rules"
        scores = logits
        if not self.greedy:
            scores = logits.to(torch.float64)  # greedy rows: float32 logits exactly, argmax unchanged
            offsets = torch.cat([torch.zeros(B, 1, dtype=torch.long), node_depths(tree.parents)], dim=1)  # [B, Q]
            for b, rule in enumerate(self.rules):
                if rule.sampling is not None:
                    probs = target_probs(logits[b : b + 1], rule.sampling)[0]  # [Q, V]
                    noise = rule.noise.take(int(offsets[b].max()) + 1, V)  # [depth + 1, V]
                    scores[b] = gumbel_scores(probs, noise[offsets[b]])
        ver = verify_greedy(scores, tree)
        for b, rule in enumerate(self.rules):
            if rule.noise is not None:
                rule.noise.advance(int(ver.num_accepted[b]) + 1)
        return ver

    def select(self, rows: list[int]) -> None:
        self.rules = [self.rules[b] for b in rows]

    def joined(self, other: "RowAcceptance") -> "RowAcceptance":
        self.rules += other.rules
        return self
