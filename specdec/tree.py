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
from typing import Callable

import torch


@dataclass(frozen=True)
class DraftTree:
    tokens: torch.Tensor  # [B, N] int64 drafted token ids
    parents: torch.Tensor  # [B, N] int64 parent node index, -1 = child of the pending token
    num_nodes: torch.Tensor  # [B] int64 real nodes per row; nodes >= num_nodes[b] are padding
    # [B, N, V] the drafter's distribution each token was drawn from (lossless sampling needs q);
    # None means the draft is deterministic (one-hot at the drafted token), as for prompt lookup.
    # Trees: row i is the distribution node i's token was drawn from, i.e. the drafter's processed
    # distribution after node i's parent, so siblings carry the same row; siblings are drawn without
    # replacement and tried in index order (specdec.verifiers.sampling removes each rejected one from
    # q). Deterministic trees (EAGLE's top-k) leave it None: siblings must then be distinct tokens.
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

    def real_nodes(self) -> tuple[list[list[int]], list[list[int]]]:
        """Each row's real nodes as lists, padding cut off: (parents per row, tokens per row).
        Example: parents [[-1, 0], [-1, -1]], tokens [[5, 6], [7, 0]], num_nodes [2, 1] ->
        ([[-1, 0], [-1]], [[5, 6], [7]])."""
        n = self.num_nodes.tolist()
        return ([p[:k] for p, k in zip(self.parents.tolist(), n)], [t[:k] for t, k in zip(self.tokens.tolist(), n)])

    def to(self, device: torch.device | str) -> "DraftTree":
        """The same tree on ``device`` (itself if it is there already)."""
        if self.tokens.device == torch.device(device):
            return self
        probs = None if self.probs is None else self.probs.to(device)
        return DraftTree(self.tokens.to(device), self.parents.to(device), self.num_nodes.to(device), probs)

    def pruned(self, keep: list[list[bool]]) -> "DraftTree":
        """Only the real nodes marked in ``keep`` (per row, one flag per real node; a kept node's parent
        must be kept), renumbered in their order, on the host. Example: parents [[-1, 0, -1]], tokens
        [[5, 6, 7]], keep [[True, False, True]] -> parents [[-1, -1]], tokens [[5, 7]]."""
        parents, tokens = self.real_nodes()
        B = self.batch_size
        kept = [[i for i, k in enumerate(row) if k] for row in keep]
        N = max((len(k) for k in kept), default=0)
        new_tokens = torch.zeros(B, N, dtype=torch.long)
        new_parents = torch.full((B, N), -1, dtype=torch.long)
        probs = None if self.probs is None else torch.zeros(B, N, self.probs.shape[-1], dtype=self.probs.dtype)
        for b, nodes in enumerate(kept):
            index = {old: new for new, old in enumerate(nodes)}
            for new, old in enumerate(nodes):
                p = parents[b][old]
                assert p < 0 or p in index, f"row {b}: node {old} kept without its parent {p}"
                new_tokens[b, new] = tokens[b][old]
                new_parents[b, new] = index[p] if p >= 0 else -1
            if probs is not None and nodes:
                probs[b, : len(nodes)] = self.probs[b, nodes].cpu()
        return DraftTree(new_tokens, new_parents, torch.tensor([len(k) for k in kept], dtype=torch.long), probs)

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

    @staticmethod
    def chains(rows: list[list[int]]) -> "DraftTree":
        """One chain per row from token lists of any lengths (an empty list drafts nothing), on the host.
        Example: [[5, 6], [7]] -> tokens [[5, 6], [7, 0]], num_nodes [2, 1]."""
        K = max((len(r) for r in rows), default=0)
        tokens = torch.zeros(len(rows), K, dtype=torch.long)
        for b, r in enumerate(rows):
            tokens[b, : len(r)] = torch.tensor(r, dtype=torch.long)
        return DraftTree.chain(tokens, torch.tensor([len(r) for r in rows], dtype=torch.long))

    def to_networkx(self, b: int = 0, decode: Callable[[int], str] | None = None):
        """Row ``b``'s real nodes as a ``networkx.DiGraph``, for inspection (drawing, ``nx.write_gml``,
        ``nx.dag_longest_path``), never on a hot path. Node -1 is the pending token (``depth`` 0);
        node i carries ``token``, ``depth`` (1 = child of the pending token), ``rank`` (index among
        its parent's children), ``prob`` (the drafter's probability of its token, when the tree has
        ``probs``) and ``text`` (``decode(token)``, when given); edges run parent -> child.
        Example: parents [-1, 0, -1], tokens [5, 6, 7] -> edges (-1, 0), (0, 1), (-1, 2); node 2 has
        depth 1 and rank 1."""
        import networkx as nx  # only for inspection: kept out of the decoder's imports

        parents, tokens = (x[b] for x in self.real_nodes())
        g = nx.DiGraph(row=b)
        g.add_node(-1, depth=0)
        children: dict[int, int] = {}
        for i, (p, tok) in enumerate(zip(parents, tokens)):
            children[p] = children.get(p, 0) + 1
            attrs = {"token": tok, "depth": g.nodes[p]["depth"] + 1, "rank": children[p] - 1}
            if self.probs is not None:
                attrs["prob"] = float(self.probs[b, i, tok])
            if decode is not None:
                attrs["text"] = decode(tok)
            g.add_node(i, **attrs)
            g.add_edge(p, i)
        return g


def pick_rows(use_a: list[bool], a: DraftTree, b: DraftTree) -> DraftTree:
    """Row b of the result is row b of ``a`` where use_a[b], else of ``b`` (each row keeps its own
    node count); the narrower tree is padded. Example: a = [[5, 6]] chain, b = [[7]] -> use_a
    [False] gives [[7, 0]] with parents [[-1, 0]] (the padding slot's parent is never read) and
    num_nodes [1]. Trees carrying draft distributions (sampling) keep them; a deterministic tree's
    rows become one-hot at its tokens (what ``probs=None`` means)."""
    assert a.batch_size == b.batch_size == len(use_a), "pick_rows: trees and choices disagree on B"
    N = max(a.width, b.width)

    def widen(t: DraftTree, x: torch.Tensor, fill: int) -> torch.Tensor:
        out = torch.full((t.batch_size, N), fill, dtype=x.dtype, device=x.device)
        out[:, : t.width] = x
        return out

    # padding slots hang off the pending token (parent -1): always valid, never a real node's ancestor
    pick = torch.tensor(use_a, device=a.tokens.device)[:, None]
    tokens = torch.where(pick, widen(a, a.tokens, 0), widen(b, b.tokens.to(a.tokens.device), 0))
    parents = torch.where(pick, widen(a, a.parents, -1), widen(b, b.parents.to(a.tokens.device), -1))
    num = torch.where(pick[:, 0], a.num_nodes, b.num_nodes.to(a.num_nodes.device))
    probs = None
    if a.probs is not None or b.probs is not None:  # sampling: a deterministic tree's q is one-hot
        V = (a.probs if a.probs is not None else b.probs).shape[-1]

        def dist(t: DraftTree) -> torch.Tensor:  # [B, N, V]
            q = t.probs if t.probs is not None else torch.nn.functional.one_hot(t.tokens.cpu(), V).to(torch.float64)
            out = torch.zeros(t.batch_size, N, V, dtype=q.dtype)
            out[:, : t.width] = q.cpu()
            return out

        qa, qb = dist(a), dist(b)
        probs = torch.where(pick.cpu()[:, :, None], qa, qb.to(qa.dtype))
    return DraftTree(tokens, parents, num, probs)


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
        p = parents[:, i] + 1  # row of the parent (0 = pending)
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


def path_along(parents: list[int], tokens: list[int], text: list[int]) -> list[int]:
    """The nodes of one row's tree (parents, tokens of its real nodes) that ``text`` walks down from
    the root: at each depth the child whose token is the text's next token. Against the tokens a
    greedy target committed, this is the path the tree verifier would have accepted, as far as the
    text goes. Example: parents [-1, -1, 0], tokens [5, 7, 9], text [7, 9] -> [1] (node 1 has no
    children)."""
    path, node = [], -1
    for t in text:
        node = next((i for i, (p, tok) in enumerate(zip(parents, tokens)) if p == node and tok == t), None)
        if node is None:
            break
        path.append(node)
    return path


def subtree_depth(parents: list[int], node: int) -> int:
    """How many levels of one row's tree (parents of its real nodes, each after its parent) lie below
    ``node`` (-1: the root). Example: parents [-1, 0, 0, 1] -> node 0: 2, node 2: 0, -1: 3."""
    below = {node: 0}
    deepest = 0
    for i, p in enumerate(parents):
        if p in below:
            below[i] = below[p] + 1
            deepest = max(deepest, below[i])
    return deepest


def chain_mask(batch_size: int, q: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The block mask of a chain (or a prefill): causal, [B, Q, Q] bool."""
    return torch.ones(q, q, dtype=torch.bool, device=device).tril().expand(batch_size, q, q)


def position_ids(parents: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Positions of a verify block [B, Q]: the pending token sits at ``lengths[b]`` (the committed
    rows before it), node i at ``lengths[b] + depth[i]``.

    Example: lengths [7], parents [-1, 0, -1, 2] -> [[7, 8, 9, 8, 9]].
    """
    B, N = parents.shape
    assert lengths.shape == (B,), f"lengths {tuple(lengths.shape)} != ({B},)"
    depth = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=parents.device), node_depths(parents)], 1)
    return lengths.to(parents.device)[:, None] + depth
