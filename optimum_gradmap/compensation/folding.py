# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Folding W' into a kept layer's down projection(s) (Eq. 15), and the backup that undoes it."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..adapters import DecoderAdapter
from ..weights import WeightBackup, fold_into, is_offloaded_module, linear_map_tensors, materialized


def apply_compensation(adapter: DecoderAdapter, layer: nn.Module, matrix: torch.Tensor) -> None:
    """Folds W' into every down projection of `layer` (Eq. 15), where its weights live (offloaded
    weights are written back to CPU or the offload folder, see [`~optimum_gradmap.weights.materialized`]).
    Where each down projection's own hook offloads it, only the one being folded is brought into memory."""
    targets = adapter.get_down_projections(layer)
    own = all(
        isinstance(target, nn.Module) and (is_offloaded_module(target) or target.weight.device.type != "meta")
        for target in targets
    )
    if own:
        for target in targets:
            with materialized(target):
                fold_into(target, matrix)
        return
    with materialized(layer):  # 3-D expert weights, or a hook on the layer: all of it, the tensors read once loaded
        for target in adapter.get_down_projections(layer):
            fold_into(target, matrix)


def down_projection_backup(adapter: DecoderAdapter, layers: Sequence[nn.Module]) -> WeightBackup:
    """A [`WeightBackup`] of the down projections of `layers`: what Stage 2's fold changes."""
    return WeightBackup(
        layers, lambda layer: [tensor for target in adapter.get_down_projections(layer) for tensor in linear_map_tensors(target)]
    )
