# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""The pipeline: the steps a configuration asks for ([`pruning_steps`]), which `GradMAPPruner.prune`, the commands and
the dry run's plan ([`plan_pruning`]) walk in the same order."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
from transformers import PretrainedConfig, PreTrainedModel

from ..configuration import GradMAPConfig
from ..errors import InvalidInputError
from ..planning import DeviceThroughput, Planner, PruningPlan
from .heal import Heal
from .output import Evaluate, Save
from .quantize import Quantize
from .run import RunInputs, Step
from .stage1 import SelectLayers
from .stage2 import Compensate


def pruning_steps(config: GradMAPConfig) -> list[Step]:
    """The steps `config` asks for, in the order they run: Stage 1, then Stage 2 (`compensation`), the heal
    (`heal_tokens`) and quantization (`quantization`)."""
    steps: list[Step] = [SelectLayers.from_config(config)]
    if config.compensation:
        steps.append(Compensate.from_config(config))
    if config.heal_tokens:
        steps.append(Heal.from_config(config))
    if config.quantization:
        steps.append(Quantize.from_config(config))
    return steps


def check_inputs_have_steps(config: GradMAPConfig, inputs: RunInputs) -> None:
    """Refuses text given for a step that does not run: it would be ignored."""
    if not config.compensation and (inputs.compensation_data is not None or config.compensation_dataset is not None):
        raise InvalidInputError(
            "Text for Stage 2 was given (`compensation_data` or `compensation_dataset`), but Stage 2 is off "
            "(`compensation=False`): turn it on, or leave the text out."
        )
    if not config.compensation and inputs.validation_data is not None:
        raise InvalidInputError(
            "`validation_data` was given, but Stage 2 is off (`compensation=False`): it decides whether Stage 2's "
            "compensation is kept. Turn Stage 2 on, or leave `validation_data` out."
        )
    if not config.heal_tokens and inputs.heal_data is not None:
        raise InvalidInputError(
            "`heal_data` was given, but the heal stage is off (`heal_tokens=0`): give it a budget, or leave the text out."
        )


def plan_pruning(
    model_or_path: PreTrainedModel | PretrainedConfig | str | os.PathLike,
    config: GradMAPConfig,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device | None = None,
    throughput: DeviceThroughput | None = None,
    execution: str | None = None,
    device_map: str | dict[str, Any] | None = None,
    max_memory: dict[int | str, str] | None = None,
    removed_layers: Sequence[int] | None = None,
    validation: bool = False,
    evaluation_tokens: int = 0,
    tokenizer_bytes: int | None = None,
    measure: bool = True,
    name: str | None = None,
    host_allocator_overhead: float | None = None,
    steps: Sequence[Step] | None = None,
) -> PruningPlan:
    """The plan of a pruning run ([`GradMAPPruner.plan`], `prune --dry-run`): each step of the run adds its stage to a
    [`~optimum_gradmap.planning.Planner`], in the order the run makes them: the steps `config` asks for
    ([`pruning_steps`]), then the evaluation and the save. See [`~optimum_gradmap.planning.PruningPlan`] and
    [`optimum_gradmap.planning`].

    Args:
        model_or_path (`PreTrainedModel`, `PretrainedConfig`, `str` or `os.PathLike`): The model, its config, a local
            folder or a Hub id (only `config.json` is read).
        config ([`GradMAPConfig`]): The run.
        dtype (`torch.dtype` or `str`, defaults to `torch.float32`): The dtype the model computes in (`"checkpoint"`:
            the one its config names).
        device (`str` or `torch.device`, *optional*): Where it computes (defaults to the CPU).
        throughput ([`~optimum_gradmap.planning.DeviceThroughput`], *optional*): The device's rates; measured on
            `device` when not given and `measure` is on.
        execution (`str`, *optional*): `"in_memory"` or `"layer_streamed"`; defaults to what `config.execution` chooses
            (`"auto"`: layer-streamed where `device_map` offloads layers).
        device_map (`str` or `dict`, *optional*), max_memory (`dict`, *optional*): As `from_pretrained` takes them:
            where Accelerate would offload layers, inferred on the meta model.
        removed_layers (`Sequence[int]`, *optional*): The layers Stage 1 will remove, when known (a Stage 1
            checkpoint, an earlier run): Stage 2's counts then are exact.
        validation (`bool`, defaults to `False`): Stage 2 checks its compensation on validation text.
        evaluation_tokens (`int`, defaults to 0): Tokens of `prune --evaluate`'s perplexity (dense and pruned).
        tokenizer_bytes (`int`, *optional*): The tokenizer's files; read from a local folder when not given.
        measure (`bool`, defaults to `True`): Measure the throughput when none is given (else no time is told).
        name (`str`, *optional*): The model's name in the plan; defaults to `model_or_path`.
        host_allocator_overhead (`float`, *optional*): On a CPU device, the resident bytes one byte of a pass's tensors
            takes: an assumption about the C allocator, which keeps freed blocks. `None`:
            [`~optimum_gradmap.planning.HOST_ALLOCATOR_OVERHEAD`]
            (1.48, measured with glibc's malloc on one machine); 1.0 for an allocator that returns freed memory.

        steps (`Sequence[Step]`, *optional*): The steps to plan; defaults to `config`'s, the evaluation and the save
            (the `prune` command passes its own).

    Returns:
        [`~optimum_gradmap.planning.PruningPlan`].
    """
    planner = Planner.for_model(
        model_or_path,
        config,
        dtype=dtype,
        device=device,
        throughput=throughput,
        execution=execution,
        device_map=device_map,
        max_memory=max_memory,
        removed_layers=removed_layers,
        validation=validation,
        evaluation_tokens=evaluation_tokens,
        tokenizer_bytes=tokenizer_bytes,
        measure=measure,
        name=name,
        host_allocator_overhead=host_allocator_overhead,
    )
    for step in steps if steps is not None else [*pruning_steps(config), Evaluate(), Save()]:
        step.plan(planner)
    return planner.finish()
