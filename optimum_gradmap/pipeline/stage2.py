# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Stage 2 as a step of the pipeline ([`Compensate`]): the sequences it fits on and those that validate it, read and
checked before Stage 1 changes anything; the fit on the pruned result; its undo. Also the checks of the layers Stage 2
fits against those Stage 1 leaves, before Stage 1 and at each of its removals under a budget."""

from __future__ import annotations

import dataclasses

import torch
from transformers.utils import logging

from .. import distributed
from ..adapters import get_adapter
from ..compensation import (
    Stage2Settings,
    check_auto_lambda_data,
    check_num_compensated_layers,
    check_refinement_data,
    check_stage2_settings,
    compensate,
)
from ..configuration import GradMAPConfig
from ..errors import InvalidInputError
from ..importance import Stage1Settings
from ..result import refuse_after_heal
from ..surgery import LayerSnapshot
from .run import Run, Step

logger = logging.get_logger(__name__)


def check_fit_ids(fit_ids: torch.LongTensor, settings: Stage2Settings) -> None:
    """Refuses, before anything changes, sequences Stage 2 cannot fit on as `settings` say: too few for
    `reg_lambda="auto"`'s folds or `refinement_steps`'s held-out fold, or fewer than the processes sharing them."""
    if settings.reg_lambda == "auto":
        check_auto_lambda_data(fit_ids)
    if settings.refinement_steps:
        check_refinement_data(fit_ids)
    distributed.shard_bounds(fit_ids.shape[0])


@dataclasses.dataclass(frozen=True)
class Compensate(Step):
    """Stage 2: measures the mean drift of every kept layer (Eq. 10), learns W' for the layers `compensation_target`
    names (Eq. 12-14) and folds it into their down projections (Eq. 15). Run again on the same result, it first undoes
    the previous fit.

    Args:
        settings ([`~optimum_gradmap.compensation.Stage2Settings`]): How it fits.
        stage1 ([`~optimum_gradmap.importance.Stage1Settings`], *optional*): In a run that starts with Stage 1, its
            settings: the layers Stage 1 will leave are checked before it starts. `None`: Stage 2 on a pruned result
            (the layers it kept are checked).
    """

    name = "Stage 2"
    summary = "the repair: a matrix W' fitted where the hidden state drifted, folded into a down projection"
    settings: Stage2Settings
    stage1: Stage1Settings | None = None

    @classmethod
    def from_config(cls, config: GradMAPConfig) -> Compensate:
        return cls(Stage2Settings.from_config(config), Stage1Settings.from_config(config))

    def check(self, run: Run) -> None:
        """The family and settings, the layers it fits against those Stage 1 leaves, then its text: the sequences it
        fits on (`compensation_data`, else `compensation_dataset`, else Stage 1's calibration sequences) and those that
        validate it, read and checked (kept in `run.fit_ids` and `run.validation_ids`)."""
        settings, model = self.settings, run.model
        adapter = get_adapter(model)
        adapter.check_supported(model, compensation=True)
        check_stage2_settings(settings, adapter)
        if self.stage1 is not None:
            check_layers_for_stage2(self.stage1, settings, adapter.num_layers(model))
        else:
            refuse_after_heal(run.result, "Stage 2")
            num_kept = len(run.result.kept_layers)
            check_num_compensated_layers(settings.num_compensated_layers, num_kept, settings.compensation_target)
        data = run.inputs.compensation_data if run.inputs.compensation_data is not None else settings.compensation_dataset
        run.fit_ids = run.read(data) if data is not None else None
        fit_ids = run.fit_ids if run.fit_ids is not None else run.calibration_ids
        if fit_ids is None and run.result is not None:
            fit_ids = run.result.calibration_ids
        check_fit_ids(fit_ids, settings)
        validation = run.inputs.validation_data
        run.validation_ids = run.read(validation, run.config.seed + 1) if validation is not None else None

    def plan(self, planner) -> None:
        planner.plan_stage2()

    def run(self, run: Run) -> None:
        """Fits on the checked sequences; `run.result.compensation`, `.config` and `.timings["stage2"]` say what it did."""
        result = run.result
        if result.compensation is not None:  # back to the Stage 1 model, which the result then describes
            self.undo(run)
        fit_ids = run.fit_ids if run.fit_ids is not None else result.calibration_ids
        outcome = compensate(run.dense, fit_ids, self.settings, run.progress_bar, run.validation_ids, run.pass_precision())
        result.config = dataclasses.replace(result.config, compensation=True, **dataclasses.asdict(self.settings))
        result.compensation = outcome
        result.timings["stage2"] = outcome.seconds
        run.record_precision()
        logger.info(f"Stage 2 compensated layer(s) {outcome.compensated_layers} in {outcome.seconds:.1f}s.")

    def undo(self, run: Run) -> None:
        """Unfolds W' from every down projection it changed."""
        result = run.result
        if result is not None and result.compensation is not None:
            result.compensation.undo()
            result.compensation = None
            result.timings.pop("stage2", None)


def check_layers_left_for_stage2(stage2: Stage2Settings, dense: LayerSnapshot, removed: int, most: int) -> None:
    """With a budget, refuses the removal after which fewer layers remain than Stage 2 fits (`max_drift`'s
    `num_compensated_layers`): Stage 2 would fail, so Stage 1 stops there (and its removals are undone).

    Args:
        stage2 ([`~optimum_gradmap.compensation.Stage2Settings`]): Stage 2's settings.
        dense ([`~optimum_gradmap.surgery.LayerSnapshot`]): The dense stack, after the removal.
        removed (`int`): The layer just removed.
        most (`int`): The most layers Stage 1 may remove.
    """
    num_kept = len(dense.kept_layers())
    if stage2.compensation_target == "max_drift" and stage2.num_compensated_layers > num_kept:
        raise InvalidInputError(
            f"num_compensated_layers={stage2.num_compensated_layers} exceeds the {num_kept} layers that remain once "
            f"Stage 1 removed layer {removed}: with a budget it may remove up to {most} of the "
            f"{dense.num_layers} layers. Use num_compensated_layers <= {dense.num_layers - most} (valid "
            "whatever the budget removes), a smaller num_layers_to_prune, or compensation_target='span_end'. "
            "Stage 1's removals were undone."
        )


def check_layers_for_stage2(settings: Stage1Settings, stage2: Stage2Settings, num_layers: int) -> None:
    """Refuses, before any change, a Stage 2 that would fit more layers than Stage 1 leaves: with a budget, K is known
    only as Stage 1 goes ([`check_layers_left_for_stage2`] checks each removal), and no budget keeps more than all."""
    num_to_prune = settings.num_layers_to_remove(num_layers)
    if not settings.has_budget:
        check_num_compensated_layers(stage2.num_compensated_layers, num_layers - num_to_prune, stage2.compensation_target)
    elif stage2.compensation_target == "max_drift" and stage2.num_compensated_layers > num_layers:
        raise InvalidInputError(
            f"num_compensated_layers={stage2.num_compensated_layers} exceeds the {num_layers} layers the model has: "
            f"Stage 2 cannot fit more layers than remain after pruning. Use num_compensated_layers <= "
            f"{num_layers - num_to_prune} (valid whatever the budget removes), or compensation_target='span_end'."
        )
