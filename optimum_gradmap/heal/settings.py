# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""What the heal is given: its settings ([`HealSettings`], the `GradMAPConfig` fields it reads, under the same names),
the layers of the pruned model it heals ([`PrunedLayout`]), and, before the pruning runs, what is known of it
([`PlannedPruning`])."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Literal, get_args

from ..configuration import ExecutionMode, HealLoss, HealTrainable
from ..settings import StepSettings

HEAL_LOSS_CHOICES: tuple[str, ...] = get_args(HealLoss)
HEAL_TRAINABLE_CHOICES: tuple[str, ...] = get_args(HealTrainable)
# The learning rate of each choice of `heal_trainable` when `heal_lr` is None. LoRA and the norms: the better of two
# rates measured on SmolLM2-135M 25% with 40,960 tokens (held-out Wikipedia KL from the dense model, lower is better:
# LoRA 0.869 at 1e-3 against 0.980 at 2e-4; norms 0.917 at 3e-3 against 0.958 at 1e-3; docs/benchmarks/heal.md).
DEFAULT_LEARNING_RATES: dict[str, float] = {
    "lora": 1e-3,
    "norms": 3e-3,
    "all": 3e-5,
}


@dataclass(frozen=True)
class HealSettings(StepSettings):
    """The heal's settings: the `heal_*` fields of [`~optimum_gradmap.GradMAPConfig`] and the run's fields it reads
    (the seed, the execution mode, the calibration text that prompts the dense model's own text), under the same names
    (their meaning is told there), frozen; `HealSettings.from_config(config)` takes them from a config. A later heal
    ([`~optimum_gradmap.GradMAPPruner.heal`]) may change the `heal_*` ones ([`HEAL_SETTINGS`])."""

    heal_tokens: int | Literal["auto"]
    heal_dataset: str
    heal_temperature: float
    heal_trainable: HealTrainable
    heal_loss: HealLoss
    heal_lr: float | None
    heal_batch_size: int
    heal_seq_len: int
    heal_lora_rank: int
    heal_validation_sequences: int
    heal_check_every: int
    heal_autocast: bool
    seed: int
    execution: ExecutionMode
    dataset: str
    text_column: str
    seq_len: int

    @property
    def learning_rate(self) -> float:
        """AdamW's peak rate: `heal_lr`, else `DEFAULT_LEARNING_RATES[heal_trainable]`."""
        return self.heal_lr if self.heal_lr is not None else DEFAULT_LEARNING_RATES[self.heal_trainable]


# The GradMAPConfig fields a later heal (`GradMAPPruner.heal`, the `heal` command) may override.
HEAL_SETTINGS: tuple[str, ...] = tuple(item.name for item in fields(HealSettings) if item.name.startswith("heal_"))


@dataclass(frozen=True)
class PrunedLayout:
    """The layers of a pruned model, by their indices in the dense model.

    Args:
        kept (`Sequence[int]`): The kept layers, in order.
        num_layers (`int`): The dense model's number of layers.
        compensated (`Sequence[int]`, defaults to `()`): The kept layers Stage 2 compensated.
    """

    kept: Sequence[int]
    num_layers: int
    compensated: Sequence[int] = ()

    @classmethod
    def unpruned(cls, num_layers: int) -> PrunedLayout:
        """Every layer of a model of `num_layers` kept, none compensated."""
        return cls(tuple(range(num_layers)), num_layers)

    @classmethod
    def without(cls, removed: Sequence[int], num_layers: int) -> PrunedLayout:
        """The layers a model of `num_layers` keeps once `removed` are removed, none compensated."""
        removed = set(removed)
        return cls(tuple(index for index in range(num_layers) if index not in removed), num_layers)

    def seams(self) -> list[int]:
        """The positions, among the kept layers, of those directly after a run of removed ones (whose outputs
        `heal_loss="kl_hidden_mse"` matches to the dense model's outputs of the same original layers)."""
        kept = set(self.kept)
        return [position for position, index in enumerate(self.kept) if index > 0 and index - 1 not in kept]


@dataclass(frozen=True)
class PlannedPruning:
    """What the pruning before a heal will do, as far as it is known before it runs: whether Stage 2 runs, and the
    layers given to remove (`None`: Stage 1 chooses them).

    Args:
        compensation (`bool`): Stage 2 runs (`GradMAPConfig.compensation`).
        layers_to_prune (`Sequence[int]`, *optional*): `GradMAPConfig.layers_to_prune`.
    """

    compensation: bool
    layers_to_prune: Sequence[int] | None = None
