# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""The dense model's next-token distribution kept as a distillation target: what Stage 2's refinement
(`refinement_steps`, [`~optimum_gradmap.compensation.refinement`]) and the heal stage ([`optimum_gradmap.heal`], whose
losses to it are in [`~optimum_gradmap.heal.loss`]) distil from.

The teacher runs once over the sequences and keeps, at every position but the last, its `TOP_K` most likely next
tokens' log-probabilities and the log of the probability left to all other tokens ([`teacher_targets`]; LinearPatch's
"offline" teacher, Chen et al., NeurIPS 2025, Sec. 3.3): the student's training then needs neither the teacher's
weights nor its full-vocabulary distribution. Where a loss reads hidden states, the teacher keeps some layers' outputs
([`layer_outputs`]) beside them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext

import torch
from torch import nn
from transformers.utils import logging

from .errors import InvalidInputError
from .objectives import TeacherTargets, chunked_top_k, top_k_log_probs
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
        layers (`Sequence[nn.Module]`, defaults to `()`): Decoder layers of `teacher`, in the order they run, whose
            outputs are kept too (`TeacherTargets.layer_states`, for [`~optimum_gradmap.heal.loss.hidden_state_mse`]).

    Returns:
        [`TeacherTargets`], on the CPU.
    """
    parts: list[TeacherTargets] = []
    head = teacher.get_output_embeddings()
    if input_ids.shape[0] == 0:  # a process with no sequence of its own (torchrun): nothing to keep
        top_k, width = min(TOP_K, head.weight.shape[0]), head.weight.shape[1]
        shape = (0, max(0, input_ids.shape[1] - 1))
        states = torch.zeros(*shape, len(layers), width, dtype=torch.bfloat16) if layers else None
        return TeacherTargets(
            torch.zeros(*shape, top_k, dtype=torch.int32), torch.zeros(*shape, top_k), torch.zeros(*shape), states
        )
    device = input_device(teacher)
    vocabulary = vocabulary_head(teacher)  # the logits a few at a time, where the split is known exact
    chunked = vocabulary.final_hidden_states is not None
    with calibration_mode(teacher), layer_outputs(layers) as outputs:
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
            if layers:
                targets.layer_states = the_layer_outputs(outputs, len(layers))[:, :-1].to(torch.bfloat16).cpu()
            parts.append(targets)
    return TeacherTargets.concatenate(parts)


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


def targets_from_logits(logits: torch.Tensor) -> TeacherTargets:
    """The teacher's targets at positions whose next-token logits are `logits` (`(..., vocabulary)`): its `TOP_K`
    most likely tokens' log-probabilities (the log-softmax in float32) and the rest's, on the CPU."""
    indices, log_probs, rest = top_k_log_probs(logits, min(TOP_K, logits.shape[-1]))
    return TeacherTargets(indices.int().cpu(), log_probs.cpu(), rest.cpu())
