# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""The quantization step in a plan (`GradMAPConfig.quantization`): what llm-compressor computes and holds, and the bytes
of the compressed-tensors checkpoint it writes.

llm-compressor's sequential pipeline takes one decoder layer at a time: it runs the layer on every calibration sequence
with its modifiers' hooks on (SmoothQuant's activation ranges, GPTQ's Hessian H = X^T X of each linear map's inputs),
rounds the layer's linear maps one after the other (GPTQ: a Cholesky factor of H's inverse, then a sweep over the
columns that corrects the ones not rounded yet, about out x in^2 products), and runs the layer again on the rounded
weights to give the next layer its inputs. It keeps every calibration sequence's inputs of the current layer and its
outputs, and the Hessians of the layer's linear maps. The stored checkpoint holds each quantized weight in 8 or 4 bits
with its scales in the model's dtype (INT4: eight values packed in an int32, a scale per group of input columns), and
every other tensor as it was.
"""

from __future__ import annotations

import os

import torch
from transformers import PretrainedConfig, PreTrainedModel

from ..quantize import QuantizationScheme, scheme_named
from .counts import ZERO, Count, Work
from .placement import allocator_overhead, process_bytes
from .plan import REPORT_BYTES, PruningPlan, described, stage_plan, tokenizer_bytes
from .shape import ModelShape, describe_model, load_model_config, resolve_dtype
from .throughput import DeviceThroughput

# Bits a quantized weight is stored in, per scheme.
WEIGHT_BITS = {"w8a8": 8, "w4a16": 4, "fp8": 8}
# The passes over each layer's calibration tokens per calibrated modifier (SmoothQuant and GPTQ each run their own):
# with the hooks on, then again on the smoothed or rounded weights.
LAYER_PASSES = 2
GPTQ_NOTE = "GPTQ's time per column is an assumption measured on a CPU (llm-compressor 0.14); on a GPU its steps are shorter."
# GPTQ's factorisations of one d x d Hessian (Cholesky, inverse, Cholesky again), in units of d^3.
FACTOR_FLOPS_PER_CUBE = 4 / 3


def _linear_maps(shape: ModelShape, layer: int) -> list[tuple[int, int]]:
    return shape.layer_linear_maps[layer] if shape.layer_linear_maps else []


def group_size(shape: ModelShape, scheme: QuantizationScheme) -> int | None:
    """The weight group `scheme` uses on this model's linear maps ([`QuantizationScheme.group_size_for`])."""
    widths = [width for maps in shape.layer_linear_maps for width, _ in maps]
    return scheme.group_size_for(widths)


def stored_layer_bytes(shape: ModelShape, scheme_name: str) -> list[int]:
    """Each decoder layer's bytes in the compressed checkpoint: its linear maps' weights in `WEIGHT_BITS` with their
    scales (one per output channel, or per group of input columns) in the model's dtype, the rest as it is.

    Args:
        shape ([`ModelShape`]): The model.
        scheme_name (`str`): `"w8a8"`, `"w4a16"` or `"fp8"`.

    Returns:
        `list[int]`: per layer.
    """
    scheme = scheme_named(scheme_name)
    group = group_size(shape, scheme)
    sizes = []
    for index, parameters in enumerate(shape.layer_parameters):
        stored = parameters * shape.dtype_bytes
        for width, outputs in _linear_maps(shape, index):
            scales = outputs * (width // group if group else 1)
            stored -= width * outputs * shape.dtype_bytes
            stored += width * outputs * WEIGHT_BITS[scheme_name] // 8 + scales * shape.dtype_bytes
            stored += 16 if WEIGHT_BITS[scheme_name] == 4 else 0  # the packed weight's shape, two int64
        sizes.append(stored)
    return sizes


def quantization_work(shape: ModelShape, scheme_name: str, kept: Count, tokens: int) -> Work:
    """What the step computes: `LAYER_PASSES` passes of each kept layer over the calibration tokens for each calibrated
    modifier (W8A8's SmoothQuant, then GPTQ: four), and per linear map GPTQ's Hessian (float32 products), its
    factorisations and column sweep (small, at the factorisations' rate) and its columns one after the other; round to
    nearest (`fp8`) reads no text.

    Args:
        shape ([`ModelShape`]): The model.
        scheme_name (`str`): The scheme.
        kept (`Count`): The decoder layers left after pruning.
        tokens (`int`): Calibration tokens (sequences x length).

    Returns:
        [`Work`].
    """
    if not scheme_named(scheme_name).calibrated:
        return Work()
    maps = _linear_maps(shape, 0)
    hessians = sum(2 * tokens * width**2 for width, _ in maps)
    factorization = sum(FACTOR_FLOPS_PER_CUBE * width**3 + 2 * outputs * width**2 for width, outputs in maps)
    columns = sum(width for width, _ in maps)
    return Work(
        layer_forward=kept * (LAYER_PASSES * calibrated_modifiers(scheme_name) * tokens),
        device_float32_flops=kept * hessians,
        factorization_flops=kept * factorization,
        sequential_steps=kept * columns,
    )


def calibrated_modifiers(scheme_name: str) -> int:
    """The calibrated modifiers of the scheme's recipe (`"SmoothQuant + GPTQ"`: 2), each with its own pipeline."""
    scheme = scheme_named(scheme_name)
    return len(scheme.algorithm.split(" + ")) if scheme.calibrated else 0


def passes_text(scheme_name: str, num_samples: int, seq_len: int) -> str:
    """The stage's passes, in words."""
    scheme = scheme_named(scheme_name)
    if not scheme.calibrated:
        return f"{scheme_name}: weights rounded to nearest, no calibration"
    times = LAYER_PASSES * calibrated_modifiers(scheme_name)
    return f"{scheme_name} ({scheme.algorithm}): each layer run {times} times over {num_samples} x {seq_len} tokens"


def quantization_memory(shape: ModelShape, scheme_name: str, num_samples: int, seq_len: int) -> float:
    """Bytes the step holds beside the weights at its peak: while a layer is calibrated, every calibration sequence's
    inputs and outputs of the layer, its Hessians (float32), and for the map being rounded its weight and H's inverse
    in float32, with one sequence's activations through the layer; when the checkpoint is written, its compressed copy
    of the weights (`stored_bytes`).

    Args:
        shape ([`ModelShape`]): The model.
        scheme_name (`str`): The scheme.
        num_samples (`int`), seq_len (`int`): The calibration sequences.

    Returns:
        `float`.
    """
    if not scheme_named(scheme_name).calibrated:
        return float(stored_bytes(shape, scheme_name))
    maps = max(shape.layer_linear_maps, key=lambda layer: sum(width**2 for width, _ in layer), default=[])
    hessians = sum(4 * width**2 for width, _ in maps)
    rounding = max((4 * (width * outputs + width**2) for width, outputs in maps), default=0)
    intermediates = 2 * num_samples * seq_len * shape.hidden_size * shape.dtype_bytes
    one_sequence = max(layer.activation_bytes for layer in shape.layers) * seq_len
    return max(hessians + rounding + intermediates + one_sequence, stored_bytes(shape, scheme_name))


def stored_bytes(shape: ModelShape, scheme_name: str) -> int:
    """The weights' bytes in the compressed checkpoint: the layers as `stored_layer_bytes` gives them, the embeddings,
    norms and output embedding in the model's dtype."""
    return (shape.num_parameters - sum(shape.layer_parameters)) * shape.dtype_bytes + sum(stored_layer_bytes(shape, scheme_name))


def plan_quantization(
    model_or_path: PreTrainedModel | PretrainedConfig | str | os.PathLike,
    scheme: str,
    num_samples: int,
    seq_len: int,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device | None = None,
    throughput: DeviceThroughput | None = None,
    measure: bool = True,
    host_allocator_overhead: float | None = None,
) -> PruningPlan:
    """The plan of `optimum-gradmap quantize` on a saved checkpoint: its FLOPs, peak memory and time, and the
    compressed checkpoint's bytes on disk. Only the config is read.

    Args:
        model_or_path (`PreTrainedModel`, `PretrainedConfig`, `str` or `os.PathLike`): The checkpoint to quantize.
        scheme (`str`): `"w8a8"`, `"w4a16"` or `"fp8"`.
        num_samples (`int`), seq_len (`int`): The calibration sequences.
        dtype, device, throughput, measure, host_allocator_overhead: As in [`~optimum_gradmap.pipeline.plan_pruning`].

    Returns:
        [`PruningPlan`] with the quantization stage alone.
    """
    scheme_named(scheme)  # an unknown scheme: refused, with the schemes
    model_config = load_model_config(model_or_path)
    dtype = resolve_dtype(dtype, model_config)
    device = torch.device(device if device is not None else "cpu")
    name = os.fspath(model_or_path) if isinstance(model_or_path, (str, os.PathLike)) else model_config._name_or_path
    shape = describe_model(model_config, dtype, 1, seq_len, name=name)
    if throughput is None and measure:
        throughput = DeviceThroughput.measure(model_config, dtype, device, 1, seq_len)
    process = process_bytes() if device.type == "cpu" else 0
    work = quantization_work(shape, scheme, Count.of(shape.num_layers), num_samples * seq_len)
    beside = allocator_overhead(device, host_allocator_overhead) * quantization_memory(shape, scheme, num_samples, seq_len)
    calibrated = scheme_named(scheme).calibrated
    passes = passes_text(scheme, num_samples, seq_len)
    tokens = num_samples * seq_len if calibrated else 0
    stage = stage_plan("Quantize", passes, tokens, work, shape, throughput, shape.weight_bytes + beside + process, None, 0.0)
    output = stored_bytes(shape, scheme) + (tokenizer_bytes(model_or_path) or 0) + REPORT_BYTES
    return PruningPlan(
        model=name,
        **described(shape, dtype),
        num_layers_to_remove=0,
        rounds=ZERO,
        budget=None,
        stage1="none (a saved checkpoint, quantized)",
        stage2=f"none; {scheme} ({scheme_named(scheme).algorithm}) by llm-compressor",
        execution="in_memory",
        stages=[stage],
        output_bytes=Count.of(output),
        throughput=throughput,
        notes=[GPTQ_NOTE] if calibrated else [],
    )
