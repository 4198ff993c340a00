# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Compensation between Stage 1 removals (`compensate_each_round`, Prune&Comp's schedule): after each removal,
the kept layer before the run the removed layer belongs to is fitted to the run's dense end."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import distributed
from ..surgery import LayerSnapshot
from ..weights import WeightBackup
from .activations import FitData, record_layer_outputs
from .fit import fit_and_fold
from .folding import down_projection_backup
from .next_token import resolve_selection
from .settings import Stage2Settings
from .targets import compensation_targets


@dataclass
class RunCompensation:
    """One compensation made during Stage 1, after a removal (`compensate_each_round`).

    Args:
        layer (`int`): The kept layer fitted (dense index).
        target (`int`): The dense layer whose output it was fitted to (the end of the run of removed layers).
        reg_lambda (`float`, *optional*): The lambda its fit used; `None` when it was left alone.
        backup (`WeightBackup`): Its down projection(s) before the fold.
    """

    layer: int
    target: int
    reg_lambda: float | None
    backup: WeightBackup = field(repr=False, compare=False)


def compensate_run(
    dense: LayerSnapshot,
    calibration_ids: torch.LongTensor,
    config: Stage2Settings,
    removed_layer: int,
    progress_bar: bool = True,
) -> RunCompensation | None:
    """Compensation between removals (as Prune&Comp does): after `removed_layer` went, fits the kept
    layer just before the run of removed layers it belongs to, to the dense hidden state at the end of
    that run, and folds it, so that the next Stage 1 round scores the repaired model.

    If the fit fails, its down projection(s) are put back as they were before the error propagates.

    Returns:
        [`RunCompensation`], or `None` when the run starts at layer 0 (no layer before it).
    """
    model, adapter = dense.model, dense.adapter
    adapter.check_supported(model, compensation=True)
    config = resolve_selection(config, adapter)
    runs = compensation_targets(dense.kept_layers(), {}, dense.num_layers, "span_end", 0)
    found = [(index, end) for index, end in runs if index < removed_layer <= end]
    if not found:
        return None
    ((index, end),) = found
    layer = dense.layers[index]
    backup = down_projection_backup(adapter, [layer])
    shared_ids, first_sample = distributed.shard(calibration_ids)  # all of them with one process
    try:
        with dense.temporarily(range(dense.num_layers)):
            (original,) = record_layer_outputs(model, [dense.layers[end]], shared_ids, config.batch_size, progress_bar)
        fit = fit_and_fold(FitData(model, adapter, layer, original, shared_ids, first_sample), config, progress_bar)
    except BaseException:  # a fit that failed mid-fold (one down projection of several, or one of its tensors)
        backup.restore()
        raise
    return RunCompensation(index, end, None if fit.skipped else fit.reg_lambda, backup)
