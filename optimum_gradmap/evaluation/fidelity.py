# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Fidelity of a compressed model to its reference (the dense model): flips and next-token KL divergence.

Dutta et al., "Accuracy is Not All You Need" (NeurIPS 2024), show that a compressed model can keep its accuracy
while answering many questions differently from the model it was compressed from: questions it now gets wrong and
questions it now gets right cancel out in the accuracy difference. They propose two measures of that damage, which
track it better than accuracy differences:

- **flips** ([`flips`]): the share of questions whose right/wrong differs from the reference's answer. We also
  count the share whose chosen answer differs (a question both get wrong with different answers changes its answer
  without flipping), and the flips each way (right to wrong, wrong to right);
- **KL divergence** ([`next_token_kl`]): the mean over every predicted token of KL(p_reference || p_model), the
  divergence of the model's next-token distribution from the reference's, on the same held-out segments as
  perplexity. Its standard error is the standard deviation over segments of each segment's mean, / sqrt(number of
  segments).

Dutta et al. also find that flips come mostly from the questions where the reference's top answer barely wins. The
**margin** of a question ([`question_margin`]) is the reference's log-likelihood of the answer it chose (the largest)
minus the next best answer's. [`flips`] cuts each task's questions into the quartiles of that task's own reference
margins ([`margin_quartiles_by_task`]), pools each quartile over the tasks and counts its flips
(`FlipsResult.by_margin`, the edges per task in `FlipsResult.margin_edges`), and counts the flips on the
**confident** questions, those whose margin is above their own task's median (`FlipsResult.confident`): a flip there
is a question the dense model was sure of. The quartiles are cut within each task, not over the pooled margins,
because a raw margin is a difference of log-likelihoods summed over an answer's tokens, on very different scales per
task: on SmolLM2-135M's dense answers (screening protocol, 400 questions per task) the median margin is 13.2 nats on
HellaSwag, 5.6 on PIQA, 2.6 on ARC-Challenge, 2.0 on OpenBookQA and ARC-Easy, 1.26 on BoolQ and 0.80 on WinoGrande,
so "above the pooled median" would hold 90% of HellaSwag's questions and 13% of WinoGrande's and BoolQ's: it would
measure which task a question is from more than how sure the model was. [`answer_shares`] gives the share of a
task's questions on which a model chose each answer (on BoolQ, its "yes" rate).

[`~optimum_gradmap.evaluation.evaluate`] reports both (`reference=` and `reference_model=`), and
[`~optimum_gradmap.evaluation.compare_zero_shot`] compares two models' flips against the same reference, question
by question.

[`~optimum_gradmap.evaluation.kl_divergence`] computes the KL divergence and [`~optimum_gradmap.evaluation.margins`] the
margins and their quartiles; this module counts the flips.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import InvalidInputError
from .margins import format_margin_edges, margin_quartiles_by_task, question_margin
from .zero_shot import STANDARD_SUBSETS, SUBSET_SEED, QuestionRecord, ZeroShotResult, question_ids, scored_split_and_source


@dataclass
class TaskFlips:
    """A model's answers against the reference's on one task's questions, or on every question of every task.

    Attributes:
        task (`str`): The task, or `"pooled"` for every question of every task, each counted once.
        num_questions (`int`): Questions compared (every question the model answered).
        flips (`float`): The share whose right/wrong differs from the reference's.
        answer_changes (`float`): The share whose chosen answer differs from the reference's (every flip, and the
            questions both get wrong with different answers).
        right_to_wrong (`int`): Questions the reference gets right and the model wrong.
        wrong_to_right (`int`): Questions the reference gets wrong and the model right.
    """

    task: str
    num_questions: int
    flips: float
    answer_changes: float
    right_to_wrong: int
    wrong_to_right: int


@dataclass
class MarginFlips:
    """A model's flips against the reference on the questions of one quartile of the reference's margins
    ([`question_margin`]), each question's quartile cut among its own task's margins ([`margin_quartiles_by_task`])
    and the quartile then pooled over every task: quartile 2 holds every task's second quartile. Raw margins are on
    very different scales per task (see the module docstring), so one quartile holds no single range of margins:
    each task's edges are [`FlipsResult`]'s `margin_edges`.

    Attributes:
        quartile (`int`): 1 for each task's smallest margins (the reference's top answer barely wins) to 4 for its
            largest.
        num_questions (`int`): Its questions, over every task. Ties at an edge all go to the lower quartile, so a
            quartile may hold more or fewer than a quarter of the questions, or none.
        num_flips (`int`): Those whose right/wrong differs from the reference's.
        flips (`float`): Their share of `num_questions` (0 for a quartile without questions).
        right_to_wrong (`int`): Flips the reference gets right and the model wrong.
        wrong_to_right (`int`): Flips the reference gets wrong and the model right.
        cut (`str`, defaults to `"within task"`): How the quartile was cut: within each task, pooled after.
    """

    quartile: int
    num_questions: int
    num_flips: int
    flips: float
    right_to_wrong: int
    wrong_to_right: int
    cut: str = "within task"

    def label(self) -> str:
        """`"within-task Q1"` to `"within-task Q4"`: the quartile, cut within each task, for tables."""
        return f"within-task Q{self.quartile}"


@dataclass
class FlipsResult:
    """A model's flips against a reference model's answers to the same zero-shot questions (see the module docstring).

    Attributes:
        reference (`str`): The reference model's name.
        tasks (`list[TaskFlips]`): Per task, in the model's order.
        pooled ([`TaskFlips`], *optional*): Every question of every task.
        by_margin (`list[MarginFlips]`, *optional*): The pooled questions by quartile of the reference's margins,
            each question's quartile cut among its own task's margins, the four in order: their flips add up to the
            pooled flips, their questions to the pooled questions. `None` where a reference record has fewer than two
            log-likelihoods (records written without them), and in results written without the split.
        confident ([`TaskFlips`], *optional*): The flips on the pooled questions whose reference margin is above their
            own task's median (`task` `"confident"`; the third and fourth quartiles): questions the reference was
            sure of. `None` where `by_margin` is.
        margin_edges (`dict[str, list[float]]`, *optional*): Per task, the five edges of its quartiles of the
            reference's margins, in nats (its smallest margin, its quartiles, its largest; the middle one its
            median). `None` where `by_margin` is.
    """

    reference: str
    tasks: list[TaskFlips] = field(default_factory=list)
    pooled: TaskFlips | None = None
    by_margin: list[MarginFlips] | None = None
    confident: TaskFlips | None = None
    margin_edges: dict[str, list[float]] | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable."""
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> FlipsResult:
        """Builds a result from [`to_dict`]'s output. A margin split cut over the pooled margins (quartiles with a
        `low` and `high` edge and no `cut`) is left out: its quartiles and confident questions are not those of
        [`flips`], which cuts them within each task.

        Args:
            values (`dict[str, Any]`): [`to_dict`]'s output.

        Returns:
            [`FlipsResult`].
        """
        pooled, by_margin, confident = values.get("pooled"), values.get("by_margin"), values.get("confident")
        margin_edges = values.get("margin_edges")
        if by_margin is not None and any("cut" not in entry for entry in by_margin):  # the pooled cut
            by_margin = confident = margin_edges = None
        return cls(
            reference=values["reference"],
            tasks=[TaskFlips(**entry) for entry in values.get("tasks", [])],
            pooled=TaskFlips(**pooled) if pooled is not None else None,
            by_margin=[MarginFlips(**entry) for entry in by_margin] if by_margin is not None else None,
            confident=TaskFlips(**confident) if confident is not None else None,
            margin_edges=margin_edges,
        )

    def summary_lines(self) -> list[str]:
        """One line per task and one pooled, for the terminal; with the margin split, a line of the flips on the
        confident questions, one of the flips per within-task margin quartile and one of each task's edges."""
        lines = [
            f"{entry.task}: {entry.flips:.2%} of {entry.num_questions} questions flipped against {self.reference} "
            f"({entry.right_to_wrong} right -> wrong, {entry.wrong_to_right} wrong -> right); "
            f"answer changed on {entry.answer_changes:.2%}"
            for entry in [*self.tasks, *([self.pooled] if self.pooled is not None else [])]
        ]
        if self.confident is not None:
            confident = self.confident
            lines.append(
                f"confident questions ({self.reference}'s margin above its task's median): {confident.flips:.2%} of "
                f"{confident.num_questions} flipped ({confident.right_to_wrong} right -> wrong, "
                f"{confident.wrong_to_right} wrong -> right)"
            )
        if self.by_margin is not None:
            lines.append(
                f"by quartile of {self.reference}'s margin within each task (its answer's log-likelihood minus the next "
                "best; each task cut at its own quartiles, pooled over tasks): "
                + "; ".join(f"{entry.label()} {entry.flips:.2%} of {entry.num_questions}" for entry in self.by_margin)
            )
        if self.margin_edges is not None:
            lines.append(f"{self.reference}'s margin quartile edges per task (nats): {format_margin_edges(self.margin_edges)}")
        return lines


def _task_flips(task: str, pairs: Sequence[tuple[Any, Any]]) -> TaskFlips:
    """[`TaskFlips`] from (model's record, reference's record) pairs of the same questions."""
    right_to_wrong = sum(1 for mine, theirs in pairs if theirs.acc and not mine.acc)
    wrong_to_right = sum(1 for mine, theirs in pairs if mine.acc and not theirs.acc)
    changes = sum(1 for mine, theirs in pairs if mine.choice != theirs.choice)
    n = len(pairs)
    share = n or 1  # no question (an empty margin quartile): shares of 0
    return TaskFlips(task, n, (right_to_wrong + wrong_to_right) / share, changes / share, right_to_wrong, wrong_to_right)


def _margin_split(
    tasks: Sequence[str], pairs: Sequence[tuple[Any, Any]]
) -> tuple[list[MarginFlips] | None, TaskFlips | None, dict[str, list[float]] | None]:
    """[`FlipsResult.by_margin`], [`FlipsResult.confident`] and [`FlipsResult.margin_edges`] from (model's record,
    reference's record) pairs and each pair's task, the margins the reference's, cut within each task
    ([`margin_quartiles_by_task`]); `(None, None, None)` where a reference record has no margin."""
    margins = [question_margin(theirs) for _, theirs in pairs]
    if not margins or any(margin is None for margin in margins):
        return None, None, None
    edges, quartiles = margin_quartiles_by_task(tasks, margins)
    by_margin = []
    for quartile in range(1, 5):
        entry = _task_flips(f"Q{quartile}", [pair for pair, q in zip(pairs, quartiles) if q == quartile])
        flipped = entry.right_to_wrong + entry.wrong_to_right
        counts = (entry.num_questions, flipped, entry.flips, entry.right_to_wrong, entry.wrong_to_right)
        by_margin.append(MarginFlips(quartile, *counts))
    confident = _task_flips("confident", [pair for pair, q in zip(pairs, quartiles) if q >= 3])  # above its task's median
    return by_margin, confident, edges


# Pairing two results' records, shared with comparison.py (which imports them from here: fidelity imports nothing
# from comparison, so the two modules do not import each other).
def question_records(result: ZeroShotResult, name: str) -> dict[str, dict[int, QuestionRecord]]:
    """Every task's questions' records by question id; refuses a result with a task without records."""
    records = {task.task: {question.doc_id: question for question in task.questions} for task in result.tasks}
    missing = [task for task, questions in records.items() if not questions]
    if missing:
        raise InvalidInputError(
            f"{name} has no per-question records for {', '.join(missing)}: evaluate it with this version of "
            "optimum-gradmap and keep the .questions.jsonl file beside its JSON summary."
        )
    return records


def check_same_data(result: ZeroShotResult, other: ZeroShotResult, name: str, other_name: str) -> None:
    """Refuses to pair tasks that `result` and `other` scored on another split or from another source."""
    scored = {task.task: task for task in other.tasks}
    for task in result.tasks:
        if task.task not in scored:
            continue
        for field_name in ("split", "source"):
            mine, theirs = getattr(task, field_name), getattr(scored[task.task], field_name)
            if mine != theirs:
                raise InvalidInputError(
                    f"{task.task}: {name} was scored on {field_name} {mine!r}, {other_name} on {theirs!r}: their "
                    "answers are to other questions and cannot be paired. Evaluate both on the same split with the same "
                    "task data (`task_data`, `--task-data`)."
                )


def check_reference_covers(answers: dict[str, dict], reference: dict[str, dict], evaluated: str, reference_name: str) -> None:
    """Refuses a reference that did not answer every question `answers` holds (by task, then question id); `evaluated`
    says who answered them ("A and B were", "the model was")."""
    for task, questions in answers.items():
        missing = set(questions) - set(reference.get(task, {}))
        if missing:
            raise InvalidInputError(
                f"{reference_name} has no answers to {len(missing)} of the {len(questions)} {task} questions {evaluated} "
                "evaluated on: evaluate the reference with the same tasks, task data, limit and subsets."
            )


def answer_shares(result: ZeroShotResult, task: str) -> dict[int, float]:
    """The share of a task's questions on which a model chose each answer, by the answer's index. On BoolQ, whose
    answers are lm-eval's `["no", "yes"]`, `answer_shares(result, "boolq")[1]` is the model's "yes" rate: a yes/no
    bias moves BoolQ's accuracy and flips without the model knowing more or less.

    Args:
        result ([`ZeroShotResult`]): A model's result, with its questions' records.
        task (`str`): One of its tasks (e.g. `"boolq"`).

    Returns:
        `dict[int, float]`: each answer index, from 0 to the last (the records' number of log-likelihoods, or the
        largest chosen), and its share of the questions; the shares add up to 1.

    Raises:
        InvalidInputError: where `result` has no records of `task`.
    """
    questions = next((entry.questions for entry in result.tasks if entry.task == task), None)
    if not questions:
        raise InvalidInputError(f"The result has no per-question records for {task}: evaluate the model on it with its records.")
    count = max(max(len(question.loglikelihoods), question.choice + 1) for question in questions)
    return {index: sum(question.choice == index for question in questions) / len(questions) for index in range(count)}


def flips(
    result: ZeroShotResult, reference: ZeroShotResult, names: Sequence[str] = ("the model", "the reference")
) -> FlipsResult:
    """A model's flips against a reference model on the same zero-shot questions: per task and pooled, the share of
    questions whose right/wrong differs from the reference's, the share whose chosen answer differs, and the flips
    each way; and over the pooled questions, the flips per quartile of the reference's margins, each question's
    quartile cut among its own task's margins ([`margin_quartiles_by_task`]: raw margins are on very different scales
    per task), and on the questions whose margin is above their task's median (the confident ones). The measure of
    Dutta et al., "Accuracy is Not All You Need" (NeurIPS 2024), who find that flips come mostly from questions where
    the reference's top answer barely wins.

    Args:
        result ([`ZeroShotResult`]): The model's, with its questions' records.
        reference ([`ZeroShotResult`]): The reference model's (the dense one), with its records, on the same tasks
            (in any order), splits and data sources, and on every question `result` answered (or more).
        names (`Sequence[str]`, defaults to `("the model", "the reference")`): The names of the model and the
            reference, for the errors; the reference's is stored in the result.

    Returns:
        [`FlipsResult`]: the tasks in `result`'s order; without the margin split (`by_margin`, `confident` and
        `margin_edges` `None`)
        where a reference record has fewer than two log-likelihoods.

    Raises:
        InvalidInputError: when either result has a task without records, a task was scored on another split or from
            another source, or the reference misses some of the model's questions (or tasks).
    """
    records, reference_records = question_records(result, names[0]), question_records(reference, names[1])
    check_same_data(result, reference, names[0], names[1])
    check_reference_covers(records, reference_records, f"{names[0]} was", names[1])
    outcome = FlipsResult(reference=names[1])
    pooled, pooled_tasks = [], []
    for task, questions in records.items():
        pairs = [(questions[i], reference_records[task][i]) for i in sorted(questions)]
        outcome.tasks.append(_task_flips(task, pairs))
        pooled += pairs
        pooled_tasks += [task] * len(pairs)
    outcome.pooled = _task_flips("pooled", pooled)
    outcome.by_margin, outcome.confident, outcome.margin_edges = _margin_split(pooled_tasks, pooled)
    return outcome


def check_flips_reference(
    reference: ZeroShotResult | None,
    tasks: Sequence[str],
    task_data: str = "hub",
    limit: int | None = None,
    subsets: Mapping[str, int] = STANDARD_SUBSETS,
    name: str = "the reference",
) -> None:
    """Refuses, before anything runs, a reference whose records cannot give the flips of an evaluation of `tasks`
    with these settings ([`~optimum_gradmap.evaluation.zero_shot_accuracy`]'s): a task it has no records for, scored
    on another split or from another source, or questions the evaluation will score that it did not answer.

    Args:
        reference ([`ZeroShotResult`], *optional*): The reference's zero-shot result, with its records.
        tasks (`Sequence[str]`): The tasks the evaluation runs.
        task_data (`str`, defaults to `"hub"`): The evaluation's task data.
        limit (`int`, *optional*): The evaluation's questions per task.
        subsets (`Mapping[str, int]`, defaults to `STANDARD_SUBSETS`): The evaluation's subsets (seed `SUBSET_SEED`).
        name (`str`, defaults to `"the reference"`): The reference's name, for the errors.

    Raises:
        InvalidInputError: saying what the reference lacks and how to evaluate it.
    """
    how = "evaluate it with the same --tasks, --task-data, --task-limit and subsets, and keep its .questions.jsonl file"
    if reference is None:
        raise InvalidInputError(f"{name} has no zero-shot results to count flips against: {how}.")
    scored = {entry.task: entry for entry in reference.tasks}
    for task in tasks:
        entry = scored.get(task)
        if entry is None or not entry.questions:
            raise InvalidInputError(f"{name} has no per-question records for {task}, so no flips can be counted: {how}.")
        split, source = scored_split_and_source(task, task_data)
        if (entry.split, entry.source) != (split, source):
            raise InvalidInputError(
                f"{task}: {name} was scored on split {entry.split!r} from {entry.source!r}, this evaluation scores split "
                f"{split!r} from {source!r} (task data {task_data!r}): {how}."
            )
        if entry.split_size is not None:
            missing = set(question_ids(task, entry.split_size, limit, subsets, SUBSET_SEED))
            missing -= {question.doc_id for question in entry.questions}
            if missing:
                raise InvalidInputError(
                    f"{name} has no answers to {len(missing)} of the {task} questions this evaluation scores (its limit "
                    f"{reference.limit}, this one's {limit}): {how}."
                )
