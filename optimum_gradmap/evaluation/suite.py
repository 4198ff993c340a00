# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""One call that evaluates a model on a chosen set of measurements, and its JSON-serialisable result.

Given the dense model or its evaluation, the result also says how faithful the model stays to it (Dutta et al.,
"Accuracy is Not All You Need", NeurIPS 2024; [`optimum_gradmap.evaluation.fidelity`]): the next-token KL divergence
beside every perplexity (`reference_model`), and the zero-shot flips (`reference`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase
from transformers.utils import logging

from ..data import check_dataset_name
from ..errors import InvalidInputError
from ..files import write_atomically
from .fidelity import FlipsResult, check_flips_reference, flips
from .kl_divergence import perplexity_and_kl
from .perplexity import PerplexityResult, load_evaluation_segments, perplexity, protocol_name
from .speed import SpeedResult, inference_speed
from .zero_shot import STANDARD_SUBSETS, ZeroShotResult, check_zero_shot_settings, zero_shot_accuracy

logger = logging.get_logger(__name__)


@dataclass
class EvaluationResult:
    """Everything measured about one model, serialisable to JSON.

    Attributes:
        model (`str`): A name for the model (path, Hub id, or a label such as "GradMAP 25%").
        perplexities (`list[PerplexityResult]`): One entry per dataset and protocol.
        zero_shot ([`ZeroShotResult`], *optional*): Zero-shot task accuracies, when run.
        speed ([`SpeedResult`], *optional*): Inference speed, when measured.
        flips ([`FlipsResult`], *optional*): The zero-shot flips against a reference model's answers, when given
            (Dutta et al., "Accuracy is Not All You Need", NeurIPS 2024).
    """

    model: str
    perplexities: list[PerplexityResult] = field(default_factory=list)
    zero_shot: ZeroShotResult | None = None
    speed: SpeedResult | None = None
    flips: FlipsResult | None = None

    def to_dict(self) -> dict[str, Any]:
        """The summary, JSON-serialisable (the zero-shot questions' records are not in it: see [`to_json`])."""
        values = asdict(self)
        values["zero_shot"] = self.zero_shot.to_dict() if self.zero_shot is not None else None
        values["flips"] = self.flips.to_dict() if self.flips is not None else None
        return values

    def to_json(self, path: str | None = None) -> str:
        """Returns the summary as JSON, and writes it to `path` if given, with every zero-shot question's
        record beside it as JSON lines ([`records_path`]: one line per question, its task, id, answers'
        log-likelihoods, choice and whether it is right). Both files are written atomically.

        Args:
            path (`str`, *optional*): Where to write the summary.

        Returns:
            `str`: The summary as JSON.
        """
        text = json.dumps(self.to_dict(), indent=2)
        if path is not None:
            if self.zero_shot is not None:
                lines = "".join(json.dumps(record) + "\n" for record in self.zero_shot.records())
                write_atomically(records_path(path), lines)
            write_atomically(path, text + "\n")
        return text

    def summary(self) -> str:
        """A few readable lines: every perplexity (with its KL divergence from the reference model), task accuracy,
        flips against the reference and speed measured."""
        lines = [f"Evaluation of {self.model}"]
        for entry in self.perplexities:
            line = f"  {entry.dataset} perplexity: {entry.perplexity:.3f} ({entry.protocol}, {entry.num_segments} segments)"
            if entry.kl_to_reference is not None:
                error = f" +/- {entry.kl_stderr:.4f}" if entry.kl_stderr is not None else ""
                line += f"; KL from {entry.reference}: {entry.kl_to_reference:.4f}{error} nats/token"
            lines.append(line)
        if self.zero_shot:
            zero_shot = self.zero_shot
            for task in zero_shot.tasks:
                norm = "" if task.acc_norm is None else f", acc_norm {task.acc_norm:.4f}"
                error = f" +/- {task.acc_stderr:.4f}" if task.acc_stderr is not None else ""
                of = f" of {task.split_size}" if task.split_size and task.split_size != task.num_samples else ""
                lines.append(f"  {task.task} ({task.split}, {task.num_samples}{of} questions): acc {task.acc:.4f}{error}{norm}")
            questions = sum(task.num_samples for task in zero_shot.tasks)
            lines.append(
                f"  zero-shot: average acc {zero_shot.average_acc:.4f} over {len(zero_shot.tasks)} tasks, "
                f"{zero_shot.pooled_acc:.4f} over all {questions} questions ({zero_shot.seconds:.0f} s)"
            )
        if self.flips:
            lines += [f"  flips: {line}" for line in self.flips.summary_lines()]
        if self.speed:
            speed = self.speed
            lines.append(
                f"  decoding: {speed.decode_tokens_per_second:.2f} tokens/s, prefill of {speed.prompt_length} tokens: "
                f"{speed.prefill_latency_ms:.1f} ms (batch {speed.batch_size}, {speed.device}, median of {speed.repeats})"
            )
        return "\n".join(lines)

    @classmethod
    def from_dict(cls, values: dict[str, Any], records: Sequence[dict[str, Any]] = ()) -> "EvaluationResult":
        """Builds a result from [`to_dict`]'s output and, optionally, the zero-shot questions' records.

        Args:
            values (`dict[str, Any]`): [`to_dict`]'s output.
            records (`Sequence[dict[str, Any]]`, *optional*): The questions' records ([`records_path`]'s lines).

        Returns:
            [`EvaluationResult`].
        """
        values = dict(values)
        values["perplexities"] = [PerplexityResult(**entry) for entry in values.get("perplexities", [])]
        if values.get("zero_shot") is not None:
            values["zero_shot"] = ZeroShotResult.from_dict(values["zero_shot"], records)
        if values.get("speed") is not None:
            values["speed"] = SpeedResult(**values["speed"])
        if values.get("flips") is not None:
            values["flips"] = FlipsResult.from_dict(values["flips"])
        return cls(**values)

    @classmethod
    def from_json(cls, path: str) -> "EvaluationResult":
        """Reads a result written by [`to_json`], with its questions' records when they are beside it.

        Args:
            path (`str`): The summary's path.

        Returns:
            [`EvaluationResult`].
        """
        with open(path, encoding="utf-8") as file:
            values = json.load(file)
        records = []
        if os.path.isfile(records_path(path)):
            with open(records_path(path), encoding="utf-8") as file:
                records = [json.loads(line) for line in file if line.strip()]
        return cls.from_dict(values, records)


def records_path(path: str | os.PathLike) -> str:
    """Where [`EvaluationResult.to_json`] writes the zero-shot questions' records for a summary at `path`:
    `result.json` -> `result.questions.jsonl`.

    Args:
        path (`str` or `os.PathLike`): The summary's path.

    Returns:
        `str`: The records' path.
    """
    stem = os.fspath(path)[: -len(".json")] if os.fspath(path).endswith(".json") else os.fspath(path)
    return stem + ".questions.jsonl"


def evaluate(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    perplexity_datasets: Sequence[str] = ("wikitext2", "c4"),
    segment_length: int = 128,
    max_segments: int | None = None,
    tasks: Sequence[str] = (),
    task_limit: int | None = None,
    task_subsets: Mapping[str, int] = STANDARD_SUBSETS,
    task_data: str = "hub",
    speed: bool = False,
    batch_size: int = 8,
    model_name: str | None = None,
    progress_bar: bool = True,
    shared_by_processes: bool = False,
    reference_model: nn.Module | None = None,
    reference_model_name: str | None = None,
    reference: EvaluationResult | None = None,
) -> EvaluationResult:
    """Evaluates an in-memory model on a chosen set of perplexities, zero-shot tasks and speed, and its fidelity to a
    reference (the dense model): the next-token KL divergence beside every perplexity, and the zero-shot flips
    (Dutta et al., "Accuracy is Not All You Need", NeurIPS 2024; [`~optimum_gradmap.evaluation.fidelity`]).

    Args:
        model (`nn.Module`): A causal LM (dense, or pruned in place; no save/reload needed).
        tokenizer (`PreTrainedTokenizerBase`): Its tokenizer.
        perplexity_datasets (`Sequence[str]`, defaults to `("wikitext2", "c4")`): Dataset names with an
            evaluation split (see [`optimum_gradmap.data`]), from the Hub; offline, `"offline:wikipedia"`
            and `"offline:web_text"`. `()` for none.
        segment_length (`int`, defaults to 128): Perplexity segment length: 128 is the paper's protocol, 2048
            the common one in other pruning papers.
        max_segments (`int`, *optional*): Evaluate only the first segments, for quick runs; stated
            in the result through `num_segments`.
        tasks (`Sequence[str]`, defaults to `()`): Zero-shot tasks (see [`zero_shot_accuracy`]), e.g.
            `PAPER_TASKS` for the paper's seven.
        task_limit (`int`, *optional*): The first questions of each task only, for quick runs (stated in the result).
        task_subsets (`Mapping[str, int]`, defaults to `STANDARD_SUBSETS`): Without `task_limit`, the tasks
            scored on a fixed random subset of their questions, and its size (see [`zero_shot_accuracy`]).
        task_data (`str`, defaults to `"hub"`): `"hub"` or `"offline"`, see [`zero_shot_accuracy`].
        speed (`bool`, defaults to `False`): Also measure inference speed with
            [`inference_speed`]'s defaults.
        batch_size (`int`, defaults to 8): Segments or requests per forward pass.
        model_name (`str`, *optional*): Label stored in the result; defaults to the model's name.
        progress_bar (`bool`, defaults to `True`): Show progress bars.
        shared_by_processes (`bool`, defaults to `False`): Under `torch.distributed`, every process calls this and the
            perplexity segments (and the KL divergence's) are shared among them ([`perplexity`]); the zero-shot tasks
            and speed, if asked for, run on every process.
        reference_model (`nn.Module`, *optional*): The dense model, with the same tokenizer (its parameters may be on
            another device): beside every perplexity, the next-token KL divergence of `model` from it on the same
            segments, with its standard error over segments ([`~optimum_gradmap.evaluation.next_token_kl`]).
        reference_model_name (`str`, *optional*): Label of `reference_model` stored in the result; defaults to its name.
        reference ([`EvaluationResult`], *optional*): The dense model's evaluation, with its zero-shot questions'
            records on the same tasks and questions: the result's `flips` against its answers
            ([`~optimum_gradmap.evaluation.flips`]). Needs `tasks`; checked before anything runs.

    Returns:
        [`EvaluationResult`].

    Raises:
        InvalidInputError: for an unknown dataset or task, bad zero-shot settings, or a `reference` without the
            records the flips of `tasks` need (or given without `tasks`), before anything runs.
    """
    name = model_name or _name_of(model)
    _check_before_running(tasks, task_data, task_limit, task_subsets, reference)
    if reference_model is not None:
        reference_model_name = reference_model_name or _name_of(reference_model)
    evaluation = _Evaluation(
        model, tokenizer, name, batch_size, progress_bar, shared_by_processes, reference_model, reference_model_name
    )
    result = EvaluationResult(model=name)
    for dataset in [check_dataset_name(name, "evaluation") for name in perplexity_datasets]:  # all checked first
        segments = load_evaluation_segments(dataset, tokenizer, segment_length, max_segments)
        result.perplexities.append(evaluation.perplexity_entry(dataset, segment_length, segments))
    if tasks:
        result.zero_shot, result.flips = evaluation.zero_shot_and_flips(tasks, task_limit, task_data, task_subsets, reference)
    if speed:
        result.speed = inference_speed(model)
        logger.info(f"{name}: decoding {result.speed.decode_tokens_per_second:.1f} tokens/s")
    return result


def _name_of(model: nn.Module) -> str:
    """A model's label: its `name_or_path`, else its class's name."""
    return getattr(model, "name_or_path", "") or type(model).__name__


def _check_before_running(
    tasks: Sequence[str],
    task_data: str,
    task_limit: int | None,
    task_subsets: Mapping[str, int],
    reference: EvaluationResult | None,
) -> None:
    """Refuses, before anything runs, zero-shot settings [`zero_shot_accuracy`] refuses and a `reference` whose records
    cannot give the flips of `tasks` (or given without `tasks`)."""
    if tasks:  # checked before the perplexities run, as the dataset names are
        check_zero_shot_settings(tasks, task_data, task_limit)
    if reference is not None and not tasks:
        raise InvalidInputError(
            f"`reference` ({reference.model}) gives the zero-shot flips against its answers, and no `tasks` are run: "
            "give the tasks it was evaluated on, or leave `reference` out."
        )
    if reference is not None:
        check_flips_reference(reference.zero_shot, tasks, task_data, task_limit, task_subsets, name=reference.model)


@dataclass(frozen=True)
class _Evaluation:
    """What every measurement of one model shares: the model, its tokenizer and label, how its passes run, and the
    dense model whose next-token distribution it is compared with (see [`evaluate`])."""

    model: nn.Module
    tokenizer: PreTrainedTokenizerBase
    name: str
    batch_size: int
    progress_bar: bool
    shared_by_processes: bool
    reference_model: nn.Module | None
    reference_model_name: str | None

    def perplexity_entry(self, dataset: str, segment_length: int, segments: torch.LongTensor) -> PerplexityResult:
        """The perplexity of the model on one dataset's segments and, with a reference model, its KL divergence from it
        (one pass of the model for both), logged."""
        if self.reference_model is not None:  # one pass of the model for both
            value, kl = perplexity_and_kl(
                self.model, self.reference_model, segments, self.batch_size, self.progress_bar, self.shared_by_processes
            )
        else:
            value = perplexity(self.model, segments, self.batch_size, self.progress_bar, self.shared_by_processes)
        entry = PerplexityResult(
            dataset=dataset,
            protocol=protocol_name(segment_length),
            segment_length=segment_length,
            num_segments=segments.shape[0],
            num_predicted_tokens=segments.shape[0] * (segment_length - 1),
            perplexity=value,
        )
        logger.info(f"{self.name}: {dataset} perplexity {value:.3f} ({entry.protocol}, {entry.num_segments} segments)")
        if self.reference_model is not None:
            entry.kl_to_reference, entry.kl_stderr, entry.reference = kl.mean, kl.stderr, self.reference_model_name
            logger.info(f"{self.name}: {dataset} KL divergence from {self.reference_model_name} {kl.mean:.4f} nats/token")
        return entry

    def zero_shot_and_flips(
        self,
        tasks: Sequence[str],
        task_limit: int | None,
        task_data: str,
        task_subsets: Mapping[str, int],
        reference: EvaluationResult | None,
    ) -> tuple[ZeroShotResult, FlipsResult | None]:
        """The zero-shot accuracies of the model on `tasks` ([`zero_shot_accuracy`]) and, with `reference`, its flips
        against the reference's answers, logged."""
        zero_shot = zero_shot_accuracy(
            self.model,
            self.tokenizer,
            tasks,
            limit=task_limit,
            task_data=task_data,
            batch_size=self.batch_size,
            progress_bar=self.progress_bar,
            subsets=task_subsets,
        )
        logger.info(f"{self.name}: zero-shot average accuracy {zero_shot.average_acc:.4f} over {len(tasks)} tasks")
        if reference is None:
            return zero_shot, None
        result_flips = flips(zero_shot, reference.zero_shot, names=(self.name, reference.model))
        logger.info(f"{self.name}: {result_flips.pooled.flips:.2%} of the zero-shot answers flipped against {reference.model}")
        return zero_shot, result_flips
