# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""What the heal's loss compares (`heal_loss`): the seams whose hidden states `kl_hidden_mse` matches, and the refusals
of a loss the run cannot compute."""

from __future__ import annotations

from collections.abc import Sequence
from typing import get_args

from torch import nn

from ..adapters import DecoderAdapter
from ..configuration import HealLoss
from ..distillation import uses_layer_states

HEAL_LOSS_CHOICES: tuple[str, ...] = get_args(HealLoss)


def _seam_layers(model: nn.Module, adapter: DecoderAdapter, loss: str, kept: Sequence[int]) -> list[nn.Module]:
    """The pruned model's seam layers ([`_seams`]) where `loss` matches their outputs, none otherwise."""
    if not uses_layer_states(loss):
        return []
    return adapter.layers_at(model, _seams(kept))


def _seam_indices(loss: str, kept: Sequence[int] | None) -> list[int]:
    """The original indices of the seam layers ([`_seams`]), whose outputs the dense model keeps where `loss` matches
    them; none otherwise, or without `kept`."""
    if not uses_layer_states(loss) or kept is None:
        return []
    return [kept[position] for position in _seams(kept)]


def _seams(kept: Sequence[int]) -> list[int]:
    """The positions, among the kept layers, of those directly after a run of removed ones (whose outputs
    `heal_loss="kl_hidden_mse"` matches to the dense model's outputs of the same original layers)."""
    kept_set = set(kept)
    return [position for position, index in enumerate(kept) if index > 0 and index - 1 not in kept_set]


def _no_seam_refusal(kept: Sequence[int]) -> str:
    return (
        f"heal_loss='kl_hidden_mse' matches the hidden states after each kept layer that directly follows a removed "
        f"run, and the kept layers {list(kept)} leave none (only the last layers are removed): heal with "
        "heal_loss='kl', which already compares the last hidden states through the logits."
    )


def _streamed_loss_refusal(loss: str) -> str:
    return (
        f"heal_loss={loss!r} compares the two models' hidden states, which the layer-streamed heal (offloaded weights, or "
        "execution='layer_streamed') does not keep: heal with heal_loss='kl', or load the model on devices that hold it "
        "with execution='in_memory'."
    )
