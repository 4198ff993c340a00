# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Solvers of the Stage 2 objective (Eq. 12-14) and the choice of its lambda.

- [`solve_closed_form`]: the exact minimiser W' = (C + M lambda I)(A + M lambda I)^-1, in float64;
- [`solve_adam`]: the paper's optimiser, full-batch Adam from W' = I ([`adam_minimize`], the one Adam
  loop of the package, which the fit through a norm uses too);
- [`choose_ridge`]: `reg_lambda="auto"`, the one cross-validation routine of every fit: each held-out
  fold's error under the W' fitted on the others, for each strength of a grid measured relative to the
  data ([`lambda_for_strength`]), and W' = I as the baseline it must beat.

With `form="rotated_diagonal"` W' is a channel-wise scaling in a Hadamard-rotated basis (d numbers instead of d^2).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers.utils import logging

from .rotation import rotation
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


@dataclass
class CompensationFit:
    """A learned compensation matrix and the Stage 2 objective before and after.

    Args:
        matrix (`torch.Tensor` of shape `(d, d)`): W', float64 (the identity when `skipped`).
        objective_identity (`float`): The objective at W' = I (no compensation).
        objective_fitted (`float`): The objective at W'.
        reg_lambda (`float`, *optional*): The lambda of Eq. 14 the fit used (chosen by
            cross-validation with `reg_lambda="auto"`).
        cross_validation ([`RidgeChoice`], *optional*): What cross-validation measured, with `"auto"`.
        skipped (`bool`): No lambda beat W' = I on held-out calibration sequences: nothing to fold.
    """

    matrix: torch.Tensor
    objective_identity: float
    objective_fitted: float
    reg_lambda: float | None = None
    cross_validation: RidgeChoice | None = None
    skipped: bool = False

    @classmethod
    def identity(cls, size: int, choice: RidgeChoice) -> CompensationFit:
        """The fit that changes nothing, when cross-validation found no lambda that beats W' = I."""
        return cls(torch.eye(size, dtype=torch.float64), 0.0, 0.0, cross_validation=choice, skipped=True)

    @classmethod
    def measured(
        cls, matrix: torch.Tensor, statistics: CompensationStatistics, reg_lambda: float, choice: RidgeChoice | None = None
    ) -> CompensationFit:
        """The fit `matrix`, with the Eq. 12 objective of `statistics` at W' = I and at W'."""
        identity = torch.eye(matrix.shape[0], dtype=torch.float64)
        objective_identity = float(statistics.objective(identity, reg_lambda))
        return cls(matrix, objective_identity, float(statistics.objective(matrix, reg_lambda)), reg_lambda, choice)


def lambda_for_strength(alpha: float, mean_eigenvalue: float, num_elements: int) -> float:
    """lambda of Eq. 14 for the relative strength `alpha`: the ridge alpha * tr(A) / d, divided by the M
    elements the mean squared error averages."""
    return alpha * mean_eigenvalue / num_elements


def relative_ridge(statistics: CompensationStatistics, alpha: float) -> float:
    """The ridge alpha * tr(A) / d, in the units of the statistics (M x lambda)."""
    return alpha * statistics.mean_eigenvalue


def _diagonal_solutions(statistics: CompensationStatistics, ridges: Sequence[float]) -> list[torch.Tensor]:
    """The channel-wise scalings in the rotated basis minimising the objective (A and C rotated to Q A Q^T and
    Q C Q^T), w_k = (C_kk + rho) / (A_kk + rho), as matrices W' = Q^T diag(w) Q: the objective is invariant under the
    rotation, and ||W' - I||_F = ||w - 1||."""
    rotated = rotation(statistics.gram.shape[0]).to(statistics.gram)
    gram, cross = (rotated @ statistics.gram * rotated).sum(1), (rotated @ statistics.cross * rotated).sum(1)
    solutions = []
    for ridge in ridges:
        scaling = torch.where(gram + ridge > 0, (cross + ridge) / (gram + ridge), torch.ones_like(gram))
        solutions.append(rotated.T @ (scaling[:, None] * rotated))
    return solutions


def ridge_solutions(statistics: CompensationStatistics, ridges: Sequence[float], form: str = "full") -> list[torch.Tensor]:
    """W' = (C + rho I)(A + rho I)^-1 for each ridge rho, from one eigendecomposition of A; with
    `form="rotated_diagonal"`, the channel-wise scalings in the rotated basis, (C_kk + rho) / (A_kk + rho)."""
    if form != "full":
        return _diagonal_solutions(statistics, ridges)
    solve = ridge_solver(statistics)
    return [solve(ridge) for ridge in ridges]


def ridge_solver(statistics: CompensationStatistics, form: str = "full") -> Callable[[float], torch.Tensor]:
    """[`ridge_solutions`] one ridge at a time: A's eigendecomposition once, each W' formed when asked for, so that a
    search over a grid of strengths holds one `d x d` solution at a time, not one per strength (the same numbers).

    Args:
        statistics ([`CompensationStatistics`]): The fit's statistics.
        form (`str`, defaults to `"full"`): `compensation_form`.

    Returns:
        `Callable`: a ridge rho -> its W'.
    """
    if form != "full":
        return lambda ridge: _diagonal_solutions(statistics, [ridge])[0]
    eigenvalues, eigenvectors = torch.linalg.eigh(statistics.gram)

    def solve(ridge: float) -> torch.Tensor:
        identity = torch.eye(statistics.gram.shape[0], dtype=torch.float64)
        inverse = (eigenvectors / (eigenvalues + ridge).clamp_min(1e-300)) @ eigenvectors.T
        return (statistics.cross + ridge * identity) @ inverse

    return solve


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
    `form="rotated_diagonal"`, over channel-wise scalings in the rotated basis:
    w_k = (C_kk + M lambda) / (A_kk + M lambda)."""
    ridge = statistics.num_elements * reg_lambda
    if form != "full":
        return _diagonal_solutions(statistics, [ridge])[0]
    identity = torch.eye(statistics.gram.shape[0], dtype=torch.float64)
    lhs = statistics.gram + ridge * identity
    rhs = statistics.cross + ridge * identity
    # W' lhs = rhs and lhs is symmetric, so lhs W'^T = rhs^T.
    try:
        return torch.linalg.solve(lhs, rhs.T).T
    except RuntimeError:  # singular A with lambda = 0: take the minimum-norm least-squares solution
        return torch.linalg.lstsq(lhs, rhs.T, driver="gelsd").solution.T


def closed_form_at_strength(statistics: CompensationStatistics, alpha: float, form: str = "full") -> tuple[torch.Tensor, float]:
    """The exact W' at the relative strength `alpha` (what cross-validation chose) and the lambda of Eq. 14 it
    stands for ([`lambda_for_strength`]).

    Returns:
        `tuple[torch.Tensor, float]`: W' ([`solve_closed_form`]) and lambda.
    """
    reg_lambda = lambda_for_strength(alpha, statistics.mean_eigenvalue, statistics.num_elements)
    return solve_closed_form(statistics, reg_lambda, form), reg_lambda


def adam_minimize(
    objective: Callable[[torch.Tensor], torch.Tensor],
    size: int,
    learning_rate: float,
    num_steps: int,
    form: str = "full",
    device: torch.device | str = "cpu",
    progress_bar: bool = True,
    description: str = "Fitting W' (Adam)",
    start: torch.Tensor | None = None,
    held_out: Callable[[torch.Tensor], float] | None = None,
    check_every: int = 10,
    patience: int = 5,
) -> torch.Tensor:
    """Minimises `objective(W')` with full-batch Adam from W' = `start` (the identity by default), in float64:
    over every d x d matrix, or over channel-wise scalings in the rotated basis with `form="rotated_diagonal"`.

    Args:
        objective (`Callable`): W' -> the loss to minimise (a scalar tensor).
        size (`int`): d.
        learning_rate (`float`), num_steps (`int`): Adam's step size and the number of steps.
        form (`str`, defaults to `"full"`): What W' may be.
        device (`torch.device` or `str`, defaults to `"cpu"`): Where W' lives.
        progress_bar (`bool`), description (`str`): The progress bar.
        start (`torch.Tensor`, *optional*): The W' to start from, of the form given (a full matrix).
        held_out (`Callable`, *optional*): W' -> a loss on held-out data. With it, the W' returned is the one
            with the lowest held-out loss among the start and every `check_every`-th step, and the fit stops
            after `patience` checks without improvement (early stopping).
        check_every (`int`, defaults to 10), patience (`int`, defaults to 5): See `held_out`.

    Returns:
        `torch.Tensor` of shape `(size, size)`: W'.
    """
    if form == "full":
        initial = torch.eye(size, dtype=torch.float64) if start is None else start.double()
        parameter = initial.to(device).clone().requires_grad_(True)
        as_matrix = lambda matrix: matrix  # noqa: E731
    else:
        rotated = rotation(size).to(device)
        if start is None:
            initial = torch.ones(size, dtype=torch.float64)
        else:  # the scaling of a W' of this form: its diagonal, in the rotated basis
            initial = (rotated @ start.to(device).double() @ rotated.T).diagonal()
        parameter = initial.to(device).clone().requires_grad_(True)
        as_matrix = lambda scaling: rotated.T @ (scaling[:, None] * rotated)  # noqa: E731
    optimizer = torch.optim.Adam([parameter], lr=learning_rate)
    best = (held_out(as_matrix(parameter.detach())), as_matrix(parameter.detach())) if held_out is not None else None
    checks_without_improvement = 0
    with torch.enable_grad():
        for step in logging.tqdm(range(1, num_steps + 1), desc=description, leave=False, disable=not progress_bar):
            optimizer.zero_grad(set_to_none=True)
            objective(as_matrix(parameter)).backward()
            optimizer.step()
            if held_out is not None and step % check_every == 0:
                with torch.no_grad():
                    matrix = as_matrix(parameter.detach())
                    loss = held_out(matrix)
                if loss < best[0]:
                    best, checks_without_improvement = (loss, matrix.clone()), 0
                else:
                    checks_without_improvement += 1
                    if checks_without_improvement >= patience:
                        break
    return best[1] if best is not None else as_matrix(parameter.detach())


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
