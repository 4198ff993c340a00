# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""The heal stage's entry: the budget (`heal_tokens`, or `"auto"`), the text, then the training ([`heal_stage`], the
pruner's, the CLI's and the benchmarks' one call), and the preparation of the text before pruning starts
([`prepare_heal_text`])."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager

import torch
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging

from .. import distributed, streaming
from ..adapters import get_adapter
from ..configuration import GradMAPConfig
from ..data import CalibrationData
from ..errors import InvalidInputError
from ..objectives import TeacherTargets
from .budget import AUTO_TIME_SHARE, choose_heal_tokens
from .checks import check_generation_prompts, check_heal_dataset_name, check_heal_settings
from .generation import is_generated
from .loop import heal
from .result import HealResult
from .state import _read_saved
from .text import HealText, generation_seconds_per_sequence, heal_sequences

logger = logging.get_logger(__name__)


def heal_stage(
    model: PreTrainedModel,
    teacher: Callable[[], AbstractContextManager[nn.Module]],
    config: GradMAPConfig,
    tokenizer: PreTrainedTokenizerBase | None,
    kept: Sequence[int],
    num_layers: int,
    compensated: Sequence[int],
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
    """The heal stage as `config` says, from its text to the merged weights (the pruner's, the CLI's and the
    benchmarks' one call): the budget (`heal_tokens`, or `"auto"`: [`choose_heal_tokens`] for a share
    `AUTO_TIME_SHARE` of `stage1_seconds`, the text included, with a deadline), the text ([`heal_sequences`], the
    dense model's own where `heal_dataset` says `generated`), then [`heal`].

    Args:
        model, teacher, kept, num_layers, compensated, checkpoint, progress_bar: As in [`heal`].
        config ([`GradMAPConfig`]): Its `heal_*` settings, `seed`, `dataset`, `text_column` and `execution` are read.
        tokenizer (`PreTrainedTokenizerBase`, *optional*): For text.
        data (*optional*): The heal text (any form calibration data takes); defaults to `config.heal_dataset`.
        text ([`HealText`], *optional*): Sequences prepared already (for a number of tokens): used as they are.
        stage1_seconds (`float`, *optional*): Stage 1's time, the unit of `heal_tokens="auto"`.
        text_cache (`str` or `os.PathLike`, *optional*): The cache file of the dense model's own text.
        check_ids (`Callable`, *optional*): Called on each set of sequences prepared here (the pruner's token-id
            check).
        prompt_data (*optional*): The calibration data that prompts the dense model's own text ([`heal_sequences`]).
        stage1_basis (`str`, defaults to `"measured"`): Where `stage1_seconds` comes from: `"measured"` (a Stage 1 that
            ran) or `"predicted"` (the plan's, where no Stage 1 scored); logged and kept in `budget_basis`.

    Returns:
        [`HealResult`], with the text's seconds in `generation_seconds` and `seconds`, and for `"auto"` the time given
        in `budget_seconds`, the tokens chosen in `budget_tokens` and where they came from in `budget_basis` (an
        interrupted `"auto"` heal resumes with the tokens its checkpoint holds, `"resumed"`).

    Raises:
        InvalidInputError: for `heal_tokens="auto"` without Stage 1's time, and what [`heal_sequences`] and [`heal`]
            refuse.
    """
    started = time.perf_counter()
    budget, basis, generated_before = None, None, 0.0
    if config.heal_tokens == "auto":
        budget = _auto_budget_seconds(stage1_seconds)
        tokens, basis = _resumed_tokens(checkpoint), "resumed"
        if tokens is None:
            tokens, generated_before = _auto_tokens(
                model, teacher, config, tokenizer, kept, num_layers, compensated, data, budget, started, text_cache,
                prompt_data, stage1_basis,
            )  # fmt: skip
            basis = stage1_basis
        config = dataclasses.replace(config, heal_tokens=tokens)
        text = None
    if text is None:
        text = heal_sequences(data, tokenizer, config, teacher, text_cache, progress_bar, prompt_data, kept)
        for ids in (text.train_ids, text.validation_ids):
            if check_ids is not None:
                check_ids(ids)
    result = heal_as_configured(
        model, teacher, text.train_ids, text.validation_ids, config, kept, num_layers, compensated, text.source,
        checkpoint, progress_bar, deadline=started + budget if budget is not None else None,
        spent_seconds=time.perf_counter() - started,
        targets=(text.train_targets, text.validation_targets) if text.train_targets is not None else None,
    )  # fmt: skip
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
    saved = _read_saved(checkpoint) if checkpoint is not None else None
    tokens = saved and saved["budget_tokens"]
    if tokens:
        logger.info(f"Heal: heal_tokens='auto' resumes the {tokens:,} tokens its interrupted run chose ({checkpoint}).")
    return tokens or None


def _auto_tokens(
    model: PreTrainedModel,
    teacher: Callable[[], AbstractContextManager[nn.Module]],
    config: GradMAPConfig,
    tokenizer: PreTrainedTokenizerBase | None,
    kept: Sequence[int],
    num_layers: int,
    compensated: Sequence[int],
    data: CalibrationData,
    budget: float,
    started: float,
    text_cache: str | os.PathLike | None,
    prompt_data: CalibrationData,
    stage1_basis: str,
) -> tuple[int, float]:
    """`heal_tokens="auto"`: the tokens whose heal fits in `budget` seconds from `started` (what a sequence of the
    dense model's own text costs is measured first, where it writes the text), and the seconds spent on its text."""
    rate, generated_before = 0.0, 0.0
    if data is None and is_generated(config.heal_dataset):
        rate = generation_seconds_per_sequence(teacher, tokenizer, config, text_cache, prompt_data, kept)
        generated_before = time.perf_counter() - started
    remaining = budget - (time.perf_counter() - started)
    tokens, costs = choose_heal_tokens(model, config, remaining, kept, num_layers, compensated, rate)
    logger.info(f"Heal: heal_tokens='auto' chose {tokens:,} tokens for {budget:.0f} s, Stage 1's {stage1_basis} time ({costs}).")
    return tokens, generated_before


def prepare_heal_text(
    model: PreTrainedModel,
    heal_data: CalibrationData,
    config: GradMAPConfig,
    tokenizer_for: Callable[[CalibrationData], PreTrainedTokenizerBase | None],
    check_ids: Callable[[torch.LongTensor], None],
    compensated: list[int] | None = None,
) -> HealText | None:
    """The heal stage's training and held-out sequences (`heal_data`, else `config.heal_dataset`), drawn with seed
    `seed + 2`, after the checks of its settings on `model` (pruned already when `compensated`, the layers Stage 2
    compensated, is given) and of the dense model's prompts. `None` where the heal makes them when it starts: the
    dense model's own text, and `heal_tokens="auto"` (only the names are checked here).

    Args:
        model (`PreTrainedModel`): The model to prune (or pruned).
        heal_data (*optional*): The heal text (any form calibration data takes).
        config ([`GradMAPConfig`]): The run's settings.
        tokenizer_for (`Callable`): The tokenizer for some data (the pruner's rule).
        check_ids (`Callable`): Called on each set of sequences (the pruner's token-id check).
        compensated (`list[int]`, *optional*): For a pruned model, the layers Stage 2 compensated.

    Returns:
        [`HealText`], or `None`.
    """
    check_heal_settings(model, config, compensated)
    data = heal_data if heal_data is not None else config.heal_dataset
    if isinstance(data, str) and not os.path.exists(data):
        check_heal_dataset_name(data)  # a name: refused before a tokenizer is looked for
    generated = heal_data is None and is_generated(config.heal_dataset)
    if generated:  # prompts longer than the sequences, or no chat template: refused before Stage 1
        check_generation_prompts(config, tokenizer_for(config.dataset) if config.heal_prompts == "chat" else None)
    if config.heal_tokens == "auto" or generated:
        return None
    text = heal_sequences(data, tokenizer_for(data), config)
    for ids in (text.train_ids, text.validation_ids):
        check_ids(ids)
    distributed.shard_bounds(text.train_ids.shape[0])
    return text


def heal_as_configured(
    model: PreTrainedModel,
    teacher: Callable[[], AbstractContextManager[nn.Module]],
    train_ids: torch.LongTensor,
    validation_ids: torch.LongTensor,
    config: GradMAPConfig,
    kept: Sequence[int],
    num_layers: int,
    compensated: Sequence[int],
    dataset: str,
    checkpoint: str | os.PathLike | None = None,
    progress_bar: bool = True,
    deadline: float | None = None,
    spent_seconds: float = 0.0,
    targets: tuple[TeacherTargets, TeacherTargets] | None = None,
) -> HealResult:
    """[`heal`] with the `heal_*` settings of `config`, on given sequences ([`heal_stage`] prepares them).

    Args:
        model, teacher, train_ids, validation_ids, kept, num_layers, compensated, dataset, checkpoint, progress_bar,
            deadline, spent_seconds, targets: As in [`heal`].
        config ([`GradMAPConfig`]): Its `heal_trainable`, `heal_lr`, `heal_batch_size`, `heal_check_every`,
            `heal_lora_rank`, `heal_loss`, `heal_autocast`, `execution` (whether the training steps run layer-streamed, see
            [`heal`]) and `seed` (LoRA's initialisation) are read.

    Returns:
        [`HealResult`].
    """
    with streaming.execution_mode(config.execution):
        return heal(
            model,
            get_adapter(model),
            teacher,
            train_ids,
            validation_ids,
            trainable=config.heal_trainable,
            learning_rate=config.heal_lr,
            batch_size=config.heal_batch_size,
            check_every=config.heal_check_every,
            loss=config.heal_loss,
            lora_rank=config.heal_lora_rank,
            autocast=config.heal_autocast,
            kept=kept,
            num_layers=num_layers,
            compensated=compensated,
            dataset=dataset,
            checkpoint=checkpoint,
            progress_bar=progress_bar,
            seed=config.seed,
            deadline=deadline,
            spent_seconds=spent_seconds,
            targets=targets,
        )
