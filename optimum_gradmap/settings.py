# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""What the steps' settings share: [`StepSettings`], the base of each step's frozen settings (a slice of
[`~optimum_gradmap.GradMAPConfig`] under the same names), and [`LayerAmount`], how many and which layers Stage 1
removes, read the same way from the config and from Stage 1's settings. A leaf: it imports only the errors and the
metric registry."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from .errors import InvalidInputError
from .metric_registry import ImportanceMetric


class LayerAmount:
    """How many and which layers Stage 1 removes, read from the fields `pruning_ratio`, `num_layers_to_prune`,
    `layers_to_prune`, `max_loss_increase`, `target_num_parameters`, `protected_layers` and `importance`: shared by
    [`~optimum_gradmap.GradMAPConfig`] and Stage 1's own settings ([`~optimum_gradmap.importance.Stage1Settings`])."""

    def resolved_protected_layers(self, num_layers: int) -> set[int] | None:
        """`protected_layers` as dense-model indices for a model with `num_layers` layers (negative
        ones counted from the end), or `None` for the metric's own default.

        Args:
            num_layers (`int`): The dense model's number of decoder layers.

        Returns:
            `set[int]` or `None`.

        Raises:
            ValueError: for an index outside the model's layers.
        """
        if self.protected_layers is None:
            return None
        outside = [index for index in self.protected_layers if not -num_layers <= index < num_layers]
        if outside:
            raise InvalidInputError(
                f"protected_layers={self.protected_layers} names layers the model does not have: it has {num_layers} "
                f"decoder layers, indexed 0 to {num_layers - 1} (or -{num_layers} to -1)."
            )
        return {index % num_layers for index in self.protected_layers}

    @property
    def has_budget(self) -> bool:
        """Whether Stage 1 stops at a budget or a size target (`max_loss_increase`, `target_num_parameters`), K
        being only the most it may remove."""
        return self.max_loss_increase is not None or self.target_num_parameters is not None

    def num_layers_to_remove(self, num_layers: int) -> int:
        """Returns K for a model with `num_layers` decoder layers (ratio rounded half up); with a budget, the
        most that may be removed (all but one layer when no K is given).

        Args:
            num_layers (`int`): The dense model's number of decoder layers.

        Returns:
            `int`: K.
        """
        if self.num_layers_to_prune is not None:
            return self.num_layers_to_prune
        if self.layers_to_prune is not None:
            return len(self.layers_to_prune)
        if self.pruning_ratio is None:
            return num_layers - 1
        return int(math.floor(self.pruning_ratio * num_layers + 0.5))

    @property
    def importance_name(self) -> str:
        """The name of the importance metric, whether `importance` is a name or an instance."""
        return self.importance.name if isinstance(self.importance, ImportanceMetric) else self.importance


@dataclass(frozen=True)
class StepSettings:
    """The frozen settings of one step of the pipeline: the fields of [`~optimum_gradmap.GradMAPConfig`] it reads,
    under the same names. Subclasses list them as dataclass fields; [`from_config`] takes their values from a config."""

    @classmethod
    def from_config(cls, config: Any) -> Any:
        """The step's settings as `config` gives them."""
        return cls(**{item.name: getattr(config, item.name) for item in fields(cls)})
