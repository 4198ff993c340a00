# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""The pipeline: a GradMAP run as a list of steps.

A step ([`Step`]) is one object built once from [`~optimum_gradmap.GradMAPConfig`], holding its own frozen settings,
with a small lifecycle: `check_settings` (what its settings alone decide, before any weight is read), `check`
(everything else that can refuse it, before any step changes a weight), `plan` (its stage in the dry run's plan),
`run`, and `undo`. [`pruning_steps`] gives the list a configuration asks for:

| step | module | settings | undo |
|---|---|---|---|
| [`SelectLayers`] (Stage 1) | [`stage1`] | [`~optimum_gradmap.importance.Stage1Settings`] | the removed layers put back |
| [`Compensate`] (Stage 2) | [`stage2`] | [`~optimum_gradmap.compensation.Stage2Settings`] | W' unfolded |
| [`Heal`] | [`heal`] | [`~optimum_gradmap.heal.HealSettings`] | the trained weights put back from a copy |
| [`Quantize`] | [`quantize`] | [`~optimum_gradmap.quantize.QuantizationSettings`] | the model put back from a copy |

and the `prune` command ends its list with [`Evaluate`] and [`Save`] ([`output`]). [`run_steps`] checks every step
before the first one runs, and when one fails undoes every step that started, the last first.
[`~optimum_gradmap.GradMAPPruner.prune`], the commands and [`plan_pruning`] walk the same list.

The algorithm packages below it (`importance`, `compensation`, `heal`, `quantize`, `evaluation`) take a model,
tensors and their settings and return a value; they never import this package.
"""

from .heal import Heal
from .output import Evaluate, Save
from .plan import check_inputs_have_steps, plan_pruning, pruning_steps
from .quantize import Quantize
from .run import Run, RunInputs, Step, check_steps, run_checked_steps, run_steps
from .stage1 import SelectLayers, cut
from .stage2 import Compensate

__all__ = [
    "Compensate",
    "Evaluate",
    "Heal",
    "Quantize",
    "Run",
    "RunInputs",
    "Save",
    "SelectLayers",
    "Step",
    "check_inputs_have_steps",
    "check_steps",
    "cut",
    "plan_pruning",
    "pruning_steps",
    "run_checked_steps",
    "run_steps",
]
