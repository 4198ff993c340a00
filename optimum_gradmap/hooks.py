# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Deprecated: the hooks and batched passes are in [`optimum_gradmap.passes`]. This module goes in the next release."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from . import passes

_MOVED = ("layer_input", "layer_output", "forward_hooks", "forward_pre_hooks")


def run_batches(
    model: nn.Module, input_ids: torch.LongTensor, batch_size: int, description: str, progress_bar: bool
) -> Iterator[torch.LongTensor]:
    """Deprecated: use [`optimum_gradmap.passes.calibration_batches`] and call the model yourself."""
    warnings.warn(
        "`optimum_gradmap.hooks.run_batches` is deprecated: use `optimum_gradmap.passes.calibration_batches`.",
        FutureWarning,
        stacklevel=2,
    )
    with passes.calibration_batches(model, input_ids, batch_size, description, progress_bar) as batches:
        for batch in batches:
            model(input_ids=batch, use_cache=False)
            yield batch


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        warnings.warn(
            f"`optimum_gradmap.hooks.{name}` is deprecated: use `optimum_gradmap.passes.{name}`.", FutureWarning, stacklevel=2
        )
        return getattr(passes, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
