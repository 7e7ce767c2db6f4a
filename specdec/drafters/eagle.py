"""EAGLE drafting: a one-layer head autoregresses over the target's features (EAGLE-1), expanding a
dynamic token tree ranked by cumulative draft log-probability (EAGLE-2).

References: Li et al., "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty" (2024)
and "EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees" (2024); the public
SafeAILab/EAGLE code (``eagle/model/cnets1.py``) for the layout below.

The head and its files: ``drafters.eagle_head``.

Feature alignment with the decoder (P prompt tokens x_0..x_P-1; the pending token is the last
committed token, which the target has not run yet)::

    Prompt.hidden  [B, P-1, D] = f_0..f_P-2             pairs (f_t, x_t+1), t = 0..P-2
    Commit.hidden  [B, A+1, D]: hidden[j] produced tokens[j] -> pairs (hidden[j], tokens[j])

The head's KV store (a one-layer BMC store) holds one row per pair, at position t (row = position).
Pairs become known one step late (a token's feature needs a target forward), so each propose()
first feeds the pairs learnt since the last one, then grows the tree: a node of depth d is fed as
the pair (its parent's head output, its token) at position S - 1 + d (S = pairs in the store).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.config import current as current_runtime
from specdec.drafters.base import Capabilities, Commit, Drafter, Prompt
# the head and its files live in their own module; their names stay importable from here
from specdec.drafters.eagle_head import (HEAD_FILE, HEAD_FORMAT, HEAD_JSON, EagleHead, EagleHeadConfig,  # noqa: F401
                                         causal_bias, export_eagle, import_eagle, load_head, save_head)
from specdec.introspect import text_config
from specdec.kv.bmc import BMCCache, BMCConfig
from specdec.sampling import SamplingParams, target_probs
from specdec.tree import DraftTree

LN2 = 0.6931471805599453  # a sampled tree's selection: each later draw of a node's children ranks ln 2 lower


@dataclass(frozen=True)
class EagleConfig:
    # Small trees: on a CPU a verify block's price grows with its rows, and each level is one more
    # head forward (EAGLE-2 on a GPU: 60 nodes, depth 6, top-k 10). Why 6 / 3 / 3:
    # docs/decisions/012-eagle-head.md
    total_tokens: int = 6  # nodes per tree
    depth: int = 3  # tree levels, i.e. the longest acceptable draft
    top_k: int = 3  # children per expanded node, and nodes expanded per level
    bmc: BMCConfig = BMCConfig(period=64)  # the head's own one-layer KV store
    # the head's linears (all but fc, whose weight names the head's dtype and device) as blocks of this
    # GGUF format on a CPU with the block kernel: a draft streams a quarter of the bytes
    # (docs/decisions/017-eagle3.md); the drafts stay drafts, exactness is the verifier's. None: fp32
    head_blocks: str | None = "Q8_0"

    def __post_init__(self) -> None:
        if min(self.total_tokens, self.depth, self.top_k) < 1:
            raise ValueError(f"EAGLE needs total_tokens, depth, top_k >= 1, got {self}")


def _draw_penalty(n: int, dtype, device) -> torch.Tensor:
    """[n] a sampled node's place in its parent's draw order, as a score: the i-th draw ranks i ln 2 lower."""
    return -LN2 * torch.arange(1, n + 1, dtype=dtype, device=device)


@dataclass
class _Pool:
    """Every candidate node of a growing tree, in pool order: the root's children, then each fed level's
    children (a parent always before its children). One [B, n] entry per level (n: nodes it added)."""
    tok: list[torch.Tensor]  # [B, n] target token ids
    score: list[torch.Tensor]  # [B, n] cumulative draft log-prob: the greedy ranking
    sel: list[torch.Tensor]  # [B, n] selection score from the ancestors' draws: the sampled ranking
    parent: list[torch.Tensor]  # [B, n] the parent's pool index, -1 under the root
    dist: list[torch.Tensor]  # [B, n] host; sampling: the row of `dists` each node was drawn from
    dists: list[torch.Tensor] | None  # sampling: q [B, F, M] of each fed level, the root's first; greedy None
    size: int  # nodes in the pool


@dataclass
class _Frontier:
    """The F nodes per row fed next, with T tree rows (the levels fed before them) in the store."""
    pool: torch.Tensor  # [B, F] pool index
    feat: torch.Tensor  # [B, F, D] the parent's head output
    tok: torch.Tensor  # [B, F] target token ids
    score: torch.Tensor  # [B, F] cumulative draft log-prob
    sel: torch.Tensor  # [B, F] selection score
    anc: torch.Tensor  # [B, F, T] bool: the fed tree rows that are the node's ancestors


# ------------------------------------------------------------------------------------ the drafter

class EagleDrafter(Drafter):
    """EAGLE-2 dynamic trees from an ``EagleHead``: up to ``min(total_tokens, budget)`` nodes.

    One propose(): feed the new pairs (one head forward over a chain), then ``depth - 1`` head
    forwards of ``top_k`` nodes each: per level, the ``top_k`` best frontier nodes (by cumulative
    draft log-prob) are fed and each offers its ``top_k`` best children. Finally the best nodes of
    the whole candidate pool form the tree (a child never outscores its parent, and ties keep the
    parent first, so the chosen set is closed under ancestors).
    """

    # EAGLE-2 sizes its tree by draft scores, up to total_tokens; sampled trees carry their q
    capabilities = Capabilities(reads_hidden_states=True, sizes_own_tree=True, batches=True, samples=True)

    @classmethod
    def default(cls, target, config: EagleConfig = EagleConfig()) -> "EagleDrafter":
        """The head packaged with specdec (trained here for SmolLM2-135M-Instruct, the default model)."""
        return make_eagle(target, PACKAGED_HEAD, config)

    def __init__(self, target, head: EagleHead, config: EagleConfig = EagleConfig()) -> None:
        self.head = head.eval()
        self.config = config
        self.vocab_size = head.vocab_size
        if head.hidden_size != text_config(target).hidden_size:
            raise ValueError(f"EAGLE head of width {head.hidden_size} does not fit a target of hidden "
                             f"size {text_config(target).hidden_size}")
        self.cache: BMCCache | None = None
        self._feats: list[list[torch.Tensor]] = []  # per row: pair features not yet in the store
        self._toks: list[list[int]] = []  # per row: their tokens
        self._root: torch.Tensor | None = None  # [B, D] head output at each row's last stored pair
        self._has_root: torch.Tensor | None = None  # [B] bool: the row has stored at least one pair
        self.sampling: SamplingParams | None = None  # from the prompt: None = greedy top-k trees
        self.generator: torch.Generator | None = None
        self._catch_up = 0.0  # seconds the last propose spent catching up on pairs (catch_up_seconds)
        self._resume = 0.0  # ... of which on pairs committed after the prompt (resume_seconds)

    def torch_modules(self) -> list:
        return [self.head]

    def catch_up_seconds(self) -> float:
        return self._catch_up

    def resume_seconds(self) -> float:
        return self._resume

    # -- the three methods of the contract

    def begin(self, prompt: Prompt) -> None:
        B, P = prompt.input_ids.shape
        self.sampling, self.generator = prompt.sampling, prompt.generator
        p = self.head.fc.weight
        self.cache = BMCCache(1, B, self.config.bmc, p.dtype, p.device)
        self._root = None
        lengths = prompt.lengths.tolist()
        if prompt.hidden is None and max(lengths) > 1:
            raise ValueError("EagleDrafter needs the target's hidden states (Prompt.hidden): run it "
                             "through SpecDecoder, which fills them for drafters that ask")
        self._feats = [[prompt.hidden[b, : n - 1]] if n > 1 else [] for b, n in enumerate(lengths)]
        self._toks = [prompt.input_ids[b, 1:n].tolist() for b, n in enumerate(lengths)]

    def accept(self, commit: Commit) -> None:
        if commit.hidden is None:
            raise ValueError("EagleDrafter needs the target's hidden states (Commit.hidden)")
        for b, n in enumerate(commit.num_new.tolist()):
            self._feats[b].append(commit.hidden[b, :n])  # hidden[j] is the feature before tokens[j]
            self._toks[b].extend(commit.tokens[b, :n].tolist())
        self._catch_up = self._resume = 0.0

    def select(self, rows: list[int]) -> None:
        self.cache.select(rows)
        self._feats = [self._feats[b] for b in rows]
        self._toks = [self._toks[b] for b in rows]
        if self._root is not None:
            idx = torch.tensor(rows, device=self._root.device)
            self._root, self._has_root = self._root[idx], self._has_root[idx]

    @torch.inference_mode()
    def propose(self, budget: int) -> DraftTree:
        B = len(self._toks)
        # more pairs than one step can commit (a prompt, or the steps of a pause): a catch-up, not the
        # price of this tree; a step's own 1-4 pairs are part of every draft's cost
        behind = max((len(t) for t in self._toks), default=0) > self.config.depth + 1
        prompt = self._root is None  # the first feed of a generation holds the prompt's pairs
        t0 = time.perf_counter()
        self._feed_pairs()
        self._catch_up = time.perf_counter() - t0 if behind else 0.0
        self._resume = 0.0 if prompt else self._catch_up
        n_nodes = min(self.config.total_tokens, budget)
        if n_nodes <= 0 or self._root is None or not bool(self._has_root.all()):
            # nothing to draft from yet: a one-token prompt has no feature before its first step
            return DraftTree.empty(B)
        return self._grow_tree(n_nodes)

    # -- stages

    def _feed_pairs(self) -> None:
        """Run the pairs learnt since the last call through the head, as one chain per row, and keep
        their rows; the head output at each row's last pair becomes the tree's root."""
        counts = [len(t) for t in self._toks]
        if max(counts, default=0) == 0:
            return
        B, Q = len(counts), max(counts)
        dev, dtype = self.head.fc.weight.device, self.head.fc.weight.dtype
        feats = torch.zeros(B, Q, self.head.feature_size, dtype=dtype, device=dev)
        toks = torch.zeros(B, Q, dtype=torch.long, device=dev)
        for b, (f, t) in enumerate(zip(self._feats, self._toks)):
            if t:
                feats[b, : len(t)] = torch.cat([x.to(device=dev, dtype=dtype) for x in f])  # prompt rows: host
                toks[b, : len(t)] = torch.tensor(t, device=dev)
        inputs = self.cache.prepare_chain(Q)
        n = torch.tensor(counts, device=dev)
        # every pair's K/V into the store; the head's output only at each row's last pair (the root)
        last = self.head.draft(self.head.fuse(feats), toks, inputs.position_ids, inputs.attention_mask, self.cache,
                               last=(n - 1).clamp(min=0))[:, 0]  # [B, D]
        self.cache.commit([list(range(c)) for c in counts])
        has = n > 0  # [B]
        if self._root is None:
            self._root = torch.zeros_like(last)
            self._has_root = torch.zeros(B, dtype=torch.bool, device=dev)
        self._root = torch.where(has[:, None], last, self._root)
        self._has_root |= has
        self._feats = [[] for _ in range(B)]
        self._toks = [[] for _ in range(B)]

    def _log_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.head.logits(hidden)
        return torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)

    def _children(self, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """k children of each fed node: hidden [B, F, D] -> (scores [B, F, k], draft ids [B, F, k],
        q [B, F, M] float64 or None).

        Greedy: the k most likely tokens, scored by log-prob. Sampling: k tokens drawn *without
        replacement* from the head's distribution processed as the target's is (temperature, top-k,
        top-p: specdec.sampling), in draw order, by the Gumbel-top-k trick (Kool et al. 2019: the
        order of log q + Gumbel noise is a sequential draw without replacement); q is handed to the
        verifier. A child's score is its log q, capped by its earlier-drawn siblings' (a running
        minimum), so the tree's top-scored nodes take a node's children as a prefix of its draws,
        which is what the verifier's without-replacement rule assumes. Draws past the tokens with
        q > 0 (top-k / top-p cut the rest) score -inf and never enter the tree.
        Example, k = 2: q = [.5, .3, .2, 0], noise orders the draws 2, 0 -> ids [2, 0], scores
        [log .2, min(log .5, log .2)] = [log .2, log .2].
        """
        if self.sampling is None:
            lp = self._log_probs(hidden)
            score, idx = lp.topk(min(k, lp.shape[-1]), dim=-1)
            return score, idx, None
        logits = self.head.logits(hidden)  # [B, F, M]
        q = target_probs(logits.cpu(), self.sampling)  # [B, F, M] float64
        logq = q.log()
        u = torch.rand(q.shape, dtype=torch.float64, generator=self.generator).clamp_(min=1e-300)
        keys = logq - (-u.log()).log()  # log q + Gumbel(0, 1); -inf where q = 0
        kk = min(k, q.shape[-1])
        top, idx = keys.topk(kk, dim=-1)  # [B, F, kk] draw order
        score = logq.gather(-1, idx).masked_fill(top == float("-inf"), float("-inf")).cummin(dim=-1).values
        dev = hidden.device
        return score.to(device=dev, dtype=torch.float32), idx.to(dev), q

    def _grow_tree(self, n_nodes: int) -> DraftTree:
        """EAGLE-2 expansion and reranking. Shapes: B rows, k = top_k, T fed tree rows so far.

        Worked example, k = 2, depth 3: level 1 = the root's 2 best tokens (pool 0, 1); both are fed
        (T = 2), each offers 2 children (pool 2..5, scores = parent + child log-prob); the 2 best of
        those are fed (T = 4) and offer 4 more (pool 6..9). The tree = the best n_nodes of pool 0..9.
        """
        stable = list(self.cache.lengths)  # pairs per row; tree rows go after them and are dropped at the end
        S = torch.tensor(stable, device=self._root.device)  # [B]
        pool, front = self._root_children()
        for level in range(1, min(self.config.depth, n_nodes)):  # feed nodes of depth `level`, collect depth level + 1
            front = self._expand(pool, front, level, S)
        self.cache.rollback(stable)  # drop the tree rows: next step re-feeds accepted tokens as pairs
        return self._rerank(pool, n_nodes)

    def _root_children(self) -> tuple[_Pool, _Frontier]:
        """Level 1: the root's k best (sampling: first drawn) tokens, as the pool's first entries and the
        first frontier."""
        B, dev = self._root.shape[0], self._root.device
        score, idx, q_root = self._children(self._root[:, None], self.config.top_k)  # [B, 1, k1]
        score, idx = score[:, 0], idx[:, 0]  # [B, k1]
        k1 = idx.shape[1]
        tok = self.head.to_target_ids(idx)  # [B, k1]
        # sampling: which nodes enter the tree may depend on their ancestors' draws only, never on their
        # own or their siblings' (the verifier conditions on the path; a node kept for its own q would
        # bias the output): a node's selection score is its parent's cumulative log q plus a fixed penalty
        # for its place in the draw order, capped by its parent's selection score (ancestors first)
        sel = torch.where(score > float("-inf"), _draw_penalty(k1, score.dtype, dev).expand(B, k1), float("-inf"))
        pool = _Pool(tok=[tok], score=[score], sel=[sel],
                     parent=[torch.full((B, k1), -1, dtype=torch.long, device=dev)],
                     dist=[torch.zeros(B, k1, dtype=torch.long)], dists=None if q_root is None else [q_root], size=k1)
        front = _Frontier(pool=torch.arange(k1, device=dev).expand(B, k1), feat=self._root[:, None].expand(B, k1, -1),
                          tok=tok, score=score, sel=sel, anc=torch.zeros(B, k1, 0, dtype=torch.bool, device=dev))
        return pool, front

    def _feed_level(self, front: _Frontier, level: int, S: torch.Tensor) -> torch.Tensor:
        """The frontier's head outputs [B, F, D]: its nodes enter the store after the T tree rows fed
        before them (kept as committed), at position S - 1 + level, each seeing the pairs and its own
        ancestors only."""
        B, F = front.pool.shape
        T = front.anc.shape[2]
        dev = S.device
        inputs = self.cache.prepare(torch.eye(F, dtype=torch.bool, device=dev).expand(B, F, F),
                                    torch.zeros(B, F, dtype=torch.long, device=dev))
        bias = inputs.attention_mask  # [B, 1, F, L]; earlier tree rows sit at S + [0, T)
        if T:  # they count as committed for the store; a node sees only its own ancestors
            cols = (S[:, None] + torch.arange(T, device=dev))[:, None, :].expand(B, F, T)
            vals = torch.zeros(B, F, T, dtype=bias.dtype, device=dev)
            bias[:, 0].scatter_(2, cols, vals.masked_fill_(~front.anc, torch.finfo(bias.dtype).min))
        pos = (S - 1 + level)[:, None].expand(B, F)
        h = self.head.draft(front.feat, front.tok, pos, bias, self.cache)  # [B, F, D]
        self.cache.commit([list(range(F))] * B)  # keep in place (no copy) for the deeper levels
        return h

    def _expand(self, pool: _Pool, front: _Frontier, level: int, S: torch.Tensor) -> _Frontier:
        """Feed the frontier (the nodes of depth ``level``), add each one's children to the pool, and
        return the next frontier: the k best of those children."""
        B, F = front.pool.shape
        T = front.anc.shape[2]
        dev = S.device
        k = self.config.top_k
        h = self._feed_level(front, level, S)  # [B, F, D]
        child_lp, child_idx, q = self._children(h, k)  # [B, F, kc]
        kc = child_idx.shape[-1]
        if pool.dists is not None:
            first = sum(d.shape[1] for d in pool.dists)  # dist row of this level's first fed node
            pool.dist.append((first + torch.arange(F))[None, :, None].expand(B, F, kc).reshape(B, F * kc))
            pool.dists.append(q)
        cu = front.score[:, :, None] + child_lp  # [B, F, kc] cumulative log-prob
        sel = torch.minimum(front.sel[:, :, None], front.score[:, :, None] + _draw_penalty(kc, cu.dtype, dev))
        sel = torch.where(child_lp > float("-inf"), sel, float("-inf")).reshape(B, F * kc)  # [B, F * kc]
        pool.sel.append(sel)
        pool.tok.append(self.head.to_target_ids(child_idx).reshape(B, F * kc))
        pool.score.append(cu.reshape(B, F * kc))
        pool.parent.append(front.pool[:, :, None].expand(B, F, kc).reshape(B, F * kc))
        # next frontier: the k best children of this level
        nf = min(k, F * kc)
        best, pick = cu.reshape(B, F * kc).topk(nf, dim=-1)  # [B, nf]
        slot = pick // kc  # which fed node is the parent
        own_row = torch.nn.functional.one_hot(T + slot, T + F).bool()  # [B, nf, T + F]
        anc = torch.cat([front.anc.gather(1, slot[:, :, None].expand(B, nf, T)),
                         torch.zeros(B, nf, F, dtype=torch.bool, device=dev)], 2) | own_row
        nxt = _Frontier(pool=pool.size + pick, feat=h.gather(1, slot[:, :, None].expand(B, nf, h.shape[-1])),
                        tok=pool.tok[-1].gather(1, pick), score=best, sel=sel.gather(1, pick), anc=anc)
        pool.size += F * kc
        return nxt

    def _rerank(self, pool: _Pool, n_nodes: int) -> DraftTree:
        """The tree: the best ``n_nodes`` of the pool (greedy: by cumulative log-prob; sampling: by
        selection score), in pool order, parents as tree slots."""
        B, dev = self._root.shape[0], self._root.device
        n_pool = pool.size
        tokens, parents = torch.cat(pool.tok, 1), torch.cat(pool.parent, 1)
        scores = torch.cat(pool.sel if pool.dists is not None else pool.score, 1)
        N = min(n_nodes, n_pool)
        # stable sort: on equal scores the earlier pool entry (a parent before its child) wins
        order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :N]
        # -inf scores (sampling: draws past the tokens with q > 0) are not nodes; real ones first, then
        # pool order, so parents precede children and a row's padding comes last
        real = scores.gather(1, order) > float("-inf")  # [B, N] a prefix of each row (order is by score)
        chosen = torch.sort(order + (~real) * n_pool, dim=1).values % n_pool  # [B, N]
        slot_of = torch.full((B, n_pool), -1, dtype=torch.long, device=dev)
        slot_of.scatter_(1, chosen, torch.arange(N, device=dev).expand(B, N))
        par_pool = parents.gather(1, chosen)  # [B, N]
        par = torch.where(par_pool < 0, -1, slot_of.gather(1, par_pool.clamp(min=0)))
        par = torch.where(real, par, -1)
        assert bool(((par_pool < 0) | (par >= 0) | ~real).all()), "EAGLE tree lost a parent"
        probs = None if pool.dists is None else self._node_probs(pool, chosen)
        return DraftTree(tokens.gather(1, chosen).cpu(), par.cpu(), real.sum(1).cpu(), probs)

    def _node_probs(self, pool: _Pool, chosen: torch.Tensor) -> torch.Tensor:
        """Sampling: node i's q [B, N, V], the distribution it was drawn from, over the target vocab."""
        B, N = chosen.shape
        rows = torch.cat(pool.dist, 1).gather(1, chosen.cpu())  # [B, N]
        q = torch.cat(pool.dists, 1)  # [B, R, M]
        q = q.gather(1, rows[:, :, None].expand(B, N, q.shape[-1]))  # [B, N, M]
        if self.head.draft_vocab is None:
            return q
        full = torch.zeros(B, N, self.vocab_size, dtype=q.dtype)
        return full.index_copy_(2, self.head.draft_vocab.cpu(), q)


# --------------------------------------------------------------------------------- the registry

PACKAGED_HEAD = Path(__file__).resolve().parent.parent / "data" / "eagle_head"


def make_eagle(target, head_path: str | os.PathLike | None = None,
               config: EagleConfig = EagleConfig()) -> EagleDrafter:
    """An EagleDrafter from ``head_path``, else the runtime configuration's ``eagle_head``
    ($SPECDEC_EAGLE_HEAD at the CLI), else the packaged head."""
    path = head_path or current_runtime().eagle_head or PACKAGED_HEAD
    if not (Path(path) / HEAD_JSON).is_file():
        raise ValueError(
            f"no EAGLE head at {path}: train one for this target with `specdec train-eagle --model "
            "MODEL --out DIR` (self-distillation, offline), then pass it with SPECDEC_EAGLE_HEAD=DIR/head "
            "(or copy DIR/head to specdec/data/eagle_head to make it the default)")
    return EagleDrafter(target, lean_head(load_head(path, target), config), config)


def lean_head(head, config: EagleConfig):
    """A freshly loaded head with its linears as ``config.head_blocks`` blocks where that pays (fp32 on a
    CPU whose block kernel is built), else as it is."""
    from specdec.quant import quantize_model
    from specdec.runtime import kernels

    p = head.fc.weight
    if config.head_blocks is None or p.device.type != "cpu" or p.dtype != torch.float32 or kernels.extension() is None:
        return head
    return quantize_model(head, config.head_blocks, skip=("fc",))
