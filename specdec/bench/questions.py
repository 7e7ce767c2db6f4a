"""Spec-Bench question files: loading (strict), selecting, and the category -> task grouping.

A question file is JSON Lines, one question per line, in Spec-Bench's format::

    {"question_id": 81, "category": "writing", "turns": ["first user message", "second"]}

``turns`` are the user's messages; the second (if any) is asked after the model's own answer to the
first. Any other field (Spec-Bench's ``reference``) is ignored. A broken line is an error naming the
file and line, never skipped: a silently shorter question set would change every figure.

Spec-Bench groups its 13 categories into 6 tasks (Xia et al., 2024, "Unlocking Efficiency in Large
Language Model Inference", table 1); speedups are reported per task.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

# Spec-Bench's 13 categories -> its 6 tasks (the subsets of its leaderboard), in its order.
MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem",
                       "humanities")
TASK_OF_CATEGORY: dict[str, str] = {
    **{c: "mt_bench" for c in MT_BENCH_CATEGORIES},
    "translation": "translation",
    "summarization": "summarization",
    "qa": "qa",
    "math_reasoning": "math_reasoning",
    "rag": "rag",
}
TASK_TITLES: dict[str, str] = {  # the names Spec-Bench's paper and leaderboard print
    "mt_bench": "Multi-turn conversation",
    "translation": "Translation",
    "summarization": "Summarization",
    "qa": "Question answering",
    "math_reasoning": "Mathematical reasoning",
    "rag": "Retrieval-augmented generation",
}
TASKS: tuple[str, ...] = tuple(TASK_TITLES)  # report order


@dataclass(frozen=True)
class Question:
    question_id: int | str  # Spec-Bench uses ints (81-560); any unique int or string is accepted
    category: str
    turns: tuple[str, ...]  # user messages, asked in order, each after the model's previous answer

    @property
    def task(self) -> str:
        return task_of(self.category)


def task_of(category: str) -> str:
    """Spec-Bench task of a category; a category Spec-Bench does not have is its own task."""
    return TASK_OF_CATEGORY.get(category, category)


def default_questions_path() -> Path:
    """The project's own small question set (same 13 categories; not Spec-Bench's text)."""
    return Path(str(resources.files("specdec") / "data" / "questions.jsonl"))


def load_questions(path: str | Path | None = None) -> list[Question]:
    """Every question of a JSONL file (default: the shipped set), in file order.

    Raises FileNotFoundError for a missing file and ValueError naming ``file:line`` for a line that
    is not JSON, not an object, lacks ``question_id`` / ``category`` / a non-empty ``turns`` list
    of non-empty strings, or repeats an earlier question_id. Blank lines are skipped.
    """
    path = Path(path) if path is not None else default_questions_path()
    if not path.is_file():
        raise FileNotFoundError(f"question file {path} does not exist")
    questions: list[Question] = []
    first_line: dict[int | str, int] = {}  # question_id -> line it was defined on
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            q = parse_question(line, f"{path}:{lineno}")
            if q.question_id in first_line:
                raise ValueError(f"{path}:{lineno}: question_id {q.question_id!r} already used on line "
                                 f"{first_line[q.question_id]}")
            first_line[q.question_id] = lineno
            questions.append(q)
    if not questions:
        raise ValueError(f"{path}: no questions (the file is empty)")
    return questions


def parse_question(line: str, where: str) -> Question:
    """One JSONL line -> Question; ``where`` (``file:line``) starts every error message."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    qid = obj.get("question_id")
    if qid is None:
        raise ValueError(f"{where}: missing 'question_id'")
    if isinstance(qid, bool) or not isinstance(qid, (int, str)):
        raise ValueError(f"{where}: 'question_id' must be an integer or a string, got {qid!r}")
    category = obj.get("category")
    if category is None:
        raise ValueError(f"{where}: missing 'category'")
    if not isinstance(category, str) or not category.strip():
        raise ValueError(f"{where}: 'category' must be a non-empty string, got {category!r}")
    turns = obj.get("turns")
    if turns is None:
        raise ValueError(f"{where}: missing 'turns' (the list of user messages)")
    if not isinstance(turns, list) or not turns:
        raise ValueError(f"{where}: 'turns' must be a non-empty list of strings, got {turns!r}")
    for i, t in enumerate(turns, start=1):
        if not isinstance(t, str) or not t.strip():
            raise ValueError(f"{where}: turn {i} must be a non-empty string, got {t!r}")
    return Question(qid, category, tuple(turns))


def select_questions(questions: list[Question], categories: list[str] | None = None,
                     limit_per_category: int | None = None) -> list[Question]:
    """The questions of ``categories`` (default all), at most ``limit_per_category`` of each, in
    file order. A requested category the file does not have is an error (most likely a typo)."""
    if limit_per_category is not None and limit_per_category < 1:
        raise ValueError(f"limit per category must be at least 1, got {limit_per_category}")
    if categories is not None:
        known = {q.category for q in questions}
        unknown = [c for c in categories if c not in known]
        if unknown:
            raise ValueError(f"no questions in categories {', '.join(unknown)}; the file has: "
                             f"{', '.join(sorted(known))}")
    wanted = set(categories) if categories is not None else None
    taken: dict[str, int] = {}
    out = []
    for q in questions:
        if wanted is not None and q.category not in wanted:
            continue
        if limit_per_category is not None and taken.get(q.category, 0) >= limit_per_category:
            continue
        taken[q.category] = taken.get(q.category, 0) + 1
        out.append(q)
    return out
