# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""The heal stage's entry: the budget (`heal_tokens`, or `"auto"`), the text, then the training ([`heal_stage`], the
pruner's, the CLI's and the benchmarks' one call), and the preparation of the text before pruning starts
([`prepare_heal_text`])."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging

from .. import distributed, streaming
from ..data import CalibrationData
from ..errors import InvalidInputError
from .budget import choose_heal_tokens
from .checks import check_generation_prompts, check_heal_dataset_name, check_heal_settings
from .cost import AUTO_TIME_SHARE, HealCosts
from .generation import is_generated
from .loop import heal
from .result import HealResult
from .settings import HealSettings, PlannedPruning, PrunedLayout
from .state import read_heal_checkpoint
from .text import HealText, generation_seconds_per_sequence, heal_sequences

logger = logging.get_logger(__name__)


def heal_stage(
    model: PreTrainedModel,
    teacher: Callable[[], AbstractContextManager[nn.Module]],
    settings: HealSettings,
    tokenizer: PreTrainedTokenizerBase | None,
    layout: PrunedLayout,
    data: CalibrationData = None,
    text: HealText | None = None,
    stage1_seconds: float | None = None,
    checkpoint: str | os.PathLike | None = None,
    text_cache: str | os.PathLike | None = None,
    progress_bar: bool = True,
    check_ids: Callable[[torch.LongTensor], None] | None = None,
    prompt_data: CalibrationData = None,
    stage1_basis: str = "measured",
) -> HealResult:
    """The heal stage as `settings` say, from its text to the merged weights (the pruner's, the CLI's and the
    benchmarks' one call): the budget (`heal_tokens`, or `"auto"`: [`choose_heal_tokens`] for a share
    `AUTO_TIME_SHARE` of `stage1_seconds`, the text included, with a deadline), the text ([`heal_sequences`], the
    dense model's own where `heal_dataset` says `generated`), then [`heal`] in the execution mode `execution` names.

    Args:
        model, teacher, settings, layout, checkpoint, progress_bar: As in [`heal`].
        tokenizer (`PreTrainedTokenizerBase`, *optional*): For text.
        data (*optional*): The heal text (any form calibration data takes); defaults to `settings.heal_dataset`.
        text ([`HealText`], *optional*): Sequences prepared already (for a number of tokens): used as they are.
        stage1_seconds (`float`, *optional*): Stage 1's time, the unit of `heal_tokens="auto"`.
        text_cache (`str` or `os.PathLike`, *optional*): The cache file of the dense model's own text.
        check_ids (`Callable`, *optional*): Called on each set of sequences prepared here (a token-id check).
        prompt_data (*optional*): The calibration data that prompts the dense model's own text ([`heal_sequences`]).
        stage1_basis (`str`, defaults to `"measured"`): Where `stage1_seconds` comes from: `"measured"` (a Stage 1 that
            ran) or `"predicted"` (the plan's, where no Stage 1 scored); logged and kept in `budget_basis`.

    Returns:
        [`HealResult`], with the text's seconds in `generation_seconds` and `seconds`; for `"auto"`, the time given in
        `budget_seconds`, the tokens chosen in `budget_tokens` and their basis in `budget_basis` (`"resumed"`: those of
        the interrupted run whose checkpoint it resumes).

    Raises:
        InvalidInputError: for `heal_tokens="auto"` without Stage 1's time, and what [`heal_sequences`] and [`heal`] refuse.
    """
    started = time.perf_counter()
    budget, deadline, basis, generated_before = None, None, None, 0.0
    if settings.heal_tokens == "auto":
        budget = _auto_budget_seconds(stage1_seconds)
        deadline = started + budget
        tokens, basis = _resumed_tokens(checkpoint), "resumed"
        if tokens is None:
            tokens, costs, generated_before = _auto_tokens(
                model, teacher, settings, tokenizer, layout, deadline, data, text_cache, prompt_data
            )
            logger.info(
                f"Heal: heal_tokens='auto' chose {tokens:,} tokens for {budget:.0f} s, Stage 1's {stage1_basis} time ({costs})."
            )
            basis = stage1_basis
        settings = dataclasses.replace(settings, heal_tokens=tokens)
        text = None
    if text is None:
        text = heal_sequences(data, tokenizer, settings, teacher, text_cache, progress_bar, prompt_data, layout)
        for ids in (text.train_ids, text.validation_ids):
            if check_ids is not None:
                check_ids(ids)
    with streaming.execution_mode(settings.execution):
        result = heal(
            model,
            teacher,
            text.train_ids,
            text.validation_ids,
            settings,
            layout,
            text.source,
            checkpoint,
            progress_bar,
            deadline,
            spent_seconds=time.perf_counter() - started,
            targets=(text.train_targets, text.validation_targets) if text.train_targets is not None else None,
        )
    result.generation_seconds = generated_before + text.generation_seconds
    result.budget_seconds, result.budget_basis = budget, basis
    return result


def _auto_budget_seconds(stage1_seconds: float | None) -> float:
    """The seconds `heal_tokens="auto"` gives the heal: a share `AUTO_TIME_SHARE` of Stage 1's."""
    if stage1_seconds is None or not stage1_seconds > 0:
        raise InvalidInputError(
            "heal_tokens='auto' spends about Stage 1's measured time on the heal, and this run has no Stage 1 time "
            "(layers given, or a report without timings): give a number of tokens (`heal_tokens`)."
        )
    return AUTO_TIME_SHARE * stage1_seconds


def _resumed_tokens(checkpoint: str | os.PathLike | None) -> int | None:
    """The training tokens of the interrupted heal whose state `checkpoint` holds (`None` without a file, or in a file
    that does not record them): a resumed `heal_tokens="auto"` heal trains the same sequences again rather than
    timing the heal anew (another count would be another run, whose file the resume refuses)."""
    saved = read_heal_checkpoint(checkpoint) if checkpoint is not None else None
    tokens = saved and saved["budget_tokens"]
    if tokens:
        logger.info(f"Heal: heal_tokens='auto' resumes the {tokens:,} tokens its interrupted run chose ({checkpoint}).")
    return tokens or None


def _auto_tokens(
    model: PreTrainedModel,
    teacher: Callable[[], AbstractContextManager[nn.Module]],
    settings: HealSettings,
    tokenizer: PreTrainedTokenizerBase | None,
    layout: PrunedLayout,
    deadline: float,
    data: CalibrationData = None,
    text_cache: str | os.PathLike | None = None,
    prompt_data: CalibrationData = None,
) -> tuple[int, HealCosts, float]:
    """`heal_tokens="auto"`: the tokens whose heal fits before `deadline` (what a sequence of the dense model's own
    text costs is measured first, where it writes the text), the costs they come from, and the seconds spent on the
    text."""
    started, rate, generated = time.perf_counter(), 0.0, 0.0
    if data is None and is_generated(settings.heal_dataset):
        rate = generation_seconds_per_sequence(teacher, tokenizer, settings, text_cache, prompt_data, layout)
        generated = time.perf_counter() - started
    tokens, costs = choose_heal_tokens(model, settings, layout, deadline - time.perf_counter(), rate)
    return tokens, costs, generated


def prepare_heal_text(
    model: PreTrainedModel,
    heal_data: CalibrationData,
    settings: HealSettings,
    pruning: PrunedLayout | PlannedPruning,
    tokenizer_for: Callable[[CalibrationData], PreTrainedTokenizerBase | None],
    check_ids: Callable[[torch.LongTensor], None],
) -> HealText | None:
    """The heal stage's training and held-out sequences (`heal_data`, else `settings.heal_dataset`), drawn with seed
    `seed + 2`, after the checks of its settings on `model` ([`check_heal_settings`]: the model pruned already, or
    before its pruning) and of the dense model's prompts. `None` where the heal makes them when it starts: the dense
    model's own text, and `heal_tokens="auto"` (only the names are checked here).

    Args:
        model (`PreTrainedModel`): The model to prune (or pruned).
        heal_data (*optional*): The heal text (any form calibration data takes).
        settings ([`HealSettings`]): The heal's settings.
        pruning ([`PrunedLayout`] or [`PlannedPruning`]): As in [`check_heal_settings`].
        tokenizer_for (`Callable`): The tokenizer for some data (the pruner's rule).
        check_ids (`Callable`): Called on each set of sequences (the pruner's token-id check).

    Returns:
        [`HealText`], or `None`.
    """
    check_heal_settings(model, settings, pruning)
    data = heal_data if heal_data is not None else settings.heal_dataset
    if isinstance(data, str) and not os.path.exists(data):
        check_heal_dataset_name(data)  # a name: refused before a tokenizer is looked for
    generated = heal_data is None and is_generated(settings.heal_dataset)
    if generated:  # prompts longer than the sequences, or no chat template: refused before Stage 1
        check_generation_prompts(settings)
    if settings.heal_tokens == "auto" or generated:
        return None
    text = heal_sequences(data, tokenizer_for(data), settings)
    for ids in (text.train_ids, text.validation_ids):
        check_ids(ids)
    distributed.shard_bounds(text.train_ids.shape[0])
    return text
