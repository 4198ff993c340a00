# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""The pipeline: the steps a configuration asks for ([`pruning_steps`]), which `GradMAPPruner.prune`, the commands and
the dry run's plan ([`plan_pruning`]) walk in the same order."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from transformers import PretrainedConfig, PreTrainedModel

from ..configuration import GradMAPConfig
from ..errors import InvalidInputError
from ..planning import Planner, PruningPlan
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
    steps: Sequence[Step] | None = None,
    **kwargs: Any,
) -> PruningPlan:
    """The plan of a pruning run ([`GradMAPPruner.plan`], `prune --dry-run`): each step of the run adds its stage to a
    [`~optimum_gradmap.planning.Planner`], in the order the run makes them: the steps `config` asks for
    ([`pruning_steps`]), then the evaluation and the save. See [`~optimum_gradmap.planning.PruningPlan`] and
    [`optimum_gradmap.planning`].

    ```python
    >>> plan = plan_pruning("HuggingFaceTB/SmolLM2-135M", GradMAPConfig(pruning_ratio=0.25), dtype=torch.bfloat16)
    >>> print(plan)  # a table; plan.to_dict() for JSON
    ```

    Args:
        model_or_path (`PreTrainedModel`, `PretrainedConfig`, `str` or `os.PathLike`): The model, its config, a local
            folder or a Hub id (only `config.json` is read).
        config ([`GradMAPConfig`]): The run.
        steps (`Sequence[Step]`, *optional*): The steps to plan; defaults to `config`'s, the evaluation and the save
            (the `prune` command passes its own).
        kwargs: Where and how the run computes, and what is known of it ([`~optimum_gradmap.planning.Planner.for_model`]:
            `dtype`, `device`, `throughput`, `execution`, `device_map`, `max_memory`, `removed_layers`, `validation`,
            `evaluation_tokens`, `tokenizer_bytes`, `measure`, `name`, `host_allocator_overhead`).

    Returns:
        [`~optimum_gradmap.planning.PruningPlan`].
    """
    planner = Planner.for_model(model_or_path, config, **kwargs)
    for step in steps if steps is not None else [*pruning_steps(config), Evaluate(), Save()]:
        step.plan(planner)
    return planner.finish()
