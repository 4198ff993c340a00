"""Zero-shot answers compared question by question, and the scorer that computes each question's
context once: checked against hand computations and against answers scored one at a time."""

from __future__ import annotations

import json
import math

import pytest
import torch

from optimum_gradmap.errors import InvalidInputError
from optimum_gradmap.evaluation import (
    EvaluationResult,
    PairedAccuracy,
    QuestionRecord,
    TaskResult,
    ZeroShotResult,
    compare_zero_shot,
    mcnemar_p_value,
)
from optimum_gradmap.evaluation.loglikelihood import Request, _score_questions_one_at_a_time, score_questions
from optimum_gradmap.evaluation.zero_shot import question_ids

from .conftest import tiny_model


def test_paired_difference_its_standard_error_and_mcnemar_match_a_hand_computation():
    a = [1, 1, 0, 0, 1, 0, 1, 1, 0, 0]
    b = [1, 0, 1, 1, 1, 1, 1, 1, 0, 1]
    entry = PairedAccuracy.from_answers("task", a, b)
    differences = [0, -1, 1, 1, 0, 1, 0, 0, 0, 1]  # b - a by hand
    mean = 3 / 10
    variance = sum((d - mean) ** 2 for d in differences) / 9
    assert (entry.acc_a, entry.acc_b, entry.difference) == (0.5, 0.8, pytest.approx(0.3))
    assert entry.stderr == pytest.approx(math.sqrt(variance / 10))
    assert (entry.only_a, entry.only_b) == (1, 4)
    # McNemar's exact test: 2 * P(X <= 1), X ~ Binomial(5, 1/2) = 2 * (1 + 5) / 32
    assert entry.p_value == pytest.approx(12 / 32)


def test_mcnemar_exact_p_values():
    assert mcnemar_p_value(1, 9) == pytest.approx(2 * (1 + 10) / 1024)
    assert mcnemar_p_value(9, 1) == mcnemar_p_value(1, 9)
    assert mcnemar_p_value(3, 3) == 1.0 and mcnemar_p_value(0, 0) == 1.0
    assert mcnemar_p_value(0, 20) == pytest.approx(2 * 0.5**20)


def _result(name: str, answers: dict[str, list[int]], ids: dict[str, list[int]] | None = None) -> ZeroShotResult:
    tasks = []
    for task, right in answers.items():
        doc_ids = (ids or {}).get(task, list(range(len(right))))
        questions = [QuestionRecord(i, [0.0, -1.0], 0 if r else 1, None, 0, r) for i, r in zip(doc_ids, right)]
        tasks.append(TaskResult(task, "validation", "test", len(right), sum(right) / len(right), questions=questions))
    return ZeroShotResult(tasks=tasks, average_acc=sum(t.acc for t in tasks) / len(tasks))


def test_comparison_per_task_pooled_average_and_retained_accuracy():
    dense = _result("dense", {"piqa": [1, 1, 1, 0], "arc_easy": [1, 1, 0, 0, 1, 1]})
    a = _result("a", {"piqa": [1, 0, 1, 0], "arc_easy": [1, 0, 0, 0, 1, 1]})
    b = _result("b", {"piqa": [1, 1, 1, 0], "arc_easy": [0, 1, 1, 0, 1, 1]})
    comparison = compare_zero_shot(a, b, reference=dense, names=("a", "b", "dense"))
    piqa, arc = comparison.tasks
    assert (piqa.acc_a, piqa.acc_b, piqa.only_a, piqa.only_b) == (0.5, 0.75, 0, 1)
    assert (arc.acc_a, arc.acc_b, arc.only_a, arc.only_b) == (0.5, 4 / 6, 1, 2)
    pooled = comparison.pooled
    assert (pooled.num_questions, pooled.acc_a, pooled.acc_b) == (10, 0.5, 0.7)
    assert comparison.average_difference == pytest.approx((0.75 + 4 / 6) / 2 - 0.5)
    assert comparison.average_stderr == pytest.approx(math.sqrt(piqa.stderr**2 + arc.stderr**2) / 2)
    average_dense = (0.75 + 4 / 6) / 2
    assert comparison.retained_a == pytest.approx(100 * 0.5 / average_dense)
    assert comparison.retained_b == pytest.approx(100.0) and piqa.retained_b == pytest.approx(100.0)
    assert "pooled" in comparison.summary() and "retained" in comparison.summary()


def test_comparison_refuses_results_on_other_questions_or_without_records():
    a = _result("a", {"piqa": [1, 0]})
    with pytest.raises(ValueError, match="not evaluated on the same questions"):
        compare_zero_shot(a, _result("b", {"piqa": [1, 0]}, ids={"piqa": [5, 6]}))
    with pytest.raises(ValueError, match="no per-question records"):
        compare_zero_shot(a, ZeroShotResult(tasks=[TaskResult("piqa", "validation", "test", 2, 0.5)]))


def test_records_are_written_beside_the_summary_and_read_back(tmp_path):
    result = EvaluationResult(model="m", zero_shot=_result("m", {"piqa": [1, 0, 1]}))
    path = tmp_path / "m.json"
    result.to_json(str(path))
    summary = json.loads(path.read_text())
    assert "questions" not in summary["zero_shot"]["tasks"][0]
    lines = (tmp_path / "m.questions.jsonl").read_text().splitlines()
    assert [json.loads(line)["acc"] for line in lines] == [1, 0, 1] and json.loads(lines[0])["task"] == "piqa"
    again = EvaluationResult.from_json(str(path))
    assert again.zero_shot.tasks[0].questions == result.zero_shot.tasks[0].questions
    assert compare_zero_shot(again.zero_shot, result.zero_shot).pooled.difference == 0


def test_subsets_are_fixed_sorted_and_of_the_stated_size():
    first = question_ids("hellaswag", 10042, None, {"hellaswag": 2000}, 0)
    assert first == question_ids("hellaswag", 10042, None, {"hellaswag": 2000}, 0) == sorted(first)
    assert len(set(first)) == 2000 and max(first) < 10042
    assert question_ids("hellaswag", 10042, None, {"hellaswag": 2000}, 1) != first
    assert question_ids("piqa", 1838, None, {"hellaswag": 2000}, 0) == list(range(1838))
    assert question_ids("hellaswag", 10042, 5, {"hellaswag": 2000}, 0) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2", "opt", "gpt_neox", "phi3", "olmo2", "mixtral", "gemma2"])
def test_each_questions_context_computed_once_gives_the_log_likelihoods_of_answers_scored_one_at_a_time(family, caplog):
    model = tiny_model(family, num_layers=2)
    generator = torch.Generator().manual_seed(0)

    def tokens(low: int, high: int) -> tuple[int, ...]:
        length = int(torch.randint(low, high, (1,), generator=generator))
        return tuple(torch.randint(3, 200, (length,), generator=generator).tolist())

    questions = []
    for _ in range(5):
        context = tokens(3, 20)
        questions.append([Request(context, tokens(1, 6)) for _ in range(4)])
    questions.append([Request((5, 6, 7), (9, 10, 11)), Request((5, 8, 7, 4), (9, 10, 11))])  # WinoGrande's form
    with caplog.at_level("WARNING"):
        packed = score_questions(model, questions, batch_size=3, progress_bar=False)
    with torch.no_grad():
        expected = [_score_questions_one_at_a_time(model, requests) for requests in questions]
    for found, wanted in zip(packed, expected):
        assert [loglikelihood for loglikelihood, _ in found] == pytest.approx([ll for ll, _ in wanted], abs=1e-4)
        assert [greedy for _, greedy in found] == [greedy for _, greedy in wanted]
    # Gemma2's attention does not follow a packed mask: detected, and every answer is scored on its own
    assert ("does not follow a packed attention mask" in caplog.text) == (family == "gemma2")


def test_a_reference_accuracy_of_zero_leaves_that_retained_accuracy_undefined_instead_of_dividing_by_zero():
    dense = _result("dense", {"piqa": [0, 0, 0, 0], "arc_easy": [1, 1, 0, 0]})
    a = _result("a", {"piqa": [1, 0, 1, 0], "arc_easy": [1, 0, 0, 0]})
    b = _result("b", {"piqa": [1, 1, 1, 0], "arc_easy": [0, 1, 1, 0]})
    comparison = compare_zero_shot(a, b, reference=dense, names=("a", "b", "dense"))
    piqa, arc = comparison.tasks
    assert piqa.retained_a is None and piqa.retained_b is None  # x% of 0 is no number
    assert (arc.retained_a, arc.retained_b) == (pytest.approx(50.0), pytest.approx(100.0))
    assert comparison.average_reference == pytest.approx(0.25)
    assert comparison.retained_b == pytest.approx(100 * comparison.average_b / 0.25)
    assert "dense" in comparison.summary()
    # every task at 0 for the reference: no retained share at all, and the table still prints
    zero = _result("dense", {"piqa": [0, 0, 0, 0], "arc_easy": [0, 0, 0, 0]})
    comparison = compare_zero_shot(a, b, reference=zero, names=("a", "b", "dense"))
    assert comparison.retained_a is comparison.retained_b is comparison.pooled.retained_b is None
    assert "retained" in comparison.summary() and "undefined" in comparison.summary()


def test_questions_missing_from_the_reference_are_a_clear_error_naming_the_task_and_how_many():
    a = _result("a", {"piqa": [1, 0, 1, 0], "arc_easy": [1, 0, 0]})
    b = _result("b", {"piqa": [1, 1, 1, 0], "arc_easy": [0, 1, 1]})
    reference = _result("dense", {"piqa": [1, 1], "arc_easy": [1, 1, 1]})  # piqa's questions 2 and 3 are missing
    with pytest.raises(InvalidInputError, match=r"dense has no answers to 2 of the 4 piqa questions"):
        compare_zero_shot(a, b, reference=reference, names=("a", "b", "dense"))
    without_task = _result("dense", {"piqa": [1, 1, 1, 1]})
    with pytest.raises(InvalidInputError, match=r"dense has no answers to 3 of the 3 arc_easy questions"):
        compare_zero_shot(a, b, reference=without_task, names=("a", "b", "dense"))


def test_tasks_listed_in_another_order_are_paired_by_name():
    answers_a = {"piqa": [1, 0, 1, 0], "arc_easy": [1, 0, 0, 0, 1, 1]}
    answers_b = {"piqa": [1, 1, 1, 0], "arc_easy": [0, 1, 1, 0, 1, 1]}
    dense = _result("dense", {"piqa": [1, 1, 1, 0], "arc_easy": [1, 1, 0, 0, 1, 1]})
    in_order = compare_zero_shot(_result("a", answers_a), _result("b", answers_b), reference=dense)
    b_reversed = _result("b", dict(reversed(list(answers_b.items()))))
    dense_reversed = _result("dense", {"arc_easy": [1, 1, 0, 0, 1, 1], "piqa": [1, 1, 1, 0]})
    reordered = compare_zero_shot(_result("a", answers_a), b_reversed, reference=dense_reversed)
    assert reordered.to_dict() == in_order.to_dict()  # A's order, the same numbers
    with pytest.raises(InvalidInputError, match="not evaluated on the same questions"):
        compare_zero_shot(_result("a", answers_a), _result("b", {"piqa": [1, 1, 1, 0]}))


@pytest.mark.parametrize("field", ["split", "source"])
def test_results_on_another_split_or_source_are_refused(field):
    a = _result("a", {"piqa": [1, 0, 1, 0], "arc_easy": [1, 0, 0, 0]})
    b = _result("b", {"piqa": [1, 1, 1, 0], "arc_easy": [0, 1, 1, 0]})
    other = _result("other", {"piqa": [1, 1, 1, 0], "arc_easy": [0, 1, 1, 0]})
    setattr(other.tasks[1], field, "elsewhere")
    was = getattr(a.tasks[1], field)
    with pytest.raises(InvalidInputError, match=rf"arc_easy: a was scored on {field} '{was}', other on 'elsewhere'"):
        compare_zero_shot(a, other, names=("a", "other", "reference"))
    with pytest.raises(InvalidInputError, match=rf"arc_easy: a was scored on {field} '{was}', reference on 'elsewhere'"):
        compare_zero_shot(a, b, reference=other, names=("a", "b", "reference"))
