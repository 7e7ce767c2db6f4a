"""The served text the suffix drafter remembers, bounded, and kept on disk across restarts.

Every finished answer (prompt + answer ids) goes into the corpus of each suffix drafter the server
drafts with (``auto``'s ``suffix`` source, or ``--drafter suffix``), so the same question asked again,
or an agent's repeated tool calls, are drafted from it. Served text is kept in two generations of at
most ``max_tokens`` / 2 tokens each: when the young one is full the old one is dropped whole (its
index with it) and a new one starts, so memory stays within ~``max_tokens`` and eviction never stops
the decode loop to rebuild an index (rebuilding the stored answers' took seconds a time). The file is
``drafters.corpus``' format: checksummed, versioned by the tokenizer's vocabulary, replaced
atomically; one that is torn, altered or foreign is set aside with a warning and rebuilt from what
is served next, never read.

Threads: ``remember`` runs on the engine thread (it touches the drafters); ``save`` may run on any
thread (it copies the list of documents under a lock, then writes).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from specdec.drafters.corpus import CorpusDoc, CorpusFileError, load_corpus_file, save_corpus_file
from specdec.drafters.suffix import SuffixDrafter

log = logging.getLogger("specdec.serve")
CACHE_FILE = "suffix-cache.json"


@dataclass(frozen=True)
class CacheConfig:
    path: Path | None = None  # the file; None: served text is remembered in memory only
    max_tokens: int = 1_000_000  # served tokens kept, at most (~4 MB of ids on disk; its suffix index ~1 KB a token)
    save_every: float = 300.0  # seconds between periodic saves (and one on shutdown)

    def __post_init__(self) -> None:
        if self.max_tokens < 1 or not self.save_every > 0:
            raise ValueError(f"need max_tokens >= 1 and save_every > 0: {self}")


def suffix_drafters(drafter) -> list[SuffixDrafter]:
    """The suffix drafters among a drafter or a chooser's sources."""
    sources = getattr(drafter, "sources", None)
    found = list(sources.values()) if isinstance(sources, dict) else [drafter]
    return [d for d in found if isinstance(d, SuffixDrafter)]


class ServedCache:
    def __init__(self, drafters: list[SuffixDrafter], fingerprint: str, config: CacheConfig = CacheConfig()) -> None:
        self.drafters, self.fingerprint, self.config = drafters, fingerprint, config
        self.docs: deque[CorpusDoc] = deque()  # served documents kept, oldest first (what ``save`` writes)
        self.generations: deque[int] = deque([0])  # documents per generation, oldest first (at most 2)
        self.tokens = 0  # in self.docs
        self.young_tokens = 0  # in the youngest generation
        self.dirty = False  # remembered since the last save
        self._lock = threading.Lock()

    @property
    def active(self) -> bool:
        return bool(self.drafters)

    def load(self) -> int:
        """Documents loaded from the file (0 without one); a file not to be trusted is renamed to
        ``*.corrupt`` with a warning, and the cache starts empty."""
        path = self.config.path
        if path is None or not self.active:
            return 0
        try:
            docs = load_corpus_file(path, self.fingerprint)
        except FileNotFoundError:
            return 0
        except CorpusFileError as e:
            log.warning("suffix cache not trusted, rebuilding it from served text: %s", e)
            path.replace(path.with_name(path.name + ".corrupt"))
            return 0
        for doc in docs:
            self.remember(list(doc.ids[: doc.prompt_len]), list(doc.ids[doc.prompt_len:]))
        self.dirty = False
        return len(docs)

    def remember(self, prompt: list[int], answer: list[int]) -> None:
        """A finished request's text joins every suffix drafter's corpus (engine thread)."""
        if not self.active or not answer:
            return
        ids = list(prompt) + list(answer)
        if self.young_tokens + len(ids) > self.config.max_tokens // 2 and self.generations[-1]:
            self._new_generation()
        doc = [d.remember(ids, len(prompt)) for d in self.drafters][0]
        with self._lock:
            self.docs.append(doc)
            self.generations[-1] += 1
            self.tokens += len(ids)
            self.young_tokens += len(ids)
            self.dirty = True

    def _new_generation(self) -> None:
        """The young generation is full: the old one goes (documents and index), a new one starts."""
        for d in self.drafters:
            d.new_generation(keep=1)
        with self._lock:
            if len(self.generations) == 2:
                for _ in range(self.generations.popleft()):
                    self.tokens -= len(self.docs.popleft().ids)
            self.generations.append(0)
            self.young_tokens = 0

    def save(self) -> bool:
        """Write the file if anything was remembered since the last save; whether it wrote."""
        if self.config.path is None or not self.active:
            return False
        with self._lock:
            if not self.dirty:
                return False
            docs = list(self.docs)
            self.dirty = False
        try:
            save_corpus_file(self.config.path, docs, self.fingerprint)
        except OSError:
            self.dirty = True  # the next save tries again
            raise
        return True
