# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""The heal as a step of the pipeline ([`Heal`]): its text read and checked before Stage 1 (or before a later heal of
a pruned result), the heal with its teacher made of the run's dense layers, Stage 1's time for `heal_tokens="auto"`
([`stage1_seconds`]), and its undo."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.utils import logging

from ..adapters import get_adapter
from ..configuration import GradMAPConfig
from ..data import check_token_ids
from ..errors import InvalidInputError
from ..heal import (
    HealSettings,
    HealText,
    PlannedPruning,
    PrunedLayout,
    check_heal_checkpoint_origin,
    heal_backup,
    heal_stage,
    prepare_heal_text,
)
from ..planning import Planner
from ..result import PruningResult, refuse_after_heal
from ..weights import WeightBackup, available_host_bytes, is_linear_map
from .run import Run, Step

logger = logging.get_logger(__name__)


def pruned_layout(result: PruningResult) -> PrunedLayout:
    """The layers of `result`'s model: the kept ones, the dense model's number and those Stage 2 compensated."""
    return PrunedLayout(result.kept_layers, result.original_num_layers, result.compensated_layers)


@dataclasses.dataclass(frozen=True)
class Heal(Step):
    """The heal: distils the dense model's next-token distribution into the pruned model and merges what was trained
    into plain weights ([`optimum_gradmap.heal`]).

    Args:
        settings ([`~optimum_gradmap.heal.HealSettings`]): How it heals.
        undoable (`bool`, defaults to `False`): Keep a copy of every weight the heal changes, so that a later step's
            failure puts the model back (a step after the heal can fail: quantization). It costs as many host bytes as
            those weights (for LoRA, the linear maps of the kept layers), which the plan counts; where they do not fit
            in the host memory available, the check says so and the heal keeps none (a later failure leaves its
            changes).
        pruning ([`~optimum_gradmap.heal.PlannedPruning`], *optional*): In a run that starts with Stage 1, what is known
            of its pruning (whether Stage 2 runs, the layers given): the heal is checked against it before Stage 1.
            `None`: a heal of a pruned result (checked against its layers).
    """

    name = "Heal"
    summary = "optional: the dense model distilled into the pruned one, merged into plain weights"
    settings: HealSettings
    undoable: bool = False
    pruning: PlannedPruning | None = None

    @classmethod
    def from_config(cls, config: GradMAPConfig) -> Heal:
        """The heal of a run that starts with Stage 1; it keeps what undoes it where a step after it can fail and
        change weights (quantization)."""
        pruning = PlannedPruning(config.compensation, config.layers_to_prune)
        return cls(HealSettings.from_config(config), undoable=bool(config.quantization), pruning=pruning)

    def check(self, run: Run) -> None:
        """Before Stage 1: the heal's settings, text and prompts, and its checkpoint file's origin. On a pruned result
        (a later heal): a result healed already, a teacher, the settings against its layers, and the text. The text
        known before the heal starts is kept in `run.heal_text`."""
        settings, inputs = self.settings, run.inputs
        if self.pruning is not None:
            text = self.text(run, self.pruning)
            ids = (text.train_ids, text.validation_ids) if text is not None else (None, None)
            check_heal_checkpoint_origin(inputs.heal_checkpoint, run.model, *ids, settings)
        else:
            refuse_after_heal(run.result, "a second heal")
            if inputs.teacher is None and run.dense is None:
                raise InvalidInputError(
                    "The heal's teacher is the dense model: give it as `teacher=`, or heal the result of this pruner's "
                    "last `select_layers` before `prune` or `release` drops its dense layers."
                )
            text = self.text(run, pruned_layout(run.result))
        run.heal_text = text
        if self.undoable:
            self.check_copy(run)

    def check_copy(self, run: Run) -> None:
        """Whether the copy that undoes the heal fits in the host memory available (`run.heal_undoable`), measured on
        the weights of the kind the heal changes in every layer (the most it may copy); says so where it does not."""
        layers = get_adapter(run.model).get_layers(run.model)
        modules = [module for layer in layers for module in layer.modules()]
        if self.settings.heal_trainable == "lora":
            tensors = [module.weight for module in modules if is_linear_map(module)]
        elif self.settings.heal_trainable == "norms":
            tensors = [p for module in modules if "norm" in type(module).__name__.lower() for p in module.parameters(False)]
        else:
            tensors = [parameter for layer in layers for parameter in layer.parameters()]
        needed, available = sum(tensor.numel() * tensor.element_size() for tensor in tensors), available_host_bytes()
        run.heal_undoable = available is None or needed <= available
        if not run.heal_undoable:
            logger.warning(
                f"The heal cannot keep a copy of the weights it changes ({needed / 2**30:.1f} GiB, {available / 2**30:.1f} "
                "GiB available): if the quantization after it fails, the model keeps the heal's changes."
            )

    def text(self, run: Run, pruning: PrunedLayout | PlannedPruning) -> HealText | None:
        """[`~optimum_gradmap.heal.prepare_heal_text`] with the token-id check of the model's vocabulary."""
        model, data = run.model, run.inputs.heal_data
        return prepare_heal_text(model, data, self.settings, pruning, run.tokenizer_for, lambda ids: check_token_ids(ids, model))

    def plan(self, planner) -> None:
        planner.plan_heal()

    def run(self, run: Run) -> None:
        """Heals `run.result`'s model in place: `result.heal`, `.config` and `.timings["heal"]` say what it did."""
        result, settings, inputs = run.result, self.settings, run.inputs
        layout = pruned_layout(result)
        if self.undoable and run.heal_undoable:
            run.heal_backup = heal_backup(result.model, settings.heal_trainable)
        config = dataclasses.replace(result.config or run.config, **dataclasses.asdict(settings))
        data = inputs.heal_data if inputs.heal_data is not None else settings.heal_dataset
        seconds, basis = stage1_seconds(result, config, inputs.teacher)
        result.heal = heal_stage(
            result.model,
            self.teacher(run),
            settings,
            run.tokenizer_for(data) if run.heal_text is None else None,
            layout,
            data=inputs.heal_data,
            text=run.heal_text,
            stage1_seconds=seconds,
            stage1_basis=basis,
            checkpoint=inputs.heal_checkpoint,
            text_cache=inputs.heal_text_cache,
            progress_bar=run.progress_bar,
            check_ids=lambda ids: check_token_ids(ids, result.model),
            prompt_data=inputs.calibration_data,
        )
        result.config = config
        result.timings["heal"] = result.heal.seconds

    def teacher(self, run: Run) -> Any:
        """The dense model's context: the one given, else the run's dense stack with its removed layers put back and
        every fold undone (those made between Stage 1's removals, and Stage 2's)."""
        if run.inputs.teacher is not None:
            return lambda: contextlib.nullcontext(run.inputs.teacher)
        backups: list[WeightBackup] = [done.backup for done in run.run_compensations]
        if run.result.compensation is not None and run.result.compensation.backup is not None:
            backups.append(run.result.compensation.backup)
        return lambda: run.dense.dense_model(backups)

    def undo(self, run: Run) -> None:
        """Puts back the weights the heal changed (where it kept a copy; a heal that failed part-way has put them back
        itself) and forgets what it did."""
        if run.heal_backup is not None:
            run.heal_backup.restore()
            run.heal_backup = None
        if run.result is not None and run.result.heal is not None:
            run.result.heal = None
            run.result.timings.pop("heal", None)


def stage1_seconds(result: PruningResult, config: GradMAPConfig, teacher: PreTrainedModel | None) -> tuple[float | None, str]:
    """Stage 1's time for `heal_tokens="auto"`, and where it comes from: the time measured, or, where no Stage 1 scored
    (`layers_to_prune`, a cut replayed from an earlier run), the plan's time for a Stage 1 that removes as many layers
    ([`predicted_stage1_seconds`], on the dense model's config, its throughput measured here)."""
    measured = result.timings.get("stage1")
    if config.heal_tokens != "auto" or config.layers_to_prune is None:
        return measured, "measured"
    if teacher is not None:
        dense_config = teacher.config
    else:  # the pruned model's config with the dense model's layer fields
        dense_config = copy.deepcopy(result.model.config)
        text_config = dense_config.get_text_config(decoder=True)
        for name, value in result.dense_layer_config.items():
            setattr(text_config, name, copy.deepcopy(value))
    parameter = next(result.model.parameters())
    return predicted_stage1_seconds(dense_config, config, len(result.removed_layers), parameter), "predicted"


def predicted_stage1_seconds(dense_model: Any, config: GradMAPConfig, num_removed: int, parameter: torch.nn.Parameter) -> float:
    """The plan's time (its upper end) for a Stage 1 that scores `num_removed` removals from the dense model: what
    `heal_tokens="auto"` is sized by where no Stage 1 ran (`layers_to_prune`, a cut replayed from an earlier run).

    Args:
        dense_model (`PretrainedConfig` or `str`): The dense model's config, or its Hub id or folder.
        config ([`GradMAPConfig`]): The run's settings; Stage 1's are planned with `num_layers_to_prune=num_removed`.
        num_removed (`int`): How many layers the run removed.
        parameter (`torch.nn.Parameter`): A parameter of the model: its dtype and device are the plan's.

    Returns:
        `float`: the predicted seconds (Stage 1's stage of a [`~optimum_gradmap.planning.Planner`], its throughput
        measured here).
    """
    scored = dataclasses.replace(config, layers_to_prune=None, num_layers_to_prune=num_removed, heal_tokens=0, compensation=False)
    planner = Planner.for_model(dense_model, scored, dtype=parameter.dtype, device=parameter.device, tokenizer_bytes=0)
    planner.plan_stage1()
    (stage1,) = planner.stages
    seconds = stage1.seconds.high
    logger.info(
        f"Heal: heal_tokens='auto' sizes the heal by Stage 1's predicted time ({seconds:.1f} s for scoring "
        f"{num_removed} removals): layers_to_prune={config.layers_to_prune} ran no Stage 1."
    )
    return seconds
