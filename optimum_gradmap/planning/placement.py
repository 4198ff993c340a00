# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Where the weights are: in memory, offloaded by a device map to the CPU or disk (Accelerate's placement, inferred
on the meta model) and brought to the device a layer at a time, what that costs in time, and what the host's
allocator adds to a pass's tensors on a CPU device."""

from __future__ import annotations

import os
from typing import Any

import torch
from transformers import PretrainedConfig

from ..adapters import get_adapter
from ..errors import InvalidInputError
from ..heal.generation import GENERATION_BATCH_SIZE
from .counts import ZERO, Count, Work
from .shape import ModelShape, empty_model

# The bandwidth of offloaded weights where nothing was measured (labelled as assumed).
ASSUMED_OFFLOAD_BYTES_PER_SECOND = {"cpu": 12e9, "disk": 1.5e9}
# On a CPU device, the resident memory a pass's tensors take, per byte of them alive at once: glibc's malloc raises its
# mmap threshold after the first large frees (up to 32 MiB), so a pass's later tensors come from the heap, which keeps
# freed blocks and fragments. An assumption, measured on one machine (glibc, SmolLM2-135M's Stage 1 pass in float32,
# 8 x 128 tokens): the resident memory rose by 1.448 GiB and stayed; with a fixed threshold
# (MALLOC_MMAP_THRESHOLD_=131072) by 0.978 GiB, the live tensors, which the plan's 1.10 GiB of activations hold.
# 1.448 / 0.978 = 1.48 (docs/benchmarks/scale.md). Another allocator (jemalloc,
# tcmalloc, a fixed threshold) keeps less: `plan_pruning(host_allocator_overhead=...)` and
# `prune --dry-run --host-allocator-overhead` state it.
HOST_ALLOCATOR_OVERHEAD = 1.48


def allocator_overhead(device: torch.device, host_allocator_overhead: float | None = None) -> float:
    """How many bytes of resident memory a byte of a pass's tensors takes on `device`: on a CPU device
    `host_allocator_overhead` (`None`: [`HOST_ALLOCATOR_OVERHEAD`]), elsewhere 1."""
    if host_allocator_overhead is not None and not host_allocator_overhead > 0:
        raise InvalidInputError(
            f"The host allocator's overhead is a factor on the bytes of a pass's tensors, above 0 (1.0: none); got "
            f"{host_allocator_overhead!r}."
        )
    if device.type != "cpu":
        return 1.0
    return HOST_ALLOCATOR_OVERHEAD if host_allocator_overhead is None else host_allocator_overhead


def placements(shape: ModelShape, config: PretrainedConfig, device_map: Any, max_memory: Any) -> dict[str, Any]:
    """Where `device_map` puts each module: itself when it is a dict, else what Accelerate infers for it and
    `max_memory` on the meta model, as `from_pretrained(device_map="auto")` infers it."""
    if isinstance(device_map, dict):
        return device_map
    import logging as std_logging

    from accelerate import infer_auto_device_map

    model = empty_model(config, shape.dtype)
    no_split = getattr(model, "_no_split_modules", None) or []
    accelerate_logger = std_logging.getLogger("accelerate.utils.modeling")
    level = accelerate_logger.level
    accelerate_logger.setLevel(std_logging.ERROR)  # a plan for GPUs this machine lacks is what it is for
    try:
        return infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=no_split, dtype=shape.dtype)
    finally:
        accelerate_logger.setLevel(level)


def offloaded_shares(shape: ModelShape, config: PretrainedConfig, device_map: Any, max_memory: Any) -> dict[str, float]:
    """The shares of the decoder layers Accelerate would offload to the CPU and to disk for `device_map` and
    `max_memory` ([`placements`])."""
    if device_map is None:
        return {}
    placed = placements(shape, config, device_map, max_memory)
    prefix = get_adapter(config).layers_path + "."
    whole = next((placed[name] for name in _prefixes(prefix[:-1]) if name in placed), None)
    if whole is not None:  # the whole layer list in one place (or the whole model: `{"": "disk"}`)
        return {whole: 1.0} if whole in ("cpu", "disk") else {}
    layers = {name: place for name, place in placed.items() if name.startswith(prefix)}
    count = shape.num_layers
    return {
        place: sum(1 for value in layers.values() if value == place) / count
        for place in ("cpu", "disk")
        if any(value == place for value in layers.values())
    }


def weights_kept_on_device(
    shape: ModelShape, config: PretrainedConfig, device_map: Any, max_memory: Any, device: torch.device
) -> float | None:
    """The bytes of the weights `device_map` (inferred on the meta model for `"auto"`, as `from_pretrained` infers it)
    keeps on the compute device for the whole run: on a CPU device the modules it places on `"cpu"`, on an accelerator
    those it places on that device. `None` without a device map."""
    if device_map is None:
        return None
    placed = placements(shape, config, device_map, max_memory)
    model = empty_model(config, shape.dtype)
    here = {"cpu"} if device.type == "cpu" else {device.index or 0, str(device), device.type}
    kept = 0.0
    for name, parameter in model.named_parameters():
        place = next((placed[prefix] for prefix in _prefixes(name) if prefix in placed), None)
        if place in here:
            kept += parameter.numel() * shape.dtype_bytes
    return kept


def _prefixes(name: str) -> list[str]:
    """`"a.b.c"` -> `["a.b.c", "a.b", "a", ""]`: the device map's keys that may hold a parameter, longest first."""
    parts = name.split(".")
    return [".".join(parts[:end]) for end in range(len(parts), -1, -1)]


def transfer_seconds(work: Work, shape: ModelShape, batch_tokens: int, shares: dict[str, float]) -> Count:
    """The seconds spent bringing offloaded layers' weights to the device: once per call of such a layer (a batch of
    `batch_tokens`, or a generation step of `GENERATION_BATCH_SIZE` sequences), at an assumed bandwidth for each
    place."""
    calls = (work.layer_forward + work.layer_gradient) / batch_tokens
    calls = calls + work.generated_tokens * (shape.num_layers / GENERATION_BATCH_SIZE)
    layer_bytes = sum(shape.layer_parameters) / shape.num_layers * shape.dtype_bytes
    return sum((calls * (share * layer_bytes / ASSUMED_OFFLOAD_BYTES_PER_SECOND[place]) for place, share in shares.items()), ZERO)


def process_bytes() -> int:
    """This process's resident memory now (0 where `/proc` cannot tell): the interpreter, torch and transformers, which
    the pruning process holds too. Part of the peak where the device is the host CPU."""
    try:
        with open("/proc/self/statm") as file:
            return int(file.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return 0
