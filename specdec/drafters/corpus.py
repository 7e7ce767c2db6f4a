"""The suffix drafter's corpus: earlier outputs (token-id documents) behind one automaton, shared
by every row; readers for its files and the project's stored answers."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

from specdec.drafters.suffix_automaton import SEPARATOR, SuffixAutomaton
from specdec.jsonl import read_jsonl


@dataclass(frozen=True)
class CorpusDoc:
    ids: tuple[int, ...]  # the whole conversation: prompt then answer
    prompt_len: int  # tokens of the prompt (0: unknown / plain text)


def read_token_jsonl(path: str | os.PathLike) -> list[CorpusDoc]:
    """Documents of a JSONL file of token ids: {"ids": [...], "prompt_len": n (optional)} per line,
    as ``data/eagle_answers.jsonl``; a malformed line is named ("FILE:LINE: ...")."""
    def parse(obj) -> CorpusDoc:
        ids = tuple(int(t) for t in obj["ids"])
        p = int(obj.get("prompt_len", 0))
        if not ids or any(t < 0 for t in ids) or not 0 <= p <= len(ids):
            raise ValueError(f"{len(ids)} ids, prompt_len {p}")
        return CorpusDoc(ids, p)

    return read_jsonl(path, parse, "a token-id")


def read_corpus(path: str | os.PathLike, tokenizer=None) -> list[CorpusDoc]:
    """A ``.jsonl`` of token ids (``read_token_jsonl``) or, any other name, plain text, one document
    per line (``read_text_corpus``, needs the target's tokenizer)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"suffix corpus {path} not found")
    if path.suffix == ".jsonl":
        return read_token_jsonl(path)
    if tokenizer is None:
        raise ValueError(f"suffix corpus {path} is plain text: a tokenizer is needed to read it")
    return read_text_corpus(path, tokenizer)


def read_text_corpus(path: str | os.PathLike, tokenizer) -> list[CorpusDoc]:
    """Documents of a plain-text file, one per non-blank line, tokenized (no special tokens)."""
    with open(path, encoding="utf-8") as f:
        lines = [line.rstrip("\n") for line in f if line.strip()]
    return [CorpusDoc(tuple(tokenizer(line, add_special_tokens=False)["input_ids"]), 0) for line in lines]


def default_answers_path() -> Path:
    """The project's stored answers of the default model (``data/eagle_answers.jsonl`` in the repo)."""
    return Path(__file__).resolve().parents[2] / "data" / "eagle_answers.jsonl"


STORED_ANSWERS_VOCAB = 49152  # the stored answers are token ids of SmolLM2's tokenizer


def stored_answers_fit(vocab_size: int | None) -> bool:
    """Whether the stored answers can serve a target of this vocabulary as a corpus: the repository's
    data/ is there (not in an installed wheel) and the vocabulary is SmolLM2's (the default model and
    its larger siblings share the tokenizer)."""
    return vocab_size == STORED_ANSWERS_VOCAB and default_answers_path().is_file()


def _normalize(text: str) -> str:
    return " ".join(text.split())


_SERIALS = itertools.count()


class SuffixCorpus:
    """Token-id documents behind one suffix automaton, built on first use (so exclusions can be set
    first) and grown by ``add`` without a rebuild."""

    def __init__(self, docs: Iterable[CorpusDoc] = ()) -> None:
        self.docs: list[CorpusDoc] = list(docs)
        self._index: SuffixAutomaton | None = None
        self.version = 0  # bumped whenever the index changes: rows re-match their text then
        self.serial = next(_SERIALS)  # which corpus a row's match belongs to (unique for the process)

    @property
    def index(self) -> SuffixAutomaton:
        if self._index is None:
            index = SuffixAutomaton()
            for doc in self.docs:
                for t in doc.ids:
                    index.extend(t)
                index.extend(SEPARATOR)
            self._index = index
        return self._index

    @property
    def num_tokens(self) -> int:
        return sum(len(d.ids) for d in self.docs)

    def add(self, ids: Sequence[int], prompt_len: int = 0) -> CorpusDoc:
        """Append a document (indexed at once if the index is built); the document, for ``drop``."""
        doc = CorpusDoc(tuple(int(t) for t in ids), prompt_len)
        self.docs.append(doc)
        if self._index is not None:  # incremental: append to the built automaton
            for t in doc.ids:
                self._index.extend(t)
            self._index.extend(SEPARATOR)
        self.version += 1
        return doc

    def drop(self, docs: Iterable[CorpusDoc]) -> int:
        """Remove these documents (the very objects ``add`` returned: an equal document added twice
        is two documents); the index is rebuilt at its next use. How many were removed."""
        gone = {id(d) for d in docs}
        keep = [d for d in self.docs if id(d) not in gone]
        dropped = len(self.docs) - len(keep)
        if dropped:
            self.docs, self._index = keep, None
            self.version += 1
        return dropped

    def exclude_questions(self, questions: Sequence[str], decode: Callable[[list[int]], str]) -> int:
        """Drop the documents whose prompt (decoded) contains one of ``questions`` (whitespace
        normalised); a document without a prompt length is matched on its whole text. Returns how
        many were dropped. Rebuilds the index if it was built."""
        wanted = [q for q in (_normalize(q) for q in questions) if q]
        keep = []
        for doc in self.docs:
            text = _normalize(decode(list(doc.ids[: doc.prompt_len or len(doc.ids)])))
            if not any(q in text for q in wanted):
                keep.append(doc)
        dropped = len(self.docs) - len(keep)
        if dropped:
            self.docs = keep
            self._index = None
            self.version += 1
        return dropped


# --------------------------------------------------------------------------------------------------
# A corpus on disk: one JSON header line (format, version, the tokenizer's fingerprint, the body's
# SHA-256), then the documents as one JSON line; written to a temporary file and renamed over the old
# one, so a reader sees the old file or the new, never half of one. Never pickle.

CACHE_FORMAT = "specdec-suffix-cache"
CACHE_VERSION = 1


class CorpusFileError(ValueError):
    """A corpus file that must not be trusted: torn, altered, of another format or version, or made
    with another tokenizer (its ids would mean other text)."""


def vocab_fingerprint(tokenizer) -> str:
    """SHA-256 of the tokenizer's vocabulary (token -> id, sorted): ids mean the same text only
    under an equal vocabulary."""
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode("utf-8")).hexdigest()


def save_corpus_file(path: str | os.PathLike, docs: Iterable[CorpusDoc], fingerprint: str) -> None:
    """Write ``docs`` atomically (temporary file in the same folder, fsync, os.replace)."""
    path = Path(path)
    body = json.dumps([{"ids": list(d.ids), "prompt_len": d.prompt_len} for d in docs],
                      separators=(",", ":")).encode("utf-8")
    header = {"format": CACHE_FORMAT, "version": CACHE_VERSION, "tokenizer": fingerprint,
              "sha256": hashlib.sha256(body).hexdigest(), "bytes": len(body)}
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(json.dumps(header).encode("utf-8") + b"\n" + body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_corpus_file(path: str | os.PathLike, fingerprint: str) -> list[CorpusDoc]:
    """The documents of a file ``save_corpus_file`` wrote with the same tokenizer; CorpusFileError
    naming what is wrong otherwise (FileNotFoundError if there is none)."""
    raw = Path(path).read_bytes()
    head, sep, body = raw.partition(b"\n")
    try:
        header = json.loads(head)
    except ValueError:
        raise CorpusFileError(f"{path}: no readable header (not a suffix cache, or torn)") from None
    if not isinstance(header, dict) or header.get("format") != CACHE_FORMAT:
        raise CorpusFileError(f"{path}: not a {CACHE_FORMAT} file")
    if header.get("version") != CACHE_VERSION:
        raise CorpusFileError(f"{path}: version {header.get('version')!r}, this specdec reads {CACHE_VERSION}")
    if header.get("tokenizer") != fingerprint:
        raise CorpusFileError(f"{path}: written for another tokenizer (vocabulary fingerprint differs)")
    if not sep or len(body) != header.get("bytes") or hashlib.sha256(body).hexdigest() != header.get("sha256"):
        raise CorpusFileError(f"{path}: checksum mismatch (torn or altered)")
    try:
        docs = [CorpusDoc(tuple(int(t) for t in d["ids"]), int(d["prompt_len"])) for d in json.loads(body)]
    except (ValueError, TypeError, KeyError) as e:
        raise CorpusFileError(f"{path}: malformed documents ({e})") from None
    if any(not d.ids or min(d.ids) < 0 or not 0 <= d.prompt_len <= len(d.ids) for d in docs):
        raise CorpusFileError(f"{path}: a document with no ids, a negative id or a bad prompt length")
    return docs
