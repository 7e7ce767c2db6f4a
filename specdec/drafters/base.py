"""The drafter contract: four methods and a declaration, the same for every way of guessing tokens.

    begin(prompt)     a new generation starts; the drafter sets up its own state
    propose(budget)   guess up to ``budget`` tokens after the committed text, as a DraftTree
    accept(commit)    learn what was committed this step (accepted drafts + the target's token)
    select(rows)      batches: keep these batch rows (finished sequences leave the batch)
    capabilities      what the drafter declares it reads and can do (``Capabilities``), never probed

Optional: ``draft_class()`` keys the controller's statistics, ``torch_modules()`` lists the modules
it runs, ``catch_up_seconds()`` / ``resume_seconds()`` price its catch-up work. A drafter that keeps a
corpus of finished text also implements ``Corpus``. Several drafters drafting in turn are a
``drafters.chooser.Sources``, not a drafter. The decoder owns the committed text; a drafter mirrors
what it needs of it. A drafter whose vocabulary differs from the target's sets ``vocab_size`` so the
decoder can refuse it up front. docs/drafters.md walks through writing one.

Dimensions: B batch rows, P prompt columns, N draft nodes, A accepted drafts, D hidden size.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Hashable, Iterable, Sequence

import torch

from specdec.sampling import SamplingParams
from specdec.tree import DraftTree


@dataclass(frozen=True)
class Capabilities:
    """What a drafter declares (class attribute ``capabilities``); the decoder reads it, never probes."""

    # Prompt.hidden and Commit.hidden must be filled with the target's last hidden states (EAGLE)
    reads_hidden_states: bool = False
    # the drafter shapes its own tree (EAGLE-2's scores, suffix trees): the controller only gates it
    # and caps its nodes (plan(tree=True)); False: the controller sets a chain length (plan)
    sizes_own_tree: bool = False
    # propose costs microseconds and changes no state, so a draft may be made and never verified
    # (shadow drafts, scored against the committed text when greedy)
    free_drafts: bool = False
    # select() drops rows: the drafter drafts for a batch of sequences (else batch size 1 only)
    batches: bool = False
    # valid under sampling: deterministic drafts (DraftTree.probs None, a one-hot q) or drafts drawn
    # from its own distribution given as DraftTree.probs (processed as Prompt.sampling says)
    samples: bool = False
    # with reads_hidden_states: the residual stream entering each of these target layers (HF's
    # hidden_states[j], 0 = the embeddings), concatenated along D, instead of the last hidden state
    # after the final norm (EAGLE-3's fused features; vLLM's meaning of eagle_aux_hidden_state_layer_ids)
    hidden_layers: tuple[int, ...] = ()
    # its forwards run inside specdec.runtime.int8_linear.approximate() (self-speculation): the decoder checks
    # the int8 draft route for the quantized weights it runs before the first step (else nobody pays for it)
    approximate_forwards: bool = False


@dataclass(frozen=True)
class Prompt:
    input_ids: torch.Tensor  # [B, P] int64, right-padded
    lengths: torch.Tensor  # [B] int64 real tokens per row
    # [B, P - 1, D] target last hidden states, if the drafter reads them ([B, P - 1, D * len(layers)]
    # where it names Capabilities.hidden_layers)
    hidden: torch.Tensor | None = None
    # The target's KV store (a specdec.kv.BMCCache) right after the prefill, for drafters that read
    # the target's own K/V (self-speculation copies rows of it). Read it, never write it; it stays
    # the same object for the whole generation and grows by the committed rows of every step.
    cache: object | None = None
    # None: greedy. Otherwise the decoder samples, and a drafter that samples its drafts draws them
    # from its own distribution processed the same way and hands it over as DraftTree.probs.
    sampling: SamplingParams | None = None
    generator: torch.Generator | None = None  # the drafter's randomness when sampling (seeded)
    # Each row's ``specdec.processing.RowProcessor`` (None for a row with none): live objects the
    # decoder advances with every commit, so they hold each row's grammar state at its committed text.
    # Read them (``forced``: the tokens a grammar forces next), never advance them.
    processors: list | None = None


@dataclass(frozen=True)
class Commit:
    """What one step added to each sequence: the accepted drafted tokens, then the target's token."""

    tokens: torch.Tensor  # [B, A + 1] int64, row b valid up to num_new[b], right-padded
    num_new: torch.Tensor  # [B] int64 = num_accepted + 1 (0 for a row that has already finished)
    num_accepted: torch.Tensor  # [B] int64 drafted tokens the target agreed with
    # [B, A + 1, D] target last hidden state at the rows that produced each new token (the pending
    # token and the accepted nodes), for drafters that read features (EAGLE); None if not asked for.
    # As Prompt.hidden: the named layers concatenated where the drafter names Capabilities.hidden_layers.
    hidden: torch.Tensor | None = None

    def new_tokens(self, b: int) -> list[int]:
        return self.tokens[b, : int(self.num_new[b])].tolist()


class Drafter(ABC):
    capabilities: Capabilities = Capabilities()  # greedy, batch size 1, controller-sized chains
    vocab_size: int | None = None  # None: the drafter emits whatever ids the target uses

    @abstractmethod
    def begin(self, prompt: Prompt) -> None: ...

    @abstractmethod
    def propose(self, budget: int) -> DraftTree: ...

    @abstractmethod
    def accept(self, commit: Commit) -> None: ...

    def select(self, rows: list[int]) -> None:
        """Keep only batch rows ``rows`` (ascending, indices into the current rows), dropping the
        others' state: the decoder calls it when sequences finish. Declare ``batches`` with it."""
        raise NotImplementedError(f"{type(self).__name__} cannot draft for a batch (it has no select())")

    def draft_class(self) -> Hashable:
        """A key for the controller's statistics of the next draft (any hashable; None = one class
        for all). Prompt lookup returns the length of the n-gram it will copy after."""
        return None

    def own_tree(self, key: Hashable) -> bool:
        """Whether the draft of class ``key`` sizes its own tree (``Capabilities.sizes_own_tree``): the
        declaration, for every class. A drafter of several rules answers per class (the lookup hybrid:
        its lookup chains follow the controller, its other drafter's trees may not)."""
        return self.capabilities.sizes_own_tree

    def torch_modules(self) -> list:
        """The nn.Modules the drafter runs, for the decoder's CPU kernel routing (specdec.runtime.kernels)."""
        return []

    def catch_up_seconds(self) -> float:
        """Seconds of the last ``propose`` spent bringing the drafter's state up to date rather than
        drafting (EAGLE feeds its head the pairs it has not seen: a whole prompt at an answer's first
        draft), 0 once ``accept`` ran. The controller prices draft sizes without it.
        Why: docs/decisions/010-catch-up-pricing.md"""
        return 0.0

    def resume_seconds(self) -> float:
        """The part of ``catch_up_seconds`` spent on text committed after the prompt while the drafter
        was not drafting (a gated pause, or steps another source drafted): a price of drafting again
        now, which the controller counts in the step's gain. Why: docs/decisions/010-catch-up-pricing.md"""
        return 0.0


class Corpus(ABC):
    """A drafter that also drafts from a corpus of finished text (the suffix drafter; ``Sources``
    forwards to its sources that are one). The bench and chat feed it; checked by isinstance."""

    @abstractmethod
    def remember(self, sequence: Sequence[int], prompt_len: int = 0) -> None:
        """Add a finished conversation (prompt + answer ids; its first ``prompt_len`` are the prompt)."""

    @abstractmethod
    def add_documents(self, docs: Iterable) -> None:
        """Add documents (``drafters.suffix.CorpusDoc``: ids and prompt length), e.g. `--corpus FILE`."""

    @abstractmethod
    def build_index(self) -> None:
        """Index the corpus now, so no timed generation pays for it."""

    @abstractmethod
    def exclude_questions(self, questions: Sequence[str], decode: Callable[[list[int]], str]) -> int:
        """Drop stored conversations whose prompt contains one of ``questions`` (a benchmark must not
        draft from answers to its own questions); how many were dropped."""


class TokenHistory:
    """Per-row committed tokens as Python lists: what text-matching drafters search."""

    def __init__(self, prompt: Prompt) -> None:
        ids, n = prompt.input_ids.tolist(), prompt.lengths.tolist()
        self.rows: list[list[int]] = [row[:k] for row, k in zip(ids, n)]

    def extend(self, commit: Commit) -> None:
        for b, row in enumerate(self.rows):
            row.extend(commit.new_tokens(b))

    def select(self, rows: list[int]) -> None:
        self.rows = [self.rows[b] for b in rows]
