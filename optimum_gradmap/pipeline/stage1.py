# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Stage 1 as a step of the pipeline ([`SelectLayers`]): what it will do on a model ([`stage1_plan`]), its input checked
before anything changes, the removals (Algorithm 1, with the fits made between them under `compensate_each_round`),
their undo, and the cut of a finished run to its first removals ([`cut`])."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

from transformers.utils import logging

from .. import streaming, surgery
from ..adapters import get_adapter
from ..compensation import (
    Stage2Settings,
    check_auto_lambda_data,
    check_stage2_settings,
    compensate_run,
)
from ..configuration import GradMAPConfig
from ..data import calibration_sha256, describe_calibration_data
from ..errors import InvalidInputError
from ..importance import (
    Selection,
    Stage1Checkpoint,
    Stage1Plan,
    Stage1Settings,
    get_importance_metric,
    remove_by_importance,
    remove_explicit_layers,
)
from ..result import PruningResult, refuse_after_heal
from .run import Run, Step
from .stage2 import check_layers_left_for_stage2

logger = logging.get_logger(__name__)


def stage1_plan(settings: Stage1Settings, num_layers: int) -> Stage1Plan:
    """What Stage 1 will do on a model of `num_layers` layers; refuses, before any change, a number of layers to remove
    the model cannot lose."""
    num_to_prune = settings.num_layers_to_remove(num_layers)
    if num_to_prune < 1:
        raise InvalidInputError(
            f"pruning_ratio={settings.pruning_ratio} of {num_layers} layers rounds to 0 layers: "
            "raise the ratio or give `num_layers_to_prune`."
        )
    if settings.layers_to_prune is not None and max(settings.layers_to_prune) >= num_layers:
        raise InvalidInputError(
            f"layers_to_prune={settings.layers_to_prune} names layers the model does not have: "
            f"it has {num_layers} decoder layers, indexed 0 to {num_layers - 1}."
        )
    if num_to_prune >= num_layers:
        raise InvalidInputError(
            f"Cannot remove {num_to_prune} of the model's {num_layers} decoder layers: at least one must "
            f"remain. Choose num_layers_to_prune <= {num_layers - 1}."
        )
    protected = settings.resolved_protected_layers(num_layers)
    if settings.layers_to_prune is not None and protected and protected & set(settings.layers_to_prune):
        raise InvalidInputError(
            f"layers_to_prune={settings.layers_to_prune} names the protected layer(s) "
            f"{sorted(protected & set(settings.layers_to_prune))} (protected_layers={settings.protected_layers}): "
            "remove them from one of the two lists."
        )
    metric = get_importance_metric(settings.importance, seed=settings.seed)
    return Stage1Plan(
        metric=metric,
        iterative=metric.iterative if settings.iterative is None else settings.iterative,
        num_to_prune=num_to_prune,
        protected=protected,
        verify_top_k=settings.verify_top_k,
        verify_halving=settings.verify_halving,
        batch_size=settings.batch_size,
        seed=settings.seed,
        compensate_each_round=settings.compensate_each_round,
        max_loss_increase=settings.max_loss_increase,
        target_num_parameters=settings.target_num_parameters,
        loss_curve=settings.loss_curve,
    )


@dataclass(frozen=True)
class SelectLayers(Step):
    """Stage 1: scores the layers with `importance` (Eq. 5 by default) and removes K of them (Algorithm 1), or removes
    `layers_to_prune`; under `compensate_each_round` a Stage 2 fit follows each removal.

    Args:
        settings ([`~optimum_gradmap.importance.Stage1Settings`]): How many layers go and how they are chosen.
        stage2 ([`~optimum_gradmap.compensation.Stage2Settings`], *optional*): Stage 2's settings where Stage 2 runs
            (after Stage 1, or between its removals): under a budget, each removal is checked against the layers
            Stage 2 fits, and `compensate_each_round` fits with them.
        unused (`tuple[str, ...]`): Settings given that `layers_to_prune` leaves unused (a warning names them).
    """

    name = "Stage 1"
    summary = "which layers go: each layer scored, the lowest removed, the rest scored again (Algorithm 1)"
    settings: Stage1Settings
    stage2: Stage2Settings | None = None
    unused: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, config: GradMAPConfig) -> SelectLayers:
        stage2 = Stage2Settings.from_config(config) if config.compensation or config.compensate_each_round else None
        return cls(Stage1Settings.from_config(config), stage2, tuple(config.unused_stage1_settings()))

    def check(self, run: Run) -> None:
        """Every check of Stage 1's input, in order: the architecture (and Stage 2's settings where it fits between
        removals), the number of layers to remove ([`stage1_plan`]), the calibration sequences (kept in
        `run.calibration_ids`), and the progress file."""
        settings, model = self.settings, run.model
        adapter = get_adapter(model)
        adapter.check_supported(model, settings.compensate_each_round)
        if settings.compensate_each_round:
            check_stage2_settings(self.stage2, adapter)
        num_layers = adapter.num_layers(model)
        plan = stage1_plan(settings, num_layers)
        if self.unused:
            logger.warning(
                f"layers_to_prune={settings.layers_to_prune} names the layers to remove, so Stage 1 scores nothing: "
                f"{', '.join(self.unused)} are not used."
            )
        run.calibration_ids = run.read(run.inputs.calibration_data)
        if settings.compensate_each_round and self.stage2.reg_lambda == "auto":
            check_auto_lambda_data(run.calibration_ids)
        checkpoint = None
        if run.inputs.stage1_checkpoint is not None:
            if settings.layers_to_prune is not None:
                raise InvalidInputError(
                    "`stage1_checkpoint` has nothing to save: with `layers_to_prune`, Stage 1 does no scoring."
                )
            fingerprint = plan.fingerprint(model, num_layers, calibration_sha256(run.calibration_ids))
            checkpoint = Stage1Checkpoint(run.inputs.stage1_checkpoint, fingerprint)
        run.stage1_plan, run.stage1_checkpoint = plan, checkpoint

    def plan(self, planner) -> None:
        planner.plan_stage1()

    def run(self, run: Run) -> None:
        """Removes the layers from `run.model` in place and makes `run.result`; keeps the dense stack in `run.dense`."""
        model, plan, checkpoint = run.model, run.stage1_plan, run.stage1_checkpoint
        run.dense = dense = surgery.snapshot(model)
        original_num_parameters = model.num_parameters()
        start = time.perf_counter()
        selection = self.remove_layers(run, plan, checkpoint)
        timings = {"stage1": time.perf_counter() - start + selection.resumed_seconds}
        if selection.resumed_seconds:
            timings["stage1_resumed"] = selection.resumed_seconds
        config = run.config
        run.result = PruningResult(
            model=model,
            original_num_layers=dense.num_layers,
            num_layers_to_prune=len(selection.removed_layers),
            removed_layers=selection.removed_layers,
            kept_layers=selection.kept_layers,
            scores=selection.scores,
            verified=selection.verified,
            original_num_parameters=original_num_parameters,
            timings=timings,
            calibration_ids=run.calibration_ids,
            calibration_source=describe_calibration_data(run.inputs.calibration_data, config.dataset, config.text_column),
            config=config,
            tokenizer=run.tokenizer,
            compensated_during_stage1=[
                {"layer": done.layer, "target": done.target, "reg_lambda": done.reg_lambda} for done in run.run_compensations
            ],
            dense_layer_config=copy.deepcopy(dense.config_values),
            dense_loss=selection.dense_loss,
            loss_curve=selection.losses,
            stopped=selection.stopped,
            rejected=selection.rejected,
        )
        run.record_precision()
        logger.info(
            f"Stage 1 removed layers {selection.removed_layers} of {dense.num_layers} in {timings['stage1']:.1f}s; "
            f"{len(selection.kept_layers)} remain."
        )

    def remove_layers(self, run: Run, plan: Stage1Plan, checkpoint: Stage1Checkpoint | None) -> Selection:
        """Stage 1's removals on `run.dense` (with `compensate_each_round`, a fit after each, kept in
        `run.run_compensations`)."""
        settings, stage2, dense = self.settings, self.stage2, run.dense

        def after_removal(removed: int) -> None:
            if stage2 is not None and settings.has_budget:  # K is known only as Stage 1 goes: checked at each removal
                check_layers_left_for_stage2(stage2, dense, removed, plan.num_to_prune)
            if settings.compensate_each_round:  # Prune&Comp's repair between removals, in float32
                with run.pass_precision().exact():
                    done = compensate_run(dense, run.calibration_ids, stage2, removed, run.progress_bar)
                if done is not None:
                    run.run_compensations.append(done)

        if settings.layers_to_prune is not None:
            return remove_explicit_layers(dense, settings.layers_to_prune)
        with streaming.execution_mode(settings.execution):
            return remove_by_importance(
                dense, plan, run.calibration_ids, checkpoint, run.progress_bar, after_removal, run.pass_precision()
            )

    def undo(self, run: Run) -> None:
        """Puts back the fits made between removals and the removed layers, with the config values surgery rewrote."""
        for done in reversed(run.run_compensations):
            done.backup.restore()
        run.run_compensations = []
        if run.dense is not None:
            run.dense.restore()


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
