# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Stage 1's removal loop (Algorithm 1 of the paper), its budget, and its resume checkpoint.

Iterative metrics (GradMAP, SLEB) score the layers that remain, remove the lowest-scoring one and
score again, until K layers are gone; one-shot metrics score once and remove the K lowest. Ties go
to the lower layer index. Layers are always named by their index in the dense model.

With a budget (`Stage1Plan.max_loss_increase`) or a parameter target, layers are removed one at a time and
K is only a maximum: the loop stops before the removal that would raise the calibration loss more than the
budget above the dense model's, or once the model has no more parameters than the target. The calibration
loss after each removal (the curve, `Selection.losses`) comes free where the method measures it (SLEB's
scores, a verified shortlist) and costs one forward pass over the calibration set elsewhere. Removal being
nested, the first k layers of a run are the layers of a run with K = k: one run to the largest K gives the
whole curve ([`GradMAPPruner.cut`] keeps its first k removals).

Stage 1's state (its plan, rounds, decision and checkpoint) is in [`optimum_gradmap.importance.rounds`]; the verified
shortlist in [`optimum_gradmap.importance.shortlist`].
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial

import torch
from transformers import PreTrainedModel
from transformers.utils import logging

from .. import distributed
from ..adapters import DecoderAdapter
from ..errors import InvalidInputError
from ..metric_registry import ImportanceMetric
from ..objectives import mean_next_token_loss
from ..precision import LOSS_BOUND, Precision
from ..surgery import LayerSnapshot
from .rounds import Round, Selection, Stage1Checkpoint, Stage1Plan
from .shortlist import halving_rungs, verify_shortlist

__all__ = [
    "Round",
    "Selection",
    "Stage1Checkpoint",
    "Stage1Plan",
    "halving_rungs",
    "remove_by_importance",
    "remove_explicit_layers",
    "score_on_shares",
    "verify_shortlist",
]

logger = logging.get_logger(__name__)


def remove_explicit_layers(dense: LayerSnapshot, layers_to_prune: list[int]) -> Selection:
    """Removes exactly `layers_to_prune` (dense-model indices) from the model of `dense`, without scoring."""
    kept = [index for index in range(dense.num_layers) if index not in layers_to_prune]
    dense.keep(kept)
    return Selection(removed_layers=list(layers_to_prune), kept_layers=kept)


def score_on_shares(
    metric: ImportanceMetric,
    model: PreTrainedModel,
    adapter: DecoderAdapter,
    calibration_ids: torch.LongTensor,
    batch_size: int,
    positions: list[int],
    progress_bar: bool = True,
    description: str = "Scoring layers",
) -> dict[int, float]:
    """`metric.score_layers` on all calibration sequences; with several processes
    ([`optimum_gradmap.distributed`]), each scores its share and the means are averaged where the metric
    is a mean over sequences (`metric.mean_over_samples`), else every process scores all of them."""
    if not metric.mean_over_samples:
        return metric.score_layers(model, adapter, calibration_ids, batch_size, positions, progress_bar, description)
    return distributed.mean_over_samples(
        lambda ids: metric.score_layers(model, adapter, ids, batch_size, positions, progress_bar, description), calibration_ids
    )


def remove_by_importance(
    dense: LayerSnapshot,
    plan: Stage1Plan,
    calibration_ids: torch.LongTensor,
    checkpoint: Stage1Checkpoint | None = None,
    progress_bar: bool = True,
    after_removal: Callable[[int], None] | None = None,
    precision: Precision | None = None,
) -> Selection:
    """Algorithm 1: removes `plan.num_to_prune` layers from the model of `dense`, lowest score first.

    With `plan.verify_top_k=k`, every round removes one layer: the k lowest-scored candidates are each
    removed in turn and the calibration loss measured (SLEB's criterion, [`removal_losses`]), and the
    one whose removal raises it least goes (with `plan.verify_halving`, the better of the two finalists of
    [`verify_shortlist`]). A one-shot metric is scored once; an iterative one every round.

    Args:
        dense ([`LayerSnapshot`]): The dense stack of the model, which is changed in place.
        plan ([`Stage1Plan`]): What to do.
        calibration_ids (`torch.LongTensor` of shape `(num_samples, seq_len)`): Calibration sequences.
        checkpoint (`Stage1Checkpoint`, *optional*): Finished rounds to replay, and where to save new ones.
        progress_bar (`bool`, defaults to `True`): Show progress bars.
        after_removal (`Callable[[int], None]`, *optional*): Called with each removed layer once it is gone
            (before the next round scores the model), e.g. to compensate between removals.
        precision ([`~optimum_gradmap.precision.Precision`], *optional*): How the passes compute; with bfloat16
            passes, each round's choice (and the shortlist's, and the budget's stop) is recomputed in float32 where
            its margin lies within the bound ([`Precision.lowest`]). By default the model's own dtype.

    Returns:
        [`Selection`].

    Raises:
        ValueError: when the protected layers leave fewer than K candidates (before any change).
    """
    if precision is not None and precision.low is not None and precision.device_type not in plan.metric.bfloat16_devices:
        precision.log.float32.append(f"Stage 1 ({plan.metric.name}): bfloat16 does not pay for its recomputations here")
    if precision is None or plan.metric.precision_bound is None or precision.device_type not in plan.metric.bfloat16_devices:
        precision = Precision()  # the model's dtype: no bound was measured for this metric, or it does not pay here
    with precision.passes():
        return _remove_by_importance(dense, plan, calibration_ids, checkpoint, progress_bar, after_removal, precision)


def _remove_by_importance(
    dense: LayerSnapshot,
    plan: Stage1Plan,
    calibration_ids: torch.LongTensor,
    checkpoint: Stage1Checkpoint | None,
    progress_bar: bool,
    after_removal: Callable[[int], None] | None,
    precision: Precision,
) -> Selection:
    candidates, num_to_prune = _candidates(dense, plan)
    selection = Selection(kept_layers=list(range(dense.num_layers)))
    num_rounds = num_to_prune if plan.one_per_round else 1
    saved_rounds = checkpoint.rounds if checkpoint is not None else []
    if saved_rounds:
        logger.info(f"Resuming Stage 1 from {checkpoint.path}: {len(saved_rounds)} of {num_rounds} rounds are done.")
    if plan.measures_loss:
        with precision.exact():  # the budget's limit, in float32
            selection.dense_loss = _calibration_loss(dense, plan, calibration_ids, progress_bar)
        logger.info(f"Dense model: calibration loss {selection.dense_loss:.6g}")
    for round_index in logging.tqdm(range(num_rounds), desc=f"Stage 1 ({plan.metric.name})", disable=not progress_bar):
        description = f"Round {round_index + 1}/{num_rounds}"
        if _reached_target(dense, plan, selection):
            break
        started = time.perf_counter()
        replayed = round_index < len(saved_rounds)
        if replayed:
            finished = Round.from_saved(saved_rounds[round_index])
            selection.resumed_seconds += finished.seconds
        else:
            finished = _score_round(dense, plan, selection, calibration_ids, progress_bar, description, precision)
        if not _remove(dense, plan, selection, finished, calibration_ids, progress_bar, precision):
            break  # the removal is refused: the model stays as the last round left it
        if after_removal is not None:
            for index in finished.removed:
                after_removal(index)
        if not replayed:
            finished.seconds = time.perf_counter() - started
            _save_round(checkpoint, finished)
        _log_round(description, finished, selection.dense_loss)
    _warn_if_target_missed(dense, plan, selection, len(candidates))
    return selection


def _candidates(dense: LayerSnapshot, plan: Stage1Plan) -> tuple[list[int], int]:
    """The candidates (the layers not protected) and the number of removals to make (with a budget or a target, at
    most every candidate); refuses protected layers that leave fewer candidates than removals."""
    protected = plan.protected_layers(dense.num_layers)
    candidates = [index for index in range(dense.num_layers) if index not in protected]
    num_to_prune = min(plan.num_to_prune, len(candidates)) if plan.has_budget else plan.num_to_prune
    if len(candidates) < num_to_prune:
        raise InvalidInputError(
            f"importance={plan.metric.name!r} never removes layers {sorted(protected)}, which leaves "
            f"{len(candidates)} candidates for {plan.num_to_prune} removals: prune fewer layers, or set `protected_layers`."
        )
    return candidates, num_to_prune


def _reached_target(dense: LayerSnapshot, plan: Stage1Plan, selection: Selection) -> bool:
    """Whether the model has no more parameters than the plan's target; if so, says so in `selection`."""
    if plan.target_num_parameters is None or dense.model.num_parameters() > plan.target_num_parameters:
        return False
    selection.stopped = f"the model has {dense.model.num_parameters():,} parameters, the target {plan.target_num_parameters:,}"
    return True


def _remove(
    dense: LayerSnapshot,
    plan: Stage1Plan,
    selection: Selection,
    finished: Round,
    calibration_ids: torch.LongTensor,
    progress_bar: bool,
    precision: Precision,
) -> bool:
    """Removes the round's layers and records the round in `selection`, unless the removal breaks the budget (measured
    after it, in float32 where the loss lies within the bound of the budget's limit): the layers are then put back,
    and `False` returned."""
    kept = [index for index in selection.kept_layers if index not in finished.removed]
    dense.keep(kept)
    if plan.measures_loss and finished.loss is None:
        finished.loss = _loss_after(dense, plan, finished, calibration_ids, progress_bar)
    if plan.max_loss_increase is not None and finished.loss is not None:
        limit = selection.dense_loss * (1 + plan.max_loss_increase)
        exact_loss = lambda _: {"loss": _calibration_loss(dense, plan, calibration_ids, progress_bar)}  # noqa: E731
        # the budget's stop as a choice between the loss and the limit: recomputed where they lie within the bound
        _, values = precision.lowest({"loss": finished.loss, "limit": limit}, 1, LOSS_BOUND, exact_loss, "budget")
        finished.loss = values["loss"]
    if _over_budget(plan, selection, finished):
        dense.keep(selection.kept_layers)
        return False
    selection.scores.append(finished.scores)
    if finished.verified:
        selection.verified.append(finished.verified)
    selection.removed_layers.extend(finished.removed)
    selection.kept_layers = kept
    if finished.loss is not None:
        selection.losses.append(finished.loss)
    return True


def _save_round(checkpoint: Stage1Checkpoint | None, finished: Round) -> None:
    """Appends the round to the checkpoint, if any: written by the main process; if it fails, every process raises."""
    if checkpoint is not None:
        distributed.on_main_process(
            partial(checkpoint.save_round, finished.scores, finished.removed, finished.seconds, finished.verified, finished.loss)
        )


def _warn_if_target_missed(dense: LayerSnapshot, plan: Stage1Plan, selection: Selection, num_candidates: int) -> None:
    """Warns when Stage 1 made every removal it was allowed and the model is still above the parameter target (a
    budget that stopped it first says so in `selection.stopped` instead)."""
    if plan.target_num_parameters is None or selection.stopped is not None:
        return
    num_parameters = dense.model.num_parameters()
    if num_parameters <= plan.target_num_parameters:
        return
    removed = len(selection.removed_layers)
    if removed < plan.num_to_prune:  # the protected layers left fewer candidates than K
        limit = (
            f"the {num_candidates} that are not protected (protected layers: {sorted(plan.protected_layers(dense.num_layers))})"
        )
        further = "protect fewer layers (`protected_layers`)"
    else:
        limit = f"the most allowed (K = {plan.num_to_prune}, from `num_layers_to_prune` or `pruning_ratio`)"
        further = "raise `num_layers_to_prune` or `pruning_ratio` (or give neither: all but one layer are then allowed)"
    logger.warning(
        f"Stage 1 removed {removed} layers, {limit}, and the model still has {num_parameters:,} parameters, above "
        f"target_num_parameters={plan.target_num_parameters:,}. To go further, {further}."
    )


def _calibration_loss(dense: LayerSnapshot, plan: Stage1Plan, calibration_ids: torch.LongTensor, progress_bar: bool) -> float:
    """The calibration loss of the model as it is now (each process on its share, averaged)."""
    compute = lambda ids: {0: mean_next_token_loss(dense.model, ids, plan.batch_size, progress_bar, "Calibration loss")}  # noqa: E731
    return distributed.mean_over_samples(compute, calibration_ids)[0]


def _loss_after(
    dense: LayerSnapshot, plan: Stage1Plan, finished: Round, calibration_ids: torch.LongTensor, progress_bar: bool
) -> float:
    """The calibration loss after the round's removal: measured by the round already where the method
    measures it (a verified shortlist, SLEB's scores), else by one pass over the calibration set."""
    (removed,) = finished.removed
    if finished.verified:
        return finished.verified[removed]
    if plan.metric.scores_are_losses:
        return finished.scores[removed]
    return _calibration_loss(dense, plan, calibration_ids, progress_bar)


def _over_budget(plan: Stage1Plan, selection: Selection, finished: Round) -> bool:
    """Whether the round's removal breaks the budget; if so, says why in `selection`."""
    if plan.max_loss_increase is None or finished.loss is None:
        return False
    limit = selection.dense_loss * (1 + plan.max_loss_increase)
    if finished.loss <= limit:
        return False
    (removed,) = finished.removed
    increase = finished.loss / selection.dense_loss - 1
    selection.rejected = {"layer": removed, "loss": finished.loss}
    selection.stopped = (
        f"removing layer {removed} next would raise the calibration loss to {finished.loss:.6g} ({increase:+.1%} over the "
        f"dense model's {selection.dense_loss:.6g}), above the budget of {100 * plan.max_loss_increase:+g}%"
    )
    logger.info(f"Stage 1 stops: {selection.stopped}.")
    return True


def _log_round(description: str, finished: Round, dense_loss: float | None) -> None:
    for index in finished.removed:
        how = (
            f"calibration loss without it {finished.verified[index]:.6g}"
            if finished.verified
            else f"score {finished.scores[index]:.6g}"
        )
        curve = ""
        if finished.loss is not None and dense_loss is not None:
            curve = f"; calibration loss now {finished.loss:.6g} ({finished.loss / dense_loss - 1:+.1%} over dense)"
        logger.info(f"{description}: removed layer {index} ({how}){curve}")


def _score_round(
    dense: LayerSnapshot,
    plan: Stage1Plan,
    selection: Selection,
    calibration_ids: torch.LongTensor,
    progress_bar: bool,
    description: str,
    precision: Precision,
) -> Round:
    """Scores the layers `selection` kept (or, for a one-shot metric after its first round, reuses the first
    scores), verifies a shortlist of those not protected if the plan says so, and says which layer(s) to remove; each
    choice as float32 makes it ([`Precision.lowest`])."""
    model, adapter, kept = dense.model, dense.adapter, selection.kept_layers
    protected = plan.protected_layers(dense.num_layers)
    remaining = [index for index in kept if index not in protected]
    previous_scores = selection.scores[-1] if selection.scores else {}
    if plan.iterative or not previous_scores:
        positions = [kept.index(index) for index in remaining]
        scored = score_on_shares(
            plan.metric, model, adapter, calibration_ids, plan.batch_size, positions, progress_bar, description
        )
        scores = {kept[position]: float(score) for position, score in scored.items()}
    else:  # a one-shot metric: the first round's scores of the layers that remain
        scores = {index: previous_scores[index] for index in kept if index in previous_scores}

    def exact_scores(layers: list[int]) -> dict[int, float]:
        positions = [kept.index(index) for index in layers]
        scored = score_on_shares(
            plan.metric, model, adapter, calibration_ids, plan.batch_size, positions, progress_bar, description
        )
        return {kept[position]: float(score) for position, score in scored.items()}

    size = plan.verify_top_k if plan.verify_top_k is not None else 1 if plan.one_per_round else plan.num_to_prune
    candidates = {index: scores[index] for index in remaining}
    if plan.iterative or not previous_scores:
        ranked, candidates = precision.lowest(
            candidates, size, plan.metric.precision_bound, exact_scores, f"{description}: scores"
        )
        scores = {**scores, **candidates}
    else:  # the first round's scores, as they were decided
        ranked = sorted(candidates, key=lambda index: (candidates[index], index))[:size]
    if plan.verify_top_k is None:
        return Round(scores, ranked)
    shortlist = ranked
    losses, best, finalists = verify_shortlist(
        model,
        adapter,
        calibration_ids,
        plan.batch_size,
        [kept.index(index) for index in shortlist],
        halving=plan.verify_halving,
        progress_bar=progress_bar,
        description=description,
    )
    verified = {kept[position]: loss for position, loss in losses.items()}
    finalists = {kept[position]: losses[position] for position in finalists}

    def exact_losses(layers: list[int]) -> dict[int, float]:
        positions = [kept.index(index) for index in layers]
        exact, _, _ = verify_shortlist(
            model, adapter, calibration_ids, plan.batch_size, positions, progress_bar=progress_bar, description=description
        )
        return {kept[position]: loss for position, loss in exact.items()}

    (chosen,), finalists = precision.lowest(finalists, 1, LOSS_BOUND, exact_losses, f"{description}: shortlist")
    return Round(scores, [chosen], verified={**verified, **finalists})
