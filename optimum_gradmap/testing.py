# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Reference computations for tests and benchmarks, straight from the paper's definitions: slow, and
never used by the library itself, which the tests and benchmarks check against them."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def naive_layer_scores(model: nn.Module, layers: Sequence[nn.Module], input_ids: torch.LongTensor) -> torch.Tensor:
    """GradMAP's Stage 1 score (Eq. 5) by its definition: one forward and one backward pass per
    calibration sample; for each layer, the sum of the squared norms of every parameter's `.grad`;
    averaged over samples. Leaves `.grad` empty and the model in the mode it came in.

    Returns:
        `torch.Tensor` of shape `(len(layers),)`, float64.
    """
    was_training = model.training
    model.eval()
    totals = torch.zeros(len(layers), dtype=torch.float64)
    for sample in input_ids:
        model.zero_grad(set_to_none=True)
        batch = sample.unsqueeze(0).to(model.get_input_embeddings().weight.device)
        model(batch, labels=batch, use_cache=False).loss.backward()
        for position, layer in enumerate(layers):
            totals[position] += sum(p.grad.double().pow(2).sum().item() for p in layer.parameters() if p.grad is not None)
    model.zero_grad(set_to_none=True)
    model.train(was_training)
    return totals / input_ids.shape[0]


def reference_removal_losses(
    model: nn.Module, input_ids: torch.LongTensor, batch_size: int, positions: Sequence[int]
) -> dict[int, float]:
    """SLEB's criterion at the cost SLEB's own code pays: for each layer at `positions` (of the model as it is),
    the calibration loss of the model without it, by one full forward pass over every calibration sequence
    (the layer taken out of the stack for the pass). [`optimum_gradmap.importance.metrics.removal_losses`]
    computes the same numbers starting each candidate from its recorded input.

    Returns:
        `dict[int, float]`: Position -> the mean next-token cross-entropy over all calibration tokens without it.
    """
    from .objectives import mean_next_token_loss
    from .surgery import snapshot

    stack = snapshot(model)
    kept = list(range(stack.num_layers))
    losses = {}
    for position in positions:
        with stack.temporarily([index for index in kept if index != position]):
            losses[position] = mean_next_token_loss(model, input_ids, batch_size, progress_bar=False)
    return losses


def reference_next_token_choice(data: object, config: object) -> object:
    """The next-token selection of lambda ([`optimum_gradmap.compensation.learn_by_next_token_loss`]) for a
    [`~optimum_gradmap.compensation.FitData`] by its definition, at the cost it had before the held-out inputs were
    recorded: every candidate W' (each strength of the grid, fitted on the three training folds) folded into the layer
    in turn and scored by a pass of the whole model over the held-out sequences; W' = I scored the same way. One
    process.

    Returns:
        [`~optimum_gradmap.compensation.RidgeChoice`]: The chosen strength (`None`: the layer is left alone), each
        strength's held-out loss and the identity's.
    """
    from dataclasses import replace

    from .compensation import (
        AUTO_NUM_FOLDS,
        AUTO_RIDGE_GRID,
        RidgeChoice,
        apply_compensation,
        compensation_statistics,
        down_projection_backup,
        held_out_next_token_loss,
        relative_ridge,
        resolve_selection,
        ridge_solutions,
    )
    from .compensation.lambda_search import LOSS_TIE_TOLERANCE

    model, adapter, layer, input_ids = data.model, data.adapter, data.layer, data.input_ids
    config = resolve_selection(replace(config, compensation_selection="next_token_loss"), adapter)
    folds = compensation_statistics(
        data, config.batch_size, progress_bar=False, num_folds=AUTO_NUM_FOLDS, outliers=config.outlier_tokens
    )
    train = sum(folds[1:-1], folds[0])
    held_out = input_ids[AUTO_NUM_FOLDS - 1 :: AUTO_NUM_FOLDS]
    candidates = ridge_solutions(train, [relative_ridge(train, alpha) for alpha in AUTO_RIDGE_GRID], config.compensation_form)
    backup = down_projection_backup(adapter, [layer])
    identity_loss = held_out_next_token_loss(model, held_out, config.batch_size, progress_bar=False)
    losses = {}
    for alpha, matrix in zip(AUTO_RIDGE_GRID, candidates):
        apply_compensation(adapter, layer, matrix)
        try:
            losses[alpha] = held_out_next_token_loss(model, held_out, config.batch_size, progress_bar=False)
        finally:
            backup.restore()
    lowest = min(losses.values())
    best = max(alpha for alpha in losses if losses[alpha] <= lowest + LOSS_TIE_TOLERANCE * abs(lowest))
    return RidgeChoice(best if losses[best] < identity_loss else None, losses, identity_loss)
