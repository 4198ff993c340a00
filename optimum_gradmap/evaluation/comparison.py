# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Paired comparison of two models' zero-shot answers, question by question.

Two models evaluated on the same questions differ on few of them: their accuracies' difference is
measured much more precisely from the pairs than from two independent accuracies. For each task and
pooled over every question (each counted once):

- each model's accuracy;
- the paired difference d = mean over questions of (right_b - right_a), with its standard error
  sd(right_b - right_a) / sqrt(n);
- McNemar's exact test: under "no difference", a question one model gets right and the other wrong is as
  likely to favour either, so the number favouring B among the n_discordant such questions is
  Binomial(n_discordant, 1/2); the two-sided p-value;
- with a reference model (the dense one), each model's retained accuracy: its accuracy as a percentage of
  the reference's (per task, and for the average over tasks, as LinearPatch and ReplaceMe report it);
  undefined (`None`) where the reference's accuracy is 0.

Tasks are paired by name (the results may list them in any order), and only results scored on the same
split of the same data: a task scored on its validation split is never paired with its test split.

The average over tasks (each task weighted equally, the papers' "zero-shot average") has the standard error
sqrt(sum over tasks of SE_t^2) / number of tasks.

With a reference, the two models' flips against it are compared the same way, per task and pooled: a question
flips when a model's right/wrong differs from the reference's (Dutta et al., "Accuracy is Not All You Need",
NeurIPS 2024: flips track what compression damages better than accuracy differences, in which flips either way
cancel out). The paired difference of the flip shares, its standard error and McNemar's test are computed from each
question's flip flags (1 flipped, 0 not) exactly as the accuracies' are from its right/wrong flags. Where the
reference's records hold every answer's log-likelihood, the pooled questions are also cut into the quartiles of the
reference's margins (its chosen answer's log-likelihood minus the next best's,
[`~optimum_gradmap.evaluation.margins.question_margin`]), and the two models' flips are compared within each
quartile and on the confident questions, those whose reference margin is above its task's median (Dutta et al. find
flips come mostly from questions where the reference's top answer barely wins). The quartiles are cut within each
task, then pooled ([`~optimum_gradmap.evaluation.margins.margin_quartiles_by_task`]): raw margins are on very
different scales per task (on SmolLM2-135M's dense answers the median margin is 13.2 nats on HellaSwag, 0.80 on
WinoGrande), so quartiles of the pooled margins would sort the questions by task more than by how sure the reference
was.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import InvalidInputError
from .fidelity import check_reference_covers, check_same_data, question_records
from .margins import format_margin_edges, margin_quartiles_by_task, question_margin
from .zero_shot import ZeroShotResult


def mcnemar_p_value(only_a: int, only_b: int) -> float:
    """The two-sided p-value of McNemar's exact test: twice the probability of a split of the discordant
    questions at least as uneven as (`only_a`, `only_b`) under Binomial(only_a + only_b, 1/2), at most 1.

    Args:
        only_a (`int`): Questions only model A answers right.
        only_b (`int`): Questions only model B answers right.

    Returns:
        `float`: The p-value.
    """
    discordant = only_a + only_b
    if discordant == 0:
        return 1.0
    smaller = min(only_a, only_b)
    log_half = discordant * math.log(0.5)
    tail = sum(
        math.exp(math.lgamma(discordant + 1) - math.lgamma(k + 1) - math.lgamma(discordant - k + 1) + log_half)
        for k in range(smaller + 1)
    )
    return min(1.0, 2.0 * tail)


def _paired_flags(
    task: str, flags_a: Sequence[int], flags_b: Sequence[int]
) -> tuple[int, float, float, float, float, int, int, float]:
    """The paired comparison of two models' 0/1 flags on the same questions, in the same order (right answers, or flips):
    the number of questions, each model's mean, the mean difference (b - a), its standard error sd(b - a) / sqrt(n),
    the questions flagged for A only and for B only, and McNemar's exact p-value."""
    n = len(flags_a)
    if n != len(flags_b) or n == 0:
        raise InvalidInputError(f"{task}: paired answers need the same, non-empty questions ({n} and {len(flags_b)}).")
    differences = [b - a for a, b in zip(flags_a, flags_b)]
    mean = sum(differences) / n
    variance = sum((d - mean) ** 2 for d in differences) / (n - 1) if n > 1 else 0.0
    only_a, only_b = differences.count(-1), differences.count(1)
    return n, sum(flags_a) / n, sum(flags_b) / n, mean, math.sqrt(variance / n), only_a, only_b, mcnemar_p_value(only_a, only_b)


@dataclass
class PairedAccuracy:
    """Two models on the same questions of one task (or all tasks pooled).

    Attributes:
        task (`str`): The task, or `"pooled"` for every question of every task.
        num_questions (`int`): Questions both models answered.
        acc_a, acc_b (`float`): Each model's accuracy on them.
        difference (`float`): acc_b - acc_a, the mean paired difference.
        stderr (`float`): Its standard error, from the paired differences.
        only_a, only_b (`int`): Questions only A, only B got right.
        p_value (`float`): McNemar's exact two-sided p-value.
        retained_a, retained_b (`float`, *optional*): Each accuracy as a percentage of the reference model's
            (`None` without a reference, or where its accuracy is 0).
    """

    task: str
    num_questions: int
    acc_a: float
    acc_b: float
    difference: float
    stderr: float
    only_a: int
    only_b: int
    p_value: float
    retained_a: float | None = None
    retained_b: float | None = None

    @classmethod
    def from_answers(cls, task: str, right_a: Sequence[int], right_b: Sequence[int]) -> PairedAccuracy:
        """From each model's right (1) / wrong (0) answer to the same questions, in the same order.

        Args:
            task (`str`): The task's name.
            right_a (`Sequence[int]`): Model A's answers, 1 right, 0 wrong.
            right_b (`Sequence[int]`): Model B's, for the same questions.

        Returns:
            [`PairedAccuracy`].
        """
        return cls(task, *_paired_flags(task, right_a, right_b))


@dataclass
class PairedFlips:
    """Two models' flips against the same reference (the dense model) on the same questions of one task, or all
    tasks pooled. A question flips when a model's right/wrong differs from the reference's (Dutta et al., "Accuracy
    is Not All You Need", NeurIPS 2024).

    Attributes:
        task (`str`): The task, or `"pooled"` for every question of every task.
        num_questions (`int`): Questions both models and the reference answered.
        flips_a, flips_b (`float`): The share of them each model flips.
        difference (`float`): flips_b - flips_a, the mean paired difference.
        stderr (`float`): Its standard error, from the paired differences of the flip flags.
        only_a, only_b (`int`): Questions only A, only B flips.
        p_value (`float`): McNemar's exact two-sided p-value.
    """

    task: str
    num_questions: int
    flips_a: float
    flips_b: float
    difference: float
    stderr: float
    only_a: int
    only_b: int
    p_value: float

    @classmethod
    def from_flags(cls, task: str, flipped_a: Sequence[int], flipped_b: Sequence[int]) -> PairedFlips:
        """From each model's flip flag (1 flipped, 0 not) on the same questions, in the same order.

        Args:
            task (`str`): The task's name.
            flipped_a (`Sequence[int]`): Model A's flags.
            flipped_b (`Sequence[int]`): Model B's, for the same questions.

        Returns:
            [`PairedFlips`].
        """
        return cls(task, *_paired_flags(task, flipped_a, flipped_b))


@dataclass
class ZeroShotComparison:
    """Model B against model A on the same zero-shot questions (see the module docstring).

    Attributes:
        model_a, model_b (`str`): Their names.
        tasks (`list[PairedAccuracy]`): Per task.
        pooled (`PairedAccuracy`): Every question of every task, each counted once.
        average_a, average_b (`float`): The average over tasks of each model's accuracy.
        average_difference (`float`), average_stderr (`float`): Their difference and its standard error.
        reference (`str`, *optional*): The model retained accuracy is measured against.
        average_reference (`float`, *optional*): Its average over tasks.
        retained_a, retained_b (`float`, *optional*): Each average as a percentage of the reference's (`None`
            without a reference, or where its average is 0).
        flips (`list[PairedFlips]`): With a reference, per task, the two models' flips against it.
        pooled_flips ([`PairedFlips`], *optional*): With a reference, their flips over every question of every task.
        margin_edges (`dict[str, list[float]]`, *optional*): With a reference whose records hold the answers'
            log-likelihoods, per task, the five edges of the quartiles of its margins on that task's questions
            (smallest, quartiles, largest; the middle one the task's median).
        flips_by_margin (`list[PairedFlips]`): Then, the two models' flips on the pooled questions of each margin
            quartile, each question's quartile cut among its own task's margins and every task's quartile q pooled
            (`task` `"within-task Q1"` to `"within-task Q4"`, smallest margins first; a quartile without questions is
            left out).
        confident_flips ([`PairedFlips`], *optional*): Then, their flips on the pooled questions whose reference margin
            is above their own task's median (`task` `"confident"`; `None` where no margin is).
    """

    model_a: str
    model_b: str
    tasks: list[PairedAccuracy] = field(default_factory=list)
    pooled: PairedAccuracy | None = None
    average_a: float = 0.0
    average_b: float = 0.0
    average_difference: float = 0.0
    average_stderr: float = 0.0
    reference: str | None = None
    average_reference: float | None = None
    retained_a: float | None = None
    retained_b: float | None = None
    flips: list[PairedFlips] = field(default_factory=list)
    pooled_flips: PairedFlips | None = None
    margin_edges: dict[str, list[float]] | None = None
    flips_by_margin: list[PairedFlips] = field(default_factory=list)
    confident_flips: PairedFlips | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        """A table for the terminal: per task and pooled, both accuracies, the difference with its standard
        error and McNemar's p-value, and the retained accuracy against the reference; with a reference, a second
        table of the two models' flips against it (with its margins, also per within-task margin quartile and on the
        confident questions)."""
        retained = self.reference is not None
        lines = [
            f"B = {self.model_b}  against  A = {self.model_a}" + (f"  (retained: % of {self.reference})" if retained else ""),
            f"{'task':<15}{'questions':>10}{'acc A':>9}{'acc B':>9}{'B - A':>9}{'+/- SE':>9}{'only A':>8}{'only B':>8}{'p':>9}"
            + (f"{'kept A %':>10}{'kept B %':>10}" if retained else ""),
        ]
        for entry in [*self.tasks, self.pooled]:
            line = (
                f"{entry.task:<15}{entry.num_questions:>10}{entry.acc_a:>9.4f}{entry.acc_b:>9.4f}{entry.difference:>+9.4f}"
                f"{entry.stderr:>9.4f}{entry.only_a:>8}{entry.only_b:>8}{entry.p_value:>9.3g}"
            )
            if retained:
                line += _percent_column(entry.retained_a) + _percent_column(entry.retained_b)
            lines.append(line)
        average = (
            f"average of {len(self.tasks)} tasks: A {self.average_a:.4f}, B {self.average_b:.4f}, "
            f"B - A {self.average_difference:+.4f} +/- {self.average_stderr:.4f}"
        )
        if retained and self.retained_a is not None:
            average += f"; retained: A {self.retained_a:.1f}%, B {self.retained_b:.1f}% of {self.average_reference:.4f}"
        elif retained:
            average += f"; retained: undefined (the reference's average is {self.average_reference:.4f})"
        lines.append(average)
        if self.pooled_flips is not None:
            lines += [
                f"flips against {self.reference} (share of questions whose right/wrong differs from its answer)",
                f"{'task':<15}{'questions':>10}{'flips A':>9}{'flips B':>9}{'B - A':>9}{'+/- SE':>9}{'only A':>8}{'only B':>8}"
                f"{'p':>9}",
            ]
            margin_rows = [*self.flips_by_margin, *([self.confident_flips] if self.confident_flips is not None else [])]
            for entry in [*self.flips, self.pooled_flips, *margin_rows]:
                lines.append(
                    f"{entry.task:<15}{entry.num_questions:>10}{entry.flips_a:>9.4f}{entry.flips_b:>9.4f}"
                    f"{entry.difference:>+9.4f}{entry.stderr:>9.4f}{entry.only_a:>8}{entry.only_b:>8}{entry.p_value:>9.3g}"
                )
            if self.margin_edges is not None:
                lines.append(
                    f"within-task Q1-Q4: the pooled questions by quartile of {self.reference}'s margin (its answer's "
                    "log-likelihood minus the next best, nats) within their own task, each task cut at its own quartiles "
                    "and pooled; confident: margin above its task's median; edges per task: "
                    f"{format_margin_edges(self.margin_edges)}"
                )
        return "\n".join(lines)


def _percent_column(value: float | None) -> str:
    return f"{'undefined':>10}" if value is None else f"{value:>10.1f}"


def _retained(accuracy: float, reference_accuracy: float) -> float | None:
    """`accuracy` as a percentage of `reference_accuracy`; `None` (undefined) where the reference's is 0."""
    return 100 * accuracy / reference_accuracy if reference_accuracy > 0 else None


def _answers(result: ZeroShotResult, name: str) -> dict[str, dict[int, int]]:
    """Every task's right (1) / wrong (0) answers by question id."""
    return {task: {i: record.acc for i, record in records.items()} for task, records in question_records(result, name).items()}


def _compare_by_margin(
    comparison: ZeroShotComparison, flipped_a: list[int], flipped_b: list[int], tasks: list[str], margins: list[float | None]
) -> None:
    """Fills the comparison's flips per quartile of the reference's margins, cut within each task
    ([`~optimum_gradmap.evaluation.margins.margin_quartiles_by_task`]) and pooled, and on its confident questions
    (margin above its task's median), from the pooled questions' flip flags, tasks and margins; nothing where a
    margin is missing."""
    if not margins or any(margin is None for margin in margins):
        return
    comparison.margin_edges, quartiles = margin_quartiles_by_task(tasks, margins)
    for quartile in range(1, 5):
        members = [i for i, q in enumerate(quartiles) if q == quartile]
        if members:
            comparison.flips_by_margin.append(
                PairedFlips.from_flags(
                    f"within-task Q{quartile}", [flipped_a[i] for i in members], [flipped_b[i] for i in members]
                )
            )
    confident = [i for i, q in enumerate(quartiles) if q >= 3]  # above its task's median
    if confident:
        comparison.confident_flips = PairedFlips.from_flags(
            "confident", [flipped_a[i] for i in confident], [flipped_b[i] for i in confident]
        )


def compare_zero_shot(
    result_a: ZeroShotResult,
    result_b: ZeroShotResult,
    reference: ZeroShotResult | None = None,
    names: Sequence[str] = ("A", "B", "reference"),
) -> ZeroShotComparison:
    """Compares two models' zero-shot answers question by question (see the module docstring).

    Args:
        result_a, result_b ([`ZeroShotResult`]): The two models' results, with their questions' records,
            on the same tasks (in any order), questions, splits and data sources.
        reference ([`ZeroShotResult`], *optional*): The dense model's, on the same questions (or more): each
            model's accuracy is then also given as a percentage of its accuracy (retained accuracy, undefined
            where the reference's accuracy is 0), and the two models' flips against it are compared, pooled, per
            task, per quartile of its margins within each task and on its confident questions.
        names (`Sequence[str]`, defaults to `("A", "B", "reference")`): The names of A, B and the reference,
            for the table and the errors.

    Returns:
        [`ZeroShotComparison`]: the tasks in `result_a`'s order.

    Raises:
        InvalidInputError: when the two results do not hold the same tasks and questions, a task was scored on
            another split or from another source, the reference misses some of the questions, or a result has
            no records.
    """
    answers_a, answers_b = _answers(result_a, names[0]), _answers(result_b, names[1])
    answers_reference = _answers(reference, names[2]) if reference is not None else None
    if set(answers_a) != set(answers_b) or any(set(answers_a[t]) != set(answers_b[t]) for t in answers_a):
        raise InvalidInputError(
            f"{names[0]} and {names[1]} were not evaluated on the same questions: evaluate both with the same tasks, "
            "task data, limit and subsets."
        )
    check_same_data(result_a, result_b, names[0], names[1])
    if reference is not None:
        check_same_data(result_a, reference, names[0], names[2])
        check_reference_covers(answers_a, answers_reference, f"{names[0]} and {names[1]} were", names[2])
    comparison = ZeroShotComparison(names[0], names[1], reference=names[2] if reference is not None else None)
    pooled_a, pooled_b, pooled_flips_a, pooled_flips_b, pooled_tasks, pooled_margins = [], [], [], [], [], []
    if reference is not None:
        reference_records = question_records(reference, names[2])
    for task, questions in answers_a.items():
        ids = sorted(questions)
        right_a, right_b = [questions[i] for i in ids], [answers_b[task][i] for i in ids]
        entry = PairedAccuracy.from_answers(task, right_a, right_b)
        if answers_reference is not None:
            right_reference = [answers_reference[task][i] for i in ids]
            reference_acc = sum(right_reference) / len(ids)
            entry.retained_a, entry.retained_b = _retained(entry.acc_a, reference_acc), _retained(entry.acc_b, reference_acc)
            flipped_a = [int(a != r) for a, r in zip(right_a, right_reference)]
            flipped_b = [int(b != r) for b, r in zip(right_b, right_reference)]
            comparison.flips.append(PairedFlips.from_flags(task, flipped_a, flipped_b))
            pooled_flips_a += flipped_a
            pooled_flips_b += flipped_b
            pooled_tasks += [task] * len(ids)
            pooled_margins += [question_margin(reference_records[task][i]) for i in ids]
        comparison.tasks.append(entry)
        pooled_a += right_a
        pooled_b += right_b
    comparison.pooled = PairedAccuracy.from_answers("pooled", pooled_a, pooled_b)
    if answers_reference is not None:
        comparison.pooled_flips = PairedFlips.from_flags("pooled", pooled_flips_a, pooled_flips_b)
        _compare_by_margin(comparison, pooled_flips_a, pooled_flips_b, pooled_tasks, pooled_margins)
    count = len(comparison.tasks)
    comparison.average_a = sum(entry.acc_a for entry in comparison.tasks) / count
    comparison.average_b = sum(entry.acc_b for entry in comparison.tasks) / count
    comparison.average_difference = comparison.average_b - comparison.average_a
    comparison.average_stderr = math.sqrt(sum(entry.stderr**2 for entry in comparison.tasks)) / count
    if answers_reference is not None:
        per_task = [sum(answers_reference[t][i] for i in answers_a[t]) / len(answers_a[t]) for t in answers_a]
        comparison.average_reference = sum(per_task) / count
        comparison.retained_a = _retained(comparison.average_a, comparison.average_reference)
        comparison.retained_b = _retained(comparison.average_b, comparison.average_reference)
        pooled_reference = sum(answers_reference[t][i] for t in answers_a for i in answers_a[t]) / len(pooled_a)
        comparison.pooled.retained_a = _retained(comparison.pooled.acc_a, pooled_reference)
        comparison.pooled.retained_b = _retained(comparison.pooled.acc_b, pooled_reference)
    return comparison
