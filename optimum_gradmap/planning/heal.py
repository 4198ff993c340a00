# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""The heal's cost: the teacher's pass, the training steps and the held-out checks, what the heal holds (on the device
and on the host), and [`plan_heal`], the plan of `optimum-gradmap heal` on a pruned checkpoint."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from transformers import PretrainedConfig, PreTrainedModel

from ..configuration import GradMAPConfig
from ..distillation import TOP_K
from ..errors import InvalidInputError
from ..heal.generation import GENERATION_BATCH_SIZE, corpus_part, is_generated
from ..heal.loss import uses_head_inputs, uses_layer_states
from ..vocabulary import MAX_LOGIT_ELEMENTS
from .counts import ZERO, Count, Work
from .placement import allocator_overhead, offloaded_shares, process_bytes, transfer_seconds, weights_kept_on_device
from .plan import REPORT_BYTES, PruningPlan, described, stage_plan, tokenizer_bytes
from .shape import ModelShape, describe_model, load_model_config, resolve_dtype
from .stage1 import SPLIT_CHECK_TOKENS, logits_bytes
from .text import count_text
from .throughput import DeviceThroughput

# heal_tokens="auto" is planned from the cost of this many heal steps, scaled to Stage 1's planned time.
AUTO_REFERENCE_STEPS = 64


def heal_work(
    config: GradMAPConfig, shape: ModelShape, num_kept: int, teacher_layers: int, streamed: bool = False
) -> tuple[Work, dict[str, int]]:
    """The heal stage's work: the teacher's targets (its pass over corpus sequences; the dense model's own text is
    written a position at a time and its targets come with it), the held-out checks and the training steps
    (layer-streamed: each step's forward pass that stores the layers' inputs, and the head split's check, two passes
    over at most 16 tokens of one sequence)."""
    seq_len, batch = config.heal_seq_len, config.heal_batch_size
    train = -(-config.heal_tokens // seq_len)
    validation = config.heal_validation_sequences
    steps = -(-train // batch)
    checks = 1 + steps // config.heal_check_every + (1 if steps % config.heal_check_every else 0)
    generated = generated_sequences(config, train, validation)
    corpus = train + validation - generated
    split_check = 2 * min(SPLIT_CHECK_TOKENS, seq_len)
    streaming_forward = num_kept * (train * seq_len + split_check) if streamed else 0
    work = Work(
        layer_forward=Count.of(teacher_layers * corpus * seq_len + checks * num_kept * validation * seq_len + streaming_forward),
        head_forward=Count.of(corpus * seq_len + checks * validation * seq_len + (split_check if streamed else 0)),
        layer_gradient=Count.of(num_kept * train * seq_len),
        head_gradient=Count.of(train * (seq_len - 1 if streamed else seq_len)),  # streamed: the predicting positions
        generated_tokens=Count.of(generated * seq_len),
        weight_gradients=config.heal_trainable == "all",
    )
    counts = {"train_sequences": train, "validation_sequences": validation, "steps": steps, "checks": checks}
    return work, counts | {"generated_sequences": generated}


def generated_sequences(config: GradMAPConfig, train: int, validation: int) -> int:
    """How many of the heal's sequences the dense model writes itself: all of them for `generated`, half of the
    training and half of the held-out ones (rounded up) for `generated` joined to corpus names, none otherwise."""
    if not is_generated(config.heal_dataset):
        return 0
    if corpus_part(config.heal_dataset) is None:
        return train + validation
    return -(-train // 2) + -(-validation // 2)


def heal_memory(
    config: GradMAPConfig,
    shape: ModelShape,
    num_kept: int,
    counts: dict[str, int],
    trained_layers: tuple[int, int] = (1, 1),
    teacher_layers: int | None = None,
) -> dict[str, float]:
    """The heal's peak beyond the weights: the training batch's activations and logits, the trained parameters'
    gradients and AdamW state (float32), or, before training, the generation's KV cache and logits (the dense model's
    own text, `teacher_layers` layers); and on the host the teacher's targets (the generated text's held twice: the
    text's and the heal's rows; with its head inputs for a logit loss, whose `d x d` matrix is on the device; its seam
    layers' outputs for `kl_hidden_mse`) and two copies of the trained state. `trained_layers`: the kept layers
    before a removed run and the compensated layers ([`trained_parameters`])."""
    batch, seq_len = config.heal_batch_size, config.heal_seq_len
    tokens = batch * seq_len
    mean_activation = shape.mean("activation_bytes", heal=True) + (
        shape.mean("linear_input_bytes", heal=True) if config.heal_trainable == "lora" else 0.0
    )
    activations = tokens * num_kept * mean_activation
    logits = tokens * shape.vocab_size * (4 * 3 + shape.dtype_bytes)
    trained = trained_parameters(config, shape, num_kept, *trained_layers)
    optimizer = trained * 4 * (3 if config.heal_trainable != "lora" else 4)  # (the adapters) + gradient + two moments
    sequences = counts["train_sequences"] + counts["validation_sequences"] + counts.get("generated_sequences", 0)
    targets = sequences * (seq_len - 1) * (TOP_K * 8 + 4)
    gram = 0
    if uses_head_inputs(config.heal_loss):  # the teacher's head inputs, bfloat16, held twice (the text's, the heal's rows)
        targets += 2 * counts["train_sequences"] * (seq_len - 1) * shape.hidden_size * 2
        gram = shape.hidden_size**2 * 4  # the logit loss's d x d matrix, on the device
    if uses_layer_states(config.heal_loss):  # the teacher's outputs of the seam layers, bfloat16, held twice likewise
        seams = min(num_kept, shape.num_layers - num_kept)  # at most one kept layer after each removed one
        targets += 2 * counts["train_sequences"] * (seq_len - 1) * seams * shape.hidden_size * 2
    generation = _generation_bytes(config, shape, teacher_layers or shape.num_layers) if counts.get("generated_sequences") else 0
    # layer-streamed steps (an offloaded model): the kept layers' inputs and one layer's activations, the head by slices
    stored_inputs = num_kept * tokens * shape.hidden_size * shape.dtype_bytes
    one_layer = tokens * max(layer.activation_bytes for layer in shape.layers)
    logits_chunk = min(MAX_LOGIT_ELEMENTS, shape.vocab_size * tokens) * 4 * 3
    streamed = max(stored_inputs + one_layer + logits_chunk + optimizer, generation)
    return {
        "device": max(activations + logits + optimizer + gram, generation),
        "streamed": streamed,
        "host": targets + 2 * trained * 4,
        "trained": trained,
    }


def _generation_bytes(config: GradMAPConfig, shape: ModelShape, teacher_layers: int) -> float:
    """What the dense model holds while it writes its own text: the KV cache of `GENERATION_BATCH_SIZE` sequences of
    `heal_seq_len` tokens over its `teacher_layers` layers, and a step's logits with their float32 log-softmax."""
    rows = GENERATION_BATCH_SIZE
    cache = rows * config.heal_seq_len * teacher_layers * 2 * shape.kv_width * shape.dtype_bytes
    return cache + rows * shape.vocab_size * (4 * 3 + shape.dtype_bytes)


def trained_parameters(
    config: GradMAPConfig, shape: ModelShape, num_kept: int, before_removed: int = 1, compensated: int = 1
) -> int:
    """How many parameters the heal trains: LoRA's adapters, or the weights `heal_trainable` names (every weight of
    the `before_removed` kept layers before a removed run; the down projections of the `compensated` layers)."""
    mean_layer = sum(shape.layer_parameters) / shape.num_layers
    if config.heal_trainable == "lora":
        return config.heal_lora_rank * shape.lora_parameters_per_rank * num_kept
    if config.heal_trainable == "norms":
        return 2 * shape.hidden_size * (num_kept + 1)
    if config.heal_trainable == "all":
        return int(mean_layer * num_kept)
    if config.heal_trainable == "down_projections":
        return shape.down_projection_parameters * compensated
    return int(mean_layer * before_removed)


def layers_before_removed_runs(kept: list[int], num_layers: int) -> int:
    """How many kept layers come directly before a run of removed ones (what `heal_trainable="before_removed"`
    trains)."""
    kept_set = set(kept)
    return sum(1 for index in kept if index + 1 < num_layers and index + 1 not in kept_set)


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
    for its pass beside the student) and time. Only the configs are read (and a local checkpoint's
    `pruning_report.json`: which layers the heal may train).

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
    pruned_config, teacher_config = load_model_config(pruned), load_model_config(teacher)
    dtype = resolve_dtype(dtype, teacher_config)
    device = torch.device(device if device is not None else "cpu")
    name = os.fspath(pruned) if isinstance(pruned, (str, os.PathLike)) else getattr(pruned_config, "_name_or_path", "")
    teacher_shape = describe_model(teacher_config, dtype, config.heal_batch_size, config.heal_seq_len, name=str(teacher))
    student = describe_model(pruned_config, dtype, config.heal_batch_size, config.heal_seq_len, name=name)
    process = process_bytes() if device.type == "cpu" else 0
    if throughput is None and measure:
        throughput = DeviceThroughput.measure(teacher_config, dtype, device, config.heal_batch_size, config.heal_seq_len)
    shares = offloaded_shares(student, pruned_config, device_map, max_memory)
    work, counts = heal_work(config, teacher_shape, student.num_layers, teacher_shape.num_layers, streamed=bool(shares))
    layout = _pruned_layout(pruned, student.num_layers, teacher_shape.num_layers)
    memory = heal_memory(config, student, student.num_layers, counts, layout, teacher_shape.num_layers)
    host = memory["host"] if device.type == "cpu" else 0.0
    training = student.weight_bytes + allocator_overhead(device, host_allocator_overhead) * memory["device"]
    peak = Count.of(max(student.weight_bytes + teacher_shape.weight_bytes, training) + host)
    streamed = None
    if shares:
        placement = (pruned_config, teacher_config, device_map, max_memory, device)
        streamed = _streamed_heal_peak(config, student, teacher_shape, memory, placement) + host + process
    passes = f"{counts['steps']} steps, {counts['checks']} checks"
    tokens = (counts["train_sequences"] + counts["validation_sequences"]) * config.heal_seq_len
    stage = stage_plan(
        "Heal", passes, tokens, work, teacher_shape, throughput, peak.low + process, streamed, memory["host"], heal=True
    )
    if stage.seconds is not None and shares:  # both models' offloaded layers, brought to the device call by call
        heal_batch = config.heal_batch_size * config.heal_seq_len
        stage.seconds = stage.seconds + transfer_seconds(work, teacher_shape, heal_batch, shares)
    trained = f"{config.heal_trainable} ({count_text(memory['trained'])} parameters)"
    return PruningPlan(
        model=name,
        **described(student, dtype),
        num_layers_to_remove=teacher_shape.num_layers - student.num_layers,
        rounds=ZERO,
        budget=None,
        stage1=f"none (the checkpoint was pruned from {teacher_shape.name}'s {teacher_shape.num_layers} layers)",
        stage2=f"none; heal trains {trained} on {config.heal_tokens:,} tokens of {config.heal_dataset}",
        execution="layer_streamed" if streamed is not None else "in_memory",
        stages=[stage],
        output_bytes=Count.of(_stored_weight_bytes(pruned, student) + (tokenizer_bytes(pruned) or 0) + REPORT_BYTES),
        throughput=throughput,
        notes=["The teacher is loaded for its pass beside the student: in memory, the peak holds both models' weights."],
    )


def _pruned_layout(pruned: Any, num_kept: int, num_layers: int) -> tuple[int, int]:
    """The kept layers before a removed run and the compensated layers of a pruned checkpoint, from the
    `pruning_report.json` of a local folder; elsewhere the most a checkpoint of `num_kept` of `num_layers` layers
    can have (one before each removed layer)."""
    path = os.path.join(pruned, "pruning_report.json") if isinstance(pruned, (str, os.PathLike)) else ""
    if not path or not os.path.isfile(path):
        most = min(num_kept, num_layers - num_kept)
        return most, most
    with open(path) as file:
        report = json.load(file)
    kept = report.get("kept_layers") or list(range(num_kept))
    compensated = (report.get("compensation") or {}).get("compensated_layers") or []
    return layers_before_removed_runs(kept, report.get("original_num_layers", num_layers)), len(compensated)


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
