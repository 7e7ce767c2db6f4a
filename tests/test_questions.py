"""Question files: the strict loader, selection, the category -> task grouping, the shipped set."""

import json
from collections import Counter
from pathlib import Path

import pytest

from conftest import shared_file
from specdec.bench.questions import (TASK_OF_CATEGORY, TASKS, Question, default_questions_path, load_questions,
                               select_questions, task_of)

SPEC_BENCH = shared_file("specbench/question.jsonl")


def _write(tmp_path, lines) -> Path:
    p = tmp_path / "q.jsonl"
    p.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return p


GOOD = {"question_id": 1, "category": "qa", "turns": ["Why is the sky blue?"]}


def test_loads_fields_in_file_order(tmp_path):
    p = _write(tmp_path, [GOOD, "", {"question_id": 7, "category": "writing", "turns": ["a", "b"],
                                     "reference": ["ignored"]}])
    qs = load_questions(p)
    assert qs == [Question(1, "qa", ("Why is the sky blue?",)), Question(7, "writing", ("a", "b"))]
    assert [q.task for q in qs] == ["qa", "mt_bench"]


@pytest.mark.parametrize("bad, message", [
    ('{"question_id": 2, "category": "qa", "turns": ["x"]', "not valid JSON"),
    ('{"question_id": 2, "category": "qa"}', "missing 'turns'"),
    ('{"question_id": 2, "category": "qa", "turns": []}', "'turns' must be a non-empty list"),
    ('{"question_id": 2, "category": "qa", "turns": "just a string"}', "'turns' must be a non-empty list"),
    ('{"question_id": 2, "category": "qa", "turns": ["ok", ""]}', "turn 2 must be a non-empty string"),
    ('{"question_id": 2, "category": "qa", "turns": ["ok", 3]}', "turn 2 must be a non-empty string"),
    ('{"question_id": 2, "turns": ["x"]}', "missing 'category'"),
    ('{"question_id": 2, "category": "", "turns": ["x"]}', "'category' must be a non-empty string"),
    ('{"category": "qa", "turns": ["x"]}', "missing 'question_id'"),
    ('{"question_id": [2], "category": "qa", "turns": ["x"]}', "'question_id' must be"),
    ('["a list"]', "expected a JSON object"),
    ('{"question_id": 1, "category": "qa", "turns": ["x"]}', "question_id 1 already used on line 1"),
])
def test_bad_line_names_file_and_line(tmp_path, bad, message):
    p = _write(tmp_path, [GOOD, bad, {"question_id": 3, "category": "qa", "turns": ["y"]}])
    with pytest.raises(ValueError) as e:
        load_questions(p)
    assert f"{p}:2:" in str(e.value)
    assert message in str(e.value)


def test_line_numbers_count_blank_lines(tmp_path):
    p = _write(tmp_path, [GOOD, "", "   ", "not json"])
    with pytest.raises(ValueError, match=r"q\.jsonl:4: not valid JSON"):
        load_questions(p)


def test_empty_and_missing_files(tmp_path):
    with pytest.raises(ValueError, match="no questions"):
        load_questions(_write(tmp_path, ["", ""]))
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_questions(tmp_path / "nope.jsonl")


def test_select_by_category_and_limit(tmp_path):
    rows = [{"question_id": i, "category": c, "turns": ["t"]}
            for i, c in enumerate(["qa", "rag", "qa", "qa", "rag", "math"])]
    qs = load_questions(_write(tmp_path, rows))
    assert [q.question_id for q in select_questions(qs, limit_per_category=1)] == [0, 1, 5]
    assert [q.question_id for q in select_questions(qs, ["qa", "math"], 2)] == [0, 2, 5]
    assert select_questions(qs) == qs
    with pytest.raises(ValueError, match="no questions in categories writng; the file has: math, qa, rag"):
        select_questions(qs, ["qa", "writng"])
    with pytest.raises(ValueError, match="at least 1"):
        select_questions(qs, limit_per_category=0)


def test_task_grouping_is_spec_benchs():
    assert len(TASK_OF_CATEGORY) == 13
    assert set(TASK_OF_CATEGORY.values()) == set(TASKS)
    assert TASKS == ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
    for c in ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"):
        assert task_of(c) == "mt_bench"
    assert task_of("math_reasoning") == "math_reasoning"
    assert task_of("my-own-category") == "my-own-category"  # custom files: its own task


def test_shipped_set_covers_every_category():
    qs = load_questions()  # the default path
    assert default_questions_path().name == "questions.jsonl"
    counts = Counter(q.category for q in qs)
    assert set(counts) == set(TASK_OF_CATEGORY)
    assert all(n == 2 for n in counts.values())
    assert any(len(q.turns) == 2 for q in qs) and any(len(q.turns) == 1 for q in qs)
    assert all(len(q.turns) == 2 for q in qs if q.task == "mt_bench")  # like MT-bench


@pytest.mark.skipif(not SPEC_BENCH.is_file(), reason="Spec-Bench question file not present")
def test_spec_bench_file_loads_and_shipped_text_is_our_own():
    sb = load_questions(SPEC_BENCH)
    assert len(sb) == 480
    assert Counter(q.task for q in sb) == {t: 80 for t in TASKS}
    theirs = {t for q in sb for t in q.turns}
    assert not theirs & {t for q in load_questions() for t in q.turns}
