# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Stage 2 with ReplaceMe's objective (`compensation_objective="cosine"`; Shopkhoev et al., 2025, "ReplaceMe:
Network Simplification via Depth Pruning and Transformer Block Linearization", Sec. 3.2): W' minimises the
mean over calibration tokens of the cosine distance between the compensated hidden state and the dense one,

    mean_t ( 1 - cos(x_F,t + W' y_t, x_O,t) )

(with a norm after the MLP, x_F + norm(W' y)). The direction of the hidden state, not its length, is what the
next layers' norms pass on, and a few tokens with massive activations weigh no more than any other.

There is no closed form: Adam starts from the mean-squared-error solution (the paper's objective, its lambda
chosen as `reg_lambda` says, fitted on the training folds) and runs on the first three of the four
cross-validation folds of sequences; the W' kept is the one with the lowest cosine distance on the fourth
(checked every 10 steps; the fit stops after 5 checks without improvement), the start included.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .settings import Stage2Settings
from .solvers import (
    AUTO_NUM_FOLDS,
    CompensationFit,
    adam_minimize,
    closed_form_at_strength,
    cross_validate_ridge,
    solve_closed_form,
)
from .statistics import CompensationRows
from .through_norm import NormContribution


def cosine_distance(rows: CompensationRows, matrix: torch.Tensor, norm: nn.Module | None = None) -> torch.Tensor:
    """mean over `rows` of 1 - cos(x_F + W' y, x_O) (x_F + norm(W' y) with a norm after the MLP), in float32."""
    y = rows.mlp_output.float()
    contribution = NormContribution(norm)(y, matrix.float()).float() if norm is not None else y @ matrix.to(y).T
    compensated = rows.ffn_input.float() + contribution
    return (1 - torch.nn.functional.cosine_similarity(compensated, rows.original.float(), dim=-1)).mean()


def learn_cosine(
    rows: CompensationRows, config: Stage2Settings, progress_bar: bool = True, norm: nn.Module | None = None
) -> CompensationFit:
    """W' by the cosine objective (see the module docstring).

    Args:
        rows ([`CompensationRows`]): Every calibration token's Y, X_F and X_O.
        config ([`Stage2Settings`]): `reg_lambda` (for the starting point), `compensation_form`, `adam_lr` and
            `adam_steps` are read.
        progress_bar (`bool`, defaults to `True`): Show a progress bar.
        norm (`nn.Module`, *optional*): The norm that follows the MLP, if the family has one.

    Returns:
        [`CompensationFit`]: the objectives are cosine distances over every row, at W' = I and at W'.
    """
    size, form = rows.mlp_output.shape[-1], config.compensation_form
    folds = rows.sample % AUTO_NUM_FOLDS
    train, held_out = rows.select(folds != AUTO_NUM_FOLDS - 1), rows.select(folds == AUTO_NUM_FOLDS - 1)
    start, choice, reg_lambda = _mean_squared_error_start(rows, folds, train, config)

    def distance(part: CompensationRows) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda matrix: cosine_distance(part, matrix, norm)

    matrix = adam_minimize(
        distance(train),
        size,
        config.adam_lr,
        config.adam_steps,
        form,
        rows.mlp_output.device,
        progress_bar,
        "Fitting W' (cosine, Adam)",
        start=start.to(rows.mlp_output.device),
        held_out=lambda candidate: float(distance(held_out)(candidate)),
    )
    identity = torch.eye(size, dtype=torch.float64, device=rows.mlp_output.device)
    with torch.no_grad():
        at_identity, fitted = float(distance(rows)(identity)), float(distance(rows)(matrix))
    return CompensationFit(matrix.cpu(), at_identity, fitted, reg_lambda=reg_lambda, cross_validation=choice)


def _mean_squared_error_start(rows: CompensationRows, folds: torch.Tensor, train: CompensationRows, config: Stage2Settings):
    """The mean-squared-error W' fitted on the training rows: the starting point (the identity where
    cross-validation finds that nothing beats it), with the cross-validation choice and the lambda used."""
    size = rows.mlp_output.shape[-1]
    statistics = train.statistics()
    if config.reg_lambda != "auto":
        return solve_closed_form(statistics, config.reg_lambda, config.compensation_form), None, config.reg_lambda
    choice = cross_validate_ridge(
        [rows.select(folds == fold).statistics() for fold in range(AUTO_NUM_FOLDS)], form=config.compensation_form
    )
    if choice.alpha is None:
        return torch.eye(size, dtype=torch.float64), choice, None
    matrix, reg_lambda = closed_form_at_strength(statistics, choice.alpha, config.compensation_form)
    return matrix, choice, reg_lambda
