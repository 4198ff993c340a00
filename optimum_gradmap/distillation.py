# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""The dense model's next-token distribution kept as a distillation target, and the heal's losses to it: what Stage 2's
refinement (`refinement_steps`, [`~optimum_gradmap.compensation.refinement`]) and the heal stage
([`optimum_gradmap.heal`]) distil from.

**Targets.** The teacher runs once over the sequences and keeps, at every position but the last, its `TOP_K` most
likely next tokens' log-probabilities and the log of the probability left to all other tokens ([`teacher_targets`];
LinearPatch's "offline" teacher, Chen et al., NeurIPS 2025, Sec. 3.3): the student's training then needs neither the
teacher's weights nor its full-vocabulary distribution.

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

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
from torch import nn
from transformers.utils import logging

from .errors import InvalidInputError
from .objectives import TeacherTargets, chunked_top_k, top_k_kl, top_k_log_probs
from .passes import calibration_mode, input_device
from .vocabulary import vocabulary_head

# The teacher's most likely next tokens kept at each position (LinearPatch keeps 64 as well).
TOP_K = 64


@torch.no_grad()
def teacher_targets(
    teacher: nn.Module,
    input_ids: torch.LongTensor,
    batch_size: int,
    progress_bar: bool = True,
    autocast: bool = False,
    keep_hidden: bool = False,
    layers: Sequence[nn.Module] = (),
) -> TeacherTargets:
    """Runs `teacher` over `input_ids` and keeps its top-`TOP_K` next-token log-probabilities and the rest's.

    Args:
        teacher (`nn.Module`): The dense causal LM.
        input_ids (`torch.LongTensor` of shape `(N, T)`): The sequences.
        batch_size (`int`): Sequences per forward pass.
        progress_bar (`bool`, defaults to `True`): Show a progress bar.
        autocast (`bool`, defaults to `False`): Run the teacher under bfloat16 autocast (the log-softmax stays in
            float32).
        keep_hidden (`bool`, defaults to `False`): Keep its head's input too (`TeacherTargets.hidden`, for
            [`logit_mse`]).
        layers (`Sequence[nn.Module]`, defaults to `()`): Decoder layers of `teacher`, in the order they run, whose
            outputs are kept too (`TeacherTargets.layer_states`, for [`hidden_state_mse`]).

    Returns:
        [`TeacherTargets`], on the CPU.
    """
    parts: list[TeacherTargets] = []
    head = teacher.get_output_embeddings()
    if input_ids.shape[0] == 0:  # a process with no sequence of its own (torchrun): nothing to keep
        top_k, width = min(TOP_K, head.weight.shape[0]), head.weight.shape[1]
        shape = (0, max(0, input_ids.shape[1] - 1))
        hidden = torch.zeros(*shape, width, dtype=torch.bfloat16) if keep_hidden else None
        states = torch.zeros(*shape, len(layers), width, dtype=torch.bfloat16) if layers else None
        return TeacherTargets(
            torch.zeros(*shape, top_k, dtype=torch.int32), torch.zeros(*shape, top_k), torch.zeros(*shape), hidden, states
        )
    device = input_device(teacher)
    vocabulary = vocabulary_head(teacher)  # the logits a few at a time, where the split is known exact
    chunked = vocabulary.final_hidden_states is not None
    with (
        calibration_mode(teacher),
        head_inputs(head if keep_hidden and not chunked else None) as inputs,
        layer_outputs(layers) as outputs,
    ):
        for start in logging.tqdm(
            range(0, input_ids.shape[0], batch_size),
            desc="Heal: the dense model's targets",
            leave=False,
            disable=not progress_bar,
        ):
            batch = input_ids[start : start + batch_size].to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16) if autocast else nullcontext():
                if chunked:
                    hidden = vocabulary.final_hidden_states(batch)
                    indices, log_probs, rest = chunked_top_k(hidden, vocabulary, TOP_K)
                    targets = TeacherTargets(indices.int().cpu(), log_probs.cpu(), rest.cpu())
                else:
                    targets = targets_from_logits(teacher(input_ids=batch, use_cache=False).logits[:, :-1])
            if keep_hidden:
                head_input = hidden if chunked else the_head_input(inputs)
                targets.hidden = head_input[:, :-1].to(torch.bfloat16).cpu()
            if layers:
                targets.layer_states = the_layer_outputs(outputs, len(layers))[:, :-1].to(torch.bfloat16).cpu()
            parts.append(targets)
    return TeacherTargets.concatenate(parts)


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


@contextmanager
def head_inputs(head: nn.Module | None) -> Iterator[list[torch.Tensor]]:
    """Collects the input of every call of `head` inside the block (by a forward pre-hook, removed on exit).

    Args:
        head (`nn.Module`, *optional*): The output embedding; `None` collects nothing.

    Returns:
        `Iterator[list[torch.Tensor]]`: the list the inputs are appended to, as the block's value.
    """
    inputs: list[torch.Tensor] = []
    if head is None:
        yield inputs
        return
    handle = head.register_forward_pre_hook(lambda module, args: inputs.append(args[0]))
    try:
        yield inputs
    finally:
        handle.remove()


def the_head_input(inputs: list[torch.Tensor]) -> torch.Tensor:
    """The one input [`head_inputs`] collected over a forward pass, taken out of the list (which the next pass then
    fills again).

    Raises:
        InvalidInputError: the head was not called exactly once (a model that computes its logits without calling its
            output embedding, or calls it twice), where the logit loss cannot know the hidden states it scores.
    """
    if len(inputs) != 1:
        raise InvalidInputError(
            f"heal_loss reads the input of the model's output embedding, and a forward pass called it {len(inputs)} "
            "times (once expected): this model computes its logits another way. Heal it with heal_loss='kl'."
        )
    return inputs.pop()


@contextmanager
def layer_outputs(layers: Sequence[nn.Module]) -> Iterator[list[torch.Tensor]]:
    """Collects the hidden-state output of every call of each of `layers` inside the block (by forward hooks, removed
    on exit), in the order the calls come.

    Args:
        layers (`Sequence[nn.Module]`): Decoder layers; none collects nothing.

    Returns:
        `Iterator[list[torch.Tensor]]`: the list the outputs are appended to, as the block's value.
    """
    outputs: list[torch.Tensor] = []

    def keep(module: nn.Module, args: tuple, output: torch.Tensor | tuple) -> None:
        outputs.append(output[0] if isinstance(output, tuple) else output)

    handles = [layer.register_forward_hook(keep) for layer in layers]
    try:
        yield outputs
    finally:
        for handle in handles:
            handle.remove()


def the_layer_outputs(outputs: list[torch.Tensor], count: int) -> torch.Tensor:
    """The `count` layer outputs [`layer_outputs`] collected over a forward pass, stacked as `(N, T, count, d)` and
    taken out of the list (which the next pass then fills again).

    Raises:
        InvalidInputError: the layers were not called `count` times in all (a model that skips or repeats a layer).
    """
    if len(outputs) != count:
        raise InvalidInputError(
            f"heal_loss='kl_hidden_mse' reads the outputs of {count} decoder layer(s), and a forward pass gave "
            f"{len(outputs)}: this model does not call each of its layers once. Heal it with heal_loss='kl'."
        )
    stacked = torch.stack(outputs, dim=2)
    outputs.clear()
    return stacked


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
            sequences ([`head_inputs`]); needed for the logit MSE.
        targets ([`TeacherTargets`]): The teacher's, with `hidden` for the logit MSE.
        gram (`torch.Tensor` of shape `(d, d)`, *optional*): [`centred_logit_gram`]; needed for the logit MSE.
        layer_states (`torch.Tensor` of shape `(N, T, S, d)`, *optional*): The student's outputs of its seam layers over
            the whole sequences ([`the_layer_outputs`]); needed for the hidden-state MSE, with `targets.layer_states`.

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


def targets_from_logits(logits: torch.Tensor) -> TeacherTargets:
    """The teacher's targets at positions whose next-token logits are `logits` (`(..., vocabulary)`): its `TOP_K`
    most likely tokens' log-probabilities (the log-softmax in float32) and the rest's, on the CPU."""
    indices, log_probs, rest = top_k_log_probs(logits, min(TOP_K, logits.shape[-1]))
    return TeacherTargets(indices.int().cpu(), log_probs.cpu(), rest.cpu())
