# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Which kept layers Stage 2 fits, and to which dense hidden state."""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import InvalidInputError


def check_num_compensated_layers(
    num_compensated_layers: int, num_kept_layers: int, compensation_target: str = "max_drift"
) -> None:
    """Refuses a Z (`num_compensated_layers`) larger than the number of layers that remain after pruning.

    Only `compensation_target="max_drift"` reads Z: `"span_end"` fits one layer per run of removed layers
    whatever Z is, so nothing is checked for it.

    Args:
        num_compensated_layers (`int`): Z, how many kept layers Stage 2 fits.
        num_kept_layers (`int`): the decoder layers that remain after pruning.
        compensation_target (`str`, defaults to `"max_drift"`): the configuration's `compensation_target`.

    Raises:
        `InvalidInputError` (a `ValueError`): Z exceeds `num_kept_layers` under `"max_drift"`.
    """
    if compensation_target == "max_drift" and num_compensated_layers > num_kept_layers:
        raise InvalidInputError(
            f"num_compensated_layers={num_compensated_layers} exceeds the {num_kept_layers} layers that remain after pruning."
        )


def targets_need_drift(target: str) -> bool:
    """Whether [`compensation_targets`] reads the drift for `target` (`"max_drift"`), or only the kept layers."""
    return target == "max_drift"


def compensation_targets(
    kept: Sequence[int], drift: dict[int, float], num_layers: int, target: str, num_compensated_layers: int
) -> list[tuple[int, int]]:
    """Which kept layers Stage 2 fits, and to the dense output of which layer, in forward order.

    - `"max_drift"` (the paper, Eq. 11): the `num_compensated_layers` kept layers with the largest
      mean drift, each fitted to its own dense output. A layer that did not drift is never a target.
    - `"span_end"` (the placement of ReplaceMe and LinearPatch): for each run of consecutive removed
      layers, the kept layer just before it, fitted to the dense hidden state at the end of the run (the
      output of its last removed layer), which is what the layer after the run received in the dense
      model. Covers removed last layers, where nothing drifts. A run that starts at layer 0 has no
      layer before it and is not compensated.

    Returns:
        `list[tuple[int, int]]`: `(layer to fit, dense layer whose output is its target)`, dense indices.
    """
    if target == "max_drift":
        ranked = sorted((index for index in kept if drift[index] > 0), key=lambda index: -drift[index])
        return [(index, index) for index in sorted(ranked[:num_compensated_layers])]
    kept_set = set(kept)
    targets = []
    for index in range(1, num_layers):
        if index not in kept_set and index - 1 in kept_set:  # a run of removed layers starts here
            end = index
            while end + 1 < num_layers and end + 1 not in kept_set:
                end += 1
            targets.append((index - 1, end))
    return targets
