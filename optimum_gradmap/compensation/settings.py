# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""The Stage 2 settings ([`Stage2Settings`]): the `GradMAPConfig` fields Stage 2 reads, and the warning for a
calibration set too small for W'. A leaf of the package: every Stage 2 module reads its settings from here."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

import torch
from transformers.utils import logging

from ..configuration import (
    CompensationForm,
    CompensationObjective,
    CompensationSelection,
    CompensationTarget,
    OutlierTokens,
    Solver,
)
from ..settings import StepSettings

logger = logging.get_logger(__name__)

# Below this many calibration tokens per hidden unit, W' (hidden x hidden parameters) overfitted on
# SmolLM2-135M: 1.8 tokens per unit raised held-out perplexity by 60%, 7 by 2%, 28 lowered it.
MIN_TOKENS_PER_HIDDEN_UNIT = 16


@dataclass(frozen=True)
class Stage2Settings(StepSettings):
    """Stage 2's settings: the fields of [`~optimum_gradmap.GradMAPConfig`] it reads, under the same names (their
    meaning is told there), frozen; `Stage2Settings.from_config(config)` takes them from a config. A re-run of Stage 2
    ([`~optimum_gradmap.GradMAPPruner.compensate`]) may change any of them."""

    compensation_target: CompensationTarget
    compensation_form: CompensationForm
    compensation_objective: CompensationObjective
    compensation_selection: CompensationSelection
    outlier_tokens: OutlierTokens
    compensation_dataset: str | None
    refinement_steps: int
    refinement_lr: float
    num_compensated_layers: int
    solver: Solver
    reg_lambda: float | Literal["auto"]
    adam_lr: float
    adam_steps: int
    batch_size: int


# The names of Stage 2's settings: the ones a re-run of Stage 2 may change.
STAGE2_SETTINGS: tuple[str, ...] = tuple(item.name for item in fields(Stage2Settings))


def warn_if_few_tokens(calibration_ids: torch.LongTensor, hidden_size: int, config: Stage2Settings) -> None:
    """Warns when a fixed `reg_lambda` fits the hidden x hidden W' on fewer than `MIN_TOKENS_PER_HIDDEN_UNIT` calibration
    tokens per hidden unit, below which it was measured to overfit."""
    if calibration_ids.numel() < MIN_TOKENS_PER_HIDDEN_UNIT * hidden_size and config.reg_lambda != "auto":
        logger.warning(
            f"Stage 2 fits a {hidden_size} x {hidden_size} matrix on {calibration_ids.numel()} calibration tokens: with "
            f"fewer than {MIN_TOKENS_PER_HIDDEN_UNIT} x hidden size = {MIN_TOKENS_PER_HIDDEN_UNIT * hidden_size} tokens it "
            "can overfit and raise held-out perplexity. Use more calibration data (the paper uses 128 x 128 tokens), "
            "or reg_lambda='auto'."
        )
