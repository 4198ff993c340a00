# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Choosing lambda by what the model predicts (`compensation_selection="next_token_loss"`, and the default `"auto"`
where it can run), not by how close its hidden state comes to the dense one.

`compensation_selection="hidden_state"` picks, for each kept layer, the ridge strength whose W' best reproduces the
dense hidden state on held-out calibration sequences. A hidden state that is closer in squared error is not
always one from which the rest of the model predicts better. Here every strength of the grid is fitted on
three of the four cross-validation folds of sequences, folded into the layer, and scored by the model's
next-token loss on the fourth fold's sequences (the whole model runs: the later layers, the final norm and
the head decide); W' = I (the layer left alone) is a candidate too. The strength with the lowest loss is then
fitted on every sequence. The held-out criterion is the one LinearPatch (Chen et al., NeurIPS 2025, Sec. 3.3)
and ReplaceMe report accuracy against; the grid and folds are those of the hidden-state selection.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from .. import distributed
from ..adapters import DecoderAdapter
from ..configuration import GradMAPConfig
from ..errors import InvalidInputError
from ..passes import mean_next_token_loss
from .folding import apply_compensation, down_projection_backup
from .solvers import (
    AUTO_NUM_FOLDS,
    AUTO_RIDGE_GRID,
    CompensationFit,
    RidgeChoice,
    closed_form_at_strength,
    relative_ridge,
    ridge_solutions,
)
from .statistics import compensation_statistics, summed_over_processes

# Held-out losses closer than this (relative) are a tie, decided for the stronger lambda: a float32 model's loss
# moves by about this much with the order of its sums (another batch split, another number of processes).
LOSS_TIE_TOLERANCE = 1e-6


def next_token_selection_runs(config: GradMAPConfig, adapter: DecoderAdapter) -> bool:
    """Whether the next-token selection can choose among `config`'s fits for `adapter`'s family: they are closed-form
    fits (`solver="closed_form"`) of the `mse` objective, folded where the MLP's output reaches the residual stream
    directly."""
    return adapter.mlp_output_norm_path is None and config.compensation_objective == "mse" and config.solver == "closed_form"


def resolve_selection(config: GradMAPConfig, adapter: DecoderAdapter) -> GradMAPConfig:
    """`config` with its `"auto"` Stage 2 choices made for `adapter`'s family: `compensation_selection="auto"` is
    `"next_token_loss"` where [`next_token_selection_runs`], else `"hidden_state"`; `outlier_tokens="auto"` is
    `"exclude"` where lambda is chosen by the next-token loss, else `"keep"`."""
    selection = config.compensation_selection
    if selection == "auto":
        selection = "next_token_loss" if next_token_selection_runs(config, adapter) else "hidden_state"
    outliers = config.outlier_tokens
    if outliers == "auto":
        outliers = "exclude" if config.reg_lambda == "auto" and selection == "next_token_loss" else "keep"
    return replace(config, compensation_selection=selection, outlier_tokens=outliers)


def chooses_by_next_token_loss(config: GradMAPConfig) -> bool:
    """Whether `config` (its `"auto"` choices resolved by [`resolve_selection`]) chooses lambda by the held-out
    next-token loss ([`learn_by_next_token_loss`])."""
    return config.reg_lambda == "auto" and config.compensation_selection == "next_token_loss"


def check_next_token_selection(config: GradMAPConfig, adapter: DecoderAdapter) -> None:
    """Refuses, before anything changes, a next-token selection asked for by name that cannot be made (`"auto"`
    falls back to the hidden-state selection instead).

    Raises:
        InvalidInputError: with the cosine objective, with `solver="adam"`, or for a family with a norm after the MLP.
    """
    if chooses_by_next_token_loss(config) and not next_token_selection_runs(config, adapter):
        raise InvalidInputError(
            "compensation_selection='next_token_loss' chooses among closed-form fits: it needs solver='closed_form', the "
            "mean-squared-error objective and a family whose MLP output reaches the residual stream directly (no norm "
            "after the MLP). "
            "Use compensation_selection='auto' (the next-token loss where it can run) or 'hidden_state'."
        )


def held_out_next_token_loss(model: nn.Module, input_ids: torch.LongTensor, batch_size: int, progress_bar: bool) -> float:
    """The model's mean next-token loss on `input_ids` (this process's share; averaged over processes)."""
    local = mean_next_token_loss(model, input_ids, batch_size, progress_bar, description="Held-out next-token loss")
    return float(distributed.average(torch.tensor(local, dtype=torch.float64), input_ids.numel()))


def learn_by_next_token_loss(
    model: nn.Module,
    adapter: DecoderAdapter,
    layer: nn.Module,
    original_outputs: torch.Tensor,
    input_ids: torch.LongTensor,
    config: GradMAPConfig,
    progress_bar: bool = True,
    first_sample: int = 0,
) -> CompensationFit:
    """W' for one kept layer, its lambda chosen by the next-token loss on held-out calibration sequences (see
    the module docstring). The model is left as it was (the candidates are folded and undone in turn).
    `config.outlier_tokens="auto"` is `"exclude"` here ([`resolve_selection`]).

    Returns:
        [`CompensationFit`]: its `cross_validation.heldout_error` holds each strength's held-out next-token
        loss, and `identity_error` the loss with the layer left alone.
    """
    config = resolve_selection(replace(config, compensation_selection="next_token_loss"), adapter)
    check_next_token_selection(config, adapter)
    folds = compensation_statistics(
        model,
        adapter,
        layer,
        original_outputs,
        input_ids,
        config.batch_size,
        progress_bar,
        num_folds=AUTO_NUM_FOLDS,
        first_sample=first_sample,
        outliers=config.outlier_tokens,
    )
    folds = [summed_over_processes(fold) for fold in folds]
    train = sum(folds[1:-1], folds[0])
    held_out = input_ids[[i for i in range(input_ids.shape[0]) if (first_sample + i) % AUTO_NUM_FOLDS == AUTO_NUM_FOLDS - 1]]
    candidates = ridge_solutions(train, [relative_ridge(train, alpha) for alpha in AUTO_RIDGE_GRID], config.compensation_form)
    backup = down_projection_backup(adapter, [layer])

    def loss_with(matrix: torch.Tensor) -> float:
        apply_compensation(adapter, layer, matrix)
        try:
            return held_out_next_token_loss(model, held_out, config.batch_size, progress_bar)
        finally:
            backup.restore()

    identity_loss = held_out_next_token_loss(model, held_out, config.batch_size, progress_bar)
    losses = {alpha: loss_with(matrix) for alpha, matrix in zip(AUTO_RIDGE_GRID, candidates)}
    # the strongest lambda among those whose loss is the lowest up to float rounding: processes that sum the loss in
    # another order (optimum_gradmap.distributed) then choose alike
    lowest = min(losses.values())
    best = max(alpha for alpha in AUTO_RIDGE_GRID if losses[alpha] <= lowest + LOSS_TIE_TOLERANCE * abs(lowest))
    choice = RidgeChoice(best if losses[best] < identity_loss else None, losses, identity_loss)
    size = original_outputs.shape[-1]
    if choice.alpha is None:
        return CompensationFit.identity(size, choice)
    total = sum(folds[1:], folds[0])
    matrix, reg_lambda = closed_form_at_strength(total, choice.alpha, config.compensation_form)
    return CompensationFit.measured(matrix, total, reg_lambda, choice)
