# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Deprecated: the hooks and batched passes are in [`optimum_gradmap.passes`]. This module goes in the next release."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from transformers.utils import logging

from . import passes
from ._deprecation import deprecated_module_attributes, warn_deprecated

__getattr__ = deprecated_module_attributes(
    __name__,
    moved={name: "optimum_gradmap.passes" for name in ("layer_input", "layer_output", "forward_hooks", "forward_pre_hooks")},
)


def run_batches(
    model: nn.Module, input_ids: torch.LongTensor, batch_size: int, description: str, progress_bar: bool
) -> Iterator[torch.LongTensor]:
    """Deprecated: use [`optimum_gradmap.passes.calibration_batches`] and call the model yourself. Runs
    `model` (no cache) batch by batch in the caller's training and gradient modes, yielding each batch
    (as given, not moved) after its forward pass."""
    warn_deprecated("optimum_gradmap.hooks.run_batches", "`optimum_gradmap.passes.calibration_batches`")
    device = passes.input_device(model)
    starts = range(0, input_ids.shape[0], batch_size)
    for start in logging.tqdm(starts, desc=description, leave=False, disable=not progress_bar):
        batch = input_ids[start : start + batch_size]
        model(input_ids=batch.to(device), use_cache=False)
        yield batch
