# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""The heal's cost, one model for the plan ([`~optimum_gradmap.planning.plan_heal`] and the planner's heal stage) and
for `heal_tokens="auto"` ([`~optimum_gradmap.heal.choose_heal_tokens`]): the sequences, steps and held-out checks a
budget makes ([`HealCounts`]), what the heal holds ([`heal_memory`], [`trained_parameters`]), and the seconds of its
parts measured on the pruned model ([`HealCosts`]), from which the run chooses its budget."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..distillation import TOP_K
from ..vocabulary import MAX_LOGIT_ELEMENTS
from .generation import GENERATION_BATCH_SIZE, corpus_part, is_generated
from .loss import uses_layer_states
from .settings import HealSettings

# `heal_tokens="auto"`: the heal's time (the dense model's text included) as a share of Stage 1's measured time.
AUTO_TIME_SHARE = 1.0
# heal_tokens="auto" is planned from the cost of this many heal steps, scaled to Stage 1's planned time.
AUTO_REFERENCE_STEPS = 64


def num_batches(num_sequences: int, batch_size: int) -> int:
    """The batches `num_sequences` make, the last one possibly short."""
    return -(-num_sequences // batch_size)


def generated_part(heal_dataset: str, num_sequences: int) -> int:
    """How many of `num_sequences` heal sequences the dense model writes itself: all of them for `generated`, half
    (rounded up) for `generated` joined to corpus names, none otherwise."""
    if not is_generated(heal_dataset):
        return 0
    return num_sequences if corpus_part(heal_dataset) is None else num_batches(num_sequences, 2)


def generated_share(heal_dataset: str) -> float:
    """The share of the heal's sequences the dense model writes itself, as [`generated_part`] rounds it."""
    if not is_generated(heal_dataset):
        return 0.0
    return 1.0 if corpus_part(heal_dataset) is None else 0.5


@dataclass(frozen=True)
class HealCounts:
    """The sequences, steps and held-out checks of a heal of `heal_tokens` tokens ([`HealCounts.of`]).

    Attributes:
        train_sequences (`int`): The training sequences: the budget in whole `heal_seq_len`-token sequences.
        validation_sequences (`int`): The held-out sequences.
        steps (`int`): The training steps, the last one possibly short.
        checks (`int`): The held-out checks: the start's, every `heal_check_every` steps, and after the last step.
        generated_train (`int`), generated_validation (`int`): Those of them the dense model writes itself.
    """

    train_sequences: int
    validation_sequences: int
    steps: int
    checks: int
    generated_train: int
    generated_validation: int

    @classmethod
    def of(cls, settings: HealSettings) -> HealCounts:
        """The counts of a heal as `settings` say (`heal_tokens` a number)."""
        train = num_batches(settings.heal_tokens, settings.heal_seq_len)
        validation = settings.heal_validation_sequences
        steps = num_batches(train, settings.heal_batch_size)
        checks = 1 + steps // settings.heal_check_every + (1 if steps % settings.heal_check_every else 0)
        dataset = settings.heal_dataset
        return cls(train, validation, steps, checks, generated_part(dataset, train), generated_part(dataset, validation))

    @property
    def generated_sequences(self) -> int:
        """The sequences the dense model writes itself."""
        return self.generated_train + self.generated_validation


def heal_memory(
    settings: HealSettings,
    shape: Any,
    num_kept: int,
    counts: HealCounts,
    teacher_layers: int | None = None,
) -> dict[str, float]:
    """The heal's peak beyond the weights of a model of `shape` ([`~optimum_gradmap.planning.ModelShape`]) with
    `num_kept` layers: the training batch's activations and logits, the trained parameters' gradients and AdamW state
    (float32), or, before training, the generation's KV cache and logits (the dense model's own text, `teacher_layers`
    layers); and on the host the teacher's targets (the generated text's held twice: the text's and the heal's rows;
    with its seam layers' outputs for `kl_hidden_mse`) and two copies of the trained state."""
    batch, seq_len = settings.heal_batch_size, settings.heal_seq_len
    tokens = batch * seq_len
    mean_activation = shape.mean("activation_bytes", heal=True) + (
        shape.mean("linear_input_bytes", heal=True) if settings.heal_trainable == "lora" else 0.0
    )
    activations = tokens * num_kept * mean_activation
    logits = tokens * shape.vocab_size * (4 * 3 + shape.dtype_bytes)
    trained = trained_parameters(settings, shape, num_kept)
    optimizer = trained * 4 * (3 if settings.heal_trainable != "lora" else 4)  # (the adapters) + gradient + two moments
    sequences = counts.train_sequences + counts.validation_sequences + counts.generated_sequences
    targets = sequences * (seq_len - 1) * (TOP_K * 8 + 4)
    if uses_layer_states(settings.heal_loss):  # the teacher's outputs of the seam layers, bfloat16, held twice likewise
        seams = min(num_kept, shape.num_layers - num_kept)  # at most one kept layer after each removed one
        targets += 2 * counts.train_sequences * (seq_len - 1) * seams * shape.hidden_size * 2
    generation = _generation_bytes(settings, shape, teacher_layers or shape.num_layers) if counts.generated_sequences else 0
    # layer-streamed steps (an offloaded model): the kept layers' inputs and one layer's activations, the head by slices
    stored_inputs = num_kept * tokens * shape.hidden_size * shape.dtype_bytes
    one_layer = tokens * max(layer.activation_bytes for layer in shape.layers)
    logits_chunk = min(MAX_LOGIT_ELEMENTS, shape.vocab_size * tokens) * 4 * 3
    streamed = max(stored_inputs + one_layer + logits_chunk + optimizer, generation)
    return {
        "device": max(activations + logits + optimizer, generation),
        "streamed": streamed,
        "host": targets + 2 * trained * 4,
        "trained": trained,
    }


def _generation_bytes(settings: HealSettings, shape: Any, teacher_layers: int) -> float:
    """What the dense model holds while it writes its own text: the KV cache of `GENERATION_BATCH_SIZE` sequences of
    `heal_seq_len` tokens over its `teacher_layers` layers, and a step's logits with their float32 log-softmax."""
    rows = GENERATION_BATCH_SIZE
    cache = rows * settings.heal_seq_len * teacher_layers * 2 * shape.kv_width * shape.dtype_bytes
    return cache + rows * shape.vocab_size * (4 * 3 + shape.dtype_bytes)


def trained_parameters(settings: HealSettings, shape: Any, num_kept: int) -> int:
    """How many parameters the heal trains: LoRA's adapters, or the weights `heal_trainable` names."""
    if settings.heal_trainable == "lora":
        return settings.heal_lora_rank * shape.lora_parameters_per_rank * num_kept
    if settings.heal_trainable == "norms":
        return 2 * shape.hidden_size * (num_kept + 1)
    return int(sum(shape.layer_parameters) / shape.num_layers * num_kept)  # "all"


def changed_parameters(settings: HealSettings, shape: Any, num_kept: int) -> int:
    """How many of the model's own parameters the heal changes, what a copy that undoes it holds: for LoRA, the weights
    of the kept layers' linear maps its adapters merge into; else the weights it trains ([`trained_parameters`])."""
    if settings.heal_trainable != "lora":
        return trained_parameters(settings, shape, num_kept)
    linear = [sum(width * height for width, height in maps) for maps in shape.layer_linear_maps]
    return int(sum(linear) / shape.num_layers * num_kept)


@dataclass
class HealCosts:
    """The seconds of the heal's parts, measured on the pruned model before an `auto` budget is chosen
    ([`~optimum_gradmap.heal.measure_heal_costs`]).

    Attributes:
        forward_seconds (`float`): The pruned model's forward pass over one batch.
        step_seconds (`float`): One training step over one batch (forward and backward).
        teacher_seconds (`float`): The dense model's forward pass over one batch: `forward_seconds` times its number
            of layers over the pruned model's.
        check_seconds (`float`): One held-out check.
        generation_seconds (`float`): One sequence of the dense model's own text (0 for corpus text).
    """

    forward_seconds: float
    step_seconds: float
    teacher_seconds: float
    check_seconds: float
    generation_seconds: float = 0.0

    def sequences_within(self, seconds: float, settings: HealSettings) -> int:
        """The training sequences whose heal fits in `seconds`: per sequence its share of a step, of the held-out
        checks, and of the teacher's pass (corpus text) or its generation (the dense model's own text, whose targets
        come with it); once, the held-out sequences' and the first check. Whole batches, at least one."""
        batch, share = settings.heal_batch_size, generated_share(settings.heal_dataset)
        corpus_share = 1.0 - share  # the dense model's own text comes with its targets: no teacher pass
        fixed = (
            self.check_seconds
            + self.teacher_seconds * corpus_share * num_batches(settings.heal_validation_sequences, batch)
            + self.generation_seconds * generated_part(settings.heal_dataset, settings.heal_validation_sequences)
        )
        per_sequence = (
            (self.step_seconds + self.teacher_seconds * corpus_share) / batch
            + self.check_seconds / (batch * settings.heal_check_every)
            + self.generation_seconds * share
        )
        return max(1, math.floor((seconds - fixed) / per_sequence) // batch) * batch
