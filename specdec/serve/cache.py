"""The served text the suffix drafter remembers, bounded, and kept on disk across restarts.

Every finished answer (prompt + answer ids) goes into the corpus of each suffix drafter the server
drafts with (``auto``'s ``suffix`` source, or ``--drafter suffix``), so the same question asked again,
or an agent's repeated tool calls, are drafted from it. The oldest answers are evicted once the
served text passes ``max_tokens`` (down to 90% of it, so the index is rebuilt rarely). The file is
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
EVICT_TO = 0.9  # eviction keeps this share of max_tokens: one index rebuild per ~10% of the bound


@dataclass(frozen=True)
class CacheConfig:
    path: Path | None = None  # the file; None: served text is remembered in memory only
    max_tokens: int = 1_000_000  # served tokens kept (~4 MB of ids on disk, ~0.5 GB of suffix index)
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
        # (document, each drafter's copy of it): oldest first
        self.docs: deque[tuple[CorpusDoc, list[CorpusDoc]]] = deque()
        self.tokens = 0
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
        copies = [d.remember(ids, len(prompt)) for d in self.drafters]
        with self._lock:
            self.docs.append((copies[0], copies))
            self.tokens += len(ids)
            self.dirty = True
            evicted = self._evict()
        if evicted:
            for i, d in enumerate(self.drafters):
                d.forget([copies[i] for _, copies in evicted])

    def _evict(self) -> list:
        """Oldest documents out until the served text is within EVICT_TO of max_tokens (under the lock)."""
        if self.tokens <= self.config.max_tokens:
            return []
        out = []
        while self.docs and self.tokens > EVICT_TO * self.config.max_tokens:
            doc, copies = self.docs.popleft()
            self.tokens -= len(doc.ids)
            out.append((doc, copies))
        return out

    def save(self) -> bool:
        """Write the file if anything was remembered since the last save; whether it wrote."""
        if self.config.path is None or not self.active:
            return False
        with self._lock:
            if not self.dirty:
                return False
            docs = [doc for doc, _ in self.docs]
            self.dirty = False
        try:
            save_corpus_file(self.config.path, docs, self.fingerprint)
        except OSError:
            self.dirty = True  # the next save tries again
            raise
        return True
