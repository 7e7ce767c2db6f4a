"""Judging a verify block: the acceptance rule, and the pure helpers on either side of it.

Before the target's forward, ``constrain`` cuts the draft nodes each row's grammar forbids; after it,
``judge_processed`` hands the rule (a ``Judge``: ``Acceptance``, one rule for a run, or the server's
``RowAcceptance``, one per row) the logits as each row's processor makes them, and ``make_commit`` turns
the verdict into the tokens each row commits. ``is_chain``: whether the block is causal (a chain).

Dimensions: B live rows, N draft nodes, A accepted drafts, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from specdec.drafters.base import Commit
from specdec.processing import Masks, RowProcessor
from specdec.runtime import int8_linear, kernels
from specdec.sampling import SamplingParams, target_probs
from specdec.tree import DraftTree
from specdec.verifiers.sampling import verify_sampling
from specdec.verifiers.tree import Verification, verify_greedy


class Judge(Protocol):
    """A session's acceptance rule for its live rows: ``Acceptance`` (one rule for a run) or the server's
    ``RowAcceptance`` (one per row)."""

    sampling: SamplingParams | None  # what drafters are told (None: draft deterministically)
    generator: torch.Generator | None  # the drafters' randomness when sampling

    def __call__(self, logits: torch.Tensor, tree: DraftTree) -> Verification:
        """The verdict on logits [B, 1 + N, V] at the pending row and every node."""

    @property
    def greedy(self) -> bool:
        """Every row greedy (shadow drafts are scored only then)."""

    def sampling_of(self, row: int) -> SamplingParams | None:
        """Row ``row``'s sampling (None: greedy)."""

    def select(self, rows: list[int]) -> None:
        """Keep only these live rows (ascending)."""

    def joined(self, other: "Judge") -> "Judge":
        """The rule once ``other``'s rows joined after the live ones."""


@dataclass(frozen=True)
class Acceptance:
    """One rule for every row of a run: the greedy walk, or rejection sampling against the target's
    processed distribution (``sampling`` set), with the run's one generator."""

    sampling: SamplingParams | None = None
    generator: torch.Generator | None = None

    def __call__(self, logits: torch.Tensor, tree: DraftTree) -> Verification:
        """logits [B, 1 + N, V] at the pending row and every node."""
        # judged where the logits are (a draft is small, logits [B, Q, V] are not); the verdict comes
        # to the host, where the loop reads it
        tree = tree.to(logits.device)
        if self.sampling is None:  # argmax over float32 scores, as HF's greedy search takes it
            ver = verify_greedy(logits.float(), tree, kernels.argmax)
        else:
            ver = verify_sampling(target_probs(logits, self.sampling), tree, self.generator)
        return ver.cpu()

    @property
    def greedy(self) -> bool:
        """Every row greedy (shadow drafts are scored only then)."""
        return self.sampling is None

    def sampling_of(self, row: int) -> SamplingParams | None:
        """Row ``row``'s sampling (None: greedy): how its logprobs are read."""
        return self.sampling

    def select(self, rows: list[int]) -> None:
        """One rule for every row: nothing per row to drop."""

    def joined(self, other: "Acceptance") -> "Acceptance":
        """The rule once ``other``'s rows joined: rows of one run share one rule."""
        if other is not self:
            raise ValueError("rows judged by another acceptance rule cannot join this batch")
        return self


def is_chain(tree: DraftTree) -> bool:
    """Every node's parent is the node before it: the block is causal (ragged chains are too)."""
    N = tree.width
    return bool((tree.parents == torch.arange(-1, N - 1, device=tree.parents.device)).all())


def make_commit(tree: DraftTree, ver: Verification, hidden: torch.Tensor | None) -> Commit:
    """Accepted drafted tokens then the target's token, per row: tokens [B, A + 1]."""
    B = tree.batch_size
    A = ver.accepted.shape[1]
    tokens = torch.zeros(B, A + 1, dtype=torch.long)
    if A:
        path_tokens = tree.tokens.cpu().gather(1, ver.accepted.clamp(min=0))
        tokens[:, :A] = torch.where(ver.accepted >= 0, path_tokens, 0)
    tokens[torch.arange(B), ver.num_accepted] = ver.next_token.cpu()
    return Commit(tokens, ver.num_accepted + 1, ver.num_accepted, hidden)



def constrain(tree: DraftTree, procs: list[RowProcessor | None]) -> tuple[DraftTree, list[Masks | None]]:
    """The draft with the nodes each row's grammar forbids on their path cut (and their subtrees), so no
    verify row is spent on them; a sampled draft's q masked the same way (the verifier renormalises it:
    drafting from q and cutting what the grammar forbids is drafting from q restricted to what it
    allows). Returns the tree and, per row, the grammar's allowed tokens after each of its 1 + N block
    rows (``Masks``; None for a row without a grammar)."""
    masks: list[Masks | None] = [None] * tree.batch_size
    if not any(p is not None and p.grammar is not None for p in procs):
        return tree, masks
    parents, tokens = tree.real_nodes()
    keep = []
    for b, p in enumerate(procs):
        ok, masks[b] = p.check_tree(parents[b], tokens[b]) if p is not None else ([True] * len(tokens[b]), None)
        keep.append(ok)
    if not all(all(k) for k in keep):
        tree = tree.pruned(keep)
        masks = [m if m is None else m.rows([0] + [1 + i for i, k in enumerate(ok) if k]) for m, ok in zip(masks, keep)]
    if tree.probs is not None:
        probs = tree.probs.clone()
        for b, m in enumerate(masks):
            n = int(tree.num_nodes[b])
            if m is not None and n:
                allowed = m.allowed.to(probs.device)[tree.parents[b, :n].to(probs.device) + 1]  # [n, V] at each parent
                probs[b, :n] = probs[b, :n] * allowed
        tree = DraftTree(tree.tokens, tree.parents, tree.num_nodes, probs)
    return tree, masks


def unread_rows(masks: list[Masks | None], width: int) -> torch.Tensor | None:
    """[B, width] bool: block rows where a grammar allows exactly one token (``constrain``'s masks), whose
    logits no rule reads: the processed scores there are -inf but at that token, so greedy picks it, a
    sampler gives it probability 1 and its logprob is 0, whatever the logits. None where no row has one."""
    if all(m is None for m in masks):
        return None
    out = torch.zeros(len(masks), width, dtype=torch.bool)
    for b, m in enumerate(masks):
        if m is not None:
            one = m.counts() == 1  # [1 + N] the real rows
            out[b, : one.shape[0]] = one
    return out if bool(out.any()) else None


def read_groups(masks: list[Masks | None], vocab_size: int) -> torch.Tensor | None:
    """The groups of 16 token ids (``Masks.groups``) any block row's grammar allows, int64 [G], where every row
    has a grammar and they are at most a quarter of the vocabulary's groups: the only logits a rule reads (the
    others it masks to -inf), so an int8 output layer computes those alone (``fastpath``). None: all of them
    (a row without a grammar, a string's wide mask, a vocabulary not in whole groups). The groups are the int8
    layer's (``int8_linear.GROUP``: a mask word's halves)."""
    if not masks or any(m is None for m in masks) or vocab_size % int8_linear.GROUP:
        return None
    wanted = masks[0].groups()
    for m in masks[1:]:
        wanted = wanted | m.groups()
    if 4 * int(wanted.sum()) > len(wanted):
        return None
    return torch.from_numpy(wanted.nonzero()[0].astype("int64"))


def judge_processed(judge, procs: list[RowProcessor | None], logits: torch.Tensor, tree: DraftTree,
                    masks: list) -> tuple[Verification, list | None]:
    """``judge``'s verdict on the logits [B, 1 + N, V] as each row's processor makes them on each node's
    path (``specdec.processing.rows``), and the logprobs of every kept token for the rows that ask."""
    if any(p is not None and p.options.changes_scores for p in procs):
        parents, tokens = tree.real_nodes()
        rows = [p.scores(logits[b].cpu(), parents[b], tokens[b], masks[b]).to(logits.device)
                if p is not None and p.options.changes_scores else logits[b].to(torch.float32)
                for b, p in enumerate(procs)]  # each processed row a copy of its own
        logits = rows[0][None] if len(rows) == 1 else torch.stack(rows)
    ver = judge(logits, tree)
    if not any(p is not None and p.options.logprobs is not None for p in procs):
        return ver, None
    kept, out = ver.kept_rows(), []
    path_tokens = make_commit(tree, ver, None)
    for b, p in enumerate(procs):
        if p is None or p.options.logprobs is None:
            out.append(None)
            continue
        rows = logits[b, kept[b]].to(device="cpu", dtype=torch.float32)  # [K, V] the rows that chose them
        sampling = judge.sampling_of(b)
        dist = (target_probs(rows[None], sampling)[0].log() if sampling is not None
                else torch.log_softmax(rows.to(torch.float64), dim=-1))
        out.append(p.logprobs(dist, path_tokens.new_tokens(b)))
    return ver, out
