"""Long-context prompts: book excerpts cut to their first N tokens, then an instruction, inside the
chat template (``specdec bench-longctx`` and ``specdec bench-controller``).

    books = read_books(BOOKS)[:2]                                   # [{"id", "text"}, ...]
    prompts = build_prompts(tokenizer, books, [2048], ["summary"])  # one LongPrompt per book
    prompts[0].key                                                  # "b1/2048/summary"
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.prompting import chat_ids, user_turn

# the steering repo's shared/ data beside the clone (run from the repo root: ../shared), else /work/shared
BOOKS = next((p for p in (Path.cwd().parent / "shared" / "longctx" / "books.jsonl",
                          Path("/work/shared/longctx/books.jsonl")) if p.exists()),
             Path("../shared/longctx/books.jsonl"))
INSTRUCTIONS = {"continue": "Continue the story.", "summary": "Summarize the passage above."}


def prompt_key(books: tuple[str, ...], length: int, instruction: str) -> str:
    """A prompt's name in the records. Example: ("b1",), 2048, "summary" -> "b1/2048/summary"."""
    if len(books) == 1:
        return f"{books[0]}/{length}/{instruction}"
    return f"B{len(books)}:{'+'.join(books)}/{length}/{instruction}"


@dataclass(frozen=True)
class LongPrompt:
    books: tuple[str, ...]  # the excerpts' ids, one per sequence of the batch
    length: int  # tokens of each excerpt kept (--lengths)
    instruction: str  # a key of INSTRUCTIONS
    rows: tuple[torch.Tensor, ...]  # [B] of [P_b]: chat template applied (P_b a few tokens over length)

    @property
    def key(self) -> str:
        return prompt_key(self.books, self.length, self.instruction)

    @property
    def tokens(self) -> int:
        """The longest sequence's prompt tokens."""
        return max(len(x) for x in self.rows)

    @property
    def input_ids(self) -> torch.Tensor:
        """[1, P] the first sequence (--memory runs one sequence)."""
        return self.rows[0][None]


def read_books(path: Path) -> list[dict]:
    """Lines of {"id", "text", ...}; a line without them is an error naming the line."""
    books = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        rec = json.loads(line)
        if not isinstance(rec, dict) or "id" not in rec or "text" not in rec:
            raise ValueError(f"{path}:{i}: expected an object with 'id' and 'text'")
        books.append(rec)
    return books


def build_prompts(tokenizer, books: list[dict], lengths: list[int], instructions: list[str],
                  batch: int = 1) -> list[LongPrompt]:
    """Per group of ``batch`` consecutive books (a trailing partial group is dropped), per length and
    instruction, one prompt of ``batch`` sequences."""
    if len(books) < batch:
        raise ValueError(f"--batch-size {batch} needs at least {batch} books (--books), got {len(books)}")
    tokens = [tokenizer(book["text"], add_special_tokens=False)["input_ids"] for book in books]
    for book, toks in zip(books, tokens):
        if len(toks) < max(lengths):
            raise ValueError(f"book {book['id']!r} has {len(toks)} tokens, fewer than --lengths {max(lengths)}")

    def chat(toks: list[int], n: int, ins: str) -> torch.Tensor:
        excerpt = tokenizer.decode(toks[:n])  # the first n tokens, from the start
        return chat_ids(tokenizer, user_turn(f"{excerpt}\n\n{INSTRUCTIONS[ins]}"))[0]

    out = []
    for g in range(0, len(books) - batch + 1, batch):
        group = range(g, g + batch)
        for n in lengths:
            for ins in instructions:
                out.append(LongPrompt(tuple(books[b]["id"] for b in group), n, ins,
                                      tuple(chat(tokens[b], n, ins) for b in group)))
    return out
