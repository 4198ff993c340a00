# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""The heal stage on a pruned result, as [`~optimum_gradmap.GradMAPPruner`] runs it: its input read and checked before
Stage 1 ([`heal_input`]) or before a later heal ([`heal_config`]), and the heal itself ([`heal_result`]) with its
teacher made of the pruner's dense layers and Stage 1's time for `heal_tokens="auto"` ([`stage1_seconds`])."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging

from ..compensation import RunCompensation
from ..configuration import GradMAPConfig
from ..data import CalibrationData, check_token_ids
from ..errors import InvalidInputError
from ..result import PruningResult, refuse_after_heal
from ..surgery import LayerSnapshot
from .checks import HEAL_SETTINGS, check_heal_checkpoint_origin
from .stage import heal_stage, prepare_heal_text
from .text import HealText

logger = logging.get_logger(__name__)

# The tokenizer for some data (the pruner's: the one given, else the pruner's, else the one saved with the model).
TokenizerFor = Callable[[CalibrationData], "PreTrainedTokenizerBase | None"]


def heal_text(
    model: PreTrainedModel,
    heal_data: CalibrationData,
    config: GradMAPConfig,
    tokenizer_for: TokenizerFor,
    compensated: list[int] | None = None,
) -> HealText | None:
    """[`~optimum_gradmap.heal.prepare_heal_text`] with the token-id check of `model`'s vocabulary."""
    return prepare_heal_text(model, heal_data, config, tokenizer_for, lambda ids: check_token_ids(ids, model), compensated)


def heal_input(
    model: PreTrainedModel,
    heal_data: CalibrationData,
    config: GradMAPConfig,
    tokenizer_for: TokenizerFor,
    heal_checkpoint: str | os.PathLike | None,
) -> HealText | None:
    """The heal's text where it is known before Stage 1, after every check of the heal's input: its settings, text
    and prompts ([`heal_text`]) and its checkpoint file's origin; `None` where the heal is off or makes its text when
    it starts. Text for a heal that is off is refused."""
    if not config.heal_tokens:
        if heal_data is not None:
            raise InvalidInputError(
                "`heal_data` was given, but the heal stage is off (`heal_tokens=0`): give it a budget, or leave the text out."
            )
        return None
    text = heal_text(model, heal_data, config, tokenizer_for)
    ids = (text.train_ids, text.validation_ids) if text is not None else (None, None)
    check_heal_checkpoint_origin(heal_checkpoint, model, *ids, config)
    return text


def heal_config(result: PruningResult, config: GradMAPConfig, overrides: Mapping[str, Any]) -> GradMAPConfig:
    """The configuration a later heal of `result` runs with ([`~optimum_gradmap.GradMAPPruner.heal`]): `result`'s own
    (else `config`) with the heal settings in `overrides`; refuses other settings, no budget and a result healed
    already."""
    unknown = sorted(set(overrides) - set(HEAL_SETTINGS))
    if unknown:
        raise InvalidInputError(f"{unknown} are not heal settings; these are: {list(HEAL_SETTINGS)}.")
    config = dataclasses.replace(result.config or config, **overrides)  # how the result was pruned
    if not config.heal_tokens:
        raise InvalidInputError("The heal stage needs a budget: give `heal_tokens` (e.g. heal_tokens=200_000).")
    refuse_after_heal(result, "a second heal")
    return config


def heal_result(
    result: PruningResult,
    config: GradMAPConfig,
    text: HealText | None,
    heal_data: CalibrationData,
    tokenizer_for: TokenizerFor,
    teacher: PreTrainedModel | None,
    dense: LayerSnapshot | None,
    run_compensations: Sequence[RunCompensation],
    checkpoint: str | os.PathLike | None = None,
    text_cache: str | os.PathLike | None = None,
    progress_bar: bool = True,
    prompt_data: CalibrationData = None,
) -> PruningResult:
    """The heal stage on checked inputs ([`~optimum_gradmap.heal.heal_stage`]).

    Args:
        result ([`PruningResult`]): The pruned result; trained in place.
        config ([`GradMAPConfig`]): The heal's configuration.
        text ([`HealText`], *optional*): The text prepared already ([`heal_input`]); made here where `None` (the dense
            model's own text, `heal_tokens="auto"`).
        heal_data (*optional*): The heal text given (any form calibration data takes); defaults to `heal_dataset`.
        tokenizer_for (`Callable`): The tokenizer for some data.
        teacher (`PreTrainedModel`, *optional*): The dense model; without it, `dense` with its removed layers put back
            and the folds of `run_compensations` and of `result.compensation` undone.
        dense ([`~optimum_gradmap.surgery.LayerSnapshot`], *optional*): The dense stack (needed without `teacher`).
        run_compensations (`Sequence[RunCompensation]`): The fits made between Stage 1's removals.
        checkpoint, text_cache, progress_bar, prompt_data: As in [`~optimum_gradmap.heal.heal_stage`].

    Returns:
        [`PruningResult`]: `result`, with `result.heal`, `result.config` and `result.timings["heal"]`.
    """
    if teacher is not None:
        teacher_context = lambda: contextlib.nullcontext(teacher)  # noqa: E731
    else:
        backups = [done.backup for done in run_compensations]
        if result.compensation is not None and result.compensation.backup is not None:
            backups.append(result.compensation.backup)
        teacher_context = lambda: dense.dense_model(backups)  # noqa: E731
    data = heal_data if heal_data is not None else config.heal_dataset
    seconds, basis = stage1_seconds(result, config, teacher)
    result.heal = heal_stage(
        result.model,
        teacher_context,
        config,
        tokenizer_for(data) if text is None else None,
        result.kept_layers,
        result.original_num_layers,
        result.compensated_layers,
        data=heal_data,
        text=text,
        stage1_seconds=seconds,
        stage1_basis=basis,
        checkpoint=checkpoint,
        text_cache=text_cache,
        progress_bar=progress_bar,
        check_ids=lambda ids: check_token_ids(ids, result.model),
        prompt_data=prompt_data,
    )
    result.config = config
    result.timings["heal"] = result.heal.seconds
    return result


def stage1_seconds(result: PruningResult, config: GradMAPConfig, teacher: PreTrainedModel | None) -> tuple[float | None, str]:
    """Stage 1's time for `heal_tokens="auto"`, and where it comes from: the time measured, or, where no Stage 1 scored
    (`layers_to_prune`, a cut replayed from an earlier run), the plan's time for a Stage 1 that removes as many layers
    ([`~optimum_gradmap.planning.plan_pruning`], on the dense model's config, its throughput measured here)."""
    measured = result.timings.get("stage1")
    if config.heal_tokens != "auto" or config.layers_to_prune is None:
        return measured, "measured"
    if teacher is not None:
        dense_config = teacher.config
    else:  # the pruned model's config with the dense model's layer fields
        dense_config = copy.deepcopy(result.model.config)
        text_config = dense_config.get_text_config(decoder=True)
        for name, value in result.dense_layer_config.items():
            setattr(text_config, name, copy.deepcopy(value))
    parameter = next(result.model.parameters())
    return predicted_stage1_seconds(dense_config, config, len(result.removed_layers), parameter), "predicted"


def predicted_stage1_seconds(dense_model: Any, config: GradMAPConfig, num_removed: int, parameter: torch.nn.Parameter) -> float:
    """The plan's time (its upper end) for a Stage 1 that scores `num_removed` removals from the dense model: what
    `heal_tokens="auto"` is sized by where no Stage 1 ran (`layers_to_prune`, a cut replayed from an earlier run).

    Args:
        dense_model (`PretrainedConfig` or `str`):
            The dense model's config, or its Hub id or folder.
        config ([`GradMAPConfig`]):
            The run's settings; Stage 1's are planned with `num_layers_to_prune=num_removed`.
        num_removed (`int`):
            How many layers the run removed.
        parameter (`torch.nn.Parameter`):
            A parameter of the model: its dtype and device are the plan's.

    Returns:
        `float`: the predicted seconds ([`~optimum_gradmap.planning.plan_pruning`], its throughput measured here).
    """
    from ..planning import plan_pruning

    scored = dataclasses.replace(config, layers_to_prune=None, num_layers_to_prune=num_removed, heal_tokens=0, compensation=False)
    plan = plan_pruning(dense_model, scored, dtype=parameter.dtype, device=parameter.device, tokenizer_bytes=0)
    seconds = plan.stage("Stage 1").seconds.high
    logger.info(
        f"Heal: heal_tokens='auto' sizes the heal by Stage 1's predicted time ({seconds:.1f} s for scoring "
        f"{num_removed} removals): layers_to_prune={config.layers_to_prune} ran no Stage 1."
    )
    return seconds
