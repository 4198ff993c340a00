# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Stage 2 of GradMAP: the projection compensation matrix (paper Eq. 10-15).

After layers are removed, the mean hidden state drifts away from the original model's. For each
kept layer i the drift is (Eq. 10)

    delta_i = || E_x[H_i(x)] - E_x[H'_i(x)] ||_2

with H_i the output of layer i in the original model and H'_i in the pruned one, on the same
calibration tokens. For the layer(s) with the largest drift a d x d matrix W' is learned so that
the pruned layer's output matches the original one (Eq. 12-14):

    min_W'  1/N sum_j || W' Y_j + X_F,j - X_O,j ||_F^2  +  lambda || W' - I ||_F^2

with, for calibration sequence j, Y_j = W_down X_down (the MLP's output, bias included),
X_F the residual stream entering the MLP and X_O the original model's output of that layer.
The objective only needs the sufficient statistics A = sum Y Y^T, C = sum R Y^T and sum ||R||^2
(R = X_O - X_F) over all calibration tokens, so both solvers work on d x d matrices:

- `"closed_form"`: the exact minimiser W' = (C + N lambda I)(A + N lambda I)^-1, in float64;
- `"adam"`: the paper's optimiser, full-batch Adam from W' = I on the same objective.

W' is then folded into the down projection, W_down <- W' W_down and b_down <- W' b_down, so the
pruned model costs nothing extra at inference (Eq. 15).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn
from transformers.utils import logging

from .adapters import DecoderAdapter

logger = logging.get_logger(__name__)


def _hidden(output: object) -> torch.Tensor:
    return output[0] if isinstance(output, (tuple, list)) else output


def _batches(input_ids: torch.LongTensor, batch_size: int, description: str, progress_bar: bool):
    starts = range(0, input_ids.shape[0], batch_size)
    for start in logging.tqdm(starts, desc=description, leave=False, disable=not progress_bar):
        yield input_ids[start : start + batch_size]


@torch.no_grad()
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

    def accumulate(position: int, module: nn.Module, args: tuple, output: object) -> None:
        hidden = _hidden(output)
        total = hidden.reshape(-1, hidden.shape[-1]).sum(dim=0, dtype=torch.float64).cpu()
        sums[position] = total if sums[position] is None else sums[position] + total

    handles = [layer.register_forward_hook(lambda m, a, o, p=p: accumulate(p, m, a, o)) for p, layer in enumerate(layers)]
    device = model.get_input_embeddings().weight.device
    try:
        for batch in _batches(input_ids, batch_size, description, progress_bar):
            model(input_ids=batch.to(device), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return torch.stack(sums) / input_ids.numel()


@torch.no_grad()
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
    handles = [
        layer.register_forward_hook(lambda m, a, o, p=p: outputs[p].append(_hidden(o).float().cpu()))
        for p, layer in enumerate(layers)
    ]
    device = model.get_input_embeddings().weight.device
    try:
        for batch in _batches(input_ids, batch_size, description, progress_bar):
            model(input_ids=batch.to(device), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return [torch.cat(chunks) for chunks in outputs]


@dataclass
class CompensationStatistics:
    """Sufficient statistics of the Stage 2 objective for one layer.

    Args:
        gram (`torch.Tensor` of shape `(d, d)`): A = sum over tokens of y y^T, y the MLP output.
        cross (`torch.Tensor` of shape `(d, d)`): C = sum over tokens of r y^T, r = x_O - x_F.
        target_energy (`float`): sum over tokens of ||r||^2.
        num_sequences (`int`): N, the number of calibration sequences.
    """

    gram: torch.Tensor
    cross: torch.Tensor
    target_energy: float
    num_sequences: int

    def objective(self, matrix: torch.Tensor, reg_lambda: float) -> torch.Tensor:
        """Value of the Eq. 12 objective, 1/N sum_j ||W' Y_j - R_j||^2 + lambda ||W' - I||^2, at `matrix`."""
        matrix = matrix.to(self.gram)
        squared_error = (matrix @ self.gram * matrix).sum() - 2 * (matrix * self.cross).sum() + self.target_energy
        identity = torch.eye(matrix.shape[0], dtype=matrix.dtype, device=matrix.device)
        return squared_error / self.num_sequences + reg_lambda * (matrix - identity).pow(2).sum()


@torch.no_grad()
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
    captured: dict[str, torch.Tensor] = {}
    mlp = adapter.get_mlp(layer)
    handles = [
        mlp.register_forward_hook(lambda m, a, o: captured.__setitem__("mlp_output", _hidden(o))),
        layer.register_forward_hook(lambda m, a, o: captured.__setitem__("layer_output", _hidden(o))),
    ]
    hidden_size = original_outputs.shape[-1]
    gram = torch.zeros(hidden_size, hidden_size, dtype=torch.float64)
    cross = torch.zeros(hidden_size, hidden_size, dtype=torch.float64)
    target_energy = 0.0
    device = model.get_input_embeddings().weight.device
    try:
        start = 0
        for batch in _batches(input_ids, batch_size, "Collecting compensation statistics", progress_bar):
            model(input_ids=batch.to(device), use_cache=False)
            mlp_output = captured["mlp_output"].double()
            ffn_input = captured["layer_output"].double() - mlp_output  # X_F: residual stream entering the MLP
            original = original_outputs[start : start + batch.shape[0]].to(mlp_output)
            start += batch.shape[0]
            target = (original - ffn_input).reshape(-1, hidden_size)  # R = X_O - X_F
            mlp_output = mlp_output.reshape(-1, hidden_size)
            gram += (mlp_output.T @ mlp_output).cpu()
            cross += (target.T @ mlp_output).cpu()
            target_energy += target.pow(2).sum().item()
    finally:
        for handle in handles:
            handle.remove()
    return CompensationStatistics(gram, cross, target_energy, int(input_ids.shape[0]))


def solve_closed_form(statistics: CompensationStatistics, reg_lambda: float) -> torch.Tensor:
    """Exact minimiser of the Stage 2 objective, W' = (C + N lambda I)(A + N lambda I)^-1, in float64."""
    ridge = statistics.num_sequences * reg_lambda
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


@torch.no_grad()
def fold_into_linear(linear: nn.Linear, matrix: torch.Tensor) -> None:
    """Folds W' into a linear map in place: W <- W' W and b <- W' b, on its device and in its dtype."""
    weight = linear.weight
    matrix = matrix.to(device=weight.device, dtype=torch.float64)
    weight.copy_((matrix @ weight.double()).to(weight.dtype))
    if linear.bias is not None:
        linear.bias.copy_((matrix @ linear.bias.double()).to(linear.bias.dtype))
