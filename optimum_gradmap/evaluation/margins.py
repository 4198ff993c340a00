# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""The reference's margins on zero-shot questions and their quartiles: a question's margin ([`question_margin`]) is the
log-likelihood of the answer the reference chose minus the next best answer's, and each task's margins are cut into
their own quartiles ([`margin_quartiles_by_task`]), raw margins being on very different scales per task (see
[`optimum_gradmap.evaluation.fidelity`]). [`~optimum_gradmap.evaluation.flips`] counts the flips per quartile."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from ..errors import InvalidInputError
from .zero_shot import QuestionRecord


def question_margin(record: QuestionRecord) -> float | None:
    """The margin of a model's answer to one question: the log-likelihood of the answer it chose (the largest, as
    `choice` is chosen) minus the next best answer's, in nats; 0 where the two best tie. Dutta et al., "Accuracy is
    Not All You Need" (NeurIPS 2024), find that a compressed model's flips come mostly from questions where the
    reference's margin is small.

    Args:
        record ([`QuestionRecord`]): The question's record, with every answer's log-likelihood.

    Returns:
        `float`, or `None` for a record with fewer than two log-likelihoods (written without them).
    """
    values = sorted(record.loglikelihoods or (), reverse=True)
    return values[0] - values[1] if len(values) >= 2 else None


def _quantile(ordered: Sequence[float], q: float) -> float:
    """The `q` quantile of ascending `ordered` by linear interpolation between order statistics (numpy's default)."""
    position = q * (len(ordered) - 1)
    below = math.floor(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)


def margin_quartiles(margins: Sequence[float]) -> tuple[list[float], list[int]]:
    """Cuts margins into quartiles: the edges are the smallest margin, the quartiles (linear interpolation between
    order statistics, numpy's default: the middle edge is the median, the mean of the two middle margins for an even
    count) and the largest margin, and each margin goes to the quartile whose edges hold it, above the lower and at
    most the upper (the first: from the smallest). Ties at an edge all go to the lower quartile, so every margin is in
    exactly one quartile, and a margin is above the median exactly when it is in the third or fourth.

    Args:
        margins (`Sequence[float]`): One per question ([`question_margin`]), at least one: those of one task
            ([`flips`] cuts each task's margins alone, [`margin_quartiles_by_task`]).

    Returns:
        `tuple[list[float], list[int]]`: the five edges, ascending, and each margin's quartile, 1 to 4.

    Raises:
        InvalidInputError: for no margins.
    """
    if not margins:
        raise InvalidInputError("No margins to cut into quartiles.")
    ordered = sorted(margins)
    edges = [ordered[0], _quantile(ordered, 0.25), _quantile(ordered, 0.5), _quantile(ordered, 0.75), ordered[-1]]
    return edges, [1 + sum(margin > edge for edge in edges[1:4]) for margin in margins]


def margin_quartiles_by_task(tasks: Sequence[str], margins: Sequence[float]) -> tuple[dict[str, list[float]], list[int]]:
    """Cuts each task's margins into its own quartiles: [`margin_quartiles`] on the margins of each task's questions
    alone (the same edges, ties at an edge in the lower quartile), so a question is in quartile 3 or 4 exactly when
    its margin is above its own task's median. Raw margins are differences of log-likelihoods summed over an answer's
    tokens, on very different scales per task (on SmolLM2-135M's dense answers the median margin is 13.2 nats on
    HellaSwag and 0.80 on WinoGrande, see the module docstring): quartiles of the pooled margins would sort the
    questions by task more than by how sure the model was. Dutta et al., "Accuracy is Not All You Need" (NeurIPS
    2024), find flips come mostly from questions where the reference's top answer barely wins.

    Args:
        tasks (`Sequence[str]`): Each question's task.
        margins (`Sequence[float]`): Each question's margin ([`question_margin`]), in the same order; at least one.

    Returns:
        `tuple[dict[str, list[float]], list[int]]`: each task's five edges (in the order the tasks first appear), and
        each question's quartile among its task's margins, 1 to 4.

    Raises:
        InvalidInputError: for no margins, or not one task per margin.
    """
    if len(tasks) != len(margins):
        raise InvalidInputError(f"{len(margins)} margins for {len(tasks)} questions' tasks: give one task per margin.")
    if not margins:
        raise InvalidInputError("No margins to cut into quartiles.")
    members: dict[str, list[int]] = {}
    for index, task in enumerate(tasks):
        members.setdefault(task, []).append(index)
    edges, quartiles = {}, [0] * len(margins)
    for task, indices in members.items():
        edges[task], task_quartiles = margin_quartiles([margins[i] for i in indices])
        for index, quartile in zip(indices, task_quartiles):
            quartiles[index] = quartile
    return edges, quartiles


def format_margin_edges(edges: Mapping[str, Sequence[float]]) -> str:
    """`"piqa 0.1, 0.4, 1.2, 2.2, 3; arc_easy ..."`: each task's five margin edges ([`margin_quartiles_by_task`]),
    3 significant digits, for tables and summaries.

    Args:
        edges (`Mapping[str, Sequence[float]]`): Each task's edges.

    Returns:
        `str`.
    """
    return "; ".join(f"{task} " + ", ".join(f"{edge:.3g}" for edge in task_edges) for task, task_edges in edges.items())
