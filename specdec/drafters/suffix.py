"""Suffix drafting: a tree of what followed the longest matching suffix, in the text and a corpus.

After SuffixDecoding (Oliaro et al., "SuffixDecoding: A Model-Free Approach to Speeding Up Large
Language Model Inference", 2024; now in vLLM and ArcticInference). Free drafts, like prompt lookup,
but (1) the match is the *longest* suffix of the text found anywhere, not a fixed n-gram, (2) the
draft is a tree: every continuation that followed the matched context, ranked by how often it did,
and (3) besides the row's own prompt and answer it searches shared corpora of earlier outputs: the
stored corpus (the target's stored answers, ``add_documents``) and the memory of this session's answers
(``remember``), kept in generations so that a bounded cache drops its oldest answers by dropping a
whole generation's index, never rebuilding one (``new_generation``); the longest match among them drafts.

The tree: best first by estimated path probability. A child's probability is its count over the sum
of its siblings' counts (the context's continuations), times its parent's; nodes are taken in
decreasing probability while their probability is >= ``min_prob``, up to a size set by the match
length (``tree_limits``: a 1-token match gets 2 nodes, 8 tokens or more the full 16). The sum of
the path probabilities is the expected number of accepted tokens under these counts; the local
tree and the corpus tree are both built and the one with the higher score (the corpus's times
``corpus_weight``) is proposed, as SuffixDecoding picks between its per-request and global trees.

Budget: ``Capabilities.sizes_own_tree``. The drafter sizes its own tree (by match length and
probabilities); the decoder caps it at the tokens still wanted, and the controller's throughput
gate decides per *draft class* whether drafting pays at all -- the class is (source, bucketed match
length) (``match_bucket``), so 1-token matches that do not pay for their verify rows are gated off
while long matches keep drafting. Why these trees and what they reach: docs/decisions/014-suffix-drafter.md.

    drafter = SuffixDrafter()                                   # `--drafter suffix`
    drafter = SuffixDrafter.from_file("data/eagle_answers.jsonl")   # `suffix-corpus`
    out = SpecDecoder(target, drafter).generate(ids)
    drafter.remember(out.sequences[0].tolist())                  # later questions reuse it
"""

from __future__ import annotations

import heapq
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch

from specdec.drafters.base import Capabilities, Commit, Corpus, Drafter, Prompt
# the index and the corpus live in their own modules; their names stay importable from here
from specdec.drafters.corpus import (STORED_ANSWERS_VOCAB, CorpusDoc, SuffixCorpus, default_answers_path,  # noqa: F401
                                     read_corpus, read_text_corpus, read_token_jsonl, stored_answers_fit)
from specdec.drafters.suffix_automaton import SEPARATOR, SuffixAutomaton  # noqa: F401
from specdec.tree import DraftTree

@dataclass(frozen=True)
class SuffixConfig:
    max_nodes: int = 16  # a CPU verify over 17 rows costs ~1.7 plain steps: larger trees rarely pay
    max_depth: int = 16  # deepest drafted token (replayed on stored answers: 16 beats 10 by ~0.1 tau)
    min_match: int = 1  # shorter matches draft nothing; 1-token matches are gated per class anyway
    nodes_per_match: int = 2  # tree size = this x match length (capped): a longer match, a bigger tree
    min_prob: float = 0.1  # a node whose estimated path probability is below this is not drafted
    corpus_weight: float = 1.0  # the corpus tree's score is multiplied by this against the local one

    def __post_init__(self) -> None:
        if self.max_nodes < 0 or self.max_depth < 0 or self.min_match < 1 or self.nodes_per_match < 1:
            raise ValueError(f"need max_nodes, max_depth >= 0, min_match, nodes_per_match >= 1: {self}")
        if not 0.0 <= self.min_prob <= 1.0 or self.corpus_weight < 0:
            raise ValueError(f"need 0 <= min_prob <= 1 and corpus_weight >= 0: {self}")


# --------------------------------------------------------------------------------------------------
# The math: tree size and best-first expansion as pure functions


def match_bucket(matched: int) -> int:
    """The draft class of a match length: 0, 1, 2, 3, then 4-7 -> 4, 8-15 -> 8, 16+ -> 16."""
    if matched < 4:
        return matched
    return 16 if matched >= 16 else (8 if matched >= 8 else 4)


@dataclass(frozen=True)
class TreeLimits:
    nodes: int  # most drafted nodes
    depth: int  # deepest drafted token


def tree_limits(matched: int, config: SuffixConfig) -> TreeLimits:
    """Tree size from the match length: nodes_per_match x matched nodes, depth matched + 1, capped.

    Example (defaults): matched 1 -> (2 nodes, depth 2); 4 -> (8, 5); 8 -> (16, 9); 40 -> (16, 16).
    """
    if matched < config.min_match:
        return TreeLimits(0, 0)
    return TreeLimits(min(config.max_nodes, config.nodes_per_match * matched), min(config.max_depth, matched + 1))


@dataclass(frozen=True)
class Proposal:
    """One row's tree before batching; parents index into tokens, -1 = the pending token."""

    tokens: list[int]  # [N]
    parents: list[int]  # [N]
    probs: list[float]  # [N] estimated path probability of each node
    matched: int  # length of the matched context
    source: str  # "local" (the row's own text) or "corpus"

    @property
    def score(self) -> float:
        """Expected accepted tokens if the counts were the truth: the sum of path probabilities."""
        return sum(self.probs)


def expand_tree(children: Callable[[object], tuple[int, list[tuple[int, int, object]]]], root, limits: TreeLimits,
                min_prob: float) -> tuple[list[int], list[int], list[float]]:
    """Best-first tree over a continuation index: (tokens, parents, path probabilities).

    ``children(key)`` -> (their total count, [(token, count, child key)] by count descending, then token
    ascending: ``SuffixAutomaton.ranked``). Nodes are taken in decreasing path probability (ties: higher
    count, then lower token id, so the result is deterministic) while it is >= ``min_prob``, the node count
    is below ``limits.nodes`` and the depth within ``limits.depth``. A node is pushed only once its parent is
    placed, so parents precede children; of a node's children only as many as nodes are left can ever be
    placed, and siblings are taken in their order, so no more are pushed.

    Example: root followed by 7 three times (then 8 twice) and by 9 once, limits (3 nodes, depth 2),
    min_prob 0.2 -> 7 (p .75), then 8 under 7 (.75 x 1), then 9 (.25):
    tokens [7, 8, 9], parents [-1, 0, -1].
    """
    tokens: list[int] = []
    parents: list[int] = []
    probs: list[float] = []
    if limits.nodes <= 0 or limits.depth <= 0:
        return tokens, parents, probs
    heap: list = []

    def push(key, parent: int, p_parent: float, depth: int) -> None:
        total, kids = children(key)
        for tok, n, child in kids[: limits.nodes - len(tokens)]:
            p = p_parent * (n / total)  # its share of the context's continuations: [3, 1] -> .75, .25
            if p < min_prob or p <= 0:
                break  # the rest are no likelier
            heapq.heappush(heap, (-p, -n, tok, parent, depth, child))

    push(root, -1, 1.0, 1)
    while heap and len(tokens) < limits.nodes:
        neg_p, _, tok, parent, depth, child = heapq.heappop(heap)
        tokens.append(tok)
        parents.append(parent)
        probs.append(-neg_p)
        if depth < limits.depth:
            push(child, len(tokens) - 1, -neg_p, depth + 1)
    return tokens, parents, probs


# --------------------------------------------------------------------------------------------------
# The drafter


class _Row:
    """One sequence's state: its text, its own automaton, and its match in each corpus."""

    __slots__ = ("text", "local", "matches")

    def __init__(self, tokens: list[int]) -> None:
        self.text = list(tokens)
        self.local = SuffixAutomaton(tokens)
        self.matches: dict[int, tuple[int, int, int]] = {}  # corpus serial -> (its version, state, matched)


class SuffixDrafter(Drafter, Corpus):
    # self-sized trees (the controller's gate, per match class, decides); a propose walks the
    # automata and changes nothing (free); deterministic trees (a one-hot q under sampling)
    capabilities = Capabilities(sizes_own_tree=True, free_drafts=True, batches=True, samples=True)

    def __init__(self, config: SuffixConfig = SuffixConfig(), corpus: SuffixCorpus | None = None) -> None:
        self.config = config
        self.corpus = corpus  # the stored corpus (files, ``add_documents``)
        self.memory: list[SuffixCorpus] = []  # what ``remember`` added, in generations, oldest first
        self.rows: list[_Row] = []
        self._proposals: list[Proposal] | None = None  # this step's, computed by draft_class()

    # ---- corpus ----------------------------------------------------------------------------------

    @classmethod
    def from_corpus(cls, sequences: Iterable[Sequence[int]], config: SuffixConfig = SuffixConfig()) -> "SuffixDrafter":
        """A drafter whose corpus holds ``sequences`` (token ids, e.g. earlier outputs)."""
        return cls(config, SuffixCorpus(CorpusDoc(tuple(int(t) for t in s), 0) for s in sequences))

    @classmethod
    def from_file(cls, path: str | os.PathLike, tokenizer=None,
                  config: SuffixConfig = SuffixConfig()) -> "SuffixDrafter":
        """Corpus from a ``.jsonl`` of token ids (``data/eagle_answers.jsonl``'s format) or, any other
        name, a plain-text file with one document per line (needs the target's tokenizer)."""
        return cls(config, SuffixCorpus(read_corpus(path, tokenizer)))

    @classmethod
    def from_stored_answers(cls, config: SuffixConfig = SuffixConfig()) -> "SuffixDrafter":
        """The project's stored answers of the default model as the corpus (registry ``suffix-corpus``)."""
        path = default_answers_path()
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: suffix-corpus needs the repository's data/ directory")
        return cls.from_file(path, config=config)

    def remember(self, sequence: Sequence[int], prompt_len: int = 0) -> CorpusDoc:
        """Add a finished conversation (prompt + answer ids) to the memory's youngest generation: later
        questions, and the same question asked again, draft from it (rows re-match that generation,
        a small index, at their next draft). Returns the document."""
        if not self.memory:
            self.memory.append(SuffixCorpus())
        return self.memory[-1].add(sequence, prompt_len)

    def new_generation(self, keep: int = 1) -> None:
        """Start a new memory generation, keeping the ``keep`` youngest; older ones are dropped whole
        (a bounded cache's eviction: no index is rebuilt)."""
        self.memory = self.memory[len(self.memory) - keep:] if keep > 0 else []
        self.memory.append(SuffixCorpus())

    @property
    def remembered(self) -> list[CorpusDoc]:
        """The documents in memory, oldest first."""
        return [doc for gen in self.memory for doc in gen.docs]

    def add_documents(self, docs: Iterable[CorpusDoc]) -> None:
        """Add documents (``read_token_jsonl`` / ``read_text_corpus``) to the stored corpus, e.g. `--corpus FILE`."""
        if self.corpus is None:
            self.corpus = SuffixCorpus()
        for doc in docs:
            self.corpus.add(doc.ids, doc.prompt_len)

    def build_index(self) -> None:
        """Index the corpora now (they are otherwise indexed at the first draft, ~6 us a token)."""
        for corpus in self._corpora():
            corpus.index

    def exclude_questions(self, questions: Sequence[str], decode: Callable[[list[int]], str]) -> int:
        """Drop conversations whose prompt contains one of ``questions`` from the stored corpus and the
        memory (benchmarks must not draft from answers to their own questions); how many were dropped."""
        return sum(c.exclude_questions(questions, decode) for c in [self.corpus, *self.memory] if c is not None)

    def _corpora(self) -> list[SuffixCorpus]:
        """The corpora a row searches: the stored one, then the memory's generations (non-empty only)."""
        return [c for c in [self.corpus, *self.memory] if c is not None and c.docs]

    # ---- the contract ----------------------------------------------------------------------------

    def begin(self, prompt: Prompt) -> None:
        ids, n = prompt.input_ids.tolist(), prompt.lengths.tolist()
        self.rows = [_Row(row[:k]) for row, k in zip(ids, n)]
        self._proposals = None

    def select(self, rows: list[int]) -> None:
        self.rows = [self.rows[b] for b in rows]
        self._proposals = None

    def accept(self, commit: Commit) -> None:
        corpora = [(c.serial, c.version, c.index) for c in self._corpora()]
        for b, row in enumerate(self.rows):
            for t in commit.new_tokens(b):
                row.text.append(t)
                row.local.extend(t)
                for serial, version, index in corpora:
                    m = row.matches.get(serial)
                    if m is not None and m[0] == version:  # else re-matched whole at the next draft
                        row.matches[serial] = (version, *index.step(m[1], m[2], t))
        self._proposals = None

    def draft_class(self):
        """("local" | "corpus", bucketed match length) of the best row's tree; ("none", 0) if empty."""
        self._proposals = [self._propose_row(row) for row in self.rows]
        best = max(self._proposals, key=lambda p: (len(p.tokens) > 0, p.matched), default=None)
        if best is None or not best.tokens:
            return ("none", 0)
        return (best.source, match_bucket(best.matched))

    def propose(self, budget: int) -> DraftTree:
        proposals = self._proposals if self._proposals is not None else [self._propose_row(r) for r in self.rows]
        self._proposals = None
        trees = [_truncate(p, budget) for p in proposals]
        B, N = len(trees), max((len(t) for t, _ in trees), default=0)
        # Ragged rows: each row's nodes first, then padding (token 0, parent -1) up to the widest.
        # Example, rows with 3 and 1 nodes: parents [[-1, 0, -1], [-1, -1, -1]], num_nodes [3, 1].
        tokens = torch.zeros(B, N, dtype=torch.long)
        parents = torch.full((B, N), -1, dtype=torch.long)
        for b, (tok, par) in enumerate(trees):
            tokens[b, : len(tok)] = torch.tensor(tok, dtype=torch.long)
            parents[b, : len(par)] = torch.tensor(par, dtype=torch.long)
        num = torch.tensor([len(t) for t, _ in trees], dtype=torch.long)
        return DraftTree(tokens, parents, num)

    # ---- per row ---------------------------------------------------------------------------------

    def _corpus_match(self, row: _Row) -> tuple[SuffixAutomaton | None, int, int]:
        """(index, state, matched) of the corpus with the longest match of the row's text (first on ties)."""
        best: tuple[SuffixAutomaton | None, int, int] = (None, 0, 0)
        for corpus in self._corpora():
            index = corpus.index
            m = row.matches.get(corpus.serial)
            if m is None or m[0] != corpus.version:  # a changed corpus (or first use): match once, O(text)
                m = row.matches[corpus.serial] = (corpus.version, *index.match(row.text))
            if best[0] is None or m[2] > best[2]:
                best = (index, m[1], m[2])
        return best

    def _propose_row(self, row: _Row) -> Proposal:
        cfg = self.config
        state, matched = row.local.longest_repeat()
        tok, par, probs = expand_tree(row.local.ranked, state, tree_limits(matched, cfg), cfg.min_prob)
        best = Proposal(tok, par, probs, matched, "local")
        index, state, matched = self._corpus_match(row)
        if index is not None:
            tok, par, probs = expand_tree(index.ranked, state, tree_limits(matched, cfg), cfg.min_prob)
            other = Proposal(tok, par, probs, matched, "corpus")
            if cfg.corpus_weight * other.score > best.score:
                best = other
        return best


def _truncate(p: Proposal, budget: int) -> tuple[list[int], list[int]]:
    """The first ``budget`` nodes (best first, so parents stay in): the decoder's cap."""
    k = max(0, min(budget, len(p.tokens)))
    return p.tokens[:k], p.parents[:k]
