# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""The frame every step of a run fits in: a [`Step`] (its checks before any weight changes, its plan, its run, its
undo), the [`Run`] the steps of one run share, and [`run_steps`], which checks every step before the first one starts
and, when one fails, undoes every step that ran, the last first."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..configuration import GradMAPConfig
from ..data import CalibrationData, check_token_ids, is_text_data, prepare_calibration_data
from ..loading import saved_tokenizer
from ..precision import Precision

if TYPE_CHECKING:
    from ..compensation import RunCompensation
    from ..evaluation import EvaluationResult
    from ..heal import HealText
    from ..importance import Stage1Checkpoint, Stage1Plan
    from ..planning import Planner
    from ..result import PruningResult
    from ..surgery import LayerSnapshot
    from ..weights import ModelBackup, WeightBackup

# The tokenizer for some data: the one given, else the pruner's, else the one saved with the model.
TokenizerFor = Callable[[CalibrationData], "PreTrainedTokenizerBase | None"]


@dataclass(frozen=True)
class RunInputs:
    """What the caller gives a run besides the model and the configuration ([`~optimum_gradmap.GradMAPPruner.prune`]'s
    arguments): the texts each step reads, where not its dataset's name, and the files that make it resumable.

    Args:
        calibration_data, validation_data, compensation_data, heal_data: Text in any form calibration data takes.
        stage1_checkpoint, heal_checkpoint, heal_text_cache (`str` or `os.PathLike`, *optional*): Stage 1's progress
            file, the heal's resumable state and the cache of the dense model's own text.
        teacher (`PreTrainedModel`, *optional*): The dense model, for a heal of a result whose dense layers are gone.
    """

    calibration_data: CalibrationData = None
    validation_data: CalibrationData = None
    compensation_data: CalibrationData = None
    heal_data: CalibrationData = None
    stage1_checkpoint: str | os.PathLike | None = None
    heal_checkpoint: str | os.PathLike | None = None
    heal_text_cache: str | os.PathLike | None = None
    teacher: PreTrainedModel | None = field(default=None, repr=False)


@dataclass
class Run:
    """What the steps of one run share: the model and the configuration, the caller's inputs, how text becomes token
    ids, and what the steps read and made so far. A step reads what an earlier step's check or run left here.

    Args:
        model (`PreTrainedModel`): The model, changed in place.
        config ([`GradMAPConfig`]): The run's settings.
        inputs ([`RunInputs`]): The caller's texts and files.
        tokenizer (`PreTrainedTokenizerBase`, *optional*): For text; else the one saved with the model, loaded from
            `location` when text needs one.
        location (`dict`): Where the model was loaded from (`revision`, `token`, ...), for that tokenizer.
        progress_bar (`bool`, defaults to `True`): Show tqdm progress bars.
    """

    model: PreTrainedModel
    config: GradMAPConfig
    inputs: RunInputs = field(default_factory=RunInputs)
    tokenizer: PreTrainedTokenizerBase | None = field(default=None, repr=False)
    location: dict[str, Any] = field(default_factory=dict)
    progress_bar: bool = True
    # Read by the checks, for the steps to run on: Stage 1's calibration sequences, its plan and progress file, the
    # sequences Stage 2 fits on and those that validate it, the heal's text, the quantization's sequences.
    calibration_ids: torch.LongTensor | None = field(default=None, repr=False)
    stage1_plan: Stage1Plan | None = field(default=None, repr=False)
    stage1_checkpoint: Stage1Checkpoint | None = field(default=None, repr=False)
    fit_ids: torch.LongTensor | None = field(default=None, repr=False)
    validation_ids: torch.LongTensor | None = field(default=None, repr=False)
    heal_text: HealText | None = field(default=None, repr=False)
    quantization_ids: torch.LongTensor | None = field(default=None, repr=False)
    quantization_source: str | None = None
    # Made by the steps: the result, the dense stack (between Stage 1 and the end of the run) and the fits made between
    # Stage 1's removals (`compensate_each_round`), with their backups.
    result: PruningResult | None = None
    precision: Precision | None = field(default=None, repr=False)
    dense: LayerSnapshot | None = field(default=None, repr=False)
    run_compensations: list[RunCompensation] = field(default_factory=list, repr=False)
    # What undoes a step that changed weights outside the dense stack and the folds: the heal's and the quantization's.
    heal_undoable: bool = True
    heal_backup: WeightBackup | None = field(default=None, repr=False)
    quantization_undoable: bool = True
    quantization_backup: ModelBackup | None = field(default=None, repr=False)
    # The held-out figures of the dense model and of the model the run made (`prune --evaluate`).
    dense_evaluation: EvaluationResult | None = field(default=None, repr=False)
    evaluation: EvaluationResult | None = field(default=None, repr=False)

    def tokenizer_for(self, data: CalibrationData) -> PreTrainedTokenizerBase | None:
        """The tokenizer for `data`: the run's, else (for text) the one saved with the model, which the run keeps."""
        if self.tokenizer is None and is_text_data(data):
            self.tokenizer = saved_tokenizer(self.model, self.location)
        return self.tokenizer

    def require_tokenizer(self, why: str) -> PreTrainedTokenizerBase:
        """The run's tokenizer, else the one saved with the model; refuses, saying `why` one is needed, where there is
        none to load."""
        if self.tokenizer is None:
            self.tokenizer = saved_tokenizer(self.model, self.location, why=why)
        return self.tokenizer

    def pass_precision(self) -> Precision:
        """How Stage 1's and Stage 2's passes compute (`config.precision`, resolved for the model once), with the log
        of their decisions, which the result records ([`record_precision`])."""
        if self.precision is None:
            self.precision = Precision.for_model(self.config.precision, self.model)
        return self.precision

    def record_precision(self) -> None:
        """Writes how the passes computed and what their decisions cost into the result (`precision`, and
        `timings["float32_recompute"]` where a decision was recomputed)."""
        precision = self.pass_precision()
        self.result.precision = {"computed_in": precision.computed_in, **precision.log.as_dict()}
        if precision.log.recomputed:
            self.result.timings["float32_recompute"] = precision.log.seconds

    def read(self, data: CalibrationData, seed: int | None = None) -> torch.LongTensor:
        """`data` (any form calibration data takes) as `num_samples` windows of `seq_len` tokens drawn with `seed`
        (`None`: the config's), checked against the model's vocabulary."""
        config = self.config
        seed = config.seed if seed is None else seed
        ids = prepare_calibration_data(
            data, self.tokenizer_for(data), config.num_samples, config.seq_len, seed, config.dataset, config.text_column
        )
        check_token_ids(ids, self.model)
        return ids


class Step:
    """One step of a GradMAP run: Stage 1, Stage 2, the heal, quantization, saving. A step is built once from
    [`GradMAPConfig`] and holds its own frozen settings; [`run_steps`] walks a list of them.

    - [`check_settings`]: what its settings alone decide (extras installed, hardware, names), before any weight is
      read: the command line calls it before loading the model, its dry run included.
    - [`check`]: everything else that can refuse it, before any step changes a weight (the model, data, tokenizer);
      it may read and tokenize its text, and keeps what it read in the [`Run`] for [`run`].
    - [`plan`]: what it will do and cost, on the dry run's [`~optimum_gradmap.planning.Planner`].
    - [`run`]: does it, recording what it did in `run.result`.
    - [`undo`]: puts back what it changed, after a later step failed (or itself, part-way).
    """

    name: ClassVar[str]
    # What the step does, in a line: the heading of its settings' section in the command line's help.
    summary: ClassVar[str] = ""
    # Whether the step makes the model (recorded in `PruningResult.steps`): not the evaluation or the save.
    changes_weights: ClassVar[bool] = True

    def check_settings(self) -> None:
        """Refuses, before any weight is read, what this step's settings alone cannot do."""

    def check(self, run: Run) -> None:
        """Refuses, before any weight changes, what this step cannot do on `run`."""

    def plan(self, planner: Planner) -> None:
        """Adds this step's stage to the dry run's plan."""

    def run(self, run: Run) -> None:
        raise NotImplementedError

    def undo(self, run: Run) -> None:
        """Puts back what [`run`] changed (nothing to do for a step that changes no weight)."""


def check_steps(steps: Sequence[Step], run: Run) -> None:
    """Every check of every step, before any of them runs: first what their settings alone decide, then the rest."""
    for step in steps:
        step.check_settings()
    for step in steps:
        step.check(run)


def run_steps(steps: Sequence[Step], run: Run) -> None:
    """Checks every step ([`check_steps`]), then runs them ([`run_checked_steps`]).

    Args:
        steps (`Sequence[Step]`): The run's steps.
        run ([`Run`]): What they share.
    """
    check_steps(steps, run)
    run_checked_steps(steps, run)


def run_checked_steps(steps: Sequence[Step], run: Run) -> None:
    """Runs checked steps in order; if one fails (or is interrupted), every step that started is undone, the last
    first, and the error propagates: the model is as it came."""
    started: list[Step] = []
    try:
        for step in steps:
            started.append(step)
            step.run(run)
            if step.changes_weights and run.result is not None and step.name not in run.result.steps:
                run.result.steps.append(step.name)
    except BaseException:
        for step in reversed(started):
            step.undo(run)
        raise
