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

import functools
from dataclasses import dataclass

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


# --------------------------------------------------------------------------------------------------
# Tree shapes as Python data: construction and debugging (not the hot path).

ROOT = -1  # the pending token's node id in a networkx graph


def to_networkx(parents, tokens=None):
    """One row's tree as a ``networkx.DiGraph``: node ``-1`` is the pending token, node ``i`` the
    i-th drafted node, edges go parent -> child. Attributes: ``depth`` (the root has 0), ``rank``
    (index among its parent's children, in node order), and ``token`` when tokens are given.

    parents, tokens: [N] sequences or 1D tensors (one row of a ``DraftTree``).
    """
    import networkx as nx

    parents = [int(p) for p in parents]
    g = nx.DiGraph()
    g.add_node(ROOT, depth=0)
    seen_children: dict[int, int] = {}
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"node {i} has parent {p}: parents must precede their children")
        rank = seen_children.get(p, 0)
        seen_children[p] = rank + 1
        g.add_node(i, depth=g.nodes[p]["depth"] + 1, rank=rank)
        if tokens is not None:
            g.nodes[i]["token"] = int(tokens[i])
        g.add_edge(p, i)
    return g


def from_networkx(graph) -> "TreeTemplate":
    """The tree in ``graph`` (a rooted out-tree, any hashable node names) as a ``TreeTemplate``.

    Nodes are numbered breadth first: every level after the one above it, children in the order of
    their ``rank`` attribute when present, else in the graph's insertion order. Node tokens (the
    ``token`` attribute, if every node has one) come along in ``template.tokens``.
    """
    import networkx as nx

    if graph.number_of_nodes() == 0 or not nx.is_arborescence(graph):
        raise ValueError("graph is not a rooted tree (one root, every other node with one parent)")
    root = next(n for n, d in graph.in_degree() if d == 0)
    order: list = []
    parents: list[int] = []
    index = {root: -1}
    frontier = [root]
    while frontier:  # breadth first: parents always get smaller indices than their children
        nxt = []
        for u in frontier:
            kids = list(graph.successors(u))
            if all("rank" in graph.nodes[k] for k in kids):
                kids.sort(key=lambda k: graph.nodes[k]["rank"])
            for k in kids:
                index[k] = len(order)
                order.append(k)
                parents.append(index[u])
            nxt.extend(kids)
        frontier = nxt
    tokens = None
    if order and all("token" in graph.nodes[k] for k in order):
        tokens = tuple(int(graph.nodes[k]["token"]) for k in order)
    return TreeTemplate(tuple(parents), tokens)


@dataclass(frozen=True)
class TreeTemplate:
    """A tree shape (and optionally tokens) as Python tuples: what static-tree drafters fill.

    Node i's ``rank`` is its index among its parent's children (0 = the drafter's most likely
    token); in a template, the r-th child of a node is meant to hold that node's r-th ranked token.
    """

    parents: tuple[int, ...]  # [N] parent node index, -1 = child of the pending token
    tokens: tuple[int, ...] | None = None  # [N] token ids, None for a bare shape
    expected_accepted: float | None = None  # expected accepted drafts under the probs it was built for

    def __post_init__(self) -> None:
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise ValueError(f"node {i} has parent {p}: parents must precede their children")
        if self.tokens is not None and len(self.tokens) != len(self.parents):
            raise ValueError(f"{len(self.tokens)} tokens for {len(self.parents)} nodes")

    def __len__(self) -> int:
        return len(self.parents)

    @property
    def depths(self) -> tuple[int, ...]:
        d: list[int] = []
        for p in self.parents:
            d.append(1 if p < 0 else d[p] + 1)
        return tuple(d)

    @property
    def ranks(self) -> tuple[int, ...]:
        counts: dict[int, int] = {}
        r = []
        for p in self.parents:
            r.append(counts.get(p, 0))
            counts[p] = r[-1] + 1
        return tuple(r)

    @property
    def max_depth(self) -> int:
        return max(self.depths, default=0)

    def to_draft_tree(self, tokens: torch.Tensor | None = None) -> DraftTree:
        """The template as a batch-1 ``DraftTree``; tokens [N] (default: the template's own)."""
        if tokens is None:
            if self.tokens is None:
                raise ValueError("a bare template needs tokens to become a DraftTree")
            tokens = torch.tensor(self.tokens, dtype=torch.long)
        N = len(self.parents)
        parents = torch.tensor(self.parents, dtype=torch.long).reshape(1, N)
        return DraftTree(tokens.reshape(1, N).long(), parents, torch.tensor([N]))


def expected_accepted(parents, probs) -> float:
    """Expected accepted drafted tokens of a tree shape under positional acceptance (Sequoia):
    the r-th ranked child of an accepted node is the accepted one with probability ``probs[r]``,
    whatever its depth. A node counts with the product of ``probs[rank]`` along its path; ranks past
    ``len(probs)`` count 0. Tokens per step = this + 1 (the target's own token).

    Example: probs [0.6, 0.3], parents [-1, 0, -1] -> 0.6 + 0.6 * 0.6 + 0.3 = 1.26.
    """
    t = TreeTemplate(tuple(int(p) for p in parents))
    value: list[float] = []
    for p, r in zip(t.parents, t.ranks):
        q = probs[r] if r < len(probs) else 0.0
        value.append(q * (1.0 if p < 0 else value[p]))
    return float(sum(value))


def sequoia_tree(num_nodes: int, probs, max_depth: int | None = None) -> TreeTemplate:
    """The tree of ``num_nodes`` drafted nodes that maximises ``expected_accepted`` (Sequoia, Chen et
    al. 2024, dynamic programming over subtree sizes), children in rank order, breadth-first node
    order. ``probs[r]``: probability that the r-th ranked child of an accepted node is accepted
    (non-negative, summing to at most 1); a node never has more than ``len(probs)`` children.
    ``max_depth`` bounds the tree depth (default: no bound). Cached per (n, depth, probs).
    """
    probs = tuple(float(p) for p in probs)
    if num_nodes < 0:
        raise ValueError(f"num_nodes must be >= 0, got {num_nodes}")
    if not probs or any(p < 0 for p in probs) or sum(probs) > 1 + 1e-9:
        raise ValueError(f"probs must be non-negative and sum to at most 1, got {list(probs)}")
    depth = num_nodes if max_depth is None else min(max_depth, num_nodes)
    if num_nodes and depth < 1:
        raise ValueError(f"max_depth must be >= 1 for a non-empty tree, got {max_depth}")
    R = len(probs)
    capacity = sum(R ** d for d in range(1, depth + 1)) if R > 1 else depth
    if num_nodes > capacity:
        raise ValueError(f"{num_nodes} nodes do not fit a tree of depth {depth} with at most {R} "
                         f"children per node ({capacity} nodes at most)")
    return _sequoia_cached(num_nodes, depth, probs)


@functools.lru_cache(maxsize=256)
def _sequoia_cached(n: int, depth: int, probs: tuple[float, ...]) -> TreeTemplate:
    """DP tables, with d = levels a subtree may span and m = nodes to place:

        c[d][a]      best value of a subtree of exactly a nodes (its root counts 1) within d levels
        g[d][i][m]   best value of m nodes spread over the subtrees of child ranks i, i+1, ...
                     (each within d levels), ranks used in order without gaps
        g[d][i][m] = max over a in 1..m of  probs[i] * c[d][a] + g[d][i + 1][m - a]
        c[d + 1][a] = 1 + g[d][0][a - 1]
    The pending token is the root and is not drafted, so the answer is g[depth][0][n].
    Cost ~ depth * R * n^2 / 2 steps (n = 64, R = 8, depth 8: ~0.1 s); hence the cache.
    """
    NEG = float("-inf")
    R = len(probs)
    # c[d][a] for d = 1..depth: subtree of a nodes fitting in d levels
    c = [[NEG] * (n + 1) for _ in range(depth + 1)]
    g_choice: dict[tuple[int, int, int], int] = {}  # (d, i, m) -> size of rank i's subtree

    def alloc(d: int) -> list[list[float]]:
        """g[i][m] for children subtrees of depth <= d (d >= 1), remembering the argmax."""
        g = [[NEG] * (n + 1) for _ in range(R + 1)]
        g[R][0] = 0.0
        for i in range(R - 1, -1, -1):
            g[i][0] = 0.0
            for m in range(1, n + 1):
                best, arg = NEG, 0
                for a in range(1, m + 1):
                    if c[d][a] == NEG or g[i + 1][m - a] == NEG:
                        continue
                    v = probs[i] * c[d][a] + g[i + 1][m - a]
                    if v > best + 1e-12:
                        best, arg = v, a
                g[i][m] = best
                if arg:
                    g_choice[(d, i, m)] = arg
        return g

    if n == 0:
        return TreeTemplate((), None, 0.0)
    c[1][1] = 1.0  # a leaf
    top = None
    for d in range(1, depth + 1):
        g = alloc(d)
        if d == depth:
            top = g
            break
        for a in range(1, n + 1):
            c[d + 1][a] = 1.0 + g[0][a - 1] if g[0][a - 1] != NEG else NEG

    # rebuild: expand (depth budget, subtree size) recursively, then number breadth first
    import networkx as nx

    graph = nx.DiGraph()
    counter = iter(range(n + 1))

    def place_children(node, d: int, m: int) -> None:
        i = 0
        while m > 0:
            a = g_choice[(d, i, m)]
            child = next(counter)
            graph.add_node(child, rank=i)
            graph.add_edge(node, child)
            place_children(child, d - 1, a - 1)
            m -= a
            i += 1

    root = next(counter)
    graph.add_node(root)
    place_children(root, depth, n)
    template = from_networkx(graph)
    return TreeTemplate(template.parents, None, top[0][n])
