# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""The heal's cost: the teacher's pass, the training steps and the held-out checks, what the heal holds (on the device
and on the host), and [`plan_heal`], the plan of `optimum-gradmap heal` on a pruned checkpoint."""

from __future__ import annotations

import os
from typing import Any

import torch
from transformers import PretrainedConfig, PreTrainedModel

from ..configuration import GradMAPConfig
from ..distillation import TOP_K, uses_head_inputs, uses_layer_states
from ..errors import InvalidInputError
from ..passes import MAX_LOGIT_ELEMENTS
from .counts import ZERO, Count, Work
from .placement import allocator_overhead, offloaded_shares, process_bytes, weights_kept_on_device
from .plan import REPORT_BYTES, PruningPlan, stage_plan, tokenizer_bytes
from .shape import ModelShape, describe_model, load_model_config, resolve_dtype
from .stage1 import SPLIT_CHECK_TOKENS, logits_bytes
from .text import count_text
from .throughput import DeviceThroughput

# heal_tokens="auto" is planned from the cost of this many heal steps, scaled to Stage 1's planned time.
AUTO_REFERENCE_STEPS = 64


def heal_work(
    config: GradMAPConfig, shape: ModelShape, num_kept: int, teacher_layers: int, streamed: bool = False
) -> tuple[Work, dict[str, int]]:
    """The heal stage's work: the teacher's pass over every sequence, the held-out checks and the training steps
    (layer-streamed: each step's forward pass that stores the layers' inputs, and the head split's check, two passes
    over at most 16 tokens of one sequence)."""
    seq_len, batch = config.heal_seq_len, config.heal_batch_size
    train = -(-config.heal_tokens // seq_len)
    validation = config.heal_validation_sequences
    steps = -(-train // batch)
    checks = 1 + steps // config.heal_check_every + (1 if steps % config.heal_check_every else 0)
    split_check = 2 * min(SPLIT_CHECK_TOKENS, seq_len)
    streaming_forward = num_kept * (train * seq_len + split_check) if streamed else 0
    work = Work(
        layer_forward=Count.of(
            teacher_layers * (train + validation) * seq_len + checks * num_kept * validation * seq_len + streaming_forward
        ),
        head_forward=Count.of((train + validation) * seq_len + checks * validation * seq_len + (split_check if streamed else 0)),
        layer_gradient=Count.of(num_kept * train * seq_len),
        head_gradient=Count.of(train * (seq_len - 1 if streamed else seq_len)),  # streamed: the predicting positions
        weight_gradients=config.heal_trainable == "all",
    )
    return work, {"train_sequences": train, "validation_sequences": validation, "steps": steps, "checks": checks}


def heal_memory(config: GradMAPConfig, shape: ModelShape, num_kept: int, counts: dict[str, int]) -> dict[str, float]:
    """The heal's peak beyond the weights: the training batch's activations and logits, the trained parameters'
    gradients and AdamW state (float32), and on the host the teacher's targets (with its head inputs for a logit loss,
    whose `d x d` matrix is on the device; its seam layers' outputs for `kl_hidden_mse`) and two copies of the trained
    state."""
    batch, seq_len = config.heal_batch_size, config.heal_seq_len
    tokens = batch * seq_len
    mean_activation = shape.mean("activation_bytes", heal=True) + (
        shape.mean("linear_input_bytes", heal=True) if config.heal_trainable == "lora" else 0.0
    )
    activations = tokens * num_kept * mean_activation
    logits = tokens * shape.vocab_size * (4 * 3 + shape.dtype_bytes)
    trained = trained_parameters(config, shape, num_kept)
    optimizer = trained * 4 * (3 if config.heal_trainable != "lora" else 4)  # (the adapters) + gradient + two moments
    targets = (counts["train_sequences"] + counts["validation_sequences"]) * (seq_len - 1) * (TOP_K * 8 + 4)
    gram = 0
    if uses_head_inputs(config.heal_loss):  # the teacher's head inputs, bfloat16, held twice (the text's, the heal's rows)
        targets += 2 * counts["train_sequences"] * (seq_len - 1) * shape.hidden_size * 2
        gram = shape.hidden_size**2 * 4  # the logit loss's d x d matrix, on the device
    if uses_layer_states(config.heal_loss):  # the teacher's outputs of the seam layers, bfloat16, held twice likewise
        seams = min(num_kept, shape.num_layers - num_kept)  # at most one kept layer after each removed one
        targets += 2 * counts["train_sequences"] * (seq_len - 1) * seams * shape.hidden_size * 2
    # layer-streamed steps (an offloaded model): the kept layers' inputs and one layer's activations, the head by slices
    stored_inputs = num_kept * tokens * shape.hidden_size * shape.dtype_bytes
    one_layer = tokens * max(layer.activation_bytes for layer in shape.layers)
    logits_chunk = min(MAX_LOGIT_ELEMENTS, shape.vocab_size * tokens) * 4 * 3
    streamed = stored_inputs + one_layer + logits_chunk + optimizer
    return {
        "device": activations + logits + optimizer + gram,
        "streamed": streamed,
        "host": targets + 2 * trained * 4,
        "trained": trained,
    }


def trained_parameters(config: GradMAPConfig, shape: ModelShape, num_kept: int) -> int:
    """How many parameters the heal trains (LoRA's adapters, or the weights `heal_trainable` names, roughly)."""
    mean_layer = sum(shape.layer_parameters) / shape.num_layers
    if config.heal_trainable == "lora":
        return config.heal_lora_rank * shape.lora_parameters_per_rank * num_kept
    if config.heal_trainable == "norms":
        return 2 * shape.hidden_size * (num_kept + 1)
    if config.heal_trainable == "all":
        return int(mean_layer * num_kept)
    if config.heal_trainable == "down_projections":
        return shape.hidden_size * shape.intermediate_size
    return int(mean_layer)


def plan_heal(
    pruned: PreTrainedModel | PretrainedConfig | str | os.PathLike,
    teacher: PreTrainedModel | PretrainedConfig | str | os.PathLike,
    config: GradMAPConfig,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device | None = None,
    throughput: DeviceThroughput | None = None,
    measure: bool = True,
    device_map: str | dict[str, Any] | None = None,
    max_memory: dict[int | str, str] | None = None,
    host_allocator_overhead: float | None = None,
) -> PruningPlan:
    """The plan of `optimum-gradmap heal` on a pruned checkpoint: its tokens, FLOPs, peak memory (the teacher is loaded
    for its pass beside the student) and time. Only the configs are read.

    Args:
        pruned (`PreTrainedModel`, `PretrainedConfig`, `str` or `os.PathLike`): The pruned checkpoint.
        teacher (`PreTrainedModel`, `PretrainedConfig`, `str` or `os.PathLike`): The dense model it was pruned from.
        config ([`GradMAPConfig`]): Its `heal_*` settings are read (`heal_tokens` > 0).
        dtype, device, throughput, measure, device_map, max_memory, host_allocator_overhead: As in [`plan_pruning`];
            with a device map that offloads layers, both models are offloaded and the training steps run
            layer-streamed.

    Returns:
        [`PruningPlan`] with the heal stage alone.
    """
    _check_heal_budget(config)
    pruned_config, teacher_config = load_model_config(pruned), load_model_config(teacher)
    dtype = resolve_dtype(dtype, teacher_config)
    device = torch.device(device if device is not None else "cpu")
    name = os.fspath(pruned) if isinstance(pruned, (str, os.PathLike)) else getattr(pruned_config, "_name_or_path", "")
    teacher_shape = describe_model(teacher_config, dtype, config.heal_batch_size, config.heal_seq_len, name=str(teacher))
    student = describe_model(pruned_config, dtype, config.heal_batch_size, config.heal_seq_len, name=name)
    process = process_bytes() if device.type == "cpu" else 0
    if throughput is None and measure:
        throughput = DeviceThroughput.measure(teacher_config, dtype, device, config.heal_batch_size, config.heal_seq_len)
    work, counts = heal_work(config, teacher_shape, student.num_layers, teacher_shape.num_layers)
    memory = heal_memory(config, student, student.num_layers, counts)
    host = memory["host"] if device.type == "cpu" else 0.0
    training = student.weight_bytes + allocator_overhead(device, host_allocator_overhead) * memory["device"]
    peak = Count.of(max(student.weight_bytes + teacher_shape.weight_bytes, training) + host)
    streamed = None
    if offloaded_shares(student, pruned_config, device_map, max_memory):
        placement = (pruned_config, teacher_config, device_map, max_memory, device)
        streamed = _streamed_heal_peak(config, student, teacher_shape, memory, placement) + host + process
    stage = stage_plan(
        "Heal",
        f"{counts['steps']} steps, {counts['checks']} checks",
        (counts["train_sequences"] + counts["validation_sequences"]) * config.heal_seq_len,
        work,
        teacher_shape,
        throughput,
        peak.low + process,
        streamed,
        memory["host"],
        heal=True,
    )
    trained = f"{config.heal_trainable} ({count_text(memory['trained'])} parameters)"
    return PruningPlan(
        model=name,
        model_type=student.model_type,
        dtype=str(dtype).replace("torch.", ""),
        num_layers=student.num_layers,
        num_parameters=student.num_parameters,
        weight_bytes=student.weight_bytes,
        largest_layer_bytes=max(student.layer_parameters) * student.dtype_bytes,
        num_layers_to_remove=teacher_shape.num_layers - student.num_layers,
        rounds=ZERO,
        budget=None,
        stage1=f"none (the checkpoint was pruned from {teacher_shape.name}'s {teacher_shape.num_layers} layers)",
        stage2=f"none; heal trains {trained} on {config.heal_tokens:,} tokens of {config.heal_dataset}",
        execution="layer_streamed" if streamed is not None else "in_memory",
        stages=[stage],
        output_bytes=Count.of(student.weight_bytes + (tokenizer_bytes(pruned) or 0) + REPORT_BYTES),
        throughput=throughput,
        notes=["The teacher is loaded for its pass beside the student: in memory, the peak holds both models' weights."],
    )


def _check_heal_budget(config: GradMAPConfig) -> None:
    """Refuses a heal plan without a number of tokens."""
    if not config.heal_tokens:
        raise InvalidInputError("The heal needs a budget: give `heal_tokens` (e.g. heal_tokens=200_000).")
    if config.heal_tokens == "auto":
        raise InvalidInputError(
            "heal --dry-run plans a number of tokens: `auto` takes them from Stage 1's time measured in the run itself. "
            "Give --heal-tokens N to see what N tokens cost."
        )


def _streamed_heal_peak(
    config: GradMAPConfig, student: ModelShape, teacher: ModelShape, memory: dict[str, float], placement: tuple
) -> float:
    """The device's peak when both models are offloaded: the teacher's pass (what the device maps keep on the device,
    one layer and a batch's logits), or a layer-streamed training step."""
    pruned_config, teacher_config, device_map, max_memory, device = placement
    largest = max(teacher.layer_parameters) * teacher.dtype_bytes
    student_kept = weights_kept_on_device(student, pruned_config, device_map, max_memory, device) or 0.0
    teacher_kept = weights_kept_on_device(teacher, teacher_config, device_map, max_memory, device) or 0.0
    teacher_pass = student_kept + teacher_kept + largest + logits_bytes(teacher, config.heal_batch_size, config.heal_seq_len)
    return max(teacher_pass, student_kept + largest + memory["streamed"])
