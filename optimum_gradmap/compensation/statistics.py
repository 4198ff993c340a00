# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""The sufficient statistics of the Stage 2 objective (Eq. 12-14), and the per-token rows of the fits that need
more than them.

The objective mean((W' y - r)^2) + lambda ||W' - I||^2, over all calibration tokens, with y the MLP output
and r = x_O - x_F the target of its residual contribution, depends on the data only through A = sum y y^T,
C = sum r y^T and sum ||r||^2 ([`CompensationStatistics`]). Everything is accumulated in float64 on the
device the model runs on, and moved to the CPU once, at the end of the pass.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import distributed
from .activations import CompensationBatch, FitData, for_each_compensation_batch


@dataclass
class CompensationStatistics:
    """Sufficient statistics of the Stage 2 objective for one layer.

    Args:
        gram (`torch.Tensor` of shape `(d, d)`): A = sum over tokens of y y^T, y the MLP output.
        cross (`torch.Tensor` of shape `(d, d)`): C = sum over tokens of r y^T, r = x_O - x_F.
        target_energy (`float`): sum over tokens of ||r||^2.
        num_tokens (`int`): The number of calibration tokens (those with a weight above 0, where tokens are weighed:
            the sums are then weighted sums).
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


def compensation_statistics(
    data: FitData,
    batch_size: int,
    progress_bar: bool = True,
    num_folds: int = 1,
    outliers: str = "keep",
    on_batch: Callable[[CompensationBatch], None] | None = None,
) -> CompensationStatistics | list[CompensationStatistics]:
    """Runs the pruned model on the calibration data and accumulates the Stage 2 statistics of the layer of `data`.

    Args:
        data ([`FitData`]): The kept layer to compensate, and what it is fitted to.
        batch_size (`int`): Sequences per forward pass.
        progress_bar (`bool`, defaults to `True`): Show a progress bar.
        num_folds (`int`, defaults to 1): With more than one, the statistics of each fold of the
            calibration sequences (sequence j in fold j mod `num_folds`, from `data.first_sample`), for cross-validation.
        outliers (`str`, defaults to `"keep"`): `Stage2Settings.outlier_tokens`: each token's weight in the sums
            ([`outlier_token_weights`]).
        on_batch (`Callable`, *optional*): Called with every [`CompensationBatch`] too, to keep what else a caller
            needs from the same pass.

    Returns:
        [`CompensationStatistics`] on CPU, or a list of one per fold when `num_folds > 1`.
    """
    hidden_size = data.original_outputs.shape[-1]
    sums: dict[str, torch.Tensor] = {}  # created on the device of the first batch
    tokens = [0] * num_folds

    def accumulate(batch: CompensationBatch) -> None:
        mlp_output, target = batch.mlp_output, batch.target
        if not sums:
            options = {"dtype": torch.float64, "device": mlp_output.device}
            sums["gram"] = torch.zeros(num_folds, hidden_size, hidden_size, **options)
            sums["cross"] = torch.zeros(num_folds, hidden_size, hidden_size, **options)
            sums["energy"] = torch.zeros(num_folds, **options)
        first = data.first_sample + batch.first_sample
        folds = [(first + position) % num_folds for position in range(mlp_output.shape[0])]
        for fold in sorted(set(folds)):
            rows = [position for position, sample_fold in enumerate(folds) if sample_fold == fold]
            every_row = len(rows) == mlp_output.shape[0]
            y = mlp_output if every_row else mlp_output[rows]
            r = target if every_row else target[rows]
            if batch.weight is None:
                y, r = y.reshape(-1, hidden_size), r.reshape(-1, hidden_size)
                weighted_y, squared = y, r.pow(2).sum()
            else:  # the tokens weighed, of the fold's sequences; those of weight 0 left out
                weight = batch.weight if every_row else batch.weight[rows]
                used = weight > 0
                y, r, weight = y[used], r[used], weight[used]
                weighted_y, squared = y * weight[:, None], (r.pow(2).sum(dim=-1) * weight).sum()
            sums["gram"][fold].add_(y.T @ weighted_y)
            sums["cross"][fold].add_(r.T @ weighted_y)
            sums["energy"][fold] += squared
            tokens[fold] += y.shape[0]
        if on_batch is not None:
            on_batch(batch)

    for_each_compensation_batch(data, batch_size, progress_bar, accumulate, outliers)
    gram, cross, energy = (sums[name].cpu() for name in ("gram", "cross", "energy"))
    folds = [CompensationStatistics(gram[f], cross[f], float(energy[f]), tokens[f]) for f in range(num_folds)]
    return folds if num_folds > 1 else folds[0]


@dataclass
class CompensationRows:
    """Stage 2's data for one kept layer, one row per (kept) calibration token, float64, for the fits that need
    more than the statistics (through a norm, the cosine objective).

    Args:
        mlp_output (`torch.Tensor` of shape `(rows, d)`): Y.
        ffn_input (`torch.Tensor` of shape `(rows, d)`): X_F.
        original (`torch.Tensor` of shape `(rows, d)`): X_O.
        sample (`torch.Tensor` of shape `(rows,)`): The index of each row's sequence in the calibration set.
    """

    mlp_output: torch.Tensor
    ffn_input: torch.Tensor
    original: torch.Tensor
    sample: torch.Tensor

    @property
    def target(self) -> torch.Tensor:
        """R = X_O - X_F."""
        return self.original - self.ffn_input

    def select(self, rows: torch.Tensor) -> CompensationRows:
        """The rows where the bool tensor `rows` is True."""
        return CompensationRows(self.mlp_output[rows], self.ffn_input[rows], self.original[rows], self.sample[rows])

    def statistics(self) -> CompensationStatistics:
        """The sufficient statistics of these rows, on CPU."""
        y, r = self.mlp_output, self.target
        return CompensationStatistics((y.T @ y).cpu(), (r.T @ y).cpu(), float(r.pow(2).sum()), y.shape[0])


def collect_rows(data: FitData, batch_size: int, progress_bar: bool = True, outliers: str = "keep") -> CompensationRows:
    """Every calibration token's Y, X_F and X_O for the layer of `data` (those `outliers="exclude"` leaves out excepted), on
    the model's device; with several processes, every process's rows, gathered as tensors in the order of the
    sequences."""
    parts: list[CompensationRows] = []

    def store(batch: CompensationBatch) -> None:
        first = data.first_sample + batch.first_sample
        y = batch.mlp_output
        sample = torch.arange(first, first + y.shape[0], device=y.device)[:, None].expand(y.shape[:2])
        kept = batch.weight > 0 if batch.weight is not None else torch.ones(y.shape[:2], dtype=torch.bool, device=y.device)
        parts.append(CompensationRows(y[kept], batch.ffn_input[kept], batch.original[kept], sample[kept]))

    for_each_compensation_batch(data, batch_size, progress_bar, store, outliers)
    gathered = (
        distributed.gather_rows(torch.cat([getattr(part, name) for part in parts]))
        for name in ("mlp_output", "ffn_input", "original", "sample")
    )
    return CompensationRows(*gathered)


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
