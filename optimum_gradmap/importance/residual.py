# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Scores from what removing a layer does to the residual stream: its contribution f_i and the loss
gradient at its output.

A decoder layer adds f_i to the residual stream, H_i = H_{i-1} + f_i(H_{i-1}). Removing it takes f_i
away. With g_i = dL/dH_i the gradient of a sample's loss at the layer's output, the paper bounds the
change of the loss (GradMAP, Eq. 9-11, before it drops the factor M_i = max ||f_i||), here token by token:

    |dL| <= sum_t ||g_{i,t}|| ||f_{i,t}||

It needs, per sample, only f_i (from the forward pass) and g_i (from a backward pass that computes
activation gradients only): [`residual_branch_scores`] computes such a per-sample statistic for
every layer in one batched forward and backward pass, nothing per parameter. The per-sample loss is
the mean next-token cross-entropy of the sample, as in GradMAP's score.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch
from torch import nn

from ..adapters import DecoderAdapter
from ..errors import InvalidInputError
from ..passes import forward_hooks, forward_pre_hooks, layer_input, layer_output
from .gradient import loss_gradient_passes

# (g, f), each (batch, tokens, hidden) -> one value per sample, (batch,)
SampleStatistic = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def token_norm_product(gradient: torch.Tensor, contribution: torch.Tensor) -> torch.Tensor:
    """sum over tokens of ||g_t|| ||f_t|| per sample (the bound applied token by token)."""
    return (gradient.norm(dim=-1) * contribution.norm(dim=-1)).sum(dim=1)


class _ResidualBranchCollector:
    """Hooks that keep each layer's contribution f = output - input from the forward pass and turn
    it, with the gradient at the layer's output in the backward pass, into per-sample statistics."""

    def __init__(self, layers: Sequence[nn.Module], statistic: SampleStatistic):
        self.layers = list(layers)
        self.statistic = statistic
        self.totals: list[torch.Tensor | None] = [None] * len(self.layers)
        self._inputs: dict[int, torch.Tensor] = {}
        self.layers_seen: set[int] = set()

    def hooks(self) -> tuple[list, list]:
        pre_hooks = [(layer, partial(self._remember_input, position)) for position, layer in enumerate(self.layers)]
        hooks = [(layer, partial(self._watch_output, position)) for position, layer in enumerate(self.layers)]
        return pre_hooks, hooks

    def _remember_input(self, position: int, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._inputs[position] = layer_input(args, kwargs).detach()

    def _watch_output(self, position: int, module: nn.Module, args: tuple, output: object) -> None:
        hidden = layer_output(output)
        layer_input_states = self._inputs.pop(position)
        if not hidden.requires_grad:  # a pass without gradients (the check of the head split): nothing to score
            return
        self.layers_seen.add(position)
        contribution = (hidden.detach() - layer_input_states).float()
        hidden.register_hook(partial(self._accumulate, position, contribution))

    def _accumulate(self, position: int, contribution: torch.Tensor, gradient: torch.Tensor) -> None:
        with torch.no_grad():
            values = self.statistic(gradient.float().reshape(contribution.shape), contribution)
        total = values.double().sum(dim=0)  # on the device: no host synchronisation in the backward pass
        self.totals[position] = total if self.totals[position] is None else self.totals[position] + total


def residual_branch_scores(
    model: nn.Module,
    adapter: DecoderAdapter,
    layers: Sequence[nn.Module],
    input_ids: torch.LongTensor,
    batch_size: int,
    statistic: SampleStatistic,
    progress_bar: bool = True,
    description: str = "Scoring layers",
) -> torch.Tensor:
    """The mean over calibration samples of `statistic(g_i, f_i)` for every layer in `layers`.

    Args:
        model (`nn.Module`): A causal LM whose decoder stack contains `layers`.
        adapter (`DecoderAdapter`): Its adapter.
        layers (`Sequence[nn.Module]`): The decoder layers to score.
        input_ids (`torch.LongTensor` of shape `(num_samples, seq_len)`): Calibration sequences.
        batch_size (`int`): Sequences per pass.
        statistic (`Callable`): Maps the gradient at a layer's output and its contribution, each
            `(batch, tokens, hidden)` in float32, to one value per sample, `(batch,)`, or to several,
            `(batch, num_statistics)`: then every statistic comes from the same single pass.
        progress_bar (`bool`), description (`str`): The progress bar.

    Returns:
        `torch.Tensor` of shape `(len(layers),)`, or `(len(layers), num_statistics)`, float64.
    """
    collector = _ResidualBranchCollector(layers, statistic)
    pre_hooks, hooks = collector.hooks()
    with forward_pre_hooks(pre_hooks), forward_hooks(hooks):
        loss_gradient_passes(model, adapter, input_ids, batch_size, description, progress_bar)
    if len(collector.layers_seen) != len(collector.layers):
        missing = sorted(set(range(len(collector.layers))) - collector.layers_seen)
        raise InvalidInputError(f"Layers at positions {missing} of `layers` did not run in the model's forward pass.")
    return torch.stack([total.cpu() for total in collector.totals]) / input_ids.shape[0]
