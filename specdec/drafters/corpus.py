"""The suffix drafter's corpus: earlier outputs (token-id documents) behind one automaton, shared
by every row; readers for its files and the project's stored answers."""

from __future__ import annotations

import os
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


class SuffixCorpus:
    """Token-id documents behind one suffix automaton, built on first use (so exclusions can be set
    first) and grown by ``add`` without a rebuild."""

    def __init__(self, docs: Iterable[CorpusDoc] = ()) -> None:
        self.docs: list[CorpusDoc] = list(docs)
        self._index: SuffixAutomaton | None = None
        self.version = 0  # bumped whenever the index changes: rows re-match their text then

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

    def add(self, ids: Sequence[int], prompt_len: int = 0) -> None:
        doc = CorpusDoc(tuple(int(t) for t in ids), prompt_len)
        self.docs.append(doc)
        if self._index is not None:  # incremental: append to the built automaton
            for t in doc.ids:
                self._index.extend(t)
            self._index.extend(SEPARATOR)
        self.version += 1

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
