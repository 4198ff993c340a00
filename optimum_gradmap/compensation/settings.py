# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""The Stage 2 settings: the `GradMAPConfig` fields Stage 2 reads, the refusal of those a family cannot run (made
before anything changes), and the warning for a calibration set too small for W'."""

from __future__ import annotations

import torch
from transformers.utils import logging

from ..adapters import DecoderAdapter
from ..configuration import GradMAPConfig
from .activations import check_outlier_tokens
from .next_token import check_next_token_selection

logger = logging.get_logger(__name__)

# Below this many calibration tokens per hidden unit, W' (hidden x hidden parameters) overfitted on
# SmolLM2-135M: 1.8 tokens per unit raised held-out perplexity by 60%, 7 by 2%, 28 lowered it.
MIN_TOKENS_PER_HIDDEN_UNIT = 16
# The GradMAPConfig fields Stage 2 reads: the ones a re-run of Stage 2 may change.
STAGE2_SETTINGS = (
    "compensation_target",
    "compensation_form",
    "compensation_objective",
    "compensation_selection",
    "lambda_search",
    "outlier_tokens",
    "compensation_dataset",
    "refinement_steps",
    "refinement_lr",
    "num_compensated_layers",
    "solver",
    "reg_lambda",
    "adam_lr",
    "adam_steps",
    "batch_size",
)


def check_stage2_settings(config: GradMAPConfig, adapter: DecoderAdapter) -> None:
    """Refuses, before anything changes, Stage 2 settings that `adapter`'s family cannot run: a next-token
    selection ([`check_next_token_selection`]) or clipped outlier weights ([`check_outlier_tokens`]) with a
    norm after the MLP.

    Raises:
        InvalidInputError: saying which setting and what to use instead.
    """
    check_next_token_selection(config, adapter)
    check_outlier_tokens(config, adapter)


def warn_if_few_tokens(calibration_ids: torch.LongTensor, hidden_size: int, config: GradMAPConfig) -> None:
    """Warns when a fixed `reg_lambda` fits the hidden x hidden W' on fewer than `MIN_TOKENS_PER_HIDDEN_UNIT` calibration
    tokens per hidden unit, below which it was measured to overfit."""
    if calibration_ids.numel() < MIN_TOKENS_PER_HIDDEN_UNIT * hidden_size and config.reg_lambda != "auto":
        logger.warning(
            f"Stage 2 fits a {hidden_size} x {hidden_size} matrix on {calibration_ids.numel()} calibration tokens: with "
            f"fewer than {MIN_TOKENS_PER_HIDDEN_UNIT} x hidden size = {MIN_TOKENS_PER_HIDDEN_UNIT * hidden_size} tokens it "
            "can overfit and raise held-out perplexity. Use more calibration data (the paper uses 128 x 128 tokens), "
            "or reg_lambda='auto'."
        )
