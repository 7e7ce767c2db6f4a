"""Constraints: the target's choices restricted to what a grammar allows, through llguidance.

    c = Constraint.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
    grammar = c.compile(Vocabulary.of(tokenizer, vocab_size=49152, eos=[2]))   # checked here
    state = grammar.start()              # one per sequence: follows its committed tokens
    state.allowed()                      # [V] bool: tokens the grammar allows next
    state.consume([17, 4])               # committed tokens (each must have been allowed)
    state.forced()                       # tokens the grammar forces next (free drafts)
    cache = GrammarCache(64)             # a server's: one compile per (constraint, vocabulary), then shared
    cache.compile(c, grammar.vocabulary) # a Grammar, the same one for every request that repeats c

The engine is llguidance (why, and what xgrammar measured: docs/decisions/020-constraints.md); no
grammar is parsed here. A JSON schema, JSON object mode, a regular expression, a Lark grammar and a
GBNF grammar are the five kinds. The grammar's state follows the *committed* tokens only: a draft
tree is checked node by node by walking down each node's path and rolling back, a chain by the engine's
one call for a draft's masks (``GrammarState.tree_masks``), so a rejected draft leaves no trace in it.

Dimensions: V the target's vocabulary (the model's, which may exceed the tokenizer's), N draft nodes.
"""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from specdec.runtime import kernels

KINDS = ("json_schema", "json_object", "regex", "lark", "gbnf")
# JSON object mode: any JSON object (OpenAI's response_format {"type": "json_object"})
ANY_OBJECT = {"type": "object"}


class ConstraintError(ValueError):
    """A constraint that does not compile (its kind and llguidance's message say why)."""


@functools.cache
def _llguidance():
    """The engine, imported on first use (a command that constrains nothing never loads it)."""
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch
    except ImportError as e:  # a dependency of the package: only a broken install lacks it
        raise ImportError("constraints need the llguidance package (pip install llguidance)") from e
    return llguidance


@functools.cache
def _executor():
    """The engine's executor for a chain's masks: one thread (one matcher's masks are computed in order;
    torch keeps the cores)."""
    return _llguidance().LLExecutor(1)


@dataclass(frozen=True)
class Constraint:
    """What the output must match, before it meets a tokenizer. ``source``: the schema (a dict or
    its JSON text) or the grammar's text; ``compact``: JSON without optional whitespace (one way to
    write each value, so more of it is forced: free drafts), else JSON as the schema allows it."""

    kind: str
    source: object
    compact: bool = True

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConstraintError(f"constraint kind {self.kind!r}: use one of {', '.join(KINDS)}")

    @classmethod
    def json_schema(cls, schema, compact: bool = True) -> "Constraint":
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ConstraintError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise ConstraintError(f"a JSON schema is a JSON object, got {type(schema).__name__}")
        return cls("json_schema", schema, compact)

    @classmethod
    def json_object(cls, compact: bool = True) -> "Constraint":
        return cls("json_object", ANY_OBJECT, compact)

    @classmethod
    def regex(cls, pattern: str) -> "Constraint":
        return cls("regex", str(pattern))

    @classmethod
    def lark(cls, grammar: str) -> "Constraint":
        return cls("lark", str(grammar))

    @classmethod
    def gbnf(cls, grammar: str) -> "Constraint":
        return cls("gbnf", str(grammar))

    def text(self) -> str:
        """The constraint's exact text: the regex or grammar as given, or the schema's JSON without whitespace,
        its keys in their given order (not sorted: the order of ``properties``, and of a ``const`` object, is
        the order of the answer's keys, so two schemas that differ only there answer differently)."""
        if isinstance(self.source, str):
            return self.source
        try:
            return json.dumps(self.source, separators=(",", ":"), ensure_ascii=False)
        except (TypeError, ValueError) as e:  # a schema built in Python with a value JSON has no form for
            raise ConstraintError(f"the {self.kind} constraint is not JSON: {e}") from None

    def grammar_text(self) -> str:
        """llguidance's grammar for this constraint (its own serialised form)."""
        llg = _llguidance()
        try:
            if self.kind in ("json_schema", "json_object"):
                defaults = {"whitespace_flexible": not self.compact}
                return llg.LLMatcher.grammar_from_json_schema(self.source, defaults=defaults)
            if self.kind == "regex":
                return llg.LLMatcher.grammar_from_regex(self.source)
            if self.kind == "lark":
                return llg.LLMatcher.grammar_from_lark(self.source)
            return llg.grammar_from("gbnf", self.source)
        except Exception as e:  # llguidance raises ValueError / RuntimeError with its parser's message
            raise ConstraintError(f"the {self.kind} constraint does not compile: {e}") from None

    def compile(self, vocabulary: "Vocabulary") -> "Grammar":
        """Checked against the tokenizer now: a grammar llguidance refuses is a ConstraintError here,
        not a failure at the first token."""
        llg = _llguidance()
        text = self.grammar_text()
        error = llg.LLMatcher.validate_grammar(text, vocabulary.tokenizer)
        if error:
            raise ConstraintError(f"the {self.kind} constraint does not compile: {error.strip()}")
        return Grammar(text, vocabulary, self)


class Vocabulary:
    """A tokenizer as llguidance reads it (building it walks every token: ~0.4 s for 49k tokens; one
    per tokenizer, then shared), with the model's vocabulary size and its end-of-sequence ids."""

    def __init__(self, tokenizer, vocab_size: int, eos: list[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos = list(eos)

    @classmethod
    def of(cls, hf_tokenizer, vocab_size: int, eos: list[int] | set[int]) -> "Vocabulary":
        """hf_tokenizer: a fast (``tokenizers``-backed) HF tokenizer; vocab_size: the model's (its
        output layer's rows); eos: the ids that end a sequence (the grammar allows one when it is done)."""
        llg = _llguidance()
        eos = sorted(int(t) for t in eos)
        if not eos:
            raise ConstraintError("a constraint needs an end-of-sequence token to end on (the model names none)")
        return cls(llg.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos), vocab_size, eos)


class Grammar:
    """A compiled constraint for one vocabulary; ``start()`` gives a fresh state per sequence."""

    def __init__(self, text: str, vocabulary: Vocabulary, constraint: Constraint) -> None:
        self.text = text
        self.vocabulary = vocabulary
        self.constraint = constraint
        # a matcher at the start, never moved: each sequence's is a copy, not a new parse (decision 020)
        self._start = _llguidance().LLMatcher(vocabulary.tokenizer, text)

    def start(self) -> "GrammarState":
        return GrammarState(self._start.deep_copy(), self.vocabulary.vocab_size, self.vocabulary.eos)


class GrammarCache:
    """Compiled grammars kept for the requests that repeat a constraint, keyed by (kind, ``Constraint.text``,
    compact, the vocabulary object); past ``max_entries`` (0: none kept) the least recently used is dropped.

    A ``Grammar`` is safe to share: its start matcher is never moved (each sequence's state is a copy,
    ``start()``), the rest is read-only. Thread-safe: the routes compile on worker threads. A compile runs
    outside the lock (a slow grammar holds up no other lookup), so two first requests for one constraint at
    once may both compile it; one of the two is kept. A constraint that does not compile is never kept: its
    ConstraintError is raised again each time. Why and what it saves: docs/decisions/020-constraints.md."""

    def __init__(self, max_entries: int = 64) -> None:
        if max_entries < 0:
            raise ValueError(f"a grammar cache holds max_entries >= 0 grammars, got {max_entries}")
        self.max_entries = max_entries
        self._grammars: OrderedDict[tuple, Grammar] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        self.hits = 0  # lookups answered from the cache
        self.misses = 0  # lookups that compiled (a constraint refused too)
        self.evictions = 0  # grammars dropped for the bound

    def __len__(self) -> int:
        return len(self._grammars)

    def compile(self, constraint: Constraint, vocabulary: Vocabulary) -> Grammar:
        """``constraint.compile(vocabulary)``, or the grammar it gave before."""
        key = (constraint.kind, constraint.text(), constraint.compact, vocabulary)  # vocabulary: by identity
        with self._lock:
            grammar = self._grammars.get(key)
            if grammar is not None:
                self._grammars.move_to_end(key)
                self.hits += 1
                return grammar
            self.misses += 1
        grammar = constraint.compile(vocabulary)  # a ConstraintError leaves the cache as it was
        if self.max_entries == 0:
            return grammar
        with self._lock:
            grammar = self._grammars.setdefault(key, grammar)  # another thread's compile of it may have landed first
            self._grammars.move_to_end(key)
            while len(self._grammars) > self.max_entries:
                self._grammars.popitem(last=False)
                self.evictions += 1
        return grammar


def unpack_bitmask(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """llguidance's bitmask [R, ceil(V / 32)] int32 (bit j of word w = token 32 w + j) -> [R, V] bool.
    Example: one word 0b101, V 3 -> [[True, False, True]]. numpy's unpackbits over the words' little-endian
    bytes, not torch's shifts: it runs once per draft node of a constrained row (why:
    docs/decisions/020-constraints.md)."""
    words = bits.contiguous().numpy().astype("<i4", copy=False)  # little-endian: byte k holds bits 8k..8k+7
    flags = np.unpackbits(words.view(np.uint8), axis=-1, bitorder="little")[:, :vocab_size]
    return torch.from_numpy(flags.astype(bool))


class Masks:
    """The tokens a grammar allows after each block row of one sequence's draft, as llguidance fills them:
    ``bits`` [R, ceil(V / 32)] int32, bit j of word w = token 32 w + j. Kept packed: the scores are masked
    from the words (``kernels.mask_rows_``) and the rows that allow one token are counted on them, where
    bools [R, V] would cost an unpacking and a pass of V per row (docs/decisions/020-constraints.md);
    ``allowed`` unpacks them for whoever needs the bools (a sampled draft's q, the fallback's masked_fill).
    Example: bits [[0b101]], V 3 -> allowed [[True, False, True]], counts [2], allows(0, 1) False."""

    def __init__(self, bits: torch.Tensor, vocab_size: int) -> None:
        self.bits = bits
        self.vocab_size = vocab_size
        self._allowed: torch.Tensor | None = None

    @property
    def allowed(self) -> torch.Tensor:
        """[R, V] bool, unpacked once."""
        if self._allowed is None:
            self._allowed = unpack_bitmask(self.bits, self.vocab_size)
        return self._allowed

    def counts(self) -> torch.Tensor:
        """[R] int64: the tokens each row allows (the words' set bits below V)."""
        words = self.bits.contiguous().numpy().view(np.uint32)
        if self.vocab_size % 32:  # the last word's bits past V are not tokens
            words = words.copy()
            words[:, -1] &= np.uint32((1 << (self.vocab_size % 32)) - 1)
        return torch.from_numpy(np.bitwise_count(words).sum(axis=1, dtype=np.int64))

    def groups(self) -> np.ndarray:
        """[ceil(V / 16)] bool: the groups of 16 token ids (group u: 16u .. 16u + 15) some row allows a token of,
        read off the words' halves. Example: bits [[0b1, 1 << 20]] (a row allowing 0 and 52), V 64 -> [T, F, F, T]."""
        words = np.bitwise_or.reduce(self.bits.contiguous().numpy().view(np.uint32), axis=0)
        halves = np.stack([(words & 0xFFFF) != 0, (words >> 16) != 0], axis=1).reshape(-1)
        return halves[: (self.vocab_size + 15) // 16]

    def allows(self, row: int, token: int) -> bool:
        """Whether row ``row`` allows ``token`` (one bit read)."""
        return bool((int(self.bits[row, token >> 5]) >> (token & 31)) & 1)

    def rows(self, index: list[int]) -> "Masks":
        """These rows, in this order."""
        return Masks(self.bits[index], self.vocab_size)

    def apply_(self, scores: torch.Tensor) -> torch.Tensor:
        """scores [R, V] float (one row per row here): -inf where the row's grammar forbids, in place
        (``kernels.mask_rows_``: the build's op over the words, else masked_fill over the bools); returns scores."""
        return kernels.mask_rows_(scores, self.bits, lambda: self.allowed)


class GrammarState:
    """One sequence's place in its grammar (an llguidance matcher), at its committed tokens."""

    def __init__(self, matcher, vocab_size: int, eos: list[int]) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self._eos = frozenset(eos)
        self._bits = _llguidance().torch.allocate_token_bitmask(1, vocab_size)  # [1, ceil(V / 32)] int32
        self._forced: list[int] | None = None  # the engine's forced tokens here, until a commit moves the state

    @property
    def done(self) -> bool:
        """The grammar has ended (an end-of-sequence token was committed)."""
        return bool(self.matcher.is_stopped())

    def allowed(self) -> torch.Tensor:
        """[V] bool: the tokens the grammar allows after the tokens consumed so far (once it has ended,
        whether on an EOS or because nothing can follow its last token: only the EOS tokens)."""
        _llguidance().torch.fill_next_token_bitmask(self.matcher, self._bits, 0)
        return unpack_bitmask(self._bits, self.vocab_size)[0]

    def consume(self, tokens: list[int]) -> None:
        """Committed tokens, each allowed where it was chosen (the verifier masked the target there)."""
        if tokens:
            self._forced = None
        for t in tokens:
            if self.matcher.is_stopped():
                return  # the sequence ends at its end-of-sequence token; nothing follows it
            if not self.matcher.consume_token(int(t)):
                raise RuntimeError(f"token {t} was committed where the grammar forbids it: "
                                   f"{self.matcher.get_error()}")

    def forced(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens the grammar forces next (its only way to go on, in the tokenizer's
        canonical tokens), without moving the state."""
        if self.matcher.is_stopped() or limit <= 0:
            return []
        return self._forced_here()[:limit]

    def _forced_here(self) -> list[int]:
        """``compute_ff_tokens`` at the committed tokens, asked once a step: a step's class and its draft both
        open with it (choosing is paid every step: docs/decisions/008-auto-sources.md)."""
        if self._forced is None:
            self._forced = list(self.matcher.compute_ff_tokens())
        return self._forced

    def opening(self, guess) -> str | None:
        """How ``draft``'s chain would open, the state unmoved: "forced" (the grammar forces a token), "guess"
        (``guess([])``'s first token, which it allows), or None (no chain)."""
        if self.matcher.is_stopped():
            return None
        if self._forced_here():
            return "forced"
        first = [int(t) for t in guess([])][:1]
        return "guess" if first and self.matcher.validate_tokens(first) else None

    def draft(self, budget: int, guess) -> list[int]:
        """Up to ``budget`` tokens the grammar allows from here, the state unmoved: the tokens it forces,
        then as many of ``guess(drafted so far)`` (a guessed continuation: a list of tokens) as it
        allows, then what it forces after those, and so on until a guess is refused or runs out.
        Example: JSON {"name": ..., with guesses copied from the prompt: `{"name":"` forced, `Bob` guessed,
        `","age":` forced."""
        out: list[int] = []
        taken = 0  # tokens consumed here, rolled back at the end
        try:
            while len(out) < budget and not self.matcher.is_stopped():
                step = (list(self.matcher.compute_ff_tokens()) if taken else self._forced_here())[: budget - len(out)]
                if not step:
                    guessed = [int(t) for t in guess(out)][: budget - len(out)]
                    step = guessed[: self.matcher.validate_tokens(guessed)] if guessed else []
                if not step:
                    break
                for t in step:
                    if self.matcher.is_stopped() or not self.matcher.consume_token(t):
                        raise RuntimeError(f"the grammar refused token {t} it had allowed: {self.matcher.get_error()}")
                    taken += 1
                out += step
        finally:
            if taken:
                self.matcher.rollback(taken)
        return out

    def tree_masks(self, parents: list[int], tokens: list[int]) -> tuple[Masks, list[bool]]:
        """The allowed tokens after each block row of a draft tree, and which nodes the grammar allows.

        parents, tokens: one row's real nodes (parents precede children). Returns masks of 1 + N rows
        (row 0: after the committed tokens; row 1 + i: after node i's path, nothing for a node cut)
        and ok [N] (node i and all its ancestors allowed). The state ends where it began.
        Example: grammar "ab|ac", nothing committed, nodes a, b, x with parents -1, 0, 0 -> ok
        [True, True, False]; row 1 allows b and c."""
        if all(p == i - 1 for i, p in enumerate(parents)):
            chain = self._chain_masks(tokens)
            if chain is not None:
                return chain
        llg = _llguidance()
        bits = torch.zeros(1 + len(tokens), self._bits.shape[1], dtype=torch.int32)  # cut nodes' rows: nothing
        masks = Masks(bits, self.vocab_size)
        llg.torch.fill_next_token_bitmask(self.matcher, bits, 0)
        ok: list[bool] = []
        paths: list[list[int]] = []  # each node's path, root first
        held: list[int] = []  # the nodes the matcher has consumed beyond the committed tokens
        ended: list[bool] = []  # node i is an end-of-sequence token after the grammar ended: nothing follows
        for i, (p, t) in enumerate(zip(parents, tokens)):
            paths.append((paths[p] if p >= 0 else []) + [i])
            ok.append((p < 0 or (ok[p] and not ended[p])) and masks.allows(p + 1, t))
            ended.append(False)
            if not ok[i]:
                continue
            above = paths[i][:-1]
            common = 0
            while common < min(len(held), len(above)) and held[common] == above[common]:
                common += 1
            if len(held) > common:  # back to the deepest ancestor both paths share
                self.matcher.rollback(len(held) - common)
                del held[common:]
            for j in above[common:]:  # ... then down to node i's parent (each allowed and consumed before)
                self.matcher.consume_token(int(tokens[j]))
                held.append(j)
            if self.matcher.is_stopped():  # the grammar ended at the parent: t is an EOS (the mask said so)
                ended[i] = True
                bits[1 + i] = bits[p + 1]  # never read: the sequence ends at node i
                continue
            self.matcher.consume_token(int(t))
            held.append(i)
            llg.torch.fill_next_token_bitmask(self.matcher, bits, 1 + i)
        if held:
            self.matcher.rollback(len(held))
        return masks, ok

    def _chain_masks(self, tokens: list[int]) -> tuple[Masks, list[bool]] | None:
        """``tree_masks`` for a chain (node i's parent is node i - 1), the common draft: the prefix the
        grammar allows (``validate_tokens``) and the masks after each of its tokens in one call of the
        engine's, not a consume and a mask per node. None where the walk must decide: a chain that
        reaches the grammar's end (an EOS in the allowed prefix, or a state that has ended)."""
        llg = _llguidance()
        if self.matcher.is_stopped():
            return None
        n = self.matcher.validate_tokens(tokens) if tokens else 0
        if any(t in self._eos for t in tokens[:n]):
            return None
        bits = torch.zeros(1 + len(tokens), self._bits.shape[1], dtype=torch.int32)  # cut nodes' rows: nothing allowed
        if n:
            llg.torch.fill_next_token_bitmask_par_with_draft_tokens(_executor(), [(self.matcher, 0, tokens[:n])], bits)
        else:
            llg.torch.fill_next_token_bitmask(self.matcher, bits, 0)
        return Masks(bits, self.vocab_size), [True] * n + [False] * (len(tokens) - n)
