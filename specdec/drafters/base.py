"""The drafter contract: three methods, the same for every way of guessing tokens.

    begin(prompt)     a new generation starts; the drafter sets up its own state
    propose(budget)   guess up to ``budget`` tokens after the committed text, as a DraftTree
    accept(commit)    learn what was committed this step (accepted drafts + the target's token)
    select(rows)      batches only: keep these batch rows (finished sequences leave the batch)
    candidates(), use(key)   several sources only: the controller picks this step's (drafters.auto)

The decoder owns the committed text; a drafter mirrors what it needs of it. A drafter whose
vocabulary differs from the target's sets ``vocab_size`` so the decoder can refuse it up front.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from specdec.sampling import SamplingParams
from specdec.tree import DraftTree


@dataclass(frozen=True)
class Prompt:
    input_ids: torch.Tensor  # [B, P] int64, right-padded
    lengths: torch.Tensor  # [B] int64 real tokens per row
    hidden: torch.Tensor | None = None  # [B, P - 1, D] target last hidden states, if the drafter asks
    # The target's KV store (a specdec.kv.BMCCache) right after the prefill, for drafters that read
    # the target's own K/V (self-speculation copies rows of it). Read it, never write it; it stays
    # the same object for the whole generation and grows by the committed rows of every step.
    cache: object | None = None
    # None: greedy. Otherwise the decoder samples, and a drafter that samples its drafts draws them
    # from its own distribution processed the same way and hands it over as DraftTree.probs.
    sampling: SamplingParams | None = None
    generator: torch.Generator | None = None  # the drafter's randomness when sampling (seeded)


@dataclass(frozen=True)
class Commit:
    """What one step added to each sequence: the accepted drafted tokens, then the target's token."""

    tokens: torch.Tensor  # [B, A + 1] int64, row b valid up to num_new[b], right-padded
    num_new: torch.Tensor  # [B] int64 = num_accepted + 1 (0 for a row that has already finished)
    num_accepted: torch.Tensor  # [B] int64 drafted tokens the target agreed with
    # [B, A + 1, D] target last hidden state at the rows that produced each new token (the pending
    # token and the accepted nodes), for drafters that read features (EAGLE); None if not asked for.
    hidden: torch.Tensor | None = None

    def new_tokens(self, b: int) -> list[int]:
        return self.tokens[b, : int(self.num_new[b])].tolist()


class Drafter(ABC):
    vocab_size: int | None = None  # None: the drafter emits whatever ids the target uses
    needs_hidden_states: bool = False  # True: Prompt.hidden and Commit.hidden must be filled
    # True: the decoder's draft-length controller sets the budget (chain drafters). A drafter that
    # sizes its own drafts (EAGLE-2's dynamic tree ranks nodes by score) sets False: it is capped by
    # the tokens still wanted, and the controller's throughput gate only decides whether it drafts.
    follows_controller: bool = True
    # True: ``propose`` costs microseconds and changes no state, so a draft may be made and never
    # verified (``drafters.auto`` scores such shadow drafts against the committed text)
    shadow_drafts: bool = False

    def draft_class(self):
        """A key for the controller's acceptance statistics of the next draft (any hashable; None =
        one class for all). Prompt lookup returns the length of the n-gram it will copy after."""
        return None

    def candidates(self) -> list | None:
        """A drafter over several sources (``drafters.auto``): the draft classes it could draft in
        next, for the controller to pick one of (``use``); None (the default): one source."""
        return None

    def use(self, key) -> None:
        """Draft the next step in class ``key``, one of ``candidates()``."""

    def torch_modules(self) -> list:
        """The nn.Modules the drafter runs, for the decoder's CPU kernel routing (specdec.runtime.kernels)."""
        return []

    def catch_up_seconds(self) -> float:
        """Seconds of the last ``propose`` spent bringing the drafter's state up to date rather than
        drafting (EAGLE feeds its head the pairs it has not seen: a whole prompt at an answer's first
        draft), 0 once ``accept`` ran. The controller prices draft sizes without it, and gains without
        its prompt part (``resume_seconds``): a one-off cost of ~2 plain steps read as the price of a
        6-node tree kept EAGLE's trees at 1-4 nodes and its gate shut for 242 of 252 steps of a qa
        answer where 6-node trees took 0.95 tokens per step."""
        return 0.0

    def resume_seconds(self) -> float:
        """The part of ``catch_up_seconds`` spent on text committed after the prompt while the drafter
        was not drafting (a gated pause, or steps another source drafted in ``drafters.auto``). Not the
        price of a draft size, but a price of drafting again now: the controller counts it in the
        step's gain. With several sources every switch back pays it; not counted, EAGLE's feeds after
        its pauses were ~4% of a batch-8 run that nobody's gain saw, and auto, choosing EAGLE at a
        measured gain of ~1.0, ran 7% behind plain decoding."""
        return 0.0

    def select(self, rows: list[int]) -> None:
        """Keep only batch rows ``rows`` (ascending, indices into the current rows), dropping the
        others' state: the decoder calls it when sequences finish, so their rows are no longer
        computed. A drafter that cannot drop rows leaves this as is and works at batch size 1 only."""
        raise NotImplementedError(f"{type(self).__name__} cannot draft for a batch (it has no select())")

    @property
    def supports_batch(self) -> bool:
        return type(self).select is not Drafter.select

    @abstractmethod
    def begin(self, prompt: Prompt) -> None: ...

    @abstractmethod
    def propose(self, budget: int) -> DraftTree: ...

    @abstractmethod
    def accept(self, commit: Commit) -> None: ...


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
