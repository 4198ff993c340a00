# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Choosing lambda by what the model predicts (`compensation_selection="next_token_loss"`, and the default `"auto"`
where it can run), not by how close its hidden state comes to the dense one.

`compensation_selection="hidden_state"` picks, for each kept layer, the ridge strength whose W' best reproduces the
dense hidden state on held-out calibration sequences. A hidden state that is closer in squared error is not
always one from which the rest of the model predicts better. Here every strength of the grid is fitted on
three of the four cross-validation folds of sequences (sequences j with j mod 4 in {0, 1, 2}), folded into the layer,
and scored by the model's next-token loss on the fourth fold's sequences (the later layers, the final norm and the
head decide, over every predicted position); W' = I (the layer left alone) is a candidate too. The strength with the
lowest loss is then fitted on every sequence. The held-out criterion is the one LinearPatch (Chen et al., NeurIPS
2025, Sec. 3.3) and ReplaceMe report accuracy against; the grid is that of the hidden-state selection.

The layers before the fitted one compute the same thing for every candidate: their output on the held-out sequences
is recorded once, in the pass that collects the fit's statistics, and each candidate runs from the fitted layer on
([`HeldOutLoss`]). [`optimum_gradmap.testing.reference_next_token_choice`] computes the same choice with a pass of the
whole model per candidate. The search over the grid and the choice among its losses are in
[`~optimum_gradmap.compensation.lambda_search`].
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from .. import distributed, surgery
from ..adapters import DecoderAdapter
from ..errors import InvalidInputError
from ..objectives import next_token_loss_sum, summed_loss
from ..passes import calibration_batches
from ..precision import LOSS_BOUND, Precision, settled_lowest
from ..vocabulary import vocabulary_head
from . import lambda_search
from .activations import CompensationBatch, FitData
from .folding import apply_compensation, down_projection_backup
from .lambda_search import GOLDEN_SECTION as GOLDEN_SECTION  # planning estimates the search's passes from it
from .lambda_search import choose_strength, searched_losses
from .settings import Stage2Settings
from .solvers import AUTO_NUM_FOLDS, AUTO_RIDGE_GRID, CompensationFit, closed_form_at_strength, relative_ridge, ridge_solver
from .statistics import CompensationStatistics, compensation_statistics, summed_over_processes


def next_token_selection_runs(config: Stage2Settings, adapter: DecoderAdapter) -> bool:
    """Whether the next-token selection can choose among `config`'s fits for `adapter`'s family: they are closed-form
    fits (`solver="closed_form"`) of the `mse` objective, folded where the MLP's output reaches the residual stream
    directly."""
    return adapter.mlp_output_norm_path is None and config.compensation_objective == "mse" and config.solver == "closed_form"


def resolve_selection(config: Stage2Settings, adapter: DecoderAdapter) -> Stage2Settings:
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


def chooses_by_next_token_loss(config: Stage2Settings) -> bool:
    """Whether `config` (its `"auto"` choices resolved by [`resolve_selection`]) chooses lambda by the held-out
    next-token loss ([`learn_by_next_token_loss`])."""
    return config.reg_lambda == "auto" and config.compensation_selection == "next_token_loss"


def check_next_token_selection(config: Stage2Settings, adapter: DecoderAdapter) -> None:
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
    """The whole model's mean next-token loss on `input_ids`: with several processes, this process's share of the
    held-out sequences (which may hold none), the mean taken over every process's predicted tokens."""
    total, count = next_token_loss_sum(model, input_ids, batch_size, progress_bar, description="Held-out next-token loss")
    return distributed.mean_from_sums(total, count)


def is_held_out(sample: int) -> bool:
    """Whether calibration sequence `sample` (its index in the whole calibration set) is one of the held-out sequences
    the next-token selection scores its candidates on: those of the last cross-validation fold."""
    return sample % AUTO_NUM_FOLDS == AUTO_NUM_FOLDS - 1


class HeldOutLoss:
    """The model's next-token loss on the held-out sequences ([`is_held_out`]) of `data`, computed from its layer on:
    the input the layer receives on them does not depend on what is folded into it or the layers after it, so it is
    recorded once (in the pass that collects the fit's statistics) and every candidate runs only the layer, the layers
    after it, the final norm and the head, over every predicted position ([`LayerSnapshot.replaying`]). Exact: the same
    computation as the whole model's pass ([`held_out_next_token_loss`]) for every layer from the fitted one on, batch
    by batch.

    Args:
        data ([`FitData`]): The kept layer whose fits are scored, and this process's calibration sequences (maybe
            without a held-out one).
        layer_inputs (`torch.Tensor` of shape `(num_held_out, seq_len, d)`, *optional*): What the layer received on
            the held-out sequences (`None` with no sequence).
        returns_tuple (`bool`): Whether the model's layers return a tuple.
        batch_size (`int`): Sequences per pass.
        progress_bar (`bool`): Show a progress bar.
    """

    def __init__(
        self, data: FitData, layer_inputs: torch.Tensor | None, returns_tuple: bool, batch_size: int, progress_bar: bool
    ):
        self.model = data.model
        self.stack = surgery.snapshot(data.model, data.adapter)
        self.position = next(position for position, kept in enumerate(self.stack.layers) if kept is data.layer)
        rows = range(data.input_ids.shape[0])
        self.input_ids = data.input_ids[[row for row in rows if is_held_out(data.first_sample + row)]]
        self.layer_inputs = layer_inputs
        self.returns_tuple = returns_tuple
        self.batch_size = batch_size
        self.progress_bar = progress_bar

    def __call__(self) -> float:
        """The mean next-token loss on the held-out sequences of the model as it is now (over every process)."""
        total, count = torch.zeros((), dtype=torch.float64), 0
        num_sequences = self.input_ids.shape[0]
        description = "Held-out next-token loss"
        head = vocabulary_head(self.model)
        with calibration_batches(self.model, self.input_ids, self.batch_size, description, self.progress_bar) as batches:
            for start, batch in zip(range(0, num_sequences, self.batch_size), batches):
                if self.position == 0:  # no layer before it to skip
                    loss = summed_loss(self.model, batch, head)
                else:
                    inputs = self.layer_inputs[start : start + batch.shape[0]]
                    with self.stack.replaying(self.position - 1, inputs, self.returns_tuple):
                        loss = summed_loss(self.model, batch, head)
                total = total.to(loss.device) + loss
                count += batch.shape[0] * (batch.shape[1] - 1)
        return distributed.mean_from_sums(total, count)


def learn_by_next_token_loss(
    data: FitData, config: Stage2Settings, progress_bar: bool = True, precision: Precision | None = None
) -> CompensationFit:
    """W' for one kept layer, its lambda chosen by the next-token loss on held-out calibration sequences (see
    the module docstring): this function always chooses lambda, whatever `config.reg_lambda` says, so
    `config.outlier_tokens="auto"` is `"exclude"` here ([`resolve_selection`] with `reg_lambda="auto"`). The model is
    left as it was (the candidates are folded and undone in turn).

    One pass over the calibration sequences collects the statistics of every fold and, for the held-out sequences,
    the input of the layer; each candidate is then scored from `layer` on ([`HeldOutLoss`]), every strength of the grid
    or those the golden-section search scores ([`searched_losses`], [`~optimum_gradmap.compensation.lambda_search.SEARCH`]).

    Args:
        data ([`FitData`]): The kept layer to fit, and what it is fitted to.
        config ([`Stage2Settings`]): `compensation_form`, `outlier_tokens` and `batch_size` are read.
        progress_bar (`bool`, defaults to `True`): Show progress bars.
        precision ([`~optimum_gradmap.precision.Precision`], *optional*): With bfloat16 passes, whether the layer is
            fitted at all (a lambda against W' = I) is decided as float32 decides it: where W' = I's held-out loss lies
            within `LOSS_BOUND` of the lowest, the layer's fit is made again in float32. The strengths the bound cannot
            tell apart from the one chosen are logged (`precision.log.within_bound`): lambda is chosen within the bound.

    Returns:
        [`CompensationFit`]: its `cross_validation.heldout_error` holds each scored strength's held-out next-token
        loss, and `identity_error` the loss with the layer left alone.
    """
    adapter, layer = data.adapter, data.layer
    config = resolve_selection(replace(config, compensation_selection="next_token_loss", reg_lambda="auto"), adapter)
    check_next_token_selection(config, adapter)
    folds, loss = _statistics_and_held_out_loss(data, config, progress_bar)
    train = sum(folds[1:-1], folds[0])
    solve = ridge_solver(train, config.compensation_form)  # one candidate W' at a time, formed when scored
    backup = down_projection_backup(adapter, [layer])

    def loss_with(matrix: torch.Tensor) -> float:
        apply_compensation(adapter, layer, matrix)
        try:
            return loss()
        finally:
            backup.restore()

    identity_loss = loss()
    losses = searched_losses(lambda alpha: loss_with(solve(relative_ridge(train, alpha))), AUTO_RIDGE_GRID, lambda_search.SEARCH)
    choice = choose_strength(losses, identity_loss)
    if precision is not None and precision.low is not None:
        precision.log.decisions += 1
        _, undecided = settled_lowest(
            {**{str(alpha): loss for alpha, loss in losses.items()}, "identity": identity_loss}, 1, LOSS_BOUND
        )
        if "identity" in undecided:  # fitted or left alone: decided in float32
            return precision.recomputed(
                "Stage 2: fit or W' = I", undecided, lambda: learn_by_next_token_loss(data, config, progress_bar)
            )
        if undecided:
            precision.log.within_bound.append(
                {"decision": "Stage 2: lambda", "chosen": str(choice.alpha), "candidates": undecided}
            )
    size = data.original_outputs.shape[-1]
    if choice.alpha is None:
        return CompensationFit.identity(size, choice)
    total = sum(folds[1:], folds[0])
    matrix, reg_lambda = closed_form_at_strength(total, choice.alpha, config.compensation_form)
    return CompensationFit.measured(matrix, total, reg_lambda, choice)


def _statistics_and_held_out_loss(
    data: FitData, config: Stage2Settings, progress_bar: bool
) -> tuple[list[CompensationStatistics], HeldOutLoss]:
    """One pass over the calibration sequences: the statistics of every cross-validation fold (summed over processes),
    and the input the layer receives on the held-out sequences, from which [`HeldOutLoss`] scores each candidate."""
    held_out_inputs: list[torch.Tensor] = []
    returns_tuple: list[bool] = []

    def keep_held_out_inputs(batch: CompensationBatch) -> None:
        first = data.first_sample + batch.first_sample
        rows = [row for row in range(batch.mlp_output.shape[0]) if is_held_out(first + row)]
        if rows:
            held_out_inputs.append(batch.layer_input[rows])
        returns_tuple[:] = [batch.layer_returns_tuple]

    folds = compensation_statistics(
        data,
        config.batch_size,
        progress_bar,
        num_folds=AUTO_NUM_FOLDS,
        outliers=config.outlier_tokens,
        on_batch=keep_held_out_inputs,
    )
    folds = [summed_over_processes(fold) for fold in folds]
    layer_inputs = torch.cat(held_out_inputs) if held_out_inputs else None
    loss = HeldOutLoss(data, layer_inputs, bool(returns_tuple and returns_tuple[0]), config.batch_size, progress_bar)
    return folds, loss
