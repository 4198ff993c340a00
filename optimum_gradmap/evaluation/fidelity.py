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

[`~optimum_gradmap.evaluation.evaluate`] reports both (`reference=` and `reference_model=`), and
[`~optimum_gradmap.evaluation.compare_zero_shot`] compares two models' flips against the same reference, question
by question.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import InvalidInputError
from ..passes import calibration_batches, calibration_mode, input_device, summed_next_token_loss
from .comparison import _check_reference_covers, _check_same_data, _records
from .zero_shot import STANDARD_SUBSETS, SUBSET_SEED, ZeroShotResult, question_ids, scored_split_and_source


# ------------------------------------------------------------------------------------------ KL divergence
@dataclass
class KLDivergence:
    """The next-token KL divergence of a model from a reference model on evaluation segments (see the module docstring).

    Attributes:
        mean (`float`): KL(p_reference || p_model) in nats, averaged over every predicted token of every segment.
        stderr (`float`, *optional*): Its standard error: the standard deviation over segments of each segment's mean,
            / sqrt(num_segments) (`None` for one segment).
        num_segments (`int`): Segments evaluated.
        num_predicted_tokens (`int`): Tokens whose divergence was averaged (`segment_length - 1` per segment).
    """

    mean: float
    stderr: float | None
    num_segments: int
    num_predicted_tokens: int


def _segment_kl(logits: torch.Tensor, reference_logits: torch.Tensor) -> torch.Tensor:
    """Each row's mean over its predicted positions (`[:-1]`) of KL(softmax(reference) || softmax(model)), computed in
    float32 from the log-softmax of both, one row at a time (a row's vocabulary-sized tensors only); float64 on the
    logits' device (no host synchronisation: the caller brings the rows back once)."""
    if logits.shape != reference_logits.shape:
        raise InvalidInputError(
            f"The model's logits have shape {tuple(logits.shape)}, the reference model's {tuple(reference_logits.shape)}: "
            "the KL divergence needs two models with the same vocabulary (the same tokenizer)."
        )
    means = []
    for row, reference_row in zip(logits, reference_logits):
        log_q = torch.log_softmax(row[:-1].float(), dim=-1)
        log_p = torch.log_softmax(reference_row[:-1].to(log_q.device).float(), dim=-1)
        p = log_p.exp()
        terms = torch.where(p > 0, p * (log_p - log_q), torch.zeros((), dtype=p.dtype, device=p.device))  # 0 log 0 = 0
        means.append(terms.sum(dim=-1).double().mean())
    return torch.stack(means)


def next_token_kl_per_segment(
    model: nn.Module,
    reference_model: nn.Module,
    segments: torch.LongTensor,
    batch_size: int = 8,
    progress_bar: bool = True,
) -> torch.Tensor:
    """Each segment's mean next-token KL divergence of `model` from `reference_model` (see the module docstring).

    Both models run batch by batch, each on its own device (the batch goes to each model's input device), in eval
    mode without gradients; no logits are kept beyond a batch.

    Args:
        model (`nn.Module`): The causal LM measured (the pruned one).
        reference_model (`nn.Module`): The causal LM it is measured against (the dense one), with the same vocabulary.
        segments (`torch.LongTensor` of shape `(num_segments, segment_length)`): Evaluation segments, possibly none.
        batch_size (`int`, defaults to 8): Segments per forward pass of each model.
        progress_bar (`bool`, defaults to `True`): Show a progress bar.

    Returns:
        `torch.Tensor` of shape `(num_segments,)`: float64, on CPU.
    """
    return _kl_and_loss_per_segment(model, reference_model, segments, batch_size, progress_bar)[0]


def _kl_and_loss_per_segment(
    model: nn.Module, reference_model: nn.Module, segments: torch.LongTensor, batch_size: int, progress_bar: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """[`next_token_kl_per_segment`], and from the same logits the model's next-token loss summed over every predicted
    token, batch by batch as [`~optimum_gradmap.passes.next_token_loss_sum`] sums it (the same float64 scalar).
    Both are summed on the logits' device and brought to the CPU once, after the last batch (no per-batch sync)."""
    reference_device = input_device(reference_model)
    means, total = [], None
    with (
        calibration_mode(reference_model),
        calibration_batches(model, segments, batch_size, "KL divergence", progress_bar) as batches,
    ):
        for batch in batches:
            logits = model(input_ids=batch, use_cache=False).logits
            reference_logits = reference_model(input_ids=batch.to(reference_device), use_cache=False).logits
            means.append(_segment_kl(logits, reference_logits))
            batch_total = summed_next_token_loss(logits, batch)
            total = batch_total if total is None else total + batch_total.to(total.device)
    if not means:
        return torch.zeros(0, dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    return torch.cat([row.to(means[0].device) for row in means]).cpu(), total.cpu()


def perplexity_and_kl(
    model: nn.Module,
    reference_model: nn.Module,
    segments: torch.LongTensor,
    batch_size: int = 8,
    progress_bar: bool = True,
    shared_by_processes: bool = False,
) -> tuple[float, KLDivergence]:
    """The perplexity of `model` on `segments` ([`~optimum_gradmap.evaluation.perplexity`]) and its next-token KL
    divergence from `reference_model` ([`next_token_kl`]), from one pass of each model: `model` runs once for both.

    Args:
        model, reference_model, segments, batch_size, progress_bar, shared_by_processes: As in [`next_token_kl`].

    Returns:
        `tuple[float, KLDivergence]`.
    """
    from .. import distributed

    _check_segments(segments)
    share = distributed.shard_any(segments)[0] if shared_by_processes else segments
    means, total = _kl_and_loss_per_segment(model, reference_model, share, batch_size, progress_bar)
    count = share.shape[0] * (share.shape[1] - 1)
    loss = distributed.mean_from_sums(total, count) if shared_by_processes else float(total) / count
    return math.exp(loss), _kl_result(distributed.gather_rows(means) if shared_by_processes else means, segments)


def _check_segments(segments: torch.LongTensor) -> None:
    if segments.dim() != 2 or segments.shape[0] == 0 or segments.shape[1] < 2:
        raise InvalidInputError(
            f"The KL divergence needs at least one segment of two tokens or more; got segments of shape {tuple(segments.shape)}."
        )


def _kl_result(means: torch.Tensor, segments: torch.LongTensor) -> KLDivergence:
    count = means.numel()
    stderr = float(means.std() / math.sqrt(count)) if count > 1 else None
    return KLDivergence(float(means.mean()), stderr, count, count * (segments.shape[1] - 1))


def next_token_kl(
    model: nn.Module,
    reference_model: nn.Module,
    segments: torch.LongTensor,
    batch_size: int = 8,
    progress_bar: bool = True,
    shared_by_processes: bool = False,
) -> KLDivergence:
    """The next-token KL divergence KL(p_reference || p_model) of `model` from `reference_model`, averaged over every
    predicted token of `segments` (those perplexity averages over), with its standard error over segments. The
    measure of Dutta et al., "Accuracy is Not All You Need" (NeurIPS 2024).

    Args:
        model (`nn.Module`): The causal LM measured (the pruned one).
        reference_model (`nn.Module`): The causal LM it is measured against (the dense one), with the same vocabulary;
            its parameters may be on another device than `model`'s.
        segments (`torch.LongTensor` of shape `(num_segments, segment_length)`): From
            [`~optimum_gradmap.evaluation.load_evaluation_segments`].
        batch_size (`int`, defaults to 8): Segments per forward pass of each model.
        progress_bar (`bool`, defaults to `True`): Show a progress bar.
        shared_by_processes (`bool`, defaults to `False`): Under `torch.distributed`, every process calls this with the
            same segments, measures its contiguous share of them ([`~optimum_gradmap.distributed.shard_any`]) and
            gets the result on all of them (the segments' means are gathered,
            [`~optimum_gradmap.distributed.gather_rows`]). Without it, each process measures every segment.

    Returns:
        [`KLDivergence`].

    Raises:
        InvalidInputError: for no segment, segments of one token, or models whose vocabularies differ.
    """
    return perplexity_and_kl(model, reference_model, segments, batch_size, progress_bar, shared_by_processes)[1]


# ------------------------------------------------------------------------------------------ flips
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
class FlipsResult:
    """A model's flips against a reference model's answers to the same zero-shot questions (see the module docstring).

    Attributes:
        reference (`str`): The reference model's name.
        tasks (`list[TaskFlips]`): Per task, in the model's order.
        pooled ([`TaskFlips`], *optional*): Every question of every task.
    """

    reference: str
    tasks: list[TaskFlips] = field(default_factory=list)
    pooled: TaskFlips | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable."""
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> FlipsResult:
        """Builds a result from [`to_dict`]'s output.

        Args:
            values (`dict[str, Any]`): [`to_dict`]'s output.

        Returns:
            [`FlipsResult`].
        """
        pooled = values.get("pooled")
        return cls(
            reference=values["reference"],
            tasks=[TaskFlips(**entry) for entry in values.get("tasks", [])],
            pooled=TaskFlips(**pooled) if pooled is not None else None,
        )

    def summary_lines(self) -> list[str]:
        """One line per task and one pooled, for the terminal."""
        return [
            f"{entry.task}: {entry.flips:.2%} of {entry.num_questions} questions flipped against {self.reference} "
            f"({entry.right_to_wrong} right -> wrong, {entry.wrong_to_right} wrong -> right); "
            f"answer changed on {entry.answer_changes:.2%}"
            for entry in [*self.tasks, *([self.pooled] if self.pooled is not None else [])]
        ]


def _task_flips(task: str, pairs: Sequence[tuple[Any, Any]]) -> TaskFlips:
    """[`TaskFlips`] from (model's record, reference's record) pairs of the same questions."""
    right_to_wrong = sum(1 for mine, theirs in pairs if theirs.acc and not mine.acc)
    wrong_to_right = sum(1 for mine, theirs in pairs if mine.acc and not theirs.acc)
    changes = sum(1 for mine, theirs in pairs if mine.choice != theirs.choice)
    n = len(pairs)
    return TaskFlips(task, n, (right_to_wrong + wrong_to_right) / n, changes / n, right_to_wrong, wrong_to_right)


def flips(
    result: ZeroShotResult, reference: ZeroShotResult, names: Sequence[str] = ("the model", "the reference")
) -> FlipsResult:
    """A model's flips against a reference model on the same zero-shot questions: per task and pooled, the share of
    questions whose right/wrong differs from the reference's, the share whose chosen answer differs, and the flips
    each way. The measure of Dutta et al., "Accuracy is Not All You Need" (NeurIPS 2024).

    Args:
        result ([`ZeroShotResult`]): The model's, with its questions' records.
        reference ([`ZeroShotResult`]): The reference model's (the dense one), with its records, on the same tasks
            (in any order), splits and data sources, and on every question `result` answered (or more).
        names (`Sequence[str]`, defaults to `("the model", "the reference")`): The names of the model and the
            reference, for the errors; the reference's is stored in the result.

    Returns:
        [`FlipsResult`]: the tasks in `result`'s order.

    Raises:
        InvalidInputError: when either result has a task without records, a task was scored on another split or from
            another source, or the reference misses some of the model's questions (or tasks).
    """
    records, reference_records = _records(result, names[0]), _records(reference, names[1])
    _check_same_data(result, reference, names[0], names[1])
    _check_reference_covers(records, reference_records, f"{names[0]} was", names[1])
    outcome = FlipsResult(reference=names[1])
    pooled = []
    for task, questions in records.items():
        pairs = [(questions[i], reference_records[task][i]) for i in sorted(questions)]
        outcome.tasks.append(_task_flips(task, pairs))
        pooled += pairs
    outcome.pooled = _task_flips("pooled", pooled)
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
