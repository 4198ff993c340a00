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
from typing import TYPE_CHECKING

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.utils import logging

from . import surgery
from .adapters import DecoderAdapter, get_adapter
from .passes import calibration_batches, for_each_layer_output, forward_hooks, layer_output
from .weights import WeightBackup, fold_into, linear_map_tensors

if TYPE_CHECKING:
    from .configuration import GradMAPConfig

logger = logging.get_logger(__name__)

# Below this many calibration tokens per hidden unit, W' (hidden x hidden parameters) overfitted on
# SmolLM2-135M: 1.8 tokens per unit raised held-out perplexity by 60%, 7 by 2%, 28 lowered it.
MIN_TOKENS_PER_HIDDEN_UNIT = 16
# The GradMAPConfig fields Stage 2 reads: the ones a re-run of Stage 2 may change.
STAGE2_SETTINGS = ("num_compensated_layers", "solver", "reg_lambda", "adam_lr", "adam_steps", "batch_size")


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

    def objective(self, matrix: torch.Tensor, reg_lambda: float) -> torch.Tensor:
        """Value of the Eq. 12 objective, mean((W' y - r)^2) + lambda ||W' - I||^2, at `matrix`."""
        matrix = matrix.to(self.gram)
        squared_error = (matrix @ self.gram * matrix).sum() - 2 * (matrix * self.cross).sum() + self.target_energy
        identity = torch.eye(matrix.shape[0], dtype=matrix.dtype, device=matrix.device)
        return squared_error / self.num_elements + reg_lambda * (matrix - identity).pow(2).sum()


def _for_each_compensation_batch(
    model: nn.Module,
    adapter: DecoderAdapter,
    layer: nn.Module,
    original_outputs: torch.Tensor,
    input_ids: torch.LongTensor,
    batch_size: int,
    progress_bar: bool,
    consume: Callable[[torch.Tensor, torch.Tensor], None],
) -> None:
    """Runs the pruned model and calls `consume(Y, R)` per batch, with Y the MLP output and R = X_O - X_F
    the target of the MLP's residual contribution, each flattened to `(tokens, d)` in float64."""
    captured: dict[str, torch.Tensor] = {}
    mlp = adapter.get_mlp(layer)
    contribution_module = adapter.get_mlp_output_norm(layer) or mlp  # its output is what the layer adds to the residual
    hooks = [
        (mlp, lambda m, a, o: captured.__setitem__("mlp_output", layer_output(o))),
        (contribution_module, lambda m, a, o: captured.__setitem__("contribution", layer_output(o))),
        (layer, lambda m, a, o: captured.__setitem__("layer_output", layer_output(o))),
    ]
    hidden_size = original_outputs.shape[-1]
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
            start += batch.shape[0]
            target = (original - ffn_input).reshape(-1, hidden_size)  # R = X_O - X_F
            consume(captured["mlp_output"].double().reshape(-1, hidden_size), target)


def compensation_statistics(
    model: nn.Module,
    adapter: DecoderAdapter,
    layer: nn.Module,
    original_outputs: torch.Tensor,
    input_ids: torch.LongTensor,
    batch_size: int,
    progress_bar: bool = True,
) -> CompensationStatistics:
    """Runs the pruned model on the calibration data and accumulates the Stage 2 statistics of `layer`.

    Args:
        model (`nn.Module`): The pruned model.
        adapter (`DecoderAdapter`): Its family's adapter.
        layer (`nn.Module`): The kept layer to compensate.
        original_outputs (`torch.Tensor` of shape `(num_samples, seq_len, d)`):
            The original model's output of the same layer on `input_ids` (X_O).
        input_ids (`torch.LongTensor` of shape `(num_samples, seq_len)`): Calibration sequences.
        batch_size (`int`): Sequences per forward pass.
    """
    hidden_size = original_outputs.shape[-1]
    gram = torch.zeros(hidden_size, hidden_size, dtype=torch.float64)
    cross = torch.zeros(hidden_size, hidden_size, dtype=torch.float64)
    target_energy = torch.zeros((), dtype=torch.float64)

    def accumulate(mlp_output: torch.Tensor, target: torch.Tensor) -> None:
        gram.add_((mlp_output.T @ mlp_output).cpu())
        cross.add_((target.T @ mlp_output).cpu())
        target_energy.add_(target.pow(2).sum().cpu())

    _for_each_compensation_batch(model, adapter, layer, original_outputs, input_ids, batch_size, progress_bar, accumulate)
    return CompensationStatistics(gram, cross, float(target_energy), int(input_ids.numel()))


def solve_closed_form(statistics: CompensationStatistics, reg_lambda: float) -> torch.Tensor:
    """Exact minimiser of the Stage 2 objective, W' = (C + M lambda I)(A + M lambda I)^-1, in float64."""
    ridge = statistics.num_elements * reg_lambda
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
) -> torch.Tensor:
    """Minimises the Stage 2 objective with Adam from W' = I, as the paper does (full batch, float64)."""
    size = statistics.gram.shape[0]
    matrix = torch.eye(size, dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.Adam([matrix], lr=learning_rate)
    for _ in logging.tqdm(range(num_steps), desc="Fitting W' (Adam)", leave=False, disable=not progress_bar):
        optimizer.zero_grad(set_to_none=True)
        with torch.enable_grad():
            loss = statistics.objective(matrix, reg_lambda)
            loss.backward()
        optimizer.step()
    return matrix.detach()


def fit_through_norm(
    mlp_outputs: torch.Tensor,
    targets: torch.Tensor,
    norm: nn.Module,
    reg_lambda: float,
    learning_rate: float,
    num_steps: int,
    progress_bar: bool = True,
) -> tuple[torch.Tensor, float, float]:
    """Stage 2 when a norm follows the MLP (Gemma2/3, OLMo2): minimises, with Adam from W' = I,

        mean((norm(W' y) - r)^2) + lambda || W' - I ||_F^2

    on the stored activations. The norm is not linear, so there is no closed form.

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

    matrix = identity.clone().requires_grad_(True)
    optimizer = torch.optim.Adam([matrix], lr=learning_rate)
    with torch.enable_grad():
        for _ in logging.tqdm(range(num_steps), desc="Fitting W' through the norm (Adam)", leave=False, disable=not progress_bar):
            optimizer.zero_grad(set_to_none=True)
            objective(matrix).backward()
            optimizer.step()
    with torch.no_grad():
        return matrix.detach(), float(objective(identity)), float(objective(matrix))


@dataclass
class CompensationFit:
    """A learned compensation matrix and the Stage 2 objective before and after.

    Args:
        matrix (`torch.Tensor` of shape `(d, d)`): W', float64.
        objective_identity (`float`): The objective at W' = I (no compensation).
        objective_fitted (`float`): The objective at W'.
    """

    matrix: torch.Tensor
    objective_identity: float
    objective_fitted: float


def learn_compensation(
    model: nn.Module,
    adapter: DecoderAdapter,
    layer: nn.Module,
    original_outputs: torch.Tensor,
    input_ids: torch.LongTensor,
    config: "GradMAPConfig",
    progress_bar: bool = True,
) -> CompensationFit:
    """Learns W' for one kept layer of the pruned `model` (Eq. 12-14) with the configured solver.

    Where the MLP output reaches the residual stream directly, the objective is quadratic and is
    solved from its sufficient statistics (`config.solver`: exact closed form, or Adam). Where a
    norm follows the MLP, W' is fitted by Adam with the norm in the loop, whatever the solver.
    """
    norm = adapter.get_mlp_output_norm(layer)
    if norm is not None:
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        _for_each_compensation_batch(
            model, adapter, layer, original_outputs, input_ids, config.batch_size, progress_bar, lambda *pair: pairs.append(pair)
        )
        mlp_outputs, targets = (torch.cat(parts) for parts in zip(*pairs))
        matrix, at_identity, fitted = fit_through_norm(
            mlp_outputs, targets, norm, config.reg_lambda, config.adam_lr, config.adam_steps, progress_bar
        )
        return CompensationFit(matrix.cpu(), at_identity, fitted)

    statistics = compensation_statistics(model, adapter, layer, original_outputs, input_ids, config.batch_size, progress_bar)
    if config.solver == "closed_form":
        matrix = solve_closed_form(statistics, config.reg_lambda)
    else:
        matrix = solve_adam(statistics, config.reg_lambda, config.adam_lr, config.adam_steps, progress_bar)
    identity = torch.eye(matrix.shape[0], dtype=torch.float64)
    return CompensationFit(
        matrix, float(statistics.objective(identity, config.reg_lambda)), float(statistics.objective(matrix, config.reg_lambda))
    )


def apply_compensation(adapter: DecoderAdapter, layer: nn.Module, matrix: torch.Tensor) -> None:
    """Folds W' into every down projection of `layer` (Eq. 15)."""
    for target in adapter.get_down_projections(layer):
        fold_into(target, matrix)


@dataclass
class CompensationResult:
    """What Stage 2 did. Layer indices are indices in the dense model.

    Args:
        drift (`dict[int, float]`): Mean drift (Eq. 10) of each kept layer before compensation.
        drift_after_compensation (`dict[int, float]`): The same, measured again after the folds.
        compensated_layers (`list[int]`): Layers whose down projection received W', in fitting order.
        objective (`dict[int, dict[str, float]]`): For each compensated layer, the objective at W' = I
            (`"identity"`) and at the learned W' (`"fitted"`).
        seconds (`float`): Time Stage 2 took.
        backup (`WeightBackup`, *optional*): The folded tensors as they were before the fold; `restore()`
            undoes Stage 2 (to re-run it with other settings).
    """

    drift: dict[int, float] = field(default_factory=dict)
    drift_after_compensation: dict[int, float] = field(default_factory=dict)
    compensated_layers: list[int] = field(default_factory=list)
    objective: dict[int, dict[str, float]] = field(default_factory=dict)
    seconds: float = 0.0
    backup: WeightBackup | None = field(default=None, repr=False, compare=False)


def compensate(
    model: PreTrainedModel,
    dense: surgery.LayerSnapshot,
    calibration_ids: torch.LongTensor,
    config: GradMAPConfig,
    adapter: DecoderAdapter | None = None,
    progress_bar: bool = True,
) -> CompensationResult:
    """Stage 2 as one call, on a model pruned from `dense` (Eq. 10-15 of the paper):

    1. the mean drift (Eq. 10) of every kept layer, against the dense model on the same tokens (the
       dense stack is run from `dense`, then the pruned one is put back);
    2. the `config.num_compensated_layers` layers with the largest drift (Eq. 11), fitted in forward
       order, each on the model that already carries the earlier corrections; a layer that did not
       drift is never a target (nothing is compensated when only the last layers were removed);
    3. a warning when the calibration set has fewer than `MIN_TOKENS_PER_HIDDEN_UNIT` tokens per
       hidden unit, below which W' was measured to overfit;
    4. the fit of W' (Eq. 12-14, [`learn_compensation`]) and its fold into the down projection(s) (Eq. 15);
    5. the drift again, after the folds.

    If anything fails, every folded tensor is put back: the model is left as Stage 1 left it. A
    configuration the adapter cannot compensate exactly is refused before anything runs.

    Args:
        model (`PreTrainedModel`): The pruned model, changed in place.
        dense (`LayerSnapshot`): The dense stack it was pruned from.
        calibration_ids (`torch.LongTensor` of shape `(num_samples, seq_len)`): Calibration sequences.
        config ([`GradMAPConfig`]): `num_compensated_layers`, `solver`, `reg_lambda`, `adam_lr`,
            `adam_steps` and `batch_size` are read.
        adapter (`DecoderAdapter`, *optional*): The model's adapter; looked up when not given.
        progress_bar (`bool`, defaults to `True`): Show progress bars.

    Returns:
        [`CompensationResult`].
    """
    started = time.perf_counter()
    adapter = adapter or get_adapter(model)
    adapter.check_supported(model, compensation=True)
    kept = surgery.kept_layers(model, dense, adapter)
    check_num_compensated_layers(config.num_compensated_layers, len(kept))
    batch_size = config.batch_size
    with surgery.temporarily(model, dense, range(dense.num_layers), adapter):
        dense_means = hidden_state_means(model, dense.layers, calibration_ids, batch_size, progress_bar, "Dense hidden states")
    pruned_means = hidden_state_means(
        model, adapter.get_layers(model), calibration_ids, batch_size, progress_bar, "Pruned hidden states"
    )
    result = CompensationResult(
        drift={index: float((dense_means[index] - pruned_means[position]).norm()) for position, index in enumerate(kept)}
    )
    hidden_size = dense_means.shape[-1]
    if calibration_ids.numel() < MIN_TOKENS_PER_HIDDEN_UNIT * hidden_size:
        logger.warning(
            f"Stage 2 fits a {hidden_size} x {hidden_size} matrix on {calibration_ids.numel()} calibration tokens: with "
            f"fewer than {MIN_TOKENS_PER_HIDDEN_UNIT} x hidden size = {MIN_TOKENS_PER_HIDDEN_UNIT * hidden_size} tokens it "
            "can overfit and raise held-out perplexity. Use more calibration data (the paper uses 128 x 128 tokens)."
        )
    ranked = sorted((index for index in kept if result.drift[index] > 0), key=lambda index: -result.drift[index])
    targets = sorted(ranked[: config.num_compensated_layers])  # fit in forward order
    if not targets:
        logger.warning("No kept layer drifted (only layers after every kept layer were removed): nothing to compensate.")
        result.seconds = time.perf_counter() - started
        return result

    result.backup = WeightBackup(
        [
            tensor
            for index in targets
            for target in adapter.get_down_projections(dense.layers[index])
            for tensor in linear_map_tensors(target)
        ]
    )
    try:
        with surgery.temporarily(model, dense, range(dense.num_layers), adapter):
            originals = record_layer_outputs(
                model, [dense.layers[index] for index in targets], calibration_ids, batch_size, progress_bar
            )
        for index, original_outputs in zip(targets, originals):
            layer = dense.layers[index]
            fit = learn_compensation(model, adapter, layer, original_outputs, calibration_ids, config, progress_bar)
            apply_compensation(adapter, layer, fit.matrix)
            result.compensated_layers.append(index)
            result.objective[index] = {"identity": fit.objective_identity, "fitted": fit.objective_fitted}
            logger.info(
                f"Compensated layer {index} (drift {result.drift[index]:.4g}): objective "
                f"{fit.objective_identity:.6g} -> {fit.objective_fitted:.6g}"
            )
        compensated_means = hidden_state_means(
            model, adapter.get_layers(model), calibration_ids, batch_size, progress_bar, "Compensated hidden states"
        )
    except BaseException:
        result.backup.restore()
        raise
    result.drift_after_compensation = {
        index: float((dense_means[index] - compensated_means[position]).norm()) for position, index in enumerate(kept)
    }
    result.seconds = time.perf_counter() - started
    return result
