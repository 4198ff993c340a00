# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Stage 2 of GradMAP: the projection compensation matrix (paper Eq. 10-15).

After layers are removed, the mean hidden state drifts away from the original model's. For each
kept layer i the drift is (Eq. 10)

    delta_i = || E_x[H_i(x)] - E_x[H'_i(x)] ||_2

with H_i the output of layer i in the original model and H'_i in the pruned one, on the same
calibration tokens. For the layer(s) with the largest drift a d x d matrix W' is learned so that
the pruned layer's output matches the original one (Eq. 12-14):

    min_W'  MSE(W' Y + X_F, X_O)  +  lambda || W' - I ||_F^2

with Y = W_down X_down the MLP's output (bias included), X_F the residual stream entering the MLP
and X_O the original model's output of that layer, over all calibration tokens. The paper calls
the first term the mean squared error; like `torch.nn.MSELoss` it is the mean over all M = tokens x d
elements, which sets the strength of lambda (measured: this reading, not a per-sequence sum,
makes Stage 2 help on SmolLM2; docs/results.md). The objective only needs the sufficient
statistics A = sum y y^T, C = sum r y^T and sum ||r||^2 (r = x_O - x_F) over all calibration
tokens, so both solvers work on d x d matrices:

- `"closed_form"`: the exact minimiser W' = (C + M lambda I)(A + M lambda I)^-1, in float64;
- `"adam"`: the paper's optimiser, full-batch Adam from W' = I on the same objective.

W' is then folded into the down projection, W_down <- W' W_down and b_down <- W' b_down, so the
pruned model costs nothing extra at inference (Eq. 15).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.utils import logging

from . import distributed, surgery
from .adapters import DecoderAdapter, get_adapter
from .configuration import GradMAPConfig
from .passes import calibration_batches, for_each_layer_output, forward_hooks, layer_output
from .weights import WeightBackup, fold_into, linear_map_tensors, materialized

logger = logging.get_logger(__name__)

# Below this many calibration tokens per hidden unit, W' (hidden x hidden parameters) overfitted on
# SmolLM2-135M: 1.8 tokens per unit raised held-out perplexity by 60%, 7 by 2%, 28 lowered it.
MIN_TOKENS_PER_HIDDEN_UNIT = 16
# The GradMAPConfig fields Stage 2 reads: the ones a re-run of Stage 2 may change.
STAGE2_SETTINGS = (
    "compensation_target",
    "compensation_form",
    "num_compensated_layers",
    "solver",
    "reg_lambda",
    "adam_lr",
    "adam_steps",
    "batch_size",
)


def check_num_compensated_layers(num_compensated_layers: int, num_kept_layers: int) -> None:
    """Raises a `ValueError` when Z exceeds the layers that remain after pruning."""
    if num_compensated_layers > num_kept_layers:
        raise ValueError(
            f"num_compensated_layers={num_compensated_layers} exceeds the {num_kept_layers} layers that remain after pruning."
        )


def hidden_state_means(
    model: nn.Module,
    layers: Sequence[nn.Module],
    input_ids: torch.LongTensor,
    batch_size: int,
    progress_bar: bool = True,
    description: str = "Measuring hidden states",
) -> torch.Tensor:
    """Mean output hidden state of each layer over all calibration tokens.

    Returns:
        `torch.Tensor` of shape `(len(layers), hidden_size)`, float64, on CPU.
    """
    sums: list[torch.Tensor | None] = [None] * len(layers)

    def accumulate(position: int, hidden: torch.Tensor) -> None:
        total = hidden.reshape(-1, hidden.shape[-1]).sum(dim=0, dtype=torch.float64).cpu()
        sums[position] = total if sums[position] is None else sums[position] + total

    for_each_layer_output(model, layers, input_ids, batch_size, accumulate, description, progress_bar)
    return torch.stack(sums) / input_ids.numel()


def record_layer_outputs(
    model: nn.Module,
    layers: Sequence[nn.Module],
    input_ids: torch.LongTensor,
    batch_size: int,
    progress_bar: bool = True,
    description: str = "Recording original outputs",
) -> list[torch.Tensor]:
    """Output hidden states of the given layers on all calibration tokens, in float32 on CPU.

    Returns:
        `list[torch.Tensor]`, one tensor of shape `(num_samples, seq_len, hidden_size)` per layer.
    """
    outputs: list[list[torch.Tensor]] = [[] for _ in layers]
    store = lambda position, hidden: outputs[position].append(hidden.float().cpu())  # noqa: E731
    for_each_layer_output(model, layers, input_ids, batch_size, store, description, progress_bar)
    return [torch.cat(chunks) for chunks in outputs]


@dataclass
class CompensationStatistics:
    """Sufficient statistics of the Stage 2 objective for one layer.

    Args:
        gram (`torch.Tensor` of shape `(d, d)`): A = sum over tokens of y y^T, y the MLP output.
        cross (`torch.Tensor` of shape `(d, d)`): C = sum over tokens of r y^T, r = x_O - x_F.
        target_energy (`float`): sum over tokens of ||r||^2.
        num_tokens (`int`): The number of calibration tokens.
    """

    gram: torch.Tensor
    cross: torch.Tensor
    target_energy: float
    num_tokens: int

    @property
    def num_elements(self) -> int:
        """M = tokens x hidden size, the number of terms the mean squared error averages."""
        return self.num_tokens * self.gram.shape[0]

    def squared_error(self, matrix: torch.Tensor) -> torch.Tensor:
        """sum over tokens of ||W' y - r||^2, at `matrix`."""
        matrix = matrix.to(self.gram)
        return (matrix @ self.gram * matrix).sum() - 2 * (matrix * self.cross).sum() + self.target_energy

    def objective(self, matrix: torch.Tensor, reg_lambda: float) -> torch.Tensor:
        """Value of the Eq. 12 objective, mean((W' y - r)^2) + lambda ||W' - I||^2, at `matrix`."""
        matrix = matrix.to(self.gram)
        identity = torch.eye(matrix.shape[0], dtype=matrix.dtype, device=matrix.device)
        return self.squared_error(matrix) / self.num_elements + reg_lambda * (matrix - identity).pow(2).sum()

    def __add__(self, other: CompensationStatistics) -> CompensationStatistics:
        return CompensationStatistics(
            self.gram + other.gram,
            self.cross + other.cross,
            self.target_energy + other.target_energy,
            self.num_tokens + other.num_tokens,
        )

    def __sub__(self, other: CompensationStatistics) -> CompensationStatistics:
        return CompensationStatistics(
            self.gram - other.gram,
            self.cross - other.cross,
            self.target_energy - other.target_energy,
            self.num_tokens - other.num_tokens,
        )


def _for_each_compensation_batch(
    model: nn.Module,
    adapter: DecoderAdapter,
    layer: nn.Module,
    original_outputs: torch.Tensor,
    input_ids: torch.LongTensor,
    batch_size: int,
    progress_bar: bool,
    consume: Callable[[torch.Tensor, torch.Tensor, int], None],
) -> None:
    """Runs the pruned model and calls `consume(Y, R, first_sample)` per batch, with Y the MLP output and
    R = X_O - X_F the target of the MLP's residual contribution, each `(samples, tokens, d)` in float64,
    and the index of the batch's first sample in `input_ids`."""
    captured: dict[str, torch.Tensor] = {}
    mlp = adapter.get_mlp(layer)
    contribution_module = adapter.get_mlp_output_norm(layer) or mlp  # its output is what the layer adds to the residual
    hooks = [
        (mlp, lambda m, a, o: captured.__setitem__("mlp_output", layer_output(o))),
        (contribution_module, lambda m, a, o: captured.__setitem__("contribution", layer_output(o))),
        (layer, lambda m, a, o: captured.__setitem__("layer_output", layer_output(o))),
    ]
    start = 0
    description = "Collecting compensation data"
    with calibration_batches(model, input_ids, batch_size, description, progress_bar) as batches, forward_hooks(hooks):
        for batch in batches:
            model(input_ids=batch, use_cache=False)
            pruned_output = captured["layer_output"].double()
            # some families run the MLP on token-flattened rows: align with the layer output
            contribution = captured["contribution"].double().reshape(pruned_output.shape)
            ffn_input = pruned_output - contribution  # X_F
            original = original_outputs[start : start + batch.shape[0]].to(ffn_input)
            target = original - ffn_input  # R = X_O - X_F
            consume(captured["mlp_output"].double().reshape(target.shape), target, start)
            start += batch.shape[0]


def compensation_statistics(
    model: nn.Module,
    adapter: DecoderAdapter,
    layer: nn.Module,
    original_outputs: torch.Tensor,
    input_ids: torch.LongTensor,
    batch_size: int,
    progress_bar: bool = True,
    num_folds: int = 1,
    first_sample: int = 0,
) -> CompensationStatistics | list[CompensationStatistics]:
    """Runs the pruned model on the calibration data and accumulates the Stage 2 statistics of `layer`.

    Args:
        model (`nn.Module`): The pruned model.
        adapter (`DecoderAdapter`): Its family's adapter.
        layer (`nn.Module`): The kept layer to compensate.
        original_outputs (`torch.Tensor` of shape `(num_samples, seq_len, d)`):
            The target hidden states on `input_ids` (X_O): the dense model's output of the same layer,
            or of the last layer of the span removed after it.
        input_ids (`torch.LongTensor` of shape `(num_samples, seq_len)`): Calibration sequences.
        batch_size (`int`): Sequences per forward pass.
        num_folds (`int`, defaults to 1): With more than one, the statistics of each fold of the
            calibration sequences (sequence j in fold j mod `num_folds`), for cross-validation.
        first_sample (`int`, defaults to 0): The index of `input_ids[0]` in the whole calibration set
            (a process's share of it, see [`optimum_gradmap.distributed`]), which sets the folds.

    Returns:
        [`CompensationStatistics`], or a list of one per fold when `num_folds > 1`.
    """
    hidden_size = original_outputs.shape[-1]
    grams = torch.zeros(num_folds, hidden_size, hidden_size, dtype=torch.float64)
    crosses = torch.zeros(num_folds, hidden_size, hidden_size, dtype=torch.float64)
    energies = torch.zeros(num_folds, dtype=torch.float64)
    tokens = [0] * num_folds

    def accumulate(mlp_output: torch.Tensor, target: torch.Tensor, batch_start: int) -> None:
        first = first_sample + batch_start
        folds = (torch.arange(first, first + mlp_output.shape[0]) % num_folds).tolist()
        for fold in sorted(set(folds)):
            rows = [position for position, sample_fold in enumerate(folds) if sample_fold == fold]
            every_row = len(rows) == mlp_output.shape[0]
            y = (mlp_output if every_row else mlp_output[rows]).reshape(-1, hidden_size)
            r = (target if every_row else target[rows]).reshape(-1, hidden_size)
            grams[fold].add_((y.T @ y).cpu())
            crosses[fold].add_((r.T @ y).cpu())
            energies[fold] += r.pow(2).sum().cpu()
            tokens[fold] += y.shape[0]

    _for_each_compensation_batch(model, adapter, layer, original_outputs, input_ids, batch_size, progress_bar, accumulate)
    folds = [CompensationStatistics(grams[f], crosses[f], float(energies[f]), tokens[f]) for f in range(num_folds)]
    return folds if num_folds > 1 else folds[0]


def summed_over_processes(statistics: CompensationStatistics) -> CompensationStatistics:
    """The statistics of the whole calibration set from each process's share ([`optimum_gradmap.distributed`])."""
    if not distributed.is_distributed():
        return statistics
    scalars = distributed.all_reduce_sum(torch.tensor([statistics.target_energy, statistics.num_tokens], dtype=torch.float64))
    return CompensationStatistics(
        distributed.all_reduce_sum(statistics.gram),
        distributed.all_reduce_sum(statistics.cross),
        float(scalars[0]),
        int(scalars[1]),
    )


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


def relative_ridge(statistics: CompensationStatistics, alpha: float) -> float:
    """The ridge alpha * tr(A) / d, in the units of the statistics."""
    return alpha * float(statistics.gram.diagonal().mean())


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


def cross_validate_ridge(
    folds: Sequence[CompensationStatistics], grid: Sequence[float] = AUTO_RIDGE_GRID, form: str = "full"
) -> RidgeChoice:
    """Chooses the relative ridge strength that minimises the held-out squared error of W', by K-fold
    cross-validation over calibration sequences: each fold's error under the W' fitted on the others.
    Costs one d x d eigendecomposition per fold.

    Returns:
        [`RidgeChoice`]: `alpha` is `None` when no strength beats W' = I on the held-out folds.
    """
    total = sum(folds[1:], folds[0])
    identity = torch.eye(total.gram.shape[0], dtype=torch.float64)
    errors = dict.fromkeys(grid, 0.0)
    identity_error = 0.0
    for held_out in folds:
        train = total - held_out
        solutions = ridge_solutions(train, [relative_ridge(train, alpha) for alpha in grid], form)
        for alpha, matrix in zip(grid, solutions):
            errors[alpha] += float(held_out.squared_error(matrix))
        identity_error += float(held_out.squared_error(identity))
    best = min(grid, key=lambda alpha: (errors[alpha], -alpha))
    return RidgeChoice(alpha=best if errors[best] < identity_error else None, heldout_error=errors, identity_error=identity_error)


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


def solve_adam(
    statistics: CompensationStatistics,
    reg_lambda: float,
    learning_rate: float,
    num_steps: int,
    progress_bar: bool = True,
    form: str = "full",
) -> torch.Tensor:
    """Minimises the Stage 2 objective with Adam from W' = I, as the paper does (full batch, float64); with
    `form="diagonal"`, over channel-wise scalings."""
    parameter, as_matrix = _identity_parameter(statistics.gram.shape[0], form, statistics.gram.device)
    optimizer = torch.optim.Adam([parameter], lr=learning_rate)
    for _ in logging.tqdm(range(num_steps), desc="Fitting W' (Adam)", leave=False, disable=not progress_bar):
        optimizer.zero_grad(set_to_none=True)
        with torch.enable_grad():
            loss = statistics.objective(as_matrix(parameter), reg_lambda)
            loss.backward()
        optimizer.step()
    return as_matrix(parameter.detach())


def _identity_parameter(size: int, form: str, device: torch.device) -> tuple[torch.Tensor, Callable]:
    """The trainable parameter of W' at the identity, and the map from it to W'."""
    if form == "diagonal":
        return torch.ones(size, dtype=torch.float64, device=device, requires_grad=True), torch.diag
    return torch.eye(size, dtype=torch.float64, device=device, requires_grad=True), lambda matrix: matrix


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
    """Stage 2 when a norm follows the MLP (Gemma2/3, OLMo2): minimises, with Adam from W' = I,

        mean((norm(W' y) - r)^2) + lambda || W' - I ||_F^2

    on the stored activations (over channel-wise scalings with `form="diagonal"`). The norm is not
    linear, so there is no closed form.

    Returns:
        `tuple[torch.Tensor, float, float]`: W', and the objective at W' = I and at W'.
    """
    size = mlp_outputs.shape[-1]
    frozen = {name: parameter.detach() for name, parameter in norm.named_parameters()}
    dtype = next(iter(frozen.values())).dtype if frozen else mlp_outputs.dtype
    identity = torch.eye(size, dtype=torch.float64, device=mlp_outputs.device)

    def objective(matrix: torch.Tensor) -> torch.Tensor:
        mapped = (mlp_outputs @ matrix.T).to(dtype)
        contribution = torch.func.functional_call(norm, frozen, (mapped,)).double()
        return (contribution - targets).pow(2).mean() + reg_lambda * (matrix - identity).pow(2).sum()

    parameter, as_matrix = _identity_parameter(size, form, mlp_outputs.device)
    optimizer = torch.optim.Adam([parameter], lr=learning_rate)
    with torch.enable_grad():
        for _ in logging.tqdm(range(num_steps), desc="Fitting W' through the norm (Adam)", leave=False, disable=not progress_bar):
            optimizer.zero_grad(set_to_none=True)
            objective(as_matrix(parameter)).backward()
            optimizer.step()
    with torch.no_grad():
        matrix = as_matrix(parameter.detach())
        return matrix, float(objective(identity)), float(objective(matrix))


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


def _identity_fit(size: int, choice: RidgeChoice) -> CompensationFit:
    return CompensationFit(torch.eye(size, dtype=torch.float64), 0.0, 0.0, cross_validation=choice, skipped=True)


def _fit_through_norm_with_choice(
    pairs: list[tuple[torch.Tensor, torch.Tensor, int]], norm: nn.Module, config: GradMAPConfig, progress_bar: bool
) -> CompensationFit:
    """The norm-in-the-loop fit; with `reg_lambda="auto"`, lambda is chosen on a held-out fold first
    (each candidate is an Adam fit, so one fold and a short grid, not K folds)."""
    mlp_outputs = torch.cat([y.reshape(-1, y.shape[-1]) for y, _, _ in pairs])
    targets = torch.cat([r.reshape(-1, r.shape[-1]) for _, r, _ in pairs])
    choice = None
    reg_lambda = config.reg_lambda
    if reg_lambda == "auto":
        held_out_rows = torch.cat(
            [
                ((torch.arange(first, first + y.shape[0]) % AUTO_NUM_FOLDS) == AUTO_NUM_FOLDS - 1).repeat_interleave(y.shape[1])
                for y, _, first in pairs
            ]
        )
        train_y, train_r = mlp_outputs[~held_out_rows], targets[~held_out_rows]
        test_y, test_r = mlp_outputs[held_out_rows], targets[held_out_rows]
        mean_eigenvalue = float(train_y.pow(2).sum() / train_y.shape[-1])
        errors = {}
        for alpha in AUTO_RIDGE_GRID[3:7]:
            lam = alpha * mean_eigenvalue / train_y.numel()
            matrix, _, _ = fit_through_norm(
                train_y, train_r, norm, lam, config.adam_lr, config.adam_steps, progress_bar, config.compensation_form
            )
            errors[alpha] = _norm_squared_error(test_y, test_r, norm, matrix)
        identity = torch.eye(mlp_outputs.shape[-1], dtype=torch.float64)
        best = min(errors, key=lambda alpha: (errors[alpha], -alpha))
        choice = RidgeChoice(best, errors, _norm_squared_error(test_y, test_r, norm, identity))
        if errors[best] >= choice.identity_error:
            choice.alpha = None
            return _identity_fit(mlp_outputs.shape[-1], choice)
        reg_lambda = best * float(mlp_outputs.pow(2).sum() / mlp_outputs.shape[-1]) / mlp_outputs.numel()
    matrix, at_identity, fitted = fit_through_norm(
        mlp_outputs, targets, norm, reg_lambda, config.adam_lr, config.adam_steps, progress_bar, config.compensation_form
    )
    return CompensationFit(matrix.cpu(), at_identity, fitted, reg_lambda=reg_lambda, cross_validation=choice)


def _norm_squared_error(mlp_outputs: torch.Tensor, targets: torch.Tensor, norm: nn.Module, matrix: torch.Tensor) -> float:
    frozen = {name: parameter.detach() for name, parameter in norm.named_parameters()}
    dtype = next(iter(frozen.values())).dtype if frozen else mlp_outputs.dtype
    with torch.no_grad():
        mapped = (mlp_outputs @ matrix.T).to(dtype)
        return float((torch.func.functional_call(norm, frozen, (mapped,)).double() - targets).pow(2).sum())


def check_auto_lambda_data(input_ids: torch.LongTensor) -> None:
    """`reg_lambda="auto"` cross-validates over calibration sequences: it needs one per fold at least.

    Raises:
        ValueError: with fewer than `AUTO_NUM_FOLDS` sequences, saying what to change.
    """
    if input_ids.shape[0] < AUTO_NUM_FOLDS:
        raise ValueError(
            f"reg_lambda='auto' cross-validates over calibration sequences: it needs at least {AUTO_NUM_FOLDS}, "
            f"got {input_ids.shape[0]}. Use more calibration sequences (num_samples) or a fixed reg_lambda."
        )


def learn_compensation(
    model: nn.Module,
    adapter: DecoderAdapter,
    layer: nn.Module,
    original_outputs: torch.Tensor,
    input_ids: torch.LongTensor,
    config: GradMAPConfig,
    progress_bar: bool = True,
    first_sample: int = 0,
) -> CompensationFit:
    """Learns W' for one kept layer of the pruned `model` (Eq. 12-14) with the configured solver.

    Where the MLP output reaches the residual stream directly, the objective is quadratic and is
    solved from its sufficient statistics (`config.solver`: exact closed form, or Adam). Where a
    norm follows the MLP, W' is fitted by Adam with the norm in the loop, whatever the solver.

    With `config.reg_lambda="auto"`, lambda is chosen by cross-validation over calibration sequences
    ([`cross_validate_ridge`]: `AUTO_NUM_FOLDS` folds, `AUTO_RIDGE_GRID` strengths relative to the
    data); when no strength beats W' = I on the held-out sequences, the fit is `skipped`.

    With several processes ([`optimum_gradmap.distributed`]), `input_ids` and `original_outputs` are
    this process's share of the calibration set, starting at its sequence `first_sample`: the statistics
    are summed over processes (the stored activations gathered, where a norm follows the MLP), so every
    process fits the same W'.
    """
    if config.reg_lambda == "auto" and not distributed.is_distributed():  # the pruner checks the whole set
        check_auto_lambda_data(input_ids)
    norm = adapter.get_mlp_output_norm(layer)
    if norm is not None:
        pairs: list[tuple[torch.Tensor, torch.Tensor, int]] = []

        def store(mlp_output: torch.Tensor, target: torch.Tensor, batch_start: int) -> None:
            if distributed.is_distributed():  # gathered below, on CPU
                mlp_output, target = mlp_output.cpu(), target.cpu()
            pairs.append((mlp_output, target, first_sample + batch_start))

        _for_each_compensation_batch(model, adapter, layer, original_outputs, input_ids, config.batch_size, progress_bar, store)
        pairs = distributed.gather(pairs)
        with materialized(norm):  # the fit calls the norm many times: offloaded weights stay put meanwhile
            return _fit_through_norm_with_choice(pairs, norm, config, progress_bar)

    choice = None
    if config.reg_lambda == "auto":
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
        )
        folds = [summed_over_processes(fold) for fold in folds]
        choice = cross_validate_ridge(folds, form=config.compensation_form)
        if choice.alpha is None:
            return _identity_fit(original_outputs.shape[-1], choice)
        statistics = sum(folds[1:], folds[0])
        reg_lambda = relative_ridge(statistics, choice.alpha) / statistics.num_elements
    else:
        statistics = summed_over_processes(
            compensation_statistics(model, adapter, layer, original_outputs, input_ids, config.batch_size, progress_bar)
        )
        reg_lambda = config.reg_lambda
    if config.solver == "closed_form":
        matrix = solve_closed_form(statistics, reg_lambda, config.compensation_form)
    else:
        matrix = solve_adam(statistics, reg_lambda, config.adam_lr, config.adam_steps, progress_bar, config.compensation_form)
    identity = torch.eye(matrix.shape[0], dtype=torch.float64)
    return CompensationFit(
        matrix,
        float(statistics.objective(identity, reg_lambda)),
        float(statistics.objective(matrix, reg_lambda)),
        reg_lambda=reg_lambda,
        cross_validation=choice,
    )


def apply_compensation(adapter: DecoderAdapter, layer: nn.Module, matrix: torch.Tensor) -> None:
    """Folds W' into every down projection of `layer` (Eq. 15), where its weights live (offloaded
    weights are written back to CPU or the offload folder, see [`~optimum_gradmap.weights.materialized`])."""
    with materialized(layer):
        for target in adapter.get_down_projections(layer):
            fold_into(target, matrix)


def down_projection_backup(adapter: DecoderAdapter, layers: Sequence[nn.Module]) -> WeightBackup:
    """A [`WeightBackup`] of the down projections of `layers`: what Stage 2's fold changes."""
    return WeightBackup(
        layers, lambda layer: [tensor for target in adapter.get_down_projections(layer) for tensor in linear_map_tensors(target)]
    )


def compensation_targets(
    kept: Sequence[int], drift: dict[int, float], num_layers: int, target: str, num_compensated_layers: int
) -> list[tuple[int, int]]:
    """Which kept layers Stage 2 fits, and to the dense output of which layer, in forward order.

    - `"max_drift"` (the paper, Eq. 11): the `num_compensated_layers` kept layers with the largest
      mean drift, each fitted to its own dense output. A layer that did not drift is never a target.
    - `"span_end"` (the placement of ReplaceMe and LinearPatch): for each run of consecutive removed
      layers, the kept layer just before it, fitted to the dense hidden state at the end of the run (the
      output of its last removed layer), which is what the layer after the run received in the dense
      model. Covers removed last layers, where nothing drifts. A run that starts at layer 0 has no
      layer before it and is not compensated.

    Returns:
        `list[tuple[int, int]]`: `(layer to fit, dense layer whose output is its target)`, dense indices.
    """
    if target == "max_drift":
        ranked = sorted((index for index in kept if drift[index] > 0), key=lambda index: -drift[index])
        return [(index, index) for index in sorted(ranked[:num_compensated_layers])]
    kept_set = set(kept)
    targets = []
    for index in range(1, num_layers):
        if index not in kept_set and index - 1 in kept_set:  # a run of removed layers starts here
            end = index
            while end + 1 < num_layers and end + 1 not in kept_set:
                end += 1
            targets.append((index - 1, end))
    return targets


@dataclass
class CompensationResult:
    """What Stage 2 did. Layer indices are indices in the dense model.

    Args:
        drift (`dict[int, float]`): Mean drift (Eq. 10) of each kept layer before compensation.
        drift_after_compensation (`dict[int, float]`): The same, measured again after the folds.
        compensated_layers (`list[int]`): Layers whose down projection received W', in fitting order.
        objective (`dict[int, dict[str, float]]`): For each compensated layer, the objective at W' = I
            (`"identity"`) and at the learned W' (`"fitted"`).
        targets (`dict[int, int]`): For each fitted layer, the dense layer whose output it was fitted to.
        reg_lambda (`dict[int, float]`): For each compensated layer, the lambda of Eq. 14 its fit used.
        skipped_layers (`dict[int, str]`): Target layers left as they were, and why.
        validation (`dict[str, float]`, *optional*): With validation data, its perplexity without and with
            the compensation, and whether the compensation was kept.
        seconds (`float`): Time Stage 2 took.
        backup (`WeightBackup`, *optional*): The folded tensors as they were before the fold; `restore()`
            undoes Stage 2 (to re-run it with other settings).
    """

    drift: dict[int, float] = field(default_factory=dict)
    drift_after_compensation: dict[int, float] = field(default_factory=dict)
    compensated_layers: list[int] = field(default_factory=list)
    objective: dict[int, dict[str, float]] = field(default_factory=dict)
    targets: dict[int, int] = field(default_factory=dict)
    reg_lambda: dict[int, float] = field(default_factory=dict)
    skipped_layers: dict[int, str] = field(default_factory=dict)
    validation: dict[str, float] | None = None
    seconds: float = 0.0
    backup: WeightBackup | None = field(default=None, repr=False, compare=False)


def compensate(
    model: PreTrainedModel,
    dense: surgery.LayerSnapshot,
    calibration_ids: torch.LongTensor,
    config: GradMAPConfig,
    adapter: DecoderAdapter | None = None,
    progress_bar: bool = True,
    validation_ids: torch.LongTensor | None = None,
) -> CompensationResult:
    """Stage 2 as one call, on a model pruned from `dense` (Eq. 10-15 of the paper):

    1. the mean drift (Eq. 10) of every kept layer, against the dense model on the same tokens (the
       dense stack is run from `dense`, then the pruned one is put back);
    2. the target layers ([`compensation_targets`], `config.compensation_target`), fitted in forward
       order, each on the model that already carries the earlier corrections;
    3. a warning when the calibration set has fewer than `MIN_TOKENS_PER_HIDDEN_UNIT` tokens per
       hidden unit, below which W' was measured to overfit with the paper's lambda;
    4. the fit of W' (Eq. 12-14, [`learn_compensation`]; with `reg_lambda="auto"`, lambda chosen by
       cross-validation, and a layer where no lambda beats W' = I left alone) and its fold into the
       down projection(s) (Eq. 15);
    5. the drift again, after the folds;
    6. with `validation_ids`, the perplexity on them with and without the compensation: it is kept
       only if it lowers it.

    If anything fails, every folded tensor is put back: the model is left as Stage 1 left it. A
    configuration the adapter cannot compensate exactly is refused before anything runs.

    Args:
        model (`PreTrainedModel`): The pruned model, changed in place.
        dense (`LayerSnapshot`): The dense stack it was pruned from.
        calibration_ids (`torch.LongTensor` of shape `(num_samples, seq_len)`): Calibration sequences.
        config ([`GradMAPConfig`]): `compensation_target`, `num_compensated_layers`, `solver`,
            `reg_lambda`, `adam_lr`, `adam_steps` and `batch_size` are read.
        adapter (`DecoderAdapter`, *optional*): The model's adapter; looked up when not given.
        progress_bar (`bool`, defaults to `True`): Show progress bars.
        validation_ids (`torch.LongTensor`, *optional*): Sequences that decide whether to keep the result.

    Returns:
        [`CompensationResult`].
    """
    started = time.perf_counter()
    adapter = adapter or get_adapter(model)
    adapter.check_supported(model, compensation=True)
    kept = surgery.kept_layers(model, dense, adapter)
    if config.compensation_target == "max_drift":
        check_num_compensated_layers(config.num_compensated_layers, len(kept))
    batch_size = config.batch_size
    shared_ids, first_sample = distributed.shard(calibration_ids)  # all of them with one process

    def means(layers: Sequence[nn.Module], description: str) -> torch.Tensor:
        local = hidden_state_means(model, layers, shared_ids, batch_size, progress_bar, description)
        return distributed.average(local, shared_ids.numel())

    with surgery.temporarily(model, dense, range(dense.num_layers), adapter):
        dense_means = means(dense.layers, "Dense hidden states")
    pruned_means = means(adapter.get_layers(model), "Pruned hidden states")
    result = CompensationResult(
        drift={index: float((dense_means[index] - pruned_means[position]).norm()) for position, index in enumerate(kept)}
    )
    hidden_size = dense_means.shape[-1]
    if calibration_ids.numel() < MIN_TOKENS_PER_HIDDEN_UNIT * hidden_size and config.reg_lambda != "auto":
        logger.warning(
            f"Stage 2 fits a {hidden_size} x {hidden_size} matrix on {calibration_ids.numel()} calibration tokens: with "
            f"fewer than {MIN_TOKENS_PER_HIDDEN_UNIT} x hidden size = {MIN_TOKENS_PER_HIDDEN_UNIT * hidden_size} tokens it "
            "can overfit and raise held-out perplexity. Use more calibration data (the paper uses 128 x 128 tokens), "
            "or reg_lambda='auto'."
        )
    targets = compensation_targets(
        kept, result.drift, dense.num_layers, config.compensation_target, config.num_compensated_layers
    )
    if not targets:
        logger.warning(f"Stage 2 ({config.compensation_target}) found no layer to compensate.")
        result.seconds = time.perf_counter() - started
        return result

    result.backup = down_projection_backup(adapter, [dense.layers[index] for index, _ in targets])
    folds: list[tuple[nn.Module, torch.Tensor]] = []
    try:
        with surgery.temporarily(model, dense, range(dense.num_layers), adapter):
            ends = sorted({end for _, end in targets})
            recorded = record_layer_outputs(model, [dense.layers[end] for end in ends], shared_ids, batch_size, progress_bar)
            originals = dict(zip(ends, recorded))
        for index, end in targets:
            layer = dense.layers[index]
            fit = learn_compensation(model, adapter, layer, originals[end], shared_ids, config, progress_bar, first_sample)
            result.targets[index] = end
            if fit.skipped:
                result.skipped_layers[index] = "no lambda beat W' = I on held-out calibration sequences"
                logger.info(f"Layer {index} left uncompensated: no lambda beat W' = I on held-out calibration sequences.")
                continue
            apply_compensation(adapter, layer, fit.matrix)
            folds.append((layer, fit.matrix))
            result.compensated_layers.append(index)
            result.objective[index] = {"identity": fit.objective_identity, "fitted": fit.objective_fitted}
            result.reg_lambda[index] = fit.reg_lambda
            logger.info(
                f"Compensated layer {index} (fitted to the dense output of layer {end}, lambda {fit.reg_lambda:.3g}): "
                f"objective {fit.objective_identity:.6g} -> {fit.objective_fitted:.6g}"
            )
        if validation_ids is not None and folds:
            result.validation = _validate(model, adapter, folds, result.backup, validation_ids, batch_size, progress_bar)
            if not result.validation["kept"]:
                result.skipped_layers.update(
                    {index: "the compensation raised the validation perplexity" for index in result.compensated_layers}
                )
                result.compensated_layers, result.objective, result.reg_lambda = [], {}, {}
        compensated_means = means(adapter.get_layers(model), "Compensated hidden states")
    except BaseException:
        result.backup.restore()
        raise
    result.drift_after_compensation = {
        index: float((dense_means[index] - compensated_means[position]).norm()) for position, index in enumerate(kept)
    }
    result.seconds = time.perf_counter() - started
    return result


def _validate(
    model: PreTrainedModel,
    adapter: DecoderAdapter,
    folds: list[tuple[nn.Module, torch.Tensor]],
    backup: WeightBackup,
    validation_ids: torch.LongTensor,
    batch_size: int,
    progress_bar: bool,
) -> dict[str, float]:
    """Perplexity on `validation_ids` with the folds and without them; leaves the better model."""
    from .evaluation.perplexity import perplexity

    with_compensation = perplexity(model, validation_ids, batch_size, progress_bar)
    backup.restore()
    without = perplexity(model, validation_ids, batch_size, progress_bar)
    kept = with_compensation < without
    if kept:
        for layer, matrix in folds:
            apply_compensation(adapter, layer, matrix)
    return {"without": without, "with": with_compensation, "kept": kept}


@dataclass
class RunCompensation:
    """One compensation made during Stage 1, after a removal (`compensate_each_round`).

    Args:
        layer (`int`): The kept layer fitted (dense index).
        target (`int`): The dense layer whose output it was fitted to (the end of the run of removed layers).
        reg_lambda (`float`, *optional*): The lambda its fit used; `None` when it was left alone.
        backup (`WeightBackup`): Its down projection(s) before the fold.
    """

    layer: int
    target: int
    reg_lambda: float | None
    backup: WeightBackup = field(repr=False, compare=False)


def compensate_run(
    model: PreTrainedModel,
    dense: surgery.LayerSnapshot,
    calibration_ids: torch.LongTensor,
    config: GradMAPConfig,
    removed_layer: int,
    adapter: DecoderAdapter | None = None,
    progress_bar: bool = True,
) -> RunCompensation | None:
    """Compensation between removals (as Prune&Comp does): after `removed_layer` went, fits the kept
    layer just before the run of removed layers it belongs to, to the dense hidden state at the end of
    that run, and folds it, so that the next Stage 1 round scores the repaired model.

    Returns:
        [`RunCompensation`], or `None` when the run starts at layer 0 (no layer before it).
    """
    adapter = adapter or get_adapter(model)
    adapter.check_supported(model, compensation=True)
    kept = surgery.kept_layers(model, dense, adapter)
    runs = compensation_targets(kept, {}, dense.num_layers, "span_end", 0)
    found = [(index, end) for index, end in runs if index < removed_layer <= end]
    if not found:
        return None
    ((index, end),) = found
    layer = dense.layers[index]
    backup = down_projection_backup(adapter, [layer])
    shared_ids, first_sample = distributed.shard(calibration_ids)  # all of them with one process
    with surgery.temporarily(model, dense, range(dense.num_layers), adapter):
        (original,) = record_layer_outputs(model, [dense.layers[end]], shared_ids, config.batch_size, progress_bar)
    fit = learn_compensation(model, adapter, layer, original, shared_ids, config, progress_bar, first_sample)
    if not fit.skipped:
        apply_compensation(adapter, layer, fit.matrix)
    return RunCompensation(index, end, None if fit.skipped else fit.reg_lambda, backup)
