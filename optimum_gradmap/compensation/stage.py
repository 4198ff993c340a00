# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Stage 2's entry, which [`~optimum_gradmap.GradMAPPruner`] calls: the sequences Stage 2 fits on and those that
validate it, read and checked before Stage 1 changes anything ([`stage2_ids`], [`compensate_input`]), the check made at
each of Stage 1's removals under a budget ([`check_layers_left_for_stage2`]), and the fit on a pruned result
([`compensate_result`])."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from transformers.utils import logging

from .. import distributed
from ..adapters import get_adapter
from ..configuration import GradMAPConfig
from ..data import CalibrationData
from ..errors import InvalidInputError
from ..result import PruningResult, refuse_after_heal
from ..surgery import LayerSnapshot
from .fit import check_auto_lambda_data
from .refinement import check_refinement_data
from .settings import STAGE2_SETTINGS, check_stage2_settings
from .stage2 import compensate
from .targets import check_num_compensated_layers

logger = logging.get_logger(__name__)

# Reads text in any form calibration data takes into token ids, with a seed (`None`: the config's).
ReadIds = Callable[[CalibrationData, "int | None"], torch.LongTensor]


def check_fit_ids(fit_ids: torch.LongTensor, config: GradMAPConfig) -> None:
    """Refuses, before anything changes, sequences Stage 2 cannot fit on as `config` says: too few for
    `reg_lambda="auto"`'s folds or `refinement_steps`'s held-out fold, or fewer than the processes sharing them."""
    if config.reg_lambda == "auto":
        check_auto_lambda_data(fit_ids)
    if config.refinement_steps:
        check_refinement_data(fit_ids)
    distributed.shard_bounds(fit_ids.shape[0])


def check_layers_left_for_stage2(config: GradMAPConfig, dense: LayerSnapshot, removed: int, num_to_prune: int) -> None:
    """With a budget, refuses the removal after which fewer layers remain than Stage 2 fits (`max_drift`'s
    `num_compensated_layers`): Stage 2 would fail, so Stage 1 stops there (and its removals are undone).

    Args:
        config ([`GradMAPConfig`]): The run.
        dense ([`~optimum_gradmap.surgery.LayerSnapshot`]): The dense stack, after the removal.
        removed (`int`): The layer just removed.
        num_to_prune (`int`): The most layers Stage 1 may remove.
    """
    num_kept = len(dense.kept_layers())
    if config.compensation_target == "max_drift" and config.num_compensated_layers > num_kept:
        raise InvalidInputError(
            f"num_compensated_layers={config.num_compensated_layers} exceeds the {num_kept} layers that remain once "
            f"Stage 1 removed layer {removed}: with a budget it may remove up to {num_to_prune} of the "
            f"{dense.num_layers} layers. Use num_compensated_layers <= {dense.num_layers - num_to_prune} (valid "
            "whatever the budget removes), a smaller num_layers_to_prune, or compensation_target='span_end'. "
            "Stage 1's removals were undone."
        )


def compensation_ids(data: CalibrationData, config: GradMAPConfig, read: ReadIds) -> torch.LongTensor | None:
    """The sequences Stage 2 fits on when they are not the calibration sequences (`data`, else
    `config.compensation_dataset`), checked ([`check_fit_ids`]); `None` when Stage 2 fits on those."""
    data = data if data is not None else config.compensation_dataset
    if data is None:
        return None
    ids = read(data, None)
    check_fit_ids(ids, config)
    return ids


def validation_ids(data: CalibrationData, config: GradMAPConfig, read: ReadIds) -> torch.LongTensor:
    """The sequences whose perplexity decides whether Stage 2's compensation is kept, drawn with seed `seed + 1`:
    given the calibration dataset itself, they are other windows of the same text."""
    return read(data, config.seed + 1)


def stage2_ids(
    config: GradMAPConfig, compensation_data: CalibrationData, validation_data: CalibrationData, read: ReadIds
) -> tuple[torch.LongTensor | None, torch.LongTensor | None]:
    """The sequences Stage 2 fits on (where they are not the calibration ones) and those that validate it, read and
    checked before Stage 1; text for a Stage 2 that is off is refused.

    Returns:
        `tuple`: the fit's sequences ([`compensation_ids`]) and the validation's ([`validation_ids`]), each `None`
        where it is not given.
    """
    if config.compensation:
        fit_ids = compensation_ids(compensation_data, config, read)
        held_out = validation_ids(validation_data, config, read) if validation_data is not None else None
        return fit_ids, held_out
    if compensation_data is not None or config.compensation_dataset is not None:
        raise InvalidInputError(
            "Text for Stage 2 was given (`compensation_data` or `compensation_dataset`), but Stage 2 is off "
            "(`compensation=False`): turn it on, or leave the text out."
        )
    if validation_data is not None:
        raise InvalidInputError(
            "`validation_data` was given, but Stage 2 is off (`compensation=False`): it decides whether Stage 2's "
            "compensation is kept. Turn Stage 2 on, or leave `validation_data` out."
        )
    return None, None


def compensate_input(
    result: PruningResult,
    config: GradMAPConfig,
    overrides: Mapping[str, Any],
    compensation_data: CalibrationData,
    validation_data: CalibrationData,
    read: ReadIds,
) -> tuple[GradMAPConfig, torch.LongTensor, torch.LongTensor | None]:
    """The input of Stage 2 run again on a pruned result ([`~optimum_gradmap.GradMAPPruner.compensate`]), every check
    made before the previous fit is undone, so that a refused run leaves the result as it was.

    Args:
        result ([`PruningResult`]): The pruned result.
        config ([`GradMAPConfig`]): The pruner's configuration.
        overrides (`Mapping[str, Any]`): Stage 2 settings ([`STAGE2_SETTINGS`]) to use instead of `config`'s.
        compensation_data, validation_data: As in [`stage2_ids`].
        read (`Callable`): Reads text into token ids, with a seed.

    Returns:
        `tuple`: the configuration Stage 2 runs with, the sequences it fits on and those that validate it (or `None`).
    """
    unknown = sorted(set(overrides) - set(STAGE2_SETTINGS))
    if unknown:
        raise InvalidInputError(f"{unknown} are not Stage 2 settings; these are: {list(STAGE2_SETTINGS)}.")
    refuse_after_heal(result, "Stage 2")
    config = dataclasses.replace(config, compensation=True, **overrides)  # the pruner's, not the last run's
    adapter = get_adapter(result.model)
    adapter.check_supported(result.model, compensation=True)
    check_stage2_settings(config, adapter)
    check_num_compensated_layers(config.num_compensated_layers, len(result.kept_layers), config.compensation_target)
    fit_ids = compensation_ids(compensation_data, config, read)
    if fit_ids is None:
        fit_ids = result.calibration_ids
        check_fit_ids(fit_ids, config)
    held_out = validation_ids(validation_data, config, read) if validation_data is not None else None
    return config, fit_ids, held_out


def compensate_result(
    result: PruningResult,
    dense: LayerSnapshot,
    config: GradMAPConfig,
    fit_ids: torch.LongTensor,
    validation_ids: torch.LongTensor | None,
    progress_bar: bool = True,
) -> PruningResult:
    """Stage 2 on checked inputs ([`compensate`]): undoes the previous fit of `result`, if any, and fits again.

    Returns:
        [`PruningResult`]: `result`, with `result.compensation`, `result.config` and `result.timings["stage2"]`.
    """
    if result.compensation is not None:  # back to the Stage 1 model, which the result then describes
        result.compensation.undo()
        result.compensation = None
        result.timings.pop("stage2", None)
    outcome = compensate(dense, fit_ids, config, progress_bar, validation_ids)
    result.config = config
    result.compensation = outcome
    result.timings["stage2"] = outcome.seconds
    logger.info(f"Stage 2 compensated layer(s) {outcome.compensated_layers} in {outcome.seconds:.1f}s.")
    return result
