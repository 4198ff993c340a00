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
