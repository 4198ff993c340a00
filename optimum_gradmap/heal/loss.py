# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""The heal's loss (`heal_loss`) to the dense model's targets ([`~optimum_gradmap.distillation.teacher_targets`]), the
seams whose hidden states `kl_hidden_mse` matches, and the refusals of a loss the run cannot compute.

**KL.** [`~optimum_gradmap.objectives.top_k_kl`]: the forward KL over the teacher's top-K tokens and "any other token".

**Hidden states at the seams** (`heal_loss="kl_hidden_mse"`). The KL plus, at every kept layer that directly follows
a run of removed ones (a "seam", where the pruned model's residual stream first lacks what the removed layers added),
the distance of the student's output of that layer to the teacher's output of the same original layer: Minitron's
intermediate-state loss (Muralidharan et al., "Compact Language Models via Pruning and Knowledge Distillation",
NeurIPS 2024, Sec. 3.2: L = L_logits + alpha L_is, with L_is a sum over chosen layers of a distance between the two
models' hidden states), as Kovalev and Tikhomirov use for layer-pruned Qwen2.5 (arXiv 2511.05085: the KL plus the
hidden states' MSE). Two choices of ours:

- The distance, per position and seam, is `||h_s - h_t||^2 / (||h_s||^2 + ||h_t||^2)` ([`hidden_state_mse`], in
  [0, 2]; `1 - cos` where the norms are equal), averaged over the seams. A plain MSE is decided by the few positions
  whose states are orders of magnitude larger than the rest (attention sinks: on SmolLM2-135M the first token's norm
  is about 23,500 against 150-630 elsewhere); one relative to the teacher's norm alone explodes where the pruned model
  makes a sink the dense model does not (a ratio of 1,500 measured at one position).
- alpha is the ratio of the batch's KL to its seam distance, taken without gradient: the two terms weigh the same at
  every step, whatever the scales of the two.

The teacher keeps those layers' outputs (`TeacherTargets.layer_states`, bfloat16).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn

from ..adapters import DecoderAdapter
from ..distillation import layer_outputs, the_layer_outputs
from ..objectives import TeacherTargets, top_k_kl
from .settings import PrunedLayout


def uses_kl(loss: str) -> bool:
    """Whether the heal loss `loss` (`GradMAPConfig.heal_loss`) has the top-K KL term."""
    return loss in ("kl", "kl_hidden_mse")


def uses_layer_states(loss: str) -> bool:
    """Whether the heal loss `loss` has the seams' hidden-state term, which reads both models' layer outputs."""
    return loss == "kl_hidden_mse"


def reads_hidden_states(loss: str) -> bool:
    """Whether the heal loss `loss` reads hidden states beside the logits (layer outputs), which only a forward pass
    with the weights in memory collects (not a layer-streamed one)."""
    return uses_layer_states(loss)


def hidden_state_mse(states: torch.Tensor, teacher_states: torch.Tensor) -> torch.Tensor:
    """The squared distance of the student's layer outputs to the teacher's, relative to the sum of their squared
    norms, averaged over the layers, per position (see the module docstring).

    Args:
        states (`torch.Tensor` of shape `(..., S, d)`): The student's outputs of its seam layers.
        teacher_states (`torch.Tensor` of shape `(..., S, d)`): The teacher's outputs of the same original layers
            (`TeacherTargets.layer_states`).

    Returns:
        `torch.Tensor` of shape `(...)`: float32, in [0, 2].
    """
    teacher, student = teacher_states.to(device=states.device, dtype=torch.float32), states.float()
    squared_norms = (student.square().sum(-1) + teacher.square().sum(-1)).clamp_min(torch.finfo(torch.float32).tiny)
    return ((student - teacher).square().sum(-1) / squared_norms).mean(-1)


def heal_loss(
    loss: str,
    logits: torch.Tensor,
    targets: TeacherTargets,
    layer_states: torch.Tensor | None = None,
) -> torch.Tensor:
    """The heal's `loss` (`GradMAPConfig.heal_loss`: `kl`, or `kl_hidden_mse`, the KL plus the seams' distance
    weighted to equal it, see the module docstring), the mean over a batch's predicting positions.

    Args:
        loss (`str`): Which.
        logits (`torch.Tensor` of shape `(N, T - 1, V)`): The student's logits at the positions of `targets`.
        targets ([`TeacherTargets`]): The teacher's.
        layer_states (`torch.Tensor` of shape `(N, T, S, d)`, *optional*): The student's outputs of its seam layers over
            the whole sequences ([`~optimum_gradmap.distillation.the_layer_outputs`]); needed for the hidden-state
            MSE, with `targets.layer_states`.

    Returns:
        `torch.Tensor`: a float32 scalar.
    """
    total = top_k_kl(logits, targets).mean() if uses_kl(loss) else logits.new_zeros((), dtype=torch.float32)
    if uses_layer_states(loss):
        distance = hidden_state_mse(layer_states[:, :-1], targets.layer_states).mean()
        total = total + distance * (total.detach() / distance.detach().clamp_min(torch.finfo(torch.float32).tiny))
    return total


def distillation_loss(
    model: nn.Module,
    batch: torch.LongTensor,
    loss: str,
    targets: TeacherTargets,
    layers: Sequence[nn.Module] = (),
    passes: Callable[[], AbstractContextManager[None]] = nullcontext,
) -> torch.Tensor:
    """The student's forward pass over `batch`, collecting what `loss` reads, and [`heal_loss`] on it.

    Args:
        model (`nn.Module`): The student (its weights in memory).
        batch (`torch.LongTensor` of shape `(N, T)`): The sequences, on its input device.
        loss (`str`): `GradMAPConfig.heal_loss`.
        targets ([`TeacherTargets`]): The teacher's on `batch`.
        layers (`Sequence[nn.Module]`, defaults to `()`): The student's seam layers, in the order they run, for the
            hidden-state MSE (the teacher's outputs of the same original layers in `targets.layer_states`).
        passes (`Callable`, defaults to `nullcontext`): The forward pass's context (autocast); the loss is computed
            outside it, in float32.

    Returns:
        `torch.Tensor`: a float32 scalar.
    """
    with passes(), layer_outputs(layers if uses_layer_states(loss) else ()) as outputs:
        logits = model(input_ids=batch, use_cache=False).logits[:, :-1]
    states = the_layer_outputs(outputs, len(layers)) if uses_layer_states(loss) else None
    return heal_loss(loss, logits, targets, states)


def seam_layers(model: nn.Module, adapter: DecoderAdapter, loss: str, layout: PrunedLayout) -> list[nn.Module]:
    """The pruned model's seam layers ([`PrunedLayout.seams`]) where `loss` matches their outputs, none otherwise."""
    if not uses_layer_states(loss):
        return []
    return adapter.layers_at(model, layout.seams())


def seam_indices(loss: str, layout: PrunedLayout | None) -> list[int]:
    """The original indices of the seam layers ([`PrunedLayout.seams`]), whose outputs the dense model keeps where
    `loss` matches them; none otherwise, or without a layout."""
    if not uses_layer_states(loss) or layout is None:
        return []
    return [layout.kept[position] for position in layout.seams()]


def no_seam_refusal(kept: Sequence[int]) -> str:
    """The refusal of `heal_loss="kl_hidden_mse"` where the kept layers leave no seam."""
    return (
        f"heal_loss='kl_hidden_mse' matches the hidden states after each kept layer that directly follows a removed "
        f"run, and the kept layers {list(kept)} leave none (only the last layers are removed): heal with "
        "heal_loss='kl', which already compares the last hidden states through the logits."
    )


def streamed_loss_refusal(loss: str) -> str:
    """The refusal of a loss that reads hidden states where the heal runs layer-streamed."""
    return (
        f"heal_loss={loss!r} compares the two models' hidden states, which the layer-streamed heal (offloaded weights, or "
        "execution='layer_streamed') does not keep: heal with heal_loss='kl', or load the model on devices that hold it "
        "with execution='in_memory'."
    )
