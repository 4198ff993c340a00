# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""The heal's work in the plan's units ([`heal_work`]: the teacher's pass, the training steps and the held-out checks,
from the counts of [`~optimum_gradmap.heal.cost`], which also says what the heal holds), and [`plan_heal`], the plan of
`optimum-gradmap heal` on a pruned checkpoint."""

from __future__ import annotations

import os
from typing import Any

import torch
from transformers import PretrainedConfig, PreTrainedModel

from ..configuration import GradMAPConfig
from ..errors import InvalidInputError
from ..heal import HealCounts, HealSettings
from ..heal.cost import heal_memory
from .counts import ZERO, Count, Work
from .placement import allocator_overhead, offloaded_shares, process_bytes, transfer_seconds, weights_kept_on_device
from .plan import REPORT_BYTES, PruningPlan, described, stage_plan, tokenizer_bytes
from .shape import ModelShape, describe_model, load_model_config, resolve_dtype
from .stage1 import SPLIT_CHECK_TOKENS, logits_bytes
from .text import count_text
from .throughput import DeviceThroughput


def heal_work(
    settings: HealSettings, shape: ModelShape, num_kept: int, teacher_layers: int, streamed: bool = False
) -> tuple[Work, HealCounts]:
    """The heal stage's work: the teacher's targets (its pass over corpus sequences; the dense model's own text is
    written a position at a time and its targets come with it), the held-out checks and the training steps
    (layer-streamed: each step's forward pass that stores the layers' inputs, and the head split's check, two passes
    over at most 16 tokens of one sequence), with the counts ([`~optimum_gradmap.heal.HealCounts`]) they come from."""
    counts = HealCounts.of(settings)
    seq_len, train, validation, checks = settings.heal_seq_len, counts.train_sequences, counts.validation_sequences, counts.checks
    corpus = train + validation - counts.generated_sequences
    split_check = 2 * min(SPLIT_CHECK_TOKENS, seq_len)
    streaming_forward = num_kept * (train * seq_len + split_check) if streamed else 0
    work = Work(
        layer_forward=Count.of(teacher_layers * corpus * seq_len + checks * num_kept * validation * seq_len + streaming_forward),
        head_forward=Count.of(corpus * seq_len + checks * validation * seq_len + (split_check if streamed else 0)),
        layer_gradient=Count.of(num_kept * train * seq_len),
        head_gradient=Count.of(train * (seq_len - 1 if streamed else seq_len)),  # streamed: the predicting positions
        generated_tokens=Count.of(counts.generated_sequences * seq_len),
        weight_gradients=settings.heal_trainable == "all",
    )
    return work, counts


def _stored_weight_bytes(pruned: Any, student: ModelShape) -> int:
    """The healed checkpoint's weights on disk: a quantized checkpoint's are written back as stored (its files' size,
    [`optimum_gradmap.heal.quantized`]), others in the student's dtype."""
    from ..heal.quantized import stored_quantization

    if isinstance(pruned, (str, os.PathLike)) and stored_quantization(str(pruned)) is not None:
        return sum(entry.stat().st_size for entry in os.scandir(pruned) if entry.name.endswith(".safetensors"))
    return student.weight_bytes


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
        dtype, device, throughput, measure, device_map, max_memory, host_allocator_overhead: As in
            [`~optimum_gradmap.pipeline.plan_pruning`];
            with a device map that offloads layers, both models are offloaded and the training steps run
            layer-streamed.

    Returns:
        [`PruningPlan`] with the heal stage alone.
    """
    _check_heal_budget(config)
    settings = HealSettings.from_config(config)
    pruned_config, teacher_config = load_model_config(pruned), load_model_config(teacher)
    dtype = resolve_dtype(dtype, teacher_config)
    device = torch.device(device if device is not None else "cpu")
    name = os.fspath(pruned) if isinstance(pruned, (str, os.PathLike)) else getattr(pruned_config, "_name_or_path", "")
    teacher_shape = describe_model(teacher_config, dtype, settings.heal_batch_size, settings.heal_seq_len, name=str(teacher))
    student = describe_model(pruned_config, dtype, settings.heal_batch_size, settings.heal_seq_len, name=name)
    process = process_bytes() if device.type == "cpu" else 0
    if throughput is None and measure:
        throughput = DeviceThroughput.measure(teacher_config, dtype, device, settings.heal_batch_size, settings.heal_seq_len)
    shares = offloaded_shares(student, pruned_config, device_map, max_memory)
    work, counts = heal_work(settings, teacher_shape, student.num_layers, teacher_shape.num_layers, streamed=bool(shares))
    memory = heal_memory(settings, student, student.num_layers, counts, teacher_shape.num_layers)
    host = memory["host"] if device.type == "cpu" else 0.0
    training = student.weight_bytes + allocator_overhead(device, host_allocator_overhead) * memory["device"]
    peak = Count.of(max(student.weight_bytes + teacher_shape.weight_bytes, training) + host)
    streamed = None
    if shares:
        placement = (pruned_config, teacher_config, device_map, max_memory, device)
        streamed = _streamed_heal_peak(settings, student, teacher_shape, memory, placement) + host + process
    passes = f"{counts.steps} steps, {counts.checks} checks"
    tokens = (counts.train_sequences + counts.validation_sequences) * settings.heal_seq_len
    stage = stage_plan(
        "Heal", passes, tokens, work, teacher_shape, throughput, peak.low + process, streamed, memory["host"], heal=True
    )
    if stage.seconds is not None and shares:  # both models' offloaded layers, brought to the device call by call
        heal_batch = settings.heal_batch_size * settings.heal_seq_len
        stage.seconds = stage.seconds + transfer_seconds(work, teacher_shape, heal_batch, shares)
    trained = f"{settings.heal_trainable} ({count_text(memory['trained'])} parameters)"
    return PruningPlan(
        model=name,
        **described(student, dtype),
        num_layers_to_remove=teacher_shape.num_layers - student.num_layers,
        rounds=ZERO,
        budget=None,
        stage1=f"none (the checkpoint was pruned from {teacher_shape.name}'s {teacher_shape.num_layers} layers)",
        stage2=f"none; heal trains {trained} on {settings.heal_tokens:,} tokens of {settings.heal_dataset}",
        execution="layer_streamed" if streamed is not None else "in_memory",
        stages=[stage],
        output_bytes=Count.of(_stored_weight_bytes(pruned, student) + (tokenizer_bytes(pruned) or 0) + REPORT_BYTES),
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
    settings: HealSettings, student: ModelShape, teacher: ModelShape, memory: dict[str, float], placement: tuple
) -> float:
    """The device's peak when both models are offloaded: the teacher's pass (what the device maps keep on the device,
    one layer and a batch's logits), or a layer-streamed training step."""
    pruned_config, teacher_config, device_map, max_memory, device = placement
    largest = max(teacher.layer_parameters) * teacher.dtype_bytes
    student_kept = weights_kept_on_device(student, pruned_config, device_map, max_memory, device) or 0.0
    teacher_kept = weights_kept_on_device(teacher, teacher_config, device_map, max_memory, device) or 0.0
    teacher_pass = student_kept + teacher_kept + largest + logits_bytes(teacher, settings.heal_batch_size, settings.heal_seq_len)
    return max(teacher_pass, student_kept + largest + memory["streamed"])
