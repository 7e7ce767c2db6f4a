"""Lossless verification under sampling: recursive rejection sampling over a token tree.

Glossary (as in ``verifiers.tree``, after vLLM's rejection sampler):
    p            the target's processed distribution after a block row (``sampling.target_probs``)
    q            the drafter's distribution a node's token was drawn from (``DraftTree.probs``);
                 one-hot at the drafted token when the draft is deterministic (``probs is None``)
    accepted     drafted tokens kept: a path from the root, each step kept with min(1, p(x) / q(x))
    recovered    the token sampled from the residual norm(max(0, p - q)) after a rejection
    bonus        the token sampled from p after the last node of a fully accepted path

Chain (Leviathan et al. 2023; Chen et al. 2023): accept x with probability min(1, p(x)/q(x)); at the
first rejection sample from norm(max(0, p - q)); if all are accepted, sample the bonus from p.

Tree (SpecInfer, Miao et al. 2024; EAGLE's multi-round sampling; Jeon et al. 2024 for siblings
drawn without replacement): at an accepted node, try its children in drafted (index) order. Child x
is accepted with min(1, p(x)/q(x)); on rejection p <- norm(max(0, p - q)) and, because siblings are
drawn without replacement, q <- q with x removed, renormalised. The first accepted child becomes the
node (p and q restart from its own rows); if none is accepted, sample from the residual p. A chain
is the tree in which every node has one child, so one function serves both.

Each output token is then distributed exactly as the target's p given the tokens before it. The
rules are pure functions of tensors; randomness comes only from the ``torch.Generator`` passed in.
"""

from __future__ import annotations

import torch

from specdec.sampling import draw, uniforms
from specdec.tree import DraftTree, node_depths
from specdec.verifiers.tree import Verification


def acceptance_probability(p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """min(1, p(x) / q(x)) elementwise. q(x) = 0 (x could not have been drawn; a deterministic
    sibling already tried) accepts only if p(x) > 0, i.e. never after x's own rejection.
    Example: p_x [0.2, 0.5, 0.0], q_x [0.4, 0.1, 0.3] -> [0.5, 1.0, 0.0]."""
    ratio = p_x / torch.where(q_x > 0, q_x, 1.0)
    return torch.where(q_x > 0, ratio.clamp(max=1.0), (p_x > 0).to(p_x.dtype))


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) over the last dim: where to sample after rejecting a draft from q.
    A row whose residual has no mass (p == q; rejection then had probability 0) keeps p.
    Example: p [0.5, 0.3, 0.2], q [0.2, 0.6, 0.2] -> [1.0, 0.0, 0.0]."""
    r = (p - q).clamp(min=0)
    mass = r.sum(-1, keepdim=True)
    return torch.where(mass > 0, r / torch.where(mass > 0, mass, 1.0), p)


def _renormalise(q: torch.Tensor) -> torch.Tensor:
    mass = q.sum(-1, keepdim=True)
    return q / torch.where(mass > 0, mass, 1.0)


def verify_sampling(probs: torch.Tensor, tree: DraftTree, generator: torch.Generator | None) -> Verification:
    """Recursive rejection sampling of each row's tree; ragged: each row accepts its own count.

    probs: [B, Q, V] the target's processed probabilities at each block row (row 0 = pending token,
    row 1 + i = node i), Q = N + 1. tree.probs: [B, N, V] q per node, or None (deterministic).
    A row with no real nodes samples its token from row 0. Returns the same ``Verification`` as
    ``verify_greedy``.

    One pass over node slots i = 0..N-1 (parents precede children, siblings in index order), every
    row at once. Worked example, one row, tokens [a, b, c], parents [-1, -1, 1]:
        i = 0: a is a child of the root (cur = -1): try it; say rejected -> p0 <- norm(max(0, p0 - q0)),
               q0 loses a
        i = 1: b is a child of the root too: try it against the residual; say accepted -> cur = 1,
               p <- probs row 2 (b's row), nothing removed
        i = 2: c is b's child: try it; say rejected -> p2 <- residual
        end:   next token ~ p2's residual; accepted = [1], num_accepted = 1
    """
    B, Q, V = probs.shape
    N = tree.width
    assert Q == N + 1, f"probs for {Q} rows, tree has {N} nodes"
    if tree.probs is not None:
        assert tree.probs.shape == (B, N, V), f"draft probs {tuple(tree.probs.shape)} != {(B, N, V)}"
    dev = probs.device  # the tree comes to the target's probabilities; uniforms come from the CPU generator
    probs = probs.to(torch.float64)
    tokens, parents, num_nodes = tree.tokens.to(dev), tree.parents.to(dev), tree.num_nodes.to(dev)
    rows = torch.arange(B, device=dev)
    cur = torch.full((B,), -1, dtype=torch.long, device=dev)  # [B] the accepted node we stand on (-1 = pending)
    p_res = probs[:, 0].clone()  # [B, V] target distribution at cur, minus the rejected siblings
    removed = torch.zeros(B, V, dtype=torch.bool, device=dev)  # [B, V] siblings of cur's children already rejected
    depth = node_depths(parents) if N else torch.zeros(B, 0, dtype=torch.long, device=dev)  # [B, N]
    path = torch.full((B, max(N, 1)), -1, dtype=torch.long, device=dev)  # [B, N] accepted node at each depth
    u = uniforms((B, N), generator, dev)  # [B, N] one uniform per node slot
    for i in range(N):
        x = tokens[:, i]  # [B]
        tried = (parents[:, i] == cur) & (i < num_nodes)  # [B] node i is a child of cur
        # on the CPU skip slots no row stands above (a host sync elsewhere costs more than the slot)
        if dev.type == "cpu" and not bool(tried.any()):
            continue
        if tree.probs is None:  # deterministic draft: q is one-hot at x
            q = torch.nn.functional.one_hot(x, V).to(torch.float64)
        else:
            q = tree.probs[:, i].to(device=dev, dtype=torch.float64)
        q = _renormalise(q.masked_fill(removed, 0.0))  # [B, V] without the siblings already tried
        a = acceptance_probability(p_res[rows, x], q[rows, x])  # [B]
        acc = tried & (u[:, i] < a)
        rej = tried & ~acc
        # rejected rows: p <- residual, x joins the removed siblings
        p_res = torch.where(rej[:, None], residual(p_res, q), p_res)
        removed[rows[rej], x[rej]] = True
        # accepted rows: stand on node i; p restarts from its row, its children have no history
        p_res = torch.where(acc[:, None], probs[:, i + 1], p_res)
        removed[acc] = False
        cur = torch.where(acc, i, cur)
        d = depth[:, i] - 1
        path[rows[acc], d[acc]] = i
    next_token = draw(p_res, generator)  # [B]
    num_accepted = torch.zeros(B, dtype=torch.long, device=dev)  # [B] = depth of cur (0 at the pending token)
    if N:
        num_accepted = torch.where(cur >= 0, depth.gather(1, cur.clamp(min=0)[:, None])[:, 0], 0)
    K = int(num_accepted.max()) if B else 0  # host sync: the path length decides the output width
    accepted = path[:, :K]
    accepted = torch.where(torch.arange(K, device=dev)[None, :] < num_accepted[:, None], accepted, -1)
    return Verification(accepted, num_accepted, next_token)
