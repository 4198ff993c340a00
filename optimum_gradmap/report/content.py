# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""The content of `pruning_report.json`: what the run did, how to make it again (`reproduce`), the environment it
ran in, and the names of the files written beside it."""

from __future__ import annotations

import datetime
import platform
import sys
from typing import TYPE_CHECKING, Any

import torch
import transformers
from transformers import PreTrainedModel
from transformers.utils import logging

from ..configuration import GradMAPConfig
from ..data import given_directly
from ..errors import InvalidInputError
from ..passes import input_device

if TYPE_CHECKING:
    from ..evaluation import EvaluationResult

logger = logging.get_logger(__name__)

REPORT_NAME = "pruning_report.json"
IMPORTANCE_PICTURE = "importance.png"
DRIFT_PICTURE = "drift.png"
CURVE_PICTURE = "loss_curve.png"
HEAL_PICTURE = "heal_kl.png"
MODEL_CARD_NAME = "README.md"


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def library_version() -> str:
    """The installed optimum-gradmap's version (the package's metadata, else `optimum_gradmap.__version__`)."""
    from .. import __version__

    return _version("optimum-gradmap") or __version__


def versions() -> dict[str, str]:
    """The versions of optimum-gradmap, transformers and torch this process runs."""
    return {"optimum_gradmap": library_version(), "transformers": transformers.__version__, "torch": torch.__version__}


API_SNIPPET = """from optimum_gradmap import GradMAPConfig, GradMAPPruner, load_report
from transformers import AutoModelForCausalLM, AutoTokenizer

report = load_report({folder})
config = GradMAPConfig(**report["gradmap_config"])
model = AutoModelForCausalLM.from_pretrained(report["base_model"], revision=report["base_model_revision"])
tokenizer = AutoTokenizer.from_pretrained(report["base_model"], revision=report["base_model_revision"])
result = GradMAPPruner(config, model=model, tokenizer=tokenizer).prune()"""


def reproduction(
    command: str | None, step: str = "prune", earlier: dict[str, Any] | None = None, calibration: str | None = None
) -> dict[str, Any]:
    """The report's `reproduce` entry: how the checkpoint was made, for whoever wants to make it again.

    Args:
        command (`str`, *optional*): The exact command line that made it (`optimum-gradmap prune ...`, quoted as
            `shlex.join` quotes it); `None` when it was made through the Python API.
        step (`str`, defaults to `"prune"`): What this run did: `"prune"`, or `"heal"` or `"quantize"` (a checkpoint
            made earlier).
        earlier (`dict`, *optional*): The `reproduce` entry of the checkpoint this run started from (a heal's).
        calibration (`str`, *optional*): Where the calibration sequences came from (the report's `calibration_source`):
            where they were given directly, the snippet passes them and says that they must be given again.

    Returns:
        `dict`: `step`, `produced_by` (`"command line"` or `"Python API"`), `command`, `python` (through the API:
        a snippet that rebuilds the config from the report and prunes the base model again), `versions`
        (optimum-gradmap, transformers, torch) and `earlier`.
    """
    python = API_SNIPPET.format(folder='"path/to/this/checkpoint"')
    if given_directly(calibration):  # no dataset name reads them again: the config's would be another calibration set
        python = python.replace(
            ".prune()", f".prune(calibration_data=calibration_data)  # the same data: {calibration}, not the config's dataset"
        )
    return {
        "step": step,
        "produced_by": "command line" if command else "Python API",
        "command": command or None,
        "python": None if command else python,
        "versions": versions(),
        "earlier": earlier,
    }


def environment(model: PreTrainedModel) -> dict[str, Any]:
    """The report's `environment`: library versions, Python, platform, and the model's device and dtype."""
    return {
        **versions(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "device": str(input_device(model)),
        "dtype": str(model.get_input_embeddings().weight.dtype).replace("torch.", ""),
    }


def build_report(
    model: PreTrainedModel,
    summary: dict[str, Any],
    config: GradMAPConfig,
    base_model: str | None = None,
    base_model_revision: str | None = None,
    license: str | None = None,
    evaluation: EvaluationResult | None = None,
    dense_evaluation: EvaluationResult | None = None,
    command: str | None = None,
) -> dict[str, Any]:
    """The content of `pruning_report.json`.

    Args:
        model (`PreTrainedModel`): The pruned model.
        summary (`dict`): What the pruner did, [`PruningResult.to_dict`].
        config ([`GradMAPConfig`]): How it was configured.
        base_model (`str`, *optional*): Hub id (or path) of the dense model; defaults to the model's `name_or_path`.
        base_model_revision (`str`, *optional*): Its revision; defaults to the commit it was loaded from, if known.
        license (`str`, *optional*): The base model's license, inherited by the pruned model.
        evaluation ([`EvaluationResult`], *optional*): Evaluation results to include: of the model as saved (after the
            heal stage when it ran: the model card labels them "after heal").
        dense_evaluation ([`EvaluationResult`], *optional*): The same evaluation of the dense model.
        command (`str`, *optional*): The command line that made the checkpoint (`optimum-gradmap prune ...`), for
            `reproduce` ([`reproduction`]); `None`: it was made through the Python API.

    Returns:
        `dict`: JSON-serialisable.
    """
    return {
        "base_model": base_model or getattr(model, "name_or_path", "") or None,
        "base_model_revision": base_model_revision or getattr(model.config, "_commit_hash", None),
        "license": license,
        "model_type": model.config.model_type,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gradmap_config": config.to_dict(),
        "reproduce": reproduction(command, calibration=summary.get("calibration_source")),
        **summary,
        "evaluation": evaluation.to_dict() if evaluation is not None else None,
        "dense_evaluation": dense_evaluation.to_dict() if dense_evaluation is not None else None,
        "zero_shot_against_dense": _zero_shot_against_dense(evaluation, dense_evaluation),
        "flips_against_dense": _flips_against_dense(evaluation, dense_evaluation),
        "environment": environment(model),
    }


def _zero_shot_against_dense(evaluation: EvaluationResult | None, dense: EvaluationResult | None) -> dict[str, Any] | None:
    """The pruned model's zero-shot answers against the dense model's, question by question (paired
    difference, its standard error, McNemar's test, retained accuracy), when both were evaluated on the same
    questions with their records."""
    from ..evaluation import compare_zero_shot

    if evaluation is None or dense is None or evaluation.zero_shot is None or dense.zero_shot is None:
        return None
    try:
        comparison = compare_zero_shot(
            dense.zero_shot, evaluation.zero_shot, reference=dense.zero_shot, names=("dense", "pruned", "dense")
        )
    except InvalidInputError as error:  # other questions, or no records: the table shows both averages without the pairing
        logger.info(f"The pruning report compares no zero-shot answers: {error}")
        return None
    return comparison.to_dict()


def _flips_against_dense(evaluation: EvaluationResult | None, dense: EvaluationResult | None) -> dict[str, Any] | None:
    """The pruned model's zero-shot flips against the dense model's answers (Dutta et al., "Accuracy is Not All You
    Need", NeurIPS 2024): counted from both evaluations' records where both have them on the same questions, else
    those the evaluation carries (`evaluate(..., reference=...)`), else none."""
    from ..evaluation import flips

    if evaluation is None:
        return None
    if dense is not None and dense.zero_shot is not None and evaluation.zero_shot is not None:
        try:
            return flips(evaluation.zero_shot, dense.zero_shot, names=("pruned", "dense")).to_dict()
        except InvalidInputError as error:  # other questions, or no records
            logger.info(f"The pruning report counts no flips against the dense evaluation: {error}")
    return evaluation.flips.to_dict() if evaluation.flips is not None else None


def stage_before_heal(report: dict[str, Any]) -> str:
    """The stage that left the weights a heal starts from: `"Stage 1 + 2"`, or `"Stage 1"` when Stage 2 did not run.

    Args:
        report (`dict`): A pruning report ([`build_report`]).

    Returns:
        `str`: The stage's name, as the model card's column headers give it ("after Stage 1 + 2").
    """
    return "Stage 1 + 2" if report.get("compensation") else "Stage 1"


def run_steps(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The runs that made the checkpoint, the first first (a heal's pruning, then the heal); one entry with no
    command for a report written before the library recorded it."""
    step = report.get("reproduce") or {"step": "prune", "versions": report.get("environment", {})}
    steps = [step]
    while steps[0].get("earlier"):
        steps.insert(0, steps[0]["earlier"])
    return steps
