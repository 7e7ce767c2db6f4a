"""Token trees: the one structure every drafter hands to every verifier.

Dimension vocabulary used in shape comments across the package:
    B batch, N tree nodes (drafted tokens), K draft length (chain depth), Q query rows of one
    target forward (= 1 + N: the pending token, then the nodes), L cache rows, H heads,
    D head dim, V vocabulary.

A draft is a forest hanging off the *pending* token (the last committed token, which the target has
not yet seen). Node ``i`` has parent ``parents[b, i]``; ``-1`` means "child of the pending token".
A chain of K tokens is the tree whose parents are ``-1, 0, 1, ..., K-2``.

Worked example (one row, N = 4)::

    pending ── t0 ── t1          tokens  = [t0, t1, t2, t3]
           └── t2 ── t3          parents = [-1,  0, -1,  2]
                                 depth   = [ 1,  2,  1,  2]

Rows may carry different numbers of real nodes (``num_nodes``); nodes past that are padding that no
verifier follows and no real node attends to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftTree:
    tokens: torch.Tensor  # [B, N] int64 drafted token ids
    parents: torch.Tensor  # [B, N] int64 parent node index, -1 = child of the pending token
    num_nodes: torch.Tensor  # [B] int64 real nodes per row; nodes >= num_nodes[b] are padding
    # [B, N, V] the drafter's distribution each token was drawn from (lossless sampling needs q);
    # None means the draft is deterministic (one-hot at the drafted token), as for prompt lookup.
    probs: torch.Tensor | None = None

    def __post_init__(self) -> None:
        B, N = self.tokens.shape
        assert self.parents.shape == (B, N), f"parents {tuple(self.parents.shape)} != tokens {(B, N)}"
        assert self.num_nodes.shape == (B,), f"num_nodes {tuple(self.num_nodes.shape)} != ({B},)"
        if self.probs is not None:
            assert self.probs.shape[:2] == (B, N), f"probs {tuple(self.probs.shape)} vs tokens {(B, N)}"

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def width(self) -> int:
        """N: node slots per row (the longest row's node count, the rest padding)."""
        return self.tokens.shape[1]

    @staticmethod
    def empty(batch_size: int, device: torch.device | str = "cpu") -> "DraftTree":
        """No draft: the step decodes one token, as plain autoregressive decoding does."""
        z = torch.zeros(batch_size, 0, dtype=torch.long, device=device)
        return DraftTree(z, z.clone(), torch.zeros(batch_size, dtype=torch.long, device=device))

    @staticmethod
    def chain(tokens: torch.Tensor, num_nodes: torch.Tensor | None = None,
              probs: torch.Tensor | None = None) -> "DraftTree":
        """A chain per row: tokens [B, K] -> parents -1, 0, ..., K-2."""
        B, K = tokens.shape
        parents = torch.arange(-1, K - 1, device=tokens.device).expand(B, K).contiguous()
        if num_nodes is None:
            num_nodes = torch.full((B,), K, dtype=torch.long, device=tokens.device)
        return DraftTree(tokens, parents, num_nodes, probs)


def node_depths(parents: torch.Tensor) -> torch.Tensor:
    """Depth of each node (children of the pending token have depth 1).

    parents: [B, N] -> [B, N]. Parents always precede their children (index order is a topological
    order), so one pass over N fills the depths; N is a few dozen at most.
    """
    B, N = parents.shape
    depth = torch.zeros(B, N, dtype=torch.long, device=parents.device)
    for i in range(N):
        p = parents[:, i]
        depth[:, i] = torch.where(p < 0, 1, depth.gather(1, p.clamp(min=0)[:, None])[:, 0] + 1)
    return depth


def ancestor_mask(parents: torch.Tensor, num_nodes: torch.Tensor | None = None) -> torch.Tensor:
    """Which rows of a verify block each row may attend to: [B, Q, Q] bool, Q = 1 + N.

    Row/column 0 is the pending token; row 1 + i is node i. A row sees itself, the pending token and
    its ancestors. Padding nodes (i >= num_nodes[b]) see only the pending token and themselves, and
    no real node sees them.

    Example, parents = [-1, 0, -1] (a chain of two and a sibling):
        pending  1 0 0 0
        t0       1 1 0 0
        t1       1 1 1 0
        t2       1 0 0 1
    """
    B, N = parents.shape
    Q = N + 1
    mask = torch.zeros(B, Q, Q, dtype=torch.bool, device=parents.device)
    mask[:, :, 0] = True
    eye = torch.eye(Q, dtype=torch.bool, device=parents.device)
    mask |= eye
    for i in range(N):  # a parent's row is complete before its children are visited
        p = parents[:, i].clamp(min=0) + 1  # row of the parent (0 = pending)
        mask[:, i + 1] |= mask[torch.arange(B, device=parents.device), p]
    if num_nodes is not None:
        pad = torch.arange(N, device=parents.device)[None, :] >= num_nodes[:, None]  # [B, N]
        # a padding node keeps only [pending, itself]
        mask[:, 1:][pad] = eye[1:][None].expand(B, N, Q)[pad] | (torch.arange(Q, device=parents.device) == 0)
    return mask


def path_to(parents: torch.Tensor, node: int) -> list[int]:
    """Node indices from the first drafted level down to ``node`` (one row's parents [N])."""
    path = []
    while node >= 0:
        path.append(node)
        node = int(parents[node])
    return path[::-1]


def chain_mask(batch_size: int, q: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The block mask of a chain (or a prefill): causal, [B, Q, Q] bool."""
    return torch.ones(q, q, dtype=torch.bool, device=device).tril().expand(batch_size, q, q)
