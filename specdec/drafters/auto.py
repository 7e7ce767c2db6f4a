"""Several drafters, one used per step: the one the controller measures as fastest here and now.

MagicDec picks its drafter from a cost model; the hybrid (``drafters.hybrid``) picks per row by a
fixed rule (copy after an n-gram match, else guess). ``AutoDrafter`` leaves the choice to what is
measured: before each step every source names the draft class it would draft in (prompt lookup: the
n-gram length it matched; suffix: its match bucket; EAGLE, self-speculation: one class), sources
with nothing to draft drop out, and the decoder's controller (``DraftLengthController.choose``)
picks the class whose drafting steps have yielded the most tokens per second so far (per sequence,
in plain-step units, at the live batch size) among those whose own rule drafts something now. A
class not measured yet is tried first; one not chosen for a while gets a probe turn, as the text
changes. A source in ``by_match`` (EAGLE, from the registry) is keyed by how long an n-gram prompt
lookup matched (0, 1, 2+): measured only where it was chosen, one EAGLE class had its gain taken at
the positions where nothing matched (the hardest), and on a translation the 1-gram copies, carried
in from answers where they paid, kept winning the 1-gram positions (EAGLE alone was 18-27% faster
than ``auto`` there in two runs; level with it since). After the choice the usual per-class rules
size the draft (length or tree budget) or turn drafting off when even the best source does not beat
plain decoding.

Free sources are measured everywhere: prompt lookup's and suffix's drafts cost microseconds and
change nothing (``Drafter.shadow_drafts``), so when greedy, at any batch size, the decoder also
drafts every free class the controller did not choose and scores it against the tokens the target
committed in each row (``tree.path_along``: what the verifier would have kept, as far as those
tokens go), as a gain sample and acceptance of that class (``DraftLengthController.observe_shadow``).
Measured only where chosen, a copy class never saw the quotes another source drafted through (at 2k
tokens of a book, StreamingLLM drafted on through a summary's quotes and ``auto`` ran 12% behind the
suffix drafter alone; with shadows level with it), and each was drafted in every answer just to be
measured (at a batch into verifies of B x (1 + k) rows).

Every source sees every commit, so a source not used stays in step (EAGLE's head feeds the skipped
pairs at its next draft, in one forward; self-speculation copies the committed rows into its
compressed cache). A source can ask for a minimum prompt length (``min_prompt``, a number or a
function of the batch size): self-speculation only pays once its draft reads far fewer bytes than a
target step, which takes a longer prompt at batch 1 than at a batch (``registry.make_auto``), and
below that it is not even started (at batch 1 it made ``auto`` 3-25% slower at 2k tokens and 6-7% at
7k: its first drafts, and drafts where a copy would have done better); or
a maximum (``max_prompt``, the longest row counts): EAGLE's head, trained on conversations of up to
1,024 tokens, first feeds the whole prompt through its layer (at 8 x 7k tokens a forward over 56k
pairs, seconds before its first draft) to draft where its acceptance was never tried.

    drafter = AutoDrafter({"lookup": PromptLookupDrafter(), "eagle": EagleDrafter.default(target)})
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Hashable

from specdec.drafters.base import Commit, Drafter, Prompt
from specdec.tree import DraftTree


class AutoDrafter(Drafter):
    def __init__(self, sources: dict[str, Drafter], min_prompt: dict[str, int | Callable[[int], int]] | None = None,
                 max_prompt: dict[str, int] | None = None, by_match: tuple[str, ...] = ()) -> None:
        if not sources:
            raise ValueError("AutoDrafter needs at least one source drafter")
        if by_match and "lookup" not in sources:
            raise ValueError(f"by_match {by_match} keys sources by prompt lookup's match: add a 'lookup' source")
        unknown = set(by_match) - set(sources)
        if unknown:
            raise ValueError(f"by_match names no source: {sorted(unknown)}")
        vocabs = {d.vocab_size for d in sources.values()} - {None}
        if len(vocabs) > 1:
            raise ValueError(f"AutoDrafter's sources disagree on the vocabulary size: {sorted(vocabs)}")
        self.sources = sources
        self.min_prompt = dict(min_prompt or {})
        self.max_prompt = dict(max_prompt or {})
        self.by_match = set(by_match)
        self.vocab_size = vocabs.pop() if vocabs else None
        self.needs_hidden_states = any(d.needs_hidden_states for d in sources.values())
        self.active: list[str] = list(sources)  # the sources started for this generation
        self._chosen: str | None = None  # this step's source, set by use()
        self._key: Hashable = None  # and its draft class
        self.drafts = Counter()  # steps drafted per source: what a run relied on

    @property
    def follows_controller(self) -> bool:
        return self.sources[self._chosen].follows_controller if self._chosen else True

    @property
    def supports_batch(self) -> bool:
        return all(d.supports_batch for d in self.sources.values())

    def torch_modules(self) -> list:
        return [m for d in self.sources.values() for m in d.torch_modules()]

    def candidates(self) -> list[Hashable]:
        """(source, its draft class) for every started source with something to draft; a source in
        ``by_match`` is keyed by the length of prompt lookup's n-gram match instead (0, 1, 2 = 2 or
        more): a model's guesses and a copy compete where the text is the same kind, not where each
        happened to be used."""
        classes = {name: self.sources[name].draft_class() for name in self.active}
        match = min(int(classes.get("lookup") or 0), 2)
        out = []
        for name, cls in classes.items():
            if name in self.by_match:
                out.append((name, ("match", match)))
            elif cls not in (0, ("none", 0)):  # lookup without a match, suffix without a tree
                out.append((name, cls))
        return out

    def shadows(self, options: list[Hashable]) -> list[Hashable]:
        """Of this step's ``candidates()``, the classes whose source drafts for free
        (``Drafter.shadow_drafts``): the decoder drafts those not chosen too, unverified, and the
        controller scores them against what the target commits (``DraftLengthController.observe_shadow``)."""
        return [k for k in options if k[0] not in self.by_match and self.sources[k[0]].shadow_drafts]

    def shadow(self, key: Hashable, budget: int) -> DraftTree:
        """A draft of class ``key`` (one of ``shadows``) that will not be verified."""
        return self.sources[key[0]].propose(budget)

    def sizes_own_tree(self, key: Hashable) -> bool:
        """Whether class ``key``'s source shapes its own tree (``Drafter.follows_controller`` False)."""
        return not self.sources[key[0]].follows_controller

    def catch_up_seconds(self) -> float:
        return 0.0 if self._chosen is None else self.sources[self._chosen].catch_up_seconds()

    def resume_seconds(self) -> float:
        return 0.0 if self._chosen is None else self.sources[self._chosen].resume_seconds()

    def use(self, key: Hashable) -> None:
        self._chosen, self._key = key[0], key

    def draft_class(self):
        return self._key if self._chosen is not None else None

    def begin(self, prompt: Prompt) -> None:
        shortest, longest = int(prompt.lengths.min()), int(prompt.lengths.max())
        need = {n: m(len(prompt.lengths)) if callable(m) else m for n, m in self.min_prompt.items()}
        self.active = [n for n in self.sources
                       if need.get(n, 0) <= shortest and longest <= self.max_prompt.get(n, longest)]
        for name in self.active:
            self.sources[name].begin(prompt)
        self._chosen = None

    def propose(self, budget: int) -> DraftTree:
        assert self._chosen is not None, "the decoder picks a source (use) before propose"
        self.drafts[self._chosen] += 1
        return self.sources[self._chosen].propose(budget)

    def accept(self, commit: Commit) -> None:
        for name in self.active:
            self.sources[name].accept(commit)
        self._chosen = None

    def select(self, rows: list[int]) -> None:
        for name in self.active:
            self.sources[name].select(rows)

    # ---- corpus: forwarded to the sources that keep one (suffix), as the bench and chat use it -----

    def _corpus_sources(self) -> list[Drafter]:
        return [d for d in self.sources.values() if hasattr(d, "remember")]

    def remember(self, sequence, prompt_len: int = 0) -> None:
        """A finished conversation into every corpus source (``SuffixDrafter.remember``)."""
        for d in self._corpus_sources():
            d.remember(sequence, prompt_len)

    def add_documents(self, docs) -> None:
        docs = list(docs)
        for d in self._corpus_sources():
            d.add_documents(docs)

    def build_index(self) -> None:
        for d in self._corpus_sources():
            d.build_index()

    def exclude_questions(self, questions, decode) -> int:
        """Drop stored conversations answering one of ``questions`` from every corpus source; the
        number dropped (counted once per source)."""
        return sum(d.exclude_questions(questions, decode) for d in self._corpus_sources())
