# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Learning W' for one kept layer (Eq. 12-14); [`optimum_gradmap.compensation.folding`] folds it into the layer's down
projection(s) (Eq. 15)."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from .. import distributed
from ..errors import InvalidInputError
from ..precision import Precision
from ..weights import materialized
from .activations import FitData
from .cosine import learn_cosine
from .folding import apply_compensation
from .next_token import chooses_by_next_token_loss, learn_by_next_token_loss, resolve_selection
from .settings import Stage2Settings
from .solvers import (
    AUTO_NUM_FOLDS,
    CompensationFit,
    RidgeChoice,
    cross_validate_ridge,
    lambda_for_strength,
    solve_adam,
    solve_closed_form,
)
from .statistics import (
    CompensationRows,
    CompensationStatistics,
    collect_rows,
    compensation_statistics,
    summed_over_processes,
)
from .through_norm import choose_ridge_through_norm, fit_through_norm


def check_auto_lambda_data(input_ids: torch.LongTensor) -> None:
    """`reg_lambda="auto"` cross-validates over calibration sequences: it needs one per fold at least.

    Raises:
        ValueError: with fewer than `AUTO_NUM_FOLDS` sequences, saying what to change.
    """
    if input_ids.shape[0] < AUTO_NUM_FOLDS:
        raise InvalidInputError(
            f"reg_lambda='auto' cross-validates over calibration sequences: it needs at least {AUTO_NUM_FOLDS}, "
            f"got {input_ids.shape[0]}. Use more calibration sequences (num_samples) or a fixed reg_lambda."
        )


def learn_compensation(data: FitData, config: Stage2Settings, progress_bar: bool = True) -> CompensationFit:
    """Learns W' for one kept layer of the pruned model (Eq. 12-14) with the configured solver.

    Where the MLP output reaches the residual stream directly, the objective is quadratic and is
    solved from its sufficient statistics (`config.solver`: exact closed form, or Adam). Where a
    norm follows the MLP, W' is fitted by Adam with the norm in the loop, whatever the solver
    ([`optimum_gradmap.compensation.through_norm`]).

    With `config.reg_lambda="auto"`, lambda is chosen by cross-validation over calibration sequences
    ([`choose_ridge`]: `AUTO_NUM_FOLDS` folds, `AUTO_RIDGE_GRID` strengths relative to the data); when
    no strength beats W' = I on the held-out sequences, the fit is `skipped`.

    With several processes ([`optimum_gradmap.distributed`]), the sequences and hidden states of `data` are
    this process's share of the calibration set, starting at its sequence `data.first_sample`: the statistics
    are summed over processes (the stored activations gathered, where a norm follows the MLP), so every
    process fits the same W'.

    Args:
        data ([`FitData`]): The kept layer to fit, and what it is fitted to.
        config ([`Stage2Settings`]): `solver`, `reg_lambda`, `compensation_form`, `compensation_objective`,
            `outlier_tokens` (`"auto"` is `"keep"` here: this fit chooses lambda by the hidden state's error, see
            [`resolve_selection`]), `adam_lr`, `adam_steps` and `batch_size` are read.
        progress_bar (`bool`, defaults to `True`): Show progress bars.

    Returns:
        [`CompensationFit`].
    """
    if config.reg_lambda == "auto" and not distributed.is_distributed():  # the pruner checks the whole set
        check_auto_lambda_data(data.input_ids)
    config = resolve_selection(replace(config, compensation_selection="hidden_state"), data.adapter)
    norm = data.adapter.get_mlp_output_norm(data.layer)
    if norm is not None or config.compensation_objective == "cosine":
        rows = collect_rows(data, config.batch_size, progress_bar, config.outlier_tokens)
        if config.compensation_objective == "cosine":
            return learn_cosine(rows, config, progress_bar, norm)
        return _learn_through_norm(rows, norm, config, progress_bar)

    statistics, reg_lambda, choice = _statistics_and_lambda(data, config, progress_bar)
    if statistics is None:  # no strength beat W' = I
        return CompensationFit.identity(data.original_outputs.shape[-1], choice)
    if config.solver == "closed_form":
        matrix = solve_closed_form(statistics, reg_lambda, config.compensation_form)
    else:
        matrix = solve_adam(statistics, reg_lambda, config.adam_lr, config.adam_steps, progress_bar, config.compensation_form)
    return CompensationFit.measured(matrix, statistics, reg_lambda, choice)


def _statistics_and_lambda(
    data: FitData, config: Stage2Settings, progress_bar: bool
) -> tuple[CompensationStatistics | None, float | None, RidgeChoice | None]:
    """The statistics W' is solved from (summed over processes), its lambda, and with `reg_lambda="auto"` the
    cross-validation that chose it ([`cross_validate_ridge`] over `AUTO_NUM_FOLDS` folds); the statistics are `None`
    where no strength beats W' = I on the held-out sequences."""
    if config.reg_lambda != "auto":
        statistics = summed_over_processes(
            compensation_statistics(data, config.batch_size, progress_bar, outliers=config.outlier_tokens)
        )
        return statistics, config.reg_lambda, None
    folds = compensation_statistics(
        data, config.batch_size, progress_bar, num_folds=AUTO_NUM_FOLDS, outliers=config.outlier_tokens
    )
    folds = [summed_over_processes(fold) for fold in folds]
    choice = cross_validate_ridge(folds, form=config.compensation_form)
    if choice.alpha is None:
        return None, None, choice
    statistics = sum(folds[1:], folds[0])
    return statistics, lambda_for_strength(choice.alpha, statistics.mean_eigenvalue, statistics.num_elements), choice


def fit_and_fold(
    data: FitData, config: Stage2Settings, progress_bar: bool = True, precision: Precision | None = None
) -> CompensationFit:
    """Learns W' for one kept layer the way `config` chooses lambda, and folds it into the layer's down
    projection unless the fit was `skipped` (no lambda beat W' = I). The choice: the held-out next-token loss
    ([`learn_by_next_token_loss`]) where `config.compensation_selection` resolves to it, else the held-out
    hidden-state error ([`learn_compensation`]).

    Args:
        data, config, progress_bar: As in [`learn_compensation`].
        precision ([`~optimum_gradmap.precision.Precision`], *optional*): As in [`learn_by_next_token_loss`].

    Returns:
        [`CompensationFit`]: The fit, folded unless `skipped`.
    """
    if chooses_by_next_token_loss(config):
        fit = learn_by_next_token_loss(data, config, progress_bar, precision)
    else:
        fit = learn_compensation(data, config, progress_bar)
    if not fit.skipped:
        apply_compensation(data.adapter, data.layer, fit.matrix)
    return fit


def _learn_through_norm(rows: CompensationRows, norm: nn.Module, config: Stage2Settings, progress_bar: bool) -> CompensationFit:
    """[`learn_compensation`] where a norm follows the MLP: the fit through the norm on every token's rows."""
    y, r = rows.mlp_output, rows.target
    with materialized(norm):  # the fit calls the norm many times: offloaded weights stay put meanwhile
        choice, reg_lambda = None, config.reg_lambda
        if config.reg_lambda == "auto":
            choice, reg_lambda = choose_ridge_through_norm(
                y,
                r,
                rows.sample % AUTO_NUM_FOLDS,
                norm,
                config.adam_lr,
                config.adam_steps,
                progress_bar,
                config.compensation_form,
            )
            if reg_lambda is None:
                return CompensationFit.identity(y.shape[-1], choice)
        matrix, at_identity, fitted = fit_through_norm(
            y, r, norm, reg_lambda, config.adam_lr, config.adam_steps, progress_bar, config.compensation_form
        )
    return CompensationFit(matrix.cpu(), at_identity, fitted, reg_lambda=reg_lambda, cross_validation=choice)
