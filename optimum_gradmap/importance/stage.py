# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Stage 1's entry, which [`~optimum_gradmap.GradMAPPruner`] calls: what Stage 1 will do ([`stage1_plan`]), its input
checked before anything changes ([`check_stage1_input`]), the removals with the fits made between them
([`select_layers`]), the cut of a finished run to its first removals ([`cut`]), and the rollback ([`undo`])."""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging

from .. import streaming, surgery
from ..adapters import DecoderAdapter, get_adapter
from ..compensation import (
    RunCompensation,
    check_auto_lambda_data,
    check_num_compensated_layers,
    check_stage2_settings,
    compensate_run,
)
from ..compensation.stage import check_layers_left_for_stage2
from ..configuration import GradMAPConfig
from ..data import CalibrationData, calibration_sha256, describe_calibration_data
from ..errors import InvalidInputError
from ..result import PruningResult, refuse_after_heal
from .metrics import get_importance_metric
from .rounds import Selection, Stage1Checkpoint, Stage1Plan
from .selection import remove_by_importance, remove_explicit_layers

logger = logging.get_logger(__name__)


@dataclass
class Stage1Input:
    """Stage 1's input, checked ([`check_stage1_input`]): nothing has changed yet.

    Args:
        model (`PreTrainedModel`): The model to prune.
        adapter (`DecoderAdapter`): Its architecture adapter.
        num_layers (`int`): Its decoder layers.
        plan ([`Stage1Plan`]): What Stage 1 does ([`stage1_plan`]).
        calibration_ids (`torch.LongTensor` of shape `(N, T)`): The calibration sequences.
        checkpoint ([`Stage1Checkpoint`], *optional*): Where the finished rounds are saved and resumed from.
    """

    model: PreTrainedModel
    adapter: DecoderAdapter
    num_layers: int
    plan: Stage1Plan
    calibration_ids: torch.LongTensor
    checkpoint: Stage1Checkpoint | None = None


def stage1_plan(config: GradMAPConfig, num_layers: int) -> Stage1Plan:
    """What Stage 1 will do on a model of `num_layers` layers; refuses, before any change, a number of
    layers to remove the model cannot lose."""
    num_to_prune = config.num_layers_to_remove(num_layers)
    if num_to_prune < 1:
        raise InvalidInputError(
            f"pruning_ratio={config.pruning_ratio} of {num_layers} layers rounds to 0 layers: "
            "raise the ratio or give `num_layers_to_prune`."
        )
    if config.layers_to_prune is not None and max(config.layers_to_prune) >= num_layers:
        raise InvalidInputError(
            f"layers_to_prune={config.layers_to_prune} names layers the model does not have: "
            f"it has {num_layers} decoder layers, indexed 0 to {num_layers - 1}."
        )
    if num_to_prune >= num_layers:
        raise InvalidInputError(
            f"Cannot remove {num_to_prune} of the model's {num_layers} decoder layers: at least one must "
            f"remain. Choose num_layers_to_prune <= {num_layers - 1}."
        )
    protected = config.resolved_protected_layers(num_layers)
    if config.layers_to_prune is not None and protected and protected & set(config.layers_to_prune):
        raise InvalidInputError(
            f"layers_to_prune={config.layers_to_prune} names the protected layer(s) "
            f"{sorted(protected & set(config.layers_to_prune))} (protected_layers={config.protected_layers}): "
            "remove them from one of the two lists."
        )
    if config.unused_stage1_settings():
        logger.warning(
            f"layers_to_prune={config.layers_to_prune} names the layers to remove, so Stage 1 scores nothing: "
            f"{', '.join(config.unused_stage1_settings())} are not used."
        )
    if config.compensation and not config.has_budget:
        check_num_compensated_layers(config.num_compensated_layers, num_layers - num_to_prune, config.compensation_target)
    elif config.compensation and config.compensation_target == "max_drift" and config.num_compensated_layers > num_layers:
        # with a budget, K is known only as Stage 1 goes (checked at each removal); no budget keeps more than all
        raise InvalidInputError(
            f"num_compensated_layers={config.num_compensated_layers} exceeds the {num_layers} layers the model has: "
            f"Stage 2 cannot fit more layers than remain after pruning. Use num_compensated_layers <= "
            f"{num_layers - num_to_prune} (valid whatever the budget removes), or compensation_target='span_end'."
        )
    metric = get_importance_metric(config.importance, seed=config.seed)
    return Stage1Plan(
        metric=metric,
        iterative=metric.iterative if config.iterative is None else config.iterative,
        num_to_prune=num_to_prune,
        protected=protected,
        verify_top_k=config.verify_top_k,
        verify_halving=config.verify_halving,
        verify_from_scoring_pass=config.verify_from_scoring_pass,
        batch_size=config.batch_size,
        seed=config.seed,
        compensate_each_round=config.compensate_each_round,
        max_loss_increase=config.max_loss_increase,
        target_num_parameters=config.target_num_parameters,
        loss_curve=config.loss_curve,
    )


def check_stage1_input(
    model: PreTrainedModel,
    config: GradMAPConfig,
    read_calibration_ids: Callable[[], torch.LongTensor],
    stage1_checkpoint: str | os.PathLike | None = None,
    check_calibration_ids: Callable[[torch.LongTensor], None] | None = None,
) -> Stage1Input:
    """Every check Stage 1's input gets before anything changes, in order: the architecture (and Stage 2's settings
    where Stage 2 runs during or after Stage 1), the number of layers to remove ([`stage1_plan`]), then the
    calibration sequences.

    Args:
        model (`PreTrainedModel`): The model to prune.
        config ([`GradMAPConfig`]): The run.
        read_calibration_ids (`Callable`): Reads the calibration sequences (after the checks of the model).
        stage1_checkpoint (`str` or `os.PathLike`, *optional*): Stage 1's progress file
            ([`~optimum_gradmap.GradMAPPruner.select_layers`]).
        check_calibration_ids (`Callable`, *optional*): Called with the calibration sequences once they are read.

    Returns:
        [`Stage1Input`].
    """
    adapter = get_adapter(model)
    adapter.check_supported(model, config.compensation or config.compensate_each_round)
    if config.compensation or config.compensate_each_round:
        check_stage2_settings(config, adapter)
    num_layers = adapter.num_layers(model)
    plan = stage1_plan(config, num_layers)
    calibration_ids = read_calibration_ids()
    if config.reg_lambda == "auto" and (config.compensation or config.compensate_each_round):
        check_auto_lambda_data(calibration_ids)  # before Stage 1 changes anything
    if check_calibration_ids is not None:
        check_calibration_ids(calibration_ids)
    checkpoint = None
    if stage1_checkpoint is not None:
        if config.layers_to_prune is not None:
            raise InvalidInputError("`stage1_checkpoint` has nothing to save: with `layers_to_prune`, Stage 1 does no scoring.")
        fingerprint = plan.fingerprint(model, num_layers, calibration_sha256(calibration_ids))
        checkpoint = Stage1Checkpoint(stage1_checkpoint, fingerprint)
    return Stage1Input(model, adapter, num_layers, plan, calibration_ids, checkpoint)


def select_layers(
    checked: Stage1Input,
    config: GradMAPConfig,
    calibration_data: CalibrationData,
    tokenizer: PreTrainedTokenizerBase | None,
    progress_bar: bool = True,
) -> tuple[PruningResult, surgery.LayerSnapshot, list[RunCompensation]]:
    """Stage 1 on checked input: removes the layers (Algorithm 1, or `layers_to_prune`) from `checked.model` in place.

    Args:
        checked ([`Stage1Input`]): From [`check_stage1_input`].
        config ([`GradMAPConfig`]): The run.
        calibration_data: What the calibration sequences were read from (described in the result).
        tokenizer (`PreTrainedTokenizerBase`, *optional*): Kept in the result.
        progress_bar (`bool`, defaults to `True`): Show tqdm progress bars.

    Returns:
        `tuple`: the [`PruningResult`], the dense stack ([`~optimum_gradmap.surgery.LayerSnapshot`], which Stage 2
        compares against and the heal's teacher is made of), and the fits made between removals
        (`compensate_each_round`), with their backups.
    """
    model, plan, calibration_ids = checked.model, checked.plan, checked.calibration_ids
    dense = surgery.snapshot(model, checked.adapter)
    original_num_parameters = model.num_parameters()
    start = time.perf_counter()
    selection, run_compensations = remove_layers(dense, plan, config, calibration_ids, checked.checkpoint, progress_bar)
    timings = {"stage1": time.perf_counter() - start + selection.resumed_seconds}
    if selection.resumed_seconds:
        timings["stage1_resumed"] = selection.resumed_seconds
    result = PruningResult(
        model=model,
        original_num_layers=checked.num_layers,
        num_layers_to_prune=len(selection.removed_layers),
        removed_layers=selection.removed_layers,
        kept_layers=selection.kept_layers,
        scores=selection.scores,
        verified=selection.verified,
        original_num_parameters=original_num_parameters,
        timings=timings,
        calibration_ids=calibration_ids,
        calibration_source=describe_calibration_data(calibration_data, config.dataset, config.text_column),
        config=config,
        tokenizer=tokenizer,
        compensated_during_stage1=[
            {"layer": done.layer, "target": done.target, "reg_lambda": done.reg_lambda} for done in run_compensations
        ],
        dense_layer_config=copy.deepcopy(dense.config_values),
        dense_loss=selection.dense_loss,
        loss_curve=selection.losses,
        stopped=selection.stopped,
        rejected=selection.rejected,
    )
    logger.info(
        f"Stage 1 removed layers {selection.removed_layers} of {checked.num_layers} in {timings['stage1']:.1f}s; "
        f"{len(selection.kept_layers)} remain."
    )
    return result, dense, run_compensations


def remove_layers(
    dense: surgery.LayerSnapshot,
    plan: Stage1Plan,
    config: GradMAPConfig,
    calibration_ids: torch.LongTensor,
    checkpoint: Stage1Checkpoint | None,
    progress_bar: bool = True,
) -> tuple[Selection, list[RunCompensation]]:
    """Stage 1's removals (with `compensate_each_round`, a fit after each); if anything fails, the dense
    stack and every fold are put back before the error propagates."""
    run_compensations: list[RunCompensation] = []

    def after_removal(removed: int) -> None:
        if config.compensation and config.has_budget:  # K is known only as Stage 1 goes: checked at each removal
            check_layers_left_for_stage2(config, dense, removed, plan.num_to_prune)
        if config.compensate_each_round:  # Prune&Comp's repair between removals
            done = compensate_run(dense, calibration_ids, config, removed, progress_bar)
            if done is not None:
                run_compensations.append(done)

    try:
        if config.layers_to_prune is not None:
            return remove_explicit_layers(dense, config.layers_to_prune), run_compensations
        with streaming.execution_mode(config.execution):
            selection = remove_by_importance(dense, plan, calibration_ids, checkpoint, progress_bar, after_removal)
        return selection, run_compensations
    except BaseException:
        for done in reversed(run_compensations):
            done.backup.restore()
        dense.restore()
        raise


def cut(result: PruningResult, dense: surgery.LayerSnapshot, num_layers_to_prune: int) -> PruningResult:
    """Keeps only the first `num_layers_to_prune` removals of `result` ([`~optimum_gradmap.GradMAPPruner.cut`]): the
    other removed layers of `dense` go back into the model, and a compensation made before is undone.

    Args:
        result ([`PruningResult`]): The result of the Stage 1 run that made `dense`.
        dense ([`~optimum_gradmap.surgery.LayerSnapshot`]): Its dense stack.
        num_layers_to_prune (`int`): How many of its removals to keep, from 1 to as many as it made.

    Returns:
        [`PruningResult`]: `result`, describing the model with the first `num_layers_to_prune` layers removed.
    """
    refuse_after_heal(result, "a cut")
    made = len(result.removed_layers)
    if isinstance(num_layers_to_prune, bool) or not isinstance(num_layers_to_prune, int) or not 1 <= num_layers_to_prune <= made:
        raise InvalidInputError(
            f"`num_layers_to_prune` must be between 1 and the {made} removals made, got {num_layers_to_prune!r}."
        )
    if result.config.compensate_each_round:
        raise InvalidInputError(
            "A run with `compensate_each_round` cannot be cut: its later fits depend on the layers removed after."
        )
    if result.compensation is not None:
        result.compensation.undo()
        result.compensation = None
        result.timings.pop("stage2", None)
    removed = result.removed_layers[:num_layers_to_prune]
    result.kept_layers = [index for index in range(result.original_num_layers) if index not in removed]
    dense.keep(result.kept_layers)
    rounds = num_layers_to_prune if len(result.scores) == made else len(result.scores)  # one-shot: one round of scores
    result.removed_layers, result.num_layers_to_prune = removed, num_layers_to_prune
    result.scores, result.verified = result.scores[:rounds], result.verified[:num_layers_to_prune]
    result.loss_curve = result.loss_curve[:num_layers_to_prune]
    result.stopped, result.rejected = f"cut at {num_layers_to_prune} of the {made} layers Stage 1 removed", None
    logger.info(f"Cut Stage 1 at {num_layers_to_prune} of {made} removals: removed {removed}.")
    return result


def undo(result: PruningResult, dense: surgery.LayerSnapshot | None, run_compensations: list[RunCompensation]) -> None:
    """Puts the model of `result` back as Stage 1 got it (after an error once Stage 1 started): undoes Stage 2's
    folds, the fits made between removals, and the removals of `dense`."""
    if result.compensation is not None:
        result.compensation.undo()
        result.compensation = None
    for done in reversed(run_compensations):
        done.backup.restore()
    if dense is not None:
        dense.restore()
