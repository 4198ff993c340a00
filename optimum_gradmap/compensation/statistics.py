# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Stage 2's calibration passes: the mean hidden states behind the drift (Eq. 10), the dense outputs a
layer is fitted to, and the sufficient statistics of the objective (Eq. 12-14).

The objective mean((W' y - r)^2) + lambda ||W' - I||^2, over all calibration tokens, with y the MLP output
and r = x_O - x_F the target of its residual contribution, depends on the data only through A = sum y y^T,
C = sum r y^T and sum ||r||^2 ([`CompensationStatistics`]). Everything is accumulated in float64 on the
device the model runs on, and moved to the CPU once, at the end of the pass.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .. import distributed
from ..adapters import DecoderAdapter
from ..passes import calibration_batches, for_each_layer_output, forward_hooks, layer_output


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
        total = hidden.reshape(-1, hidden.shape[-1]).sum(dim=0, dtype=torch.float64)
        sums[position] = total if sums[position] is None else sums[position] + total

    for_each_layer_output(model, layers, input_ids, batch_size, accumulate, description, progress_bar)
    return torch.stack([total.cpu() for total in sums]) / input_ids.numel()


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

    @property
    def mean_eigenvalue(self) -> float:
        """tr(A) / d, the scale that relative ridge strengths are measured in."""
        return float(self.gram.diagonal().mean())

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


def for_each_compensation_batch(
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
    R = X_O - X_F the target of the MLP's residual contribution, each `(samples, tokens, d)` in float64
    on the model's device, and the index of the batch's first sample in `input_ids`."""
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
        progress_bar (`bool`, defaults to `True`): Show a progress bar.
        num_folds (`int`, defaults to 1): With more than one, the statistics of each fold of the
            calibration sequences (sequence j in fold j mod `num_folds`), for cross-validation.
        first_sample (`int`, defaults to 0): The index of `input_ids[0]` in the whole calibration set
            (a process's share of it, see [`optimum_gradmap.distributed`]), which sets the folds.

    Returns:
        [`CompensationStatistics`] on CPU, or a list of one per fold when `num_folds > 1`.
    """
    hidden_size = original_outputs.shape[-1]
    sums: dict[str, torch.Tensor] = {}  # created on the device of the first batch
    tokens = [0] * num_folds

    def accumulate(mlp_output: torch.Tensor, target: torch.Tensor, batch_start: int) -> None:
        if not sums:
            options = {"dtype": torch.float64, "device": mlp_output.device}
            sums["gram"] = torch.zeros(num_folds, hidden_size, hidden_size, **options)
            sums["cross"] = torch.zeros(num_folds, hidden_size, hidden_size, **options)
            sums["energy"] = torch.zeros(num_folds, **options)
        first = first_sample + batch_start
        folds = [(first + position) % num_folds for position in range(mlp_output.shape[0])]
        for fold in sorted(set(folds)):
            rows = [position for position, sample_fold in enumerate(folds) if sample_fold == fold]
            every_row = len(rows) == mlp_output.shape[0]
            y = (mlp_output if every_row else mlp_output[rows]).reshape(-1, hidden_size)
            r = (target if every_row else target[rows]).reshape(-1, hidden_size)
            sums["gram"][fold].add_(y.T @ y)
            sums["cross"][fold].add_(r.T @ y)
            sums["energy"][fold] += r.pow(2).sum()
            tokens[fold] += y.shape[0]

    for_each_compensation_batch(model, adapter, layer, original_outputs, input_ids, batch_size, progress_bar, accumulate)
    gram, cross, energy = (sums[name].cpu() for name in ("gram", "cross", "energy"))
    folds = [CompensationStatistics(gram[f], cross[f], float(energy[f]), tokens[f]) for f in range(num_folds)]
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
