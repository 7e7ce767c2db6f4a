"""Prompt lookup where the text repeats itself, another drafter (EAGLE, a small model) elsewhere.

Lookup drafts cost nothing and, after a 2- or 3-gram match, are accepted far more often than a
small drafter's guesses (summaries, RAG answers, code edits and translations copy their context);
where nothing long enough matches, the other drafter guesses. Each sequence uses one source per step,
chosen by the length of its suffix n-gram match: ``min_ngram`` or longer, lookup's continuation as a
chain; shorter, the other drafter's draft. So a verify row never carries both (on a CPU a verify
over more rows costs more, specdec.runtime.kernels); in a batch each row takes its own source. Both sources
see every commit, so the one not used stays in step (EAGLE's head feeds the skipped pairs at its
next draft, in one forward).

The choice is also the step's draft class (``("lookup", n)``, n the longest match, when some row
copies, else ``("other", its class)``), so the decoder's controller keeps apart what each source earns: lookup chains follow its draft length
for their n-gram class, a self-sizing drafter keeps its throughput gate.

    drafter = LookupHybridDrafter(EagleDrafter.default(target))   # `--drafter eagle+lookup`
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from specdec.drafters.base import Capabilities, Commit, Drafter, Prompt
from specdec.drafters.prompt_lookup import PromptLookupDrafter
from specdec.tree import DraftTree, pick_rows


@dataclass(frozen=True)
class HybridConfig:
    min_ngram: int = 2  # lookup drafts after a match this long or longer; 1-gram matches guess poorly


class LookupHybridDrafter(Drafter):
    def __init__(self, other: Drafter, lookup: PromptLookupDrafter | None = None,
                 config: HybridConfig = HybridConfig()) -> None:
        self.other = other
        self.lookup = lookup if lookup is not None else PromptLookupDrafter()
        self.config = config
        self.vocab_size = other.vocab_size
        o = other.capabilities  # lookup batches and samples: the other drafter decides those
        self.capabilities = Capabilities(reads_hidden_states=o.reads_hidden_states, hidden_layers=o.hidden_layers,
                                         sizes_own_tree=o.sizes_own_tree,
                                         batches=o.batches, samples=o.samples,
                                         approximate_forwards=o.approximate_forwards)
        self._use_lookup: list[bool] | None = None  # per row: this step's source is lookup; None until chosen
        self.drafts = Counter()  # row proposals per source ("lookup", "other"): what a run relied on

    def own_tree(self, key) -> bool:
        """Lookup chains follow the controller's length; the other drafter's drafts, its own rule."""
        return key[0] != "lookup" and self.other.own_tree(key[1])

    def torch_modules(self) -> list:
        return self.other.torch_modules()

    def catch_up_seconds(self) -> float:
        return self.lookup.catch_up_seconds() + self.other.catch_up_seconds()

    def resume_seconds(self) -> float:
        return self.lookup.resume_seconds() + self.other.resume_seconds()

    def draft_class(self):
        n = self.lookup.draft_class()  # also matches every row (kept for propose)
        self._use_lookup = [m >= self.config.min_ngram for m, _ in self.lookup._matches]
        return ("lookup", n) if any(self._use_lookup) else ("other", self.other.draft_class())

    def begin(self, prompt: Prompt) -> None:
        self.lookup.begin(prompt)
        self.other.begin(prompt)
        self._use_lookup = None

    def propose(self, budget: int) -> DraftTree:
        if self._use_lookup is None:
            self.draft_class()
        use = self._use_lookup
        self.drafts.update({"lookup": sum(use), "other": len(use) - sum(use)})
        self.drafts += Counter()  # drop zero counts: the counter names only the sources used
        if all(use):
            return self.lookup.propose(budget)
        if not any(use):
            return self.other.propose(budget)
        return pick_rows(use, self.lookup.propose(budget), self.other.propose(budget))  # ragged: per row

    def accept(self, commit: Commit) -> None:
        self.lookup.accept(commit)
        self.other.accept(commit)
        self._use_lookup = None

    def select(self, rows: list[int]) -> None:
        self.lookup.select(rows)
        self.other.select(rows)
        self._use_lookup = None
