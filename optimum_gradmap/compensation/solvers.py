# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Solvers of the Stage 2 objective (Eq. 12-14) and the choice of its lambda.

- [`solve_closed_form`]: the exact minimiser W' = (C + M lambda I)(A + M lambda I)^-1, in float64;
- [`solve_adam`]: the paper's optimiser, full-batch Adam from W' = I ([`adam_minimize`], the one Adam
  loop of the package, which the fit through a norm uses too);
- [`choose_ridge`]: `reg_lambda="auto"`, the one cross-validation routine of every fit: each held-out
  fold's error under the W' fitted on the others, for each strength of a grid measured relative to the
  data ([`lambda_for_strength`]), and W' = I as the baseline it must beat.

With `form="diagonal"` W' is a channel-wise scaling (d numbers instead of d^2).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers.utils import logging

from .statistics import CompensationStatistics

# Ridge strengths tried by `reg_lambda="auto"`, relative to the data: ridge = alpha * tr(A) / d (the mean
# eigenvalue of A), so that their meaning does not depend on the number of tokens. Large alpha is W' = I.
AUTO_RIDGE_GRID = tuple(10.0**exponent for exponent in range(-6, 3))
AUTO_NUM_FOLDS = 4


@dataclass
class RidgeChoice:
    """What cross-validation chose for one layer.

    Args:
        alpha (`float`, *optional*): The chosen relative ridge strength; `None` when no strength beat W' = I.
        heldout_error (`dict[float, float]`): Summed held-out squared error of each alpha over the folds.
        identity_error (`float`): The same for W' = I.
    """

    alpha: float | None
    heldout_error: dict[float, float]
    identity_error: float


def lambda_for_strength(alpha: float, mean_eigenvalue: float, num_elements: int) -> float:
    """lambda of Eq. 14 for the relative strength `alpha`: the ridge alpha * tr(A) / d, divided by the M
    elements the mean squared error averages."""
    return alpha * mean_eigenvalue / num_elements


def relative_ridge(statistics: CompensationStatistics, alpha: float) -> float:
    """The ridge alpha * tr(A) / d, in the units of the statistics (M x lambda)."""
    return alpha * statistics.mean_eigenvalue


def _diagonal_solution(statistics: CompensationStatistics, ridge: float) -> torch.Tensor:
    """The channel-wise scaling minimising the objective: w_k = (C_kk + rho) / (A_kk + rho), as a matrix."""
    gram, cross = statistics.gram.diagonal(), statistics.cross.diagonal()
    return torch.diag(torch.where(gram + ridge > 0, (cross + ridge) / (gram + ridge), torch.ones_like(gram)))


def ridge_solutions(statistics: CompensationStatistics, ridges: Sequence[float], form: str = "full") -> list[torch.Tensor]:
    """W' = (C + rho I)(A + rho I)^-1 for each ridge rho, from one eigendecomposition of A; with
    `form="diagonal"`, the channel-wise scalings (C_kk + rho) / (A_kk + rho)."""
    if form == "diagonal":
        return [_diagonal_solution(statistics, ridge) for ridge in ridges]
    eigenvalues, eigenvectors = torch.linalg.eigh(statistics.gram)
    identity = torch.eye(statistics.gram.shape[0], dtype=torch.float64)
    solutions = []
    for ridge in ridges:
        inverse = (eigenvectors / (eigenvalues + ridge).clamp_min(1e-300)) @ eigenvectors.T
        solutions.append((statistics.cross + ridge * identity) @ inverse)
    return solutions


def choose_ridge(
    held_out_folds: Sequence[int],
    grid: Sequence[float],
    fit_without: Callable[[int, Sequence[float]], list[torch.Tensor]],
    held_out_error: Callable[[int, torch.Tensor], float],
    identity: torch.Tensor,
) -> RidgeChoice:
    """Chooses the relative ridge strength with the lowest held-out error: for each fold in
    `held_out_folds`, the W' of every strength fitted on the other folds, scored on that fold. Ties go to
    the stronger ridge (closer to W' = I).

    Args:
        held_out_folds (`Sequence[int]`): The folds held out in turn.
        grid (`Sequence[float]`): The relative strengths alpha to try.
        fit_without (`Callable`): `(fold, alphas)` -> one W' per alpha, fitted without `fold`.
        held_out_error (`Callable`): `(fold, W')` -> the squared error of W' on `fold`.
        identity (`torch.Tensor`): W' = I, the fit to beat.

    Returns:
        [`RidgeChoice`]: `alpha` is `None` when no strength beats W' = I on the held-out folds.
    """
    errors = dict.fromkeys(grid, 0.0)
    identity_error = 0.0
    for fold in held_out_folds:
        for alpha, matrix in zip(grid, fit_without(fold, grid)):
            errors[alpha] += held_out_error(fold, matrix)
        identity_error += held_out_error(fold, identity)
    best = min(grid, key=lambda alpha: (errors[alpha], -alpha))
    return RidgeChoice(alpha=best if errors[best] < identity_error else None, heldout_error=errors, identity_error=identity_error)


def cross_validate_ridge(
    folds: Sequence[CompensationStatistics], grid: Sequence[float] = AUTO_RIDGE_GRID, form: str = "full"
) -> RidgeChoice:
    """[`choose_ridge`] for the closed form, by K-fold cross-validation over calibration sequences: every
    fold held out in turn, each candidate solved from the statistics of the others (one d x d
    eigendecomposition per fold).

    Returns:
        [`RidgeChoice`]: `alpha` is `None` when no strength beats W' = I on the held-out folds.
    """
    total = sum(folds[1:], folds[0])

    def fit_without(fold: int, alphas: Sequence[float]) -> list[torch.Tensor]:
        train = total - folds[fold]
        return ridge_solutions(train, [relative_ridge(train, alpha) for alpha in alphas], form)

    identity = torch.eye(total.gram.shape[0], dtype=torch.float64)
    held_out_error = lambda fold, matrix: float(folds[fold].squared_error(matrix))  # noqa: E731
    return choose_ridge(range(len(folds)), grid, fit_without, held_out_error, identity)


def solve_closed_form(statistics: CompensationStatistics, reg_lambda: float, form: str = "full") -> torch.Tensor:
    """Exact minimiser of the Stage 2 objective, W' = (C + M lambda I)(A + M lambda I)^-1, in float64; with
    `form="diagonal"`, over channel-wise scalings: w_k = (C_kk + M lambda) / (A_kk + M lambda)."""
    ridge = statistics.num_elements * reg_lambda
    if form == "diagonal":
        return _diagonal_solution(statistics, ridge)
    identity = torch.eye(statistics.gram.shape[0], dtype=torch.float64)
    lhs = statistics.gram + ridge * identity
    rhs = statistics.cross + ridge * identity
    # W' lhs = rhs and lhs is symmetric, so lhs W'^T = rhs^T.
    try:
        return torch.linalg.solve(lhs, rhs.T).T
    except RuntimeError:  # singular A with lambda = 0: take the minimum-norm least-squares solution
        return torch.linalg.lstsq(lhs, rhs.T, driver="gelsd").solution.T


def adam_minimize(
    objective: Callable[[torch.Tensor], torch.Tensor],
    size: int,
    learning_rate: float,
    num_steps: int,
    form: str = "full",
    device: torch.device | str = "cpu",
    progress_bar: bool = True,
    description: str = "Fitting W' (Adam)",
) -> torch.Tensor:
    """Minimises `objective(W')` with full-batch Adam from W' = I, in float64: over every d x d matrix, or
    over channel-wise scalings with `form="diagonal"`.

    Returns:
        `torch.Tensor` of shape `(size, size)`: W'.
    """
    if form == "diagonal":
        parameter, as_matrix = torch.ones(size, dtype=torch.float64, device=device, requires_grad=True), torch.diag
    else:
        parameter = torch.eye(size, dtype=torch.float64, device=device, requires_grad=True)
        as_matrix = lambda matrix: matrix  # noqa: E731
    optimizer = torch.optim.Adam([parameter], lr=learning_rate)
    with torch.enable_grad():
        for _ in logging.tqdm(range(num_steps), desc=description, leave=False, disable=not progress_bar):
            optimizer.zero_grad(set_to_none=True)
            objective(as_matrix(parameter)).backward()
            optimizer.step()
    return as_matrix(parameter.detach())


def solve_adam(
    statistics: CompensationStatistics,
    reg_lambda: float,
    learning_rate: float,
    num_steps: int,
    progress_bar: bool = True,
    form: str = "full",
) -> torch.Tensor:
    """Minimises the Stage 2 objective with Adam from W' = I, as the paper does (full batch, float64)."""
    return adam_minimize(
        lambda matrix: statistics.objective(matrix, reg_lambda),
        statistics.gram.shape[0],
        learning_rate,
        num_steps,
        form,
        statistics.gram.device,
        progress_bar,
    )
