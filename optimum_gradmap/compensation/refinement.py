# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Output-aware refinement of the compensation matrices (`refinement_steps`; LinearPatch, Chen et al.,
NeurIPS 2025, Sec. 3.3, "memory-efficient offline knowledge distillation", here on calibration text only).

The closed-form fits each match a hidden state; the refinement then adjusts all of them together so that
the pruned model's next-token distribution matches the dense model's. Each compensated layer gets a factor
R (d x d, from the identity) on its MLP output, and Adam minimises, over the training folds' calibration
sequences (three of the four cross-validation folds, in batches), the cross-entropy from the dense model's
top-K next-token distribution (its K most likely tokens, renormalised; K = `TOP_K`) to the pruned model's:

    - mean over tokens of sum_{k in top-K} p_dense(k) log p_pruned(k)

which is the KL divergence of the two up to a constant. Only the factors are trained: every weight of the
model is frozen, and the gradient reaches the factors through the layers after them, the final norm and the
head. The held-out fold's loss is checked every `CHECK_EVERY` steps, and the factors with the lowest one (the
identity included, i.e. the closed-form fits alone) are folded into the down projections: R W' W_down, exact
like W'.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers.utils import logging

from .. import distributed
from ..distillation import TOP_K as TOP_K  # the teacher keeps the top-K the heal stage keeps
from ..distillation import teacher_targets
from ..errors import InvalidInputError
from ..passes import calibration_mode, forward_hooks, input_device
from ..surgery import LayerSnapshot
from ..weights import WeightBackup
from .folding import apply_compensation
from .settings import Stage2Settings
from .solvers import AUTO_NUM_FOLDS

logger = logging.get_logger(__name__)

# Held-out checks: every this many steps.
CHECK_EVERY = 10


def check_refinement_data(input_ids: torch.LongTensor) -> None:
    """`refinement_steps` trains on three of the `AUTO_NUM_FOLDS` folds of the calibration sequences (sequence j in
    fold j mod `AUTO_NUM_FOLDS`) and keeps the step with the lowest loss on the last: it needs one sequence per fold
    at least.

    Args:
        input_ids (`torch.LongTensor` of shape `(num_samples, seq_len)`): The sequences Stage 2 fits on, all of them.

    Raises:
        InvalidInputError: with fewer than `AUTO_NUM_FOLDS` sequences, saying what to change.
    """
    _check_num_sequences(input_ids.shape[0])


def _check_num_sequences(num_sequences: int) -> None:
    if num_sequences < AUTO_NUM_FOLDS:
        raise InvalidInputError(
            f"refinement_steps holds out one calibration sequence in {AUTO_NUM_FOLDS} to choose the step it keeps: it needs "
            f"at least {AUTO_NUM_FOLDS} sequences, got {num_sequences}. Use more calibration sequences (num_samples, "
            "or compensation_data), or refinement_steps=0."
        )


def dense_top_k(
    dense: LayerSnapshot, input_ids: torch.LongTensor, batch_size: int, fold_backups: Sequence[WeightBackup]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The dense model's `TOP_K` most likely next tokens at every position but the last, and their
    probabilities renormalised over them: `(samples, tokens - 1, TOP_K)` indices and float32 probabilities.
    The dense model is the snapshot's stack with the folds of `fold_backups` undone ([`LayerSnapshot.dense_model`]);
    its targets are the heal stage's ([`~optimum_gradmap.distillation.teacher_targets`])."""
    with dense.dense_model(fold_backups) as model:
        targets = teacher_targets(model, input_ids, batch_size, progress_bar=False)
    return targets.indices.long(), torch.softmax(targets.log_probs, dim=-1)


def _distillation_loss(
    model: nn.Module, batch: torch.LongTensor, indices: torch.Tensor, probabilities: torch.Tensor
) -> torch.Tensor:
    """The cross-entropy from the dense top-K distribution to the model's, mean over positions."""
    log_probs = torch.log_softmax(model(input_ids=batch, use_cache=False).logits[:, :-1].float(), dim=-1)
    chosen = log_probs.gather(-1, indices.to(log_probs.device))
    return -(probabilities.to(log_probs.device) * chosen).sum(-1).mean()


def refine(
    dense: LayerSnapshot,
    layers: Sequence[nn.Module],
    input_ids: torch.LongTensor,
    first_sample: int,
    config: Stage2Settings,
    fold_backups: Sequence[WeightBackup],
    progress_bar: bool = True,
) -> dict[str, float]:
    """Refines the compensation of `layers` (already folded) by distillation from the dense model (see the module
    docstring), and folds the factors with the lowest held-out loss.

    Under `torch.distributed` each process works on its share of the sequences, and a share may hold no held-out (or no
    training) sequence: it then adds nothing to the sums that every process all-reduces. The held-out loss is the mean
    over all processes' held-out sequences, and each step follows the gradient of the mean over all their batches.

    Args:
        dense ([`LayerSnapshot`]): The dense stack of the pruned model.
        layers (`Sequence[nn.Module]`): The compensated layers.
        input_ids (`torch.LongTensor`): Calibration sequences (this process's share, from `first_sample`).
        first_sample (`int`): The index of `input_ids[0]` in the calibration set (which sets the folds).
        config ([`Stage2Settings`]): Adam's steps, step size and batches (`refinement_steps`, `refinement_lr`,
            `batch_size`) are read.
        fold_backups (`Sequence[WeightBackup]`): The backups of Stage 2's folds (those of `layers`): the teacher is the
            snapshot's stack with them undone: the dense model as it was, not one that carries Stage 2's W'. The fits
            `compensate_each_round` made between Stage 1's removals stay in, as in the rest of Stage 2.
        progress_bar (`bool`, defaults to `True`): Show a progress bar.

    Returns:
        `dict[str, float]`: the held-out loss before (`"start"`) and after (`"refined"`), and the step kept.

    Raises:
        InvalidInputError: with fewer than `AUTO_NUM_FOLDS` sequences over all processes (no held-out fold).
    """
    model, adapter, num_steps, batch_size = dense.model, dense.adapter, config.refinement_steps, config.batch_size
    train, held_out, num_held_out, num_batch_rows = _folds(input_ids, first_sample, batch_size)
    indices, probabilities = dense_top_k(dense, input_ids, batch_size, fold_backups)
    device, hidden_size = input_device(model), adapter.get_text_config(model).hidden_size  # the residual stream's width
    teacher = _Teacher(model, input_ids, indices, probabilities, device)
    factors = [torch.eye(hidden_size, device=device, requires_grad=True) for _ in layers]
    hooks = [
        (adapter.get_mlp(layer), lambda module, args, output, factor=factor: _scaled(output, factor))
        for layer, factor in zip(layers, factors)
    ]
    optimizer = torch.optim.Adam(factors, lr=config.refinement_lr)
    generator = torch.Generator().manual_seed(0)
    with calibration_mode(model, grad=True, freeze_parameters=True), forward_hooks(hooks):
        start_loss = best_loss = teacher.held_out_loss(held_out, batch_size, num_held_out)
        best = [factor.detach().clone() for factor in factors]
        best_step = 0
        for step in logging.tqdm(
            range(1, num_steps + 1), desc="Refining W' (distillation)", leave=False, disable=not progress_bar
        ):
            rows = [train[i] for i in torch.randperm(len(train), generator=generator)[:batch_size].tolist()]
            _step(teacher, factors, optimizer, rows, num_batch_rows)
            if step % CHECK_EVERY == 0:
                loss = teacher.held_out_loss(held_out, batch_size, num_held_out)
                if loss < best_loss:
                    best_loss, best, best_step = loss, [factor.detach().clone() for factor in factors], step
    for layer, factor in zip(layers, best):
        apply_compensation(adapter, layer, factor.double().cpu())
    logger.info(f"Refinement: held-out distillation loss {start_loss:.6g} -> {best_loss:.6g} (step {best_step} of {num_steps})")
    return {"start": start_loss, "refined": best_loss, "step": best_step}


def _folds(input_ids: torch.LongTensor, first_sample: int, batch_size: int) -> tuple[list[int], list[int], int, int]:
    """This process's training and held-out rows (sequence j in fold j mod `AUTO_NUM_FOLDS`, the last fold held out),
    and over all processes the number of held-out sequences and of rows in a step's batches; refuses fewer than
    `AUTO_NUM_FOLDS` sequences over all processes."""
    folds = [(first_sample + i) % AUTO_NUM_FOLDS for i in range(input_ids.shape[0])]
    train = [i for i, fold in enumerate(folds) if fold != AUTO_NUM_FOLDS - 1]
    held_out = [i for i, fold in enumerate(folds) if fold == AUTO_NUM_FOLDS - 1]
    batch_rows = min(batch_size, len(train))  # the rows of this process's batch at every step (0 with no training share)
    # over all processes: sequences, held-out sequences, and rows of a step's batches
    counts = distributed.all_reduce_sum(torch.tensor([input_ids.shape[0], len(held_out), batch_rows], dtype=torch.float64))
    num_sequences, num_held_out, num_batch_rows = (int(count) for count in counts.tolist())
    _check_num_sequences(num_sequences)
    return train, held_out, num_held_out, num_batch_rows


@dataclass
class _Teacher:
    """The calibration sequences with the dense model's top-K targets on them, and the model's distillation loss.

    Args:
        model (`nn.Module`): The pruned model, its factors hooked in.
        input_ids (`torch.LongTensor`): This process's calibration sequences.
        indices (`torch.Tensor`), probabilities (`torch.Tensor`): The dense model's top-K targets ([`dense_top_k`]).
        device (`torch.device`): The model's input device.
    """

    model: nn.Module
    input_ids: torch.LongTensor
    indices: torch.Tensor
    probabilities: torch.Tensor
    device: torch.device

    def loss(self, rows: list[int]) -> torch.Tensor:
        """The distillation loss on the sequences `rows`, mean over positions."""
        return _distillation_loss(self.model, self.input_ids[rows].to(self.device), self.indices[rows], self.probabilities[rows])

    def held_out_loss(self, held_out: list[int], batch_size: int, num_held_out: int) -> float:
        """The mean loss over every process's held-out sequences (this process's `held_out` rows may be none)."""
        total = 0.0  # the sum over this process's held-out sequences of their loss (0 for none)
        with torch.no_grad():
            for start in range(0, len(held_out), batch_size):
                rows = held_out[start : start + batch_size]
                total += float(self.loss(rows)) * len(rows)
        return float(distributed.all_reduce_sum(torch.tensor(total, dtype=torch.float64)) / num_held_out)


def _step(
    teacher: _Teacher, factors: list[torch.Tensor], optimizer: torch.optim.Optimizer, rows: list[int], num_batch_rows: int
) -> None:
    """One Adam step on the factors, from the loss on this process's `rows` (maybe none); under `torch.distributed`
    every process takes the same step: that of the mean over all processes' batches."""
    optimizer.zero_grad(set_to_none=True)
    if rows:
        teacher.loss(rows).backward()
    if distributed.is_distributed():
        for factor in factors:
            local = factor.grad * len(rows) if factor.grad is not None else torch.zeros_like(factor)
            factor.grad = distributed.all_reduce_sum(local) / num_batch_rows
    optimizer.step()


def _scaled(output: object, factor: torch.Tensor) -> object:
    """The MLP's output with its last dimension multiplied by `factor` (a tuple's first element, for MoE blocks)."""
    if isinstance(output, tuple):
        return (output[0] @ factor.T.to(output[0].dtype), *output[1:])
    return output @ factor.T.to(output.dtype)
