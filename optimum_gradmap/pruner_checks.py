# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""The checks [`~optimum_gradmap.GradMAPPruner`] makes before a stage changes anything: what Stage 1 will do and what
it refuses ([`stage1_plan`]), the sequences Stage 2 fits on, the token ids of every text, the layers a budget leaves
for Stage 2, and a result the heal stage trained already."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel
from transformers.utils import logging

from . import distributed
from .compensation import check_auto_lambda_data, check_num_compensated_layers
from .compensation.refinement import check_refinement_data
from .configuration import GradMAPConfig
from .errors import InvalidInputError
from .importance import get_importance_metric
from .importance.selection import Stage1Plan
from .result import PruningResult
from .surgery import LayerSnapshot

logger = logging.get_logger(__name__)


def stage1_plan(config: GradMAPConfig, num_layers: int) -> Stage1Plan:
    """What Stage 1 will do on a model of `num_layers` layers; refuses, before any change, a number of
    layers to remove the model cannot lose."""
    num_to_prune = config.num_layers_to_remove(num_layers)
    if num_to_prune < 1:
        raise InvalidInputError(
            f"pruning_ratio={config.pruning_ratio} of {num_layers} layers rounds to 0 layers: "
            "raise the ratio or give `num_layers_to_prune`."
        )
    if config.layers_to_prune is not None and max(config.layers_to_prune) >= num_layers:
        raise InvalidInputError(
            f"layers_to_prune={config.layers_to_prune} names layers the model does not have: "
            f"it has {num_layers} decoder layers, indexed 0 to {num_layers - 1}."
        )
    if num_to_prune >= num_layers:
        raise InvalidInputError(
            f"Cannot remove {num_to_prune} of the model's {num_layers} decoder layers: at least one must "
            f"remain. Choose num_layers_to_prune <= {num_layers - 1}."
        )
    protected = config.resolved_protected_layers(num_layers)
    if config.layers_to_prune is not None and protected and protected & set(config.layers_to_prune):
        raise InvalidInputError(
            f"layers_to_prune={config.layers_to_prune} names the protected layer(s) "
            f"{sorted(protected & set(config.layers_to_prune))} (protected_layers={config.protected_layers}): "
            "remove them from one of the two lists."
        )
    if config.unused_stage1_settings():
        logger.warning(
            f"layers_to_prune={config.layers_to_prune} names the layers to remove, so Stage 1 scores nothing: "
            f"{', '.join(config.unused_stage1_settings())} are not used."
        )
    if config.compensation and not config.has_budget:
        check_num_compensated_layers(config.num_compensated_layers, num_layers - num_to_prune, config.compensation_target)
    elif config.compensation and config.compensation_target == "max_drift" and config.num_compensated_layers > num_layers:
        # with a budget, K is known only as Stage 1 goes (checked at each removal); no budget keeps more than all
        raise InvalidInputError(
            f"num_compensated_layers={config.num_compensated_layers} exceeds the {num_layers} layers the model has: "
            f"Stage 2 cannot fit more layers than remain after pruning. Use num_compensated_layers <= "
            f"{num_layers - num_to_prune} (valid whatever the budget removes), or compensation_target='span_end'."
        )
    metric = get_importance_metric(config.importance, seed=config.seed)
    return Stage1Plan(
        metric=metric,
        iterative=metric.iterative if config.iterative is None else config.iterative,
        num_to_prune=num_to_prune,
        protected=protected,
        verify_top_k=config.verify_top_k,
        verify_halving=config.verify_halving,
        verify_from_scoring_pass=config.verify_from_scoring_pass,
        batch_size=config.batch_size,
        seed=config.seed,
        compensate_each_round=config.compensate_each_round,
        max_loss_increase=config.max_loss_increase,
        target_num_parameters=config.target_num_parameters,
        loss_curve=config.loss_curve,
    )


def check_fit_ids(fit_ids: torch.LongTensor, config: GradMAPConfig) -> None:
    """Refuses, before anything changes, sequences Stage 2 cannot fit on as `config` says: too few for
    `reg_lambda="auto"`'s folds or `refinement_steps`'s held-out fold, or fewer than the processes sharing them."""
    if config.reg_lambda == "auto":
        check_auto_lambda_data(fit_ids)
    if config.refinement_steps:
        check_refinement_data(fit_ids)
    distributed.shard_bounds(fit_ids.shape[0])


def check_layers_left_for_stage2(config: GradMAPConfig, dense: LayerSnapshot, removed: int, plan: Stage1Plan) -> None:
    """With a budget, refuses the removal after which fewer layers remain than Stage 2 fits (`max_drift`'s
    `num_compensated_layers`): Stage 2 would fail, so Stage 1 stops there (and its removals are undone)."""
    num_kept = len(dense.kept_layers())
    if config.compensation_target == "max_drift" and config.num_compensated_layers > num_kept:
        raise InvalidInputError(
            f"num_compensated_layers={config.num_compensated_layers} exceeds the {num_kept} layers that remain once "
            f"Stage 1 removed layer {removed}: with a budget it may remove up to {plan.num_to_prune} of the "
            f"{dense.num_layers} layers. Use num_compensated_layers <= {dense.num_layers - plan.num_to_prune} (valid "
            "whatever the budget removes), a smaller num_layers_to_prune, or compensation_target='span_end'. "
            "Stage 1's removals were undone."
        )


def check_token_ids(ids: torch.LongTensor, model: PreTrainedModel) -> None:
    """Refuses token ids outside the model's vocabulary."""
    vocab_size = model.get_input_embeddings().weight.shape[0]
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise InvalidInputError(f"Calibration token ids must lie in [0, {vocab_size}), the model's vocabulary.")


def refuse_after_heal(result: PruningResult, what: str) -> None:
    """Refuses to change a healed result's stack or folds: the heal stage trained the model they left."""
    if result.heal is not None:
        raise InvalidInputError(
            f"This result was healed already: {what} would build on weights the heal stage changed (the pruner's dense "
            "layers no longer make the dense model with them). Heal last and once, or start again from the dense model."
        )
