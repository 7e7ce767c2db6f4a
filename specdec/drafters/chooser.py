"""What the decoder drafts through: a chooser says which source drafts this step, in which draft
class, and how much; the decoder verifies that draft and tells every source what was committed.

``OneDrafter`` wraps a plain drafter: its own draft class, sized by the controller (a chain length,
or a node cap and a gate for a drafter that sizes its own tree). ``Sources`` is several named
drafters, one drafting per step (``--drafter auto``): every source names the class it would draft
in, sources with nothing to draft drop out, and the controller (``choose``) picks the class whose
drafting steps have yielded the most tokens per second so far, a class not measured yet first, one
passed over for a while on a probe turn. A source in ``by_match`` is keyed by how long prompt
lookup's n-gram matched (0, 1, 2+), so a model's guesses and a copy compete where the text is the
same kind (why: docs/decisions/008-auto-sources.md). A source may ask for a minimum prompt length
(``min_prompt``, a number or a function of the batch size) or a maximum (``max_prompt``, the
longest row counts); outside them it is not even started.

Shadow drafts: when greedy, a free source's class that drafts nothing this step (not chosen, or a
single drafter gated off) drafts anyway, unverified, and the controller scores it against the
tokens each row committed (``DraftLengthController.observe_shadow``). Why: docs/decisions/009-shadow-drafts.md.
Every source sees every commit, so a source not used stays in step.

    sources = Sources({"lookup": PromptLookupDrafter(), "eagle": EagleDrafter.default(target)},
                      by_match=("eagle",))
    SpecDecoder(target, sources)
"""

from __future__ import annotations

import functools
import time
from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Hashable

from specdec.controller.plan import Plan
from specdec.drafters.base import Capabilities, Commit, Corpus, Drafter, Prompt
from specdec.tree import DraftTree


def _hidden_layers(sources: dict[str, Drafter]) -> tuple[int, ...]:
    """The target layers the sources that read hidden states read (``Capabilities.hidden_layers``): one
    choice for all, since the decoder keeps one kind of features; a ValueError names a disagreement."""
    wanted = {n: d.capabilities.hidden_layers for n, d in sources.items() if d.capabilities.reads_hidden_states}
    if len(set(wanted.values())) > 1:
        raise ValueError(f"the sources read different target hidden states (layers {wanted}; () = the last "
                         "one): a chooser takes one kind, e.g. an EAGLE-3 head or an EAGLE head, not both")
    return next(iter(wanted.values()), ())


class Chooser(ABC):
    """The decoder's side of drafting; a subclass holds the drafters in ``self.sources``."""

    sources: dict[str, Drafter]
    _current: Drafter | None = None  # this step's source: the last one sized, then the one chosen

    @abstractmethod
    def choose(self, controller, wanted: int, shadow: bool) -> tuple[Plan, list[Hashable]]:
        """The controller's plan of this step's draft (``Plan.key``: the class, None if nobody drafts;
        ``Plan.size``: its nodes, at most ``wanted``), not yet taken, and with ``shadow`` the classes to
        draft unverified (free ones that draft nothing this step)."""

    @abstractmethod
    def propose(self, key: Hashable, budget: int) -> DraftTree:
        """The draft of the chosen class ``key``, up to ``budget`` nodes."""

    @abstractmethod
    def shadow(self, key: Hashable, budget: int) -> DraftTree:
        """A draft of class ``key`` (one ``choose`` named to shadow) that will not be verified."""

    @abstractmethod
    def own_tree(self, key: Hashable) -> bool:
        """Whether class ``key``'s drafts size their own tree (``Drafter.own_tree``)."""

    @abstractmethod
    def source_of(self, key: Hashable) -> str:
        """The name of the drafter that drafts class ``key`` (reports and metrics count drafts under it)."""

    def _started(self) -> list[Drafter]:
        return list(self.sources.values())

    @functools.cached_property
    def capabilities(self) -> Capabilities:
        """What the decoder may rely on: hidden states if any source reads them; a batch or sampling
        only if every source handles it. Read once (the decoder asks every step): the sources and their
        capabilities are fixed when they are made."""
        caps = [d.capabilities for d in self.sources.values()]
        return Capabilities(reads_hidden_states=any(c.reads_hidden_states for c in caps),
                            hidden_layers=_hidden_layers(self.sources),
                            sizes_own_tree=any(c.sizes_own_tree for c in caps),
                            free_drafts=all(c.free_drafts for c in caps),
                            batches=all(c.batches for c in caps), samples=all(c.samples for c in caps),
                            approximate_forwards=any(c.approximate_forwards for c in caps))

    @property
    def vocab_size(self) -> int | None:
        vocabs = {d.vocab_size for d in self.sources.values()} - {None}
        if len(vocabs) > 1:
            raise ValueError(f"the sources disagree on the vocabulary size: {sorted(vocabs)}")
        return vocabs.pop() if vocabs else None

    def torch_modules(self) -> list:
        return [m for d in self.sources.values() for m in d.torch_modules()]

    def catch_up_seconds(self) -> float:
        """The catch-up of this step's source (``Drafter.catch_up_seconds``); 0 before one is sized."""
        return 0.0 if self._current is None else self._current.catch_up_seconds()

    def resume_seconds(self) -> float:
        return 0.0 if self._current is None else self._current.resume_seconds()

    def begin(self, prompt: Prompt) -> None:
        for d in self._started():
            d.begin(prompt)
        self._current = None

    def accept(self, commit: Commit) -> None:
        for d in self._started():
            d.accept(commit)
        self._current = None

    def select(self, rows: list[int]) -> None:
        for d in self._started():
            d.select(rows)


class OneDrafter(Chooser):
    """One drafter: the controller sizes (or gates) its own draft class."""

    def __init__(self, drafter: Drafter) -> None:
        self.drafter = drafter
        self.sources = {"drafter": drafter}

    def choose(self, controller, wanted: int, shadow: bool) -> tuple[Plan, list[Hashable]]:
        key = self.drafter.draft_class()
        plan = controller.plan(key, wanted, tree=self.drafter.own_tree(key))
        # a free drafter's gated-off class is scored unverified too (docs/decisions/009-shadow-drafts.md)
        free = [key] if plan.size <= 0 and shadow and self.drafter.capabilities.free_drafts else []
        return plan, free

    def propose(self, key: Hashable, budget: int) -> DraftTree:
        return self.drafter.propose(budget)

    def catch_up_seconds(self) -> float:
        return self.drafter.catch_up_seconds()

    def resume_seconds(self) -> float:
        return self.drafter.resume_seconds()

    def shadow(self, key: Hashable, budget: int) -> DraftTree:
        return self.drafter.propose(budget)

    def own_tree(self, key: Hashable) -> bool:
        return self.drafter.own_tree(key)

    def source_of(self, key: Hashable) -> str:
        return type(self.drafter).__name__


class Sources(Chooser, Corpus):
    """Named drafters, one per step; keys are (source name, its draft class)."""

    def __init__(self, sources: dict[str, Drafter], min_prompt: dict[str, int | Callable[[int], int]] | None = None,
                 max_prompt: dict[str, int] | None = None, by_match: tuple[str, ...] = (),
                 subsumes: dict[str, tuple[str, ...]] | None = None) -> None:
        if not sources:
            raise ValueError("Sources needs at least one source drafter")
        if by_match and "lookup" not in sources:
            raise ValueError(f"by_match {by_match} keys sources by prompt lookup's match: add a 'lookup' source")
        unknown = set(by_match) - set(sources)
        if unknown:
            raise ValueError(f"by_match names no source: {sorted(unknown)}")
        self.subsumes = {k: tuple(v) for k, v in (subsumes or {}).items()}
        unknown = (set(self.subsumes) | {n for v in self.subsumes.values() for n in v}) - set(sources)
        if unknown:
            raise ValueError(f"subsumes names no source: {sorted(unknown)}")
        self.sources = dict(sources)
        self.vocab_size  # the sources agree on the vocabulary, or ValueError now
        _hidden_layers(self.sources)  # ... and on the hidden states they read
        self.min_prompt = dict(min_prompt or {})
        self.max_prompt = dict(max_prompt or {})
        self.by_match = set(by_match)
        self.active: list[str] = list(sources)  # the sources started for this generation
        self._classes: dict[str, Hashable] = {}  # this step's draft class of each active source
        self.drafts = Counter()  # steps drafted per source: what a run relied on

    def _started(self) -> list[Drafter]:
        return [self.sources[n] for n in self.active]

    def begin(self, prompt: Prompt) -> None:
        shortest, longest = int(prompt.lengths.min()), int(prompt.lengths.max())
        need = {n: m(len(prompt.lengths)) if callable(m) else m for n, m in self.min_prompt.items()}
        self.active = [n for n in self.sources
                       if need.get(n, 0) <= shortest and longest <= self.max_prompt.get(n, longest)]
        super().begin(prompt)

    def candidates(self) -> list[Hashable]:
        """(source, its draft class) for every started source with something to draft; a source in
        ``by_match`` is keyed ("match", prompt lookup's n-gram length: 0, 1, 2 = 2 or more). A source
        that ``subsumes`` others and has something to draft leaves them out this step (its drafts hold
        theirs: the grammar's chain is prompt lookup's guess, cut where the grammar forbids, and its
        forced tokens), so they are neither chosen nor shadowed. Example, {"grammar": ("lookup",)}: under a
        constraint only grammar and suffix compete; without one, lookup and suffix."""
        self._classes = classes = {name: self.sources[name].draft_class() for name in self.active}
        match = min(int(classes.get("lookup") or 0), 2)
        out = []
        for name, cls in classes.items():
            if name in self.by_match:
                out.append((name, ("match", match)))
            elif cls not in (0, ("none", 0)):  # lookup without a match, suffix without a tree
                out.append((name, cls))
        present = {k[0] for k in out}
        left_out = {n for s in present for n in self.subsumes.get(s, ())}
        return [k for k in out if k[0] not in left_out]

    def choose(self, controller, wanted: int, shadow: bool) -> tuple[Plan, list[Hashable]]:
        options = self.candidates()
        free = [k for k in options if k[0] not in self.by_match
                and self.sources[k[0]].capabilities.free_drafts] if shadow else []
        plan = controller.choose(options, lambda k: self._plan(controller, k, wanted), free)
        if plan.key is not None:
            self._current = self.sources[plan.key[0]]
        return plan, [k for k in free if k != plan.key]

    def _plan(self, controller, key: Hashable, wanted: int) -> Plan:
        self._current = self.sources[key[0]]  # asked: its catch-up is this step's (until one is chosen)
        return controller.plan(key, wanted, tree=self.own_tree(key))

    def own_tree(self, key: Hashable) -> bool:
        return self.sources[key[0]].own_tree(self._classes.get(key[0]))

    def source_of(self, key: Hashable) -> str:
        """Keys are (source name, its draft class)."""
        return key[0]

    def propose(self, key: Hashable, budget: int) -> DraftTree:
        self.drafts[key[0]] += 1
        return self.sources[key[0]].propose(budget)

    def shadow(self, key: Hashable, budget: int) -> DraftTree:
        return self.sources[key[0]].propose(budget)

    # ---- Corpus: forwarded to the sources that keep one (suffix) ----------------------------------

    def _corpora(self) -> list[Corpus]:
        return [d for d in self.sources.values() if isinstance(d, Corpus)]

    def remember(self, sequence, prompt_len: int = 0) -> None:
        for d in self._corpora():
            d.remember(sequence, prompt_len)

    def add_documents(self, docs) -> None:
        docs = list(docs)
        for d in self._corpora():
            d.add_documents(docs)

    def build_index(self) -> None:
        for d in self._corpora():
            d.build_index()

    def exclude_questions(self, questions, decode) -> int:
        """Counted once per corpus source."""
        return sum(d.exclude_questions(questions, decode) for d in self._corpora())


def as_chooser(drafter: Drafter | Chooser | None) -> Chooser | None:
    """What the decoder drafts through: a chooser as it is, a plain drafter as its one source."""
    return drafter if drafter is None or isinstance(drafter, Chooser) else OneDrafter(drafter)


@dataclass(frozen=True)
class Shadow:
    """A draft made and not verified: its class, each row's parents and tokens, and its seconds."""

    key: object
    parents: list[list[int]]
    tokens: list[list[int]]
    seconds: float


def draft_step(chooser: Chooser | None, controller, batch_size: int, wanted: int,
               shadow: bool = False, ready: Callable[[], None] | None = None) -> tuple[object, DraftTree, list[Shadow]]:
    """One step's draft through ``chooser`` (a DraftLengthController sizes it): its class, the tree
    (empty when drafting does not pay), and with ``shadow`` (greedy), the free classes' unchosen
    drafts. ``ready()`` runs first where the step may draft (a session brings its drafters up to date).
    Each of the controller's plans is taken (``observe``) as soon as it is made. The decoder's step 1,
    shared with the replays of stored answers (``specdec.bench.replay``), so a replay drafts as the
    decoder does."""
    if chooser is None or wanted <= 0:
        return None, DraftTree.empty(batch_size), []
    batch = controller.plan_batch()
    controller.observe(batch)
    if batch.priced_out:
        return None, DraftTree.empty(batch_size), []
    if ready is not None:
        ready()
    plan, free = chooser.choose(controller, wanted, shadow)
    controller.observe(plan)
    shadows = shadow_drafts(chooser, controller, free, wanted)
    if plan.size <= 0:  # nobody drafts (key None), or the class's rule says not now
        return plan.key, DraftTree.empty(batch_size), shadows
    return plan.key, chooser.propose(plan.key, plan.size), shadows


def shadow_drafts(chooser: Chooser, controller, keys: list, wanted: int) -> list[Shadow]:
    """Unverified drafts of classes ``keys`` (free classes that draft nothing this step). Their seconds
    are part of the step's draft time: the price of scoring them."""
    out = []
    for key in keys:
        plan = controller.plan_shadow(wanted, key, tree=chooser.own_tree(key))
        controller.observe(plan)
        if plan.size <= 0:
            continue
        t0 = time.perf_counter()
        tree = chooser.shadow(key, plan.size)
        out.append(Shadow(key, *tree.real_nodes(), time.perf_counter() - t0))
    return out
