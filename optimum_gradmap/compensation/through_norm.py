# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Stage 2 where a norm follows the MLP (Gemma2/3's and OLMo2's `post_feedforward_layernorm`): the layer
adds norm(W' y) to the residual stream, which is not linear in W', so there is no closed form. W' is
fitted by Adam ([`adam_minimize`]) on the stored activations, with the norm in the loop:

    mean((norm(W' y) - r)^2) + lambda || W' - I ||_F^2

and `reg_lambda="auto"` is chosen by the same routine as the closed form ([`choose_ridge`]); each
candidate is an Adam fit, so only the last of the `AUTO_NUM_FOLDS` folds is held out, over the middle
of the grid.
"""

from __future__ import annotations

import torch
from torch import nn

from .solvers import AUTO_NUM_FOLDS, AUTO_RIDGE_GRID, RidgeChoice, adam_minimize, choose_ridge, lambda_for_strength

# The strengths tried through a norm (each an Adam fit): the middle of AUTO_RIDGE_GRID.
NORM_RIDGE_GRID = AUTO_RIDGE_GRID[3:7]


class NormContribution:
    """norm(y W'^T) for rows y, with the norm's parameters frozen (detached) and its dtype kept.

    Args:
        norm (`nn.Module`): The norm that follows the MLP.
    """

    def __init__(self, norm: nn.Module):
        self.norm = norm
        self.frozen = {name: parameter.detach() for name, parameter in norm.named_parameters()}

    def __call__(self, mlp_outputs: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
        dtype = next(iter(self.frozen.values())).dtype if self.frozen else mlp_outputs.dtype
        mapped = (mlp_outputs @ matrix.T).to(dtype)
        return torch.func.functional_call(self.norm, self.frozen, (mapped,)).double()

    def squared_error(self, mlp_outputs: torch.Tensor, targets: torch.Tensor, matrix: torch.Tensor) -> float:
        """sum over rows of ||norm(W' y) - r||^2."""
        with torch.no_grad():
            return float((self(mlp_outputs, matrix) - targets).pow(2).sum())


def fit_through_norm(
    mlp_outputs: torch.Tensor,
    targets: torch.Tensor,
    norm: nn.Module,
    reg_lambda: float,
    learning_rate: float,
    num_steps: int,
    progress_bar: bool = True,
    form: str = "full",
) -> tuple[torch.Tensor, float, float]:
    """Minimises mean((norm(W' y) - r)^2) + lambda || W' - I ||_F^2 with Adam from W' = I, on the rows
    `mlp_outputs` (y) and `targets` (r), each `(rows, d)` in float64.

    Returns:
        `tuple[torch.Tensor, float, float]`: W', and the objective at W' = I and at W'.
    """
    size = mlp_outputs.shape[-1]
    contribution = NormContribution(norm)
    identity = torch.eye(size, dtype=torch.float64, device=mlp_outputs.device)

    def objective(matrix: torch.Tensor) -> torch.Tensor:
        return (contribution(mlp_outputs, matrix) - targets).pow(2).mean() + reg_lambda * (matrix - identity).pow(2).sum()

    description = "Fitting W' through the norm (Adam)"
    matrix = adam_minimize(objective, size, learning_rate, num_steps, form, mlp_outputs.device, progress_bar, description)
    with torch.no_grad():
        return matrix, float(objective(identity)), float(objective(matrix))


def choose_ridge_through_norm(
    mlp_outputs: torch.Tensor,
    targets: torch.Tensor,
    folds: torch.Tensor,
    norm: nn.Module,
    learning_rate: float,
    num_steps: int,
    progress_bar: bool = True,
    form: str = "full",
) -> tuple[RidgeChoice, float | None]:
    """`reg_lambda="auto"` through a norm: [`choose_ridge`] with the last fold held out.

    Args:
        mlp_outputs, targets (`torch.Tensor` of shape `(rows, d)`): y and r, float64.
        folds (`torch.Tensor` of shape `(rows,)`): The cross-validation fold of each row (its sequence's).

    Returns:
        `tuple[RidgeChoice, float | None]`: The choice, and the lambda of the chosen strength on all rows
        (`None` when no strength beat W' = I).
    """
    held_out = folds == AUTO_NUM_FOLDS - 1
    train_y, train_r, test_y, test_r = mlp_outputs[~held_out], targets[~held_out], mlp_outputs[held_out], targets[held_out]
    contribution = NormContribution(norm)

    def fit_without(fold: int, alphas: list[float]) -> list[torch.Tensor]:
        mean_eigenvalue = float(train_y.pow(2).sum() / train_y.shape[-1])
        return [
            fit_through_norm(
                train_y,
                train_r,
                norm,
                lambda_for_strength(alpha, mean_eigenvalue, train_y.numel()),
                learning_rate,
                num_steps,
                progress_bar,
                form,
            )[0]
            for alpha in alphas
        ]

    identity = torch.eye(mlp_outputs.shape[-1], dtype=torch.float64, device=mlp_outputs.device)
    held_out_error = lambda fold, matrix: contribution.squared_error(test_y, test_r, matrix)  # noqa: E731
    choice = choose_ridge([AUTO_NUM_FOLDS - 1], NORM_RIDGE_GRID, fit_without, held_out_error, identity)
    if choice.alpha is None:
        return choice, None
    mean_eigenvalue = float(mlp_outputs.pow(2).sum() / mlp_outputs.shape[-1])
    return choice, lambda_for_strength(choice.alpha, mean_eigenvalue, mlp_outputs.numel())
