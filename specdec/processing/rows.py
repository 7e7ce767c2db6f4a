"""What one sequence's logits go through before a token is chosen, and what is reported of them.

    opts = Processing(frequency_penalty=0.5, logit_bias={42: -100}, grammar=grammar, logprobs=3)
    row = RowProcessor(prompt_ids, opts)          # one per sequence, following its committed tokens
    ok, masks = row.check_tree(parents, tokens)    # the draft's nodes the grammar allows (cut the rest)
    scores = row.scores(logits, parents, tokens, masks)   # [1 + N, V] processed, each row on its own path
    row.advance(new_tokens)

The processed target, the one speculation is exact against, applies to the float32 logits of every
block row, in this order (each skipped at its neutral value):

    1. repetition_penalty r (HF's RepetitionPenaltyLogitsProcessor): each token already in the prompt
       or the output, its score s becomes s * r if s < 0 else s / r;
    2. frequency_penalty f and presence_penalty p (OpenAI's, as vLLM applies them): s -= f * c + p * (c > 0)
       where c counts the token in the output (not the prompt);
    3. logit_bias (OpenAI's): s += bias[token];
    4. the grammar: tokens it does not allow get -inf;

then greedy takes the argmax, sampling applies temperature / top-k / top-p (``specdec.sampling``).
Row j of a draft block is scored with the counts and the grammar state of *its own path* (the
committed tokens, then the drafted tokens from the root down to node j - 1), so a node's score is
what plain decoding would compute had that path been committed: every step is elementwise per row,
which keeps a row's bits independent of the block around it. Logprobs are the log-softmax of these
scores (greedy) or the log of the sampled distribution (after the warpers), at each committed token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec.processing.grammar import Grammar, Masks

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs


@dataclass(frozen=True)
class Processing:
    """A sequence's processing options; the defaults change nothing."""

    repetition_penalty: float = 1.0  # > 0; HF's, over prompt and output; 1 = off
    frequency_penalty: float = 0.0  # OpenAI's, over the output; 0 = off
    presence_penalty: float = 0.0  # OpenAI's, over the output; 0 = off
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its score
    grammar: Grammar | None = None  # a compiled constraint (``specdec.processing.grammar``)
    logprobs: int | None = None  # report logprobs: None = no; k >= 0: the chosen token's and the k most likely

    def __post_init__(self) -> None:
        if not self.repetition_penalty > 0:  # also NaN
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {v}")
        for tok, bias in self.logit_bias.items():
            if not isinstance(tok, int) or tok < 0:
                raise ValueError(f"logit_bias keys are token ids (ints >= 0), got {tok!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for token {tok}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs (top tokens reported) must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")

    @property
    def penalizes(self) -> bool:
        """Whether a penalty reads the tokens seen and their counts (else nobody keeps them)."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def changes_scores(self) -> bool:
        """Whether any step applies (else the logits go to the verifier untouched)."""
        return self.penalizes or bool(self.logit_bias) or self.grammar is not None

    def check_vocab(self, vocab_size: int) -> None:
        """A ValueError names a biased token outside the model's vocabulary."""
        bad = sorted(t for t in self.logit_bias if t >= vocab_size)
        if bad:
            raise ValueError(f"logit_bias names token ids {bad[:5]} outside the vocabulary of {vocab_size} tokens")
        if self.grammar is not None and self.grammar.vocabulary.vocab_size != vocab_size:
            raise ValueError(f"the grammar was compiled for {self.grammar.vocabulary.vocab_size} tokens, "
                             f"the model has {vocab_size}")


@dataclass(frozen=True)
class TokenLogprob:
    """A committed token's log-probability under the processed target, and the most likely tokens there."""

    token: int
    logprob: float
    top: list[tuple[int, float]]  # (token, logprob), most likely first, allowed tokens only; empty when 0 asked


class RowProcessor:
    """One sequence's processing state: its prompt and output counts and its grammar state."""

    def __init__(self, prompt: list[int], options: Processing, vocab_size: int) -> None:
        options.check_vocab(vocab_size)
        self.options = options
        self.vocab_size = vocab_size
        # what a penalty reads, kept only where one does
        self.seen: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None
        if options.penalizes:
            self.seen = torch.zeros(vocab_size, dtype=torch.bool)  # [V] in the prompt or the output
            self.seen[torch.tensor(prompt, dtype=torch.long)] = True
            self.counts = torch.zeros(vocab_size, dtype=torch.float32)  # [V] occurrences in the output
        self.bias = None  # [V] float32
        if options.logit_bias:
            self.bias = torch.zeros(vocab_size, dtype=torch.float32)
            for tok, b in options.logit_bias.items():
                self.bias[tok] = b
        self.grammar = options.grammar.start() if options.grammar is not None else None

    def advance(self, tokens: list[int]) -> None:
        """Tokens committed to the sequence (after the ones before)."""
        if not tokens:
            return
        if self.options.penalizes:
            ids = torch.tensor(tokens, dtype=torch.long)
            self.seen[ids] = True
            self.counts.index_put_((ids,), torch.ones(len(tokens), dtype=torch.float32), accumulate=True)
        if self.grammar is not None:
            self.grammar.consume(tokens)

    def forced(self, limit: int) -> list[int]:
        """Tokens the grammar forces next (none without a grammar)."""
        return self.grammar.forced(limit) if self.grammar is not None else []

    def opening(self, guess) -> str | None:
        """How the grammar's chain would open (``GrammarState.opening``); None without a grammar."""
        return self.grammar.opening(guess) if self.grammar is not None else None

    def draft(self, budget: int, guess) -> list[int]:
        """A chain the grammar allows: its forced tokens and the guesses it accepts (``GrammarState.draft``);
        none without a grammar."""
        return self.grammar.draft(budget, guess) if self.grammar is not None else []

    def check_tree(self, parents: list[int], tokens: list[int]) -> tuple[list[bool], Masks | None]:
        """Which real nodes the grammar allows on their paths, and the allowed tokens after each of the
        1 + N block rows (None without a grammar: every node kept)."""
        if self.grammar is None:
            return [True] * len(tokens), None
        masks, ok = self.grammar.tree_masks(parents, tokens)
        return ok, masks

    def scores(self, logits: torch.Tensor, parents: list[int], tokens: list[int],
               masks: Masks | None) -> torch.Tensor:
        """logits [Q, V] (row 0: after the committed tokens; row 1 + i: after node i; Q >= 1 + N, rows past
        the real nodes are padding and left as they come) -> float32 scores [Q, V] processed on each row's
        path. masks: ``check_tree``'s, for these same nodes."""
        opts = self.options
        if not opts.changes_scores:
            return logits.to(torch.float32)
        scores = logits.to(torch.float32, copy=True)  # one copy, then processed in place
        R = 1 + len(tokens)  # the real rows
        head = scores[:R]
        if opts.penalizes:
            counts = self.counts.expand(R, -1).clone()  # [R, V] output counts on each row's path
            rows, toks = _path_pairs(parents, tokens)
            if rows:
                counts.index_put_((torch.tensor(rows), torch.tensor(toks)), torch.ones(len(rows)), accumulate=True)
            if opts.repetition_penalty != 1.0:
                seen = self.seen.expand(R, -1) | (counts > 0)
                r = opts.repetition_penalty
                torch.where(seen, torch.where(head < 0, head * r, head / r), head, out=head)
            if opts.frequency_penalty != 0.0:
                head.sub_(opts.frequency_penalty * counts)
            if opts.presence_penalty != 0.0:
                head.sub_(opts.presence_penalty * (counts > 0).to(torch.float32))
        if self.bias is not None:
            head.add_(self.bias)
        if masks is not None:
            masks.apply_(head)
        return scores

    def logprobs(self, logprob_rows: torch.Tensor, tokens: list[int]) -> list[TokenLogprob]:
        """logprob_rows [K, V] (the log-distribution each committed token was chosen from) and the K
        tokens -> one ``TokenLogprob`` each, with ``options.logprobs`` top tokens."""
        k = self.options.logprobs or 0
        chosen = logprob_rows.gather(1, torch.tensor(tokens, dtype=torch.long)[:, None])[:, 0].tolist()
        if k:
            top_v, top_i = logprob_rows.topk(k, dim=-1)
            # tokens the processing ruled out (-inf) are not alternatives: fewer than k where fewer are allowed
            tops = [[(t, lp) for t, lp in zip(i, v) if lp != float("-inf")] for i, v in zip(top_i.tolist(), top_v.tolist())]
        else:
            tops = [[] for _ in tokens]
        return [TokenLogprob(t, lp, top) for t, lp, top in zip(tokens, chosen, tops)]


def _path_pairs(parents: list[int], tokens: list[int]) -> tuple[list[int], list[int]]:
    """(block row, token) for every drafted token on each row's path: row 1 + i's path is node i and
    its ancestors. Example: parents [-1, 0], tokens [5, 6] -> rows [1, 2, 2], tokens [5, 6, 5]."""
    rows, toks = [], []
    for i in range(len(tokens)):
        j = i
        while j >= 0:
            rows.append(1 + i)
            toks.append(tokens[j])
            j = parents[j]
    return rows, toks
