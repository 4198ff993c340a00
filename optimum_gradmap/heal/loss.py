# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""The heal's loss (`heal_loss`) to the dense model's targets ([`~optimum_gradmap.distillation.teacher_targets`]), the
seams whose hidden states `kl_hidden_mse` matches, and the refusals of a loss the run cannot compute.

**KL.** [`~optimum_gradmap.objectives.top_k_kl`]: the forward KL over the teacher's top-K tokens and "any other token".

**Logit MSE** (`heal_loss="logit_mse"` or `"kl_logit_mse"`). The forward KL weighs each token by the teacher's
probability: the student's log-probabilities of the tokens the teacher finds unlikely (a multiple-choice question's
wrong answers) are barely constrained. [`logit_mse`] is the mean squared difference of the two models' centred
logits over the whole vocabulary, every token weighted alike (Kim et al., "Comparing Kullback-Leibler Divergence and
Mean Squared Error Loss in Knowledge Distillation", IJCAI 2021, Sec. 3: L_MSE = ||z_s - z_t||^2, there over classes).
The logits are centred (their mean over the vocabulary taken off) because a softmax ignores a shift. The teacher
keeps its head's input (`TeacherTargets.hidden`, bfloat16) instead of `V` logits: the pruned model's head is the
dense model's, so with `W_c` the head's weight less its mean row, the centred logit difference is `W_c (h_s - h_t)`
and its mean square `(h_s - h_t)^T G (h_s - h_t)` with `G = W_c^T W_c / V` ([`centred_logit_gram`], `d x d`,
computed once). These are the head's linear logits (before a soft-cap such as Gemma 2's).

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
from ..distillation import head_inputs, layer_outputs, the_head_input, the_layer_outputs
from ..objectives import TeacherTargets, top_k_kl
from .settings import PrunedLayout


def uses_kl(loss: str) -> bool:
    """Whether the heal loss `loss` (`GradMAPConfig.heal_loss`) has the top-K KL term."""
    return loss in ("kl", "kl_logit_mse", "kl_hidden_mse")


def uses_head_inputs(loss: str) -> bool:
    """Whether the heal loss `loss` has the logit-MSE term, which reads both models' head inputs."""
    return loss in ("logit_mse", "kl_logit_mse")


def uses_layer_states(loss: str) -> bool:
    """Whether the heal loss `loss` has the seams' hidden-state term, which reads both models' layer outputs."""
    return loss == "kl_hidden_mse"


def reads_hidden_states(loss: str) -> bool:
    """Whether the heal loss `loss` reads hidden states beside the logits (head inputs or layer outputs), which only a
    forward pass with the weights in memory collects (not a layer-streamed one)."""
    return uses_head_inputs(loss) or uses_layer_states(loss)


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


@torch.no_grad()
def centred_logit_gram(head_weight: torch.Tensor, rows_at_once: int = 8192) -> torch.Tensor:
    """`G = W_c^T W_c / V`, with `W_c` the head's weight (`V x d`) less its mean row: for head inputs `h` and `h'`,
    `(h - h')^T G (h - h')` is the mean squared difference of their centred logits (see the module docstring).
    Two passes of `rows_at_once` rows at a time in float32: the mean row, then the sum of the centred rows' outer
    products (a one-pass `sum_i w_i w_i^T - V m m^T` loses the small differences where the mean row is large).

    Args:
        head_weight (`torch.Tensor` of shape `(V, d)`): The head's weight.
        rows_at_once (`int`, defaults to 8192): Rows converted to float32 at once.

    Returns:
        `torch.Tensor` of shape `(d, d)`: float32, symmetric, on the weight's device.
    """
    vocab_size, width = head_weight.shape
    starts = range(0, vocab_size, rows_at_once)
    mean = sum(head_weight[start : start + rows_at_once].float().sum(0) for start in starts) / vocab_size
    gram = torch.zeros(width, width, dtype=torch.float32, device=head_weight.device)
    for start in starts:
        block = head_weight[start : start + rows_at_once].float() - mean
        gram += block.T @ block
    return gram / vocab_size


def logit_mse(hidden: torch.Tensor, teacher_hidden: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """The mean squared difference, over the vocabulary, of the student's and the teacher's centred logits, per
    position (see the module docstring).

    Args:
        hidden (`torch.Tensor` of shape `(..., d)`): The student's head input.
        teacher_hidden (`torch.Tensor` of shape `(..., d)`): The teacher's (`TeacherTargets.hidden`).
        gram (`torch.Tensor` of shape `(d, d)`): [`centred_logit_gram`] of the head's weight.

    Returns:
        `torch.Tensor` of shape `(...)`: float32, >= 0 up to rounding.
    """
    difference = hidden.float() - teacher_hidden.to(device=hidden.device, dtype=torch.float32)
    # the head's input may sit on another device than its weight (a model split across devices)
    return ((difference @ gram.to(difference.device)) * difference).sum(-1)


def heal_loss(
    loss: str,
    logits: torch.Tensor,
    head_input: torch.Tensor | None,
    targets: TeacherTargets,
    gram: torch.Tensor | None,
    layer_states: torch.Tensor | None = None,
) -> torch.Tensor:
    """The heal's `loss` (`GradMAPConfig.heal_loss`: `kl`, `logit_mse`, `kl_logit_mse` (their unweighted sum) or
    `kl_hidden_mse` (the KL plus the seams' distance weighted to equal it, see the module docstring)), the mean over
    a batch's predicting positions.

    Args:
        loss (`str`): Which.
        logits (`torch.Tensor` of shape `(N, T - 1, V)`): The student's logits at the positions of `targets`.
        head_input (`torch.Tensor` of shape `(N, T, d)`, *optional*): The student's head input over the whole
            sequences ([`~optimum_gradmap.distillation.head_inputs`]); needed for the logit MSE.
        targets ([`TeacherTargets`]): The teacher's, with `hidden` for the logit MSE.
        gram (`torch.Tensor` of shape `(d, d)`, *optional*): [`centred_logit_gram`]; needed for the logit MSE.
        layer_states (`torch.Tensor` of shape `(N, T, S, d)`, *optional*): The student's outputs of its seam layers over
            the whole sequences ([`~optimum_gradmap.distillation.the_layer_outputs`]); needed for the hidden-state
            MSE, with `targets.layer_states`.

    Returns:
        `torch.Tensor`: a float32 scalar.
    """
    total = top_k_kl(logits, targets).mean() if uses_kl(loss) else logits.new_zeros((), dtype=torch.float32)
    if uses_head_inputs(loss):
        total = total + logit_mse(head_input[:, :-1], targets.hidden, gram).mean()
    if uses_layer_states(loss):
        distance = hidden_state_mse(layer_states[:, :-1], targets.layer_states).mean()
        total = total + distance * (total.detach() / distance.detach().clamp_min(torch.finfo(torch.float32).tiny))
    return total


def distillation_loss(
    model: nn.Module,
    batch: torch.LongTensor,
    loss: str,
    targets: TeacherTargets,
    gram: torch.Tensor | None = None,
    layers: Sequence[nn.Module] = (),
    passes: Callable[[], AbstractContextManager[None]] = nullcontext,
) -> torch.Tensor:
    """The student's forward pass over `batch`, collecting what `loss` reads, and [`heal_loss`] on it.

    Args:
        model (`nn.Module`): The student (its weights in memory).
        batch (`torch.LongTensor` of shape `(N, T)`): The sequences, on its input device.
        loss (`str`): `GradMAPConfig.heal_loss`.
        targets ([`TeacherTargets`]): The teacher's on `batch`.
        gram (`torch.Tensor` of shape `(d, d)`, *optional*): [`centred_logit_gram`], for the logit MSE.
        layers (`Sequence[nn.Module]`, defaults to `()`): The student's seam layers, in the order they run, for the
            hidden-state MSE (the teacher's outputs of the same original layers in `targets.layer_states`).
        passes (`Callable`, defaults to `nullcontext`): The forward pass's context (autocast); the loss is computed
            outside it, in float32.

    Returns:
        `torch.Tensor`: a float32 scalar.
    """
    head = model.get_output_embeddings() if uses_head_inputs(loss) else None
    with passes(), head_inputs(head) as inputs, layer_outputs(layers if uses_layer_states(loss) else ()) as outputs:
        logits = model(input_ids=batch, use_cache=False).logits[:, :-1]
    head_input = the_head_input(inputs) if head is not None else None
    states = the_layer_outputs(outputs, len(layers)) if uses_layer_states(loss) else None
    return heal_loss(loss, logits, head_input, targets, gram, states)


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
