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
"""

from __future__ import annotations

import itertools
import json
import math
import os
import time
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.utils import logging

from .. import distributed, streaming
from ..adapters import DecoderAdapter
from ..errors import InvalidInputError
from ..files import write_atomically
from ..passes import RecordedLayerInputs, mean_next_token_loss
from ..surgery import LayerSnapshot
from .metrics import removal_losses
from .registry import ImportanceMetric

logger = logging.get_logger(__name__)


@dataclass
class Selection:
    """What Stage 1 decided.

    Args:
        removed_layers (`list[int]`): Removed layers, in removal order.
        kept_layers (`list[int]`): Layers that remain, in model order.
        scores (`list[dict[int, float]]`): The scores of the layers present in each round.
        verified (`list[dict[int, float]]`): With a verified shortlist, the calibration loss without
            each shortlisted layer, every round (with `verify_halving`, a candidate dropped before the last
            rung has its mean over the rungs it was measured on).
        resumed_seconds (`float`): Seconds of the rounds replayed from a checkpoint (spent in an earlier run).
        dense_loss (`float`, *optional*): The dense model's calibration loss, when the loss is followed.
        losses (`list[float]`): The calibration loss after each removal (the curve), when it is followed.
        stopped (`str`, *optional*): Why Stage 1 stopped before K removals (a budget, a parameter target).
        rejected (`dict[str, float]`, *optional*): The removal a budget refused: its layer and the loss it gave.
    """

    removed_layers: list[int] = field(default_factory=list)
    kept_layers: list[int] = field(default_factory=list)
    scores: list[dict[int, float]] = field(default_factory=list)
    verified: list[dict[int, float]] = field(default_factory=list)
    resumed_seconds: float = 0.0
    dense_loss: float | None = None
    losses: list[float] = field(default_factory=list)
    stopped: str | None = None
    rejected: dict[str, float] | None = None


class Stage1Checkpoint:
    """Stage 1's progress in a JSON file: the scores, removed layers and seconds of each finished round,
    with the fingerprint of the run that wrote them (model shape, metric, K, calibration set).

    Args:
        path (`str` or `os.PathLike`): The file; read now if it exists, rewritten after every round.
        fingerprint (`dict`): What this run is; a file written by another run is refused.

    Raises:
        ValueError: the file is not a Stage 1 checkpoint, or comes from a different run.
    """

    def __init__(self, path: str | os.PathLike, fingerprint: dict[str, Any]):
        self.path = os.fspath(path)
        self.fingerprint = fingerprint
        self.rounds: list[dict[str, Any]] = []
        if os.path.exists(self.path):
            try:
                with open(self.path, encoding="utf-8") as file:
                    saved = json.load(file)
                saved_fingerprint, self.rounds = dict(saved["fingerprint"]), list(saved["rounds"])
            except (OSError, ValueError, KeyError, TypeError) as error:
                raise InvalidInputError(
                    f"{self.path} is not a Stage 1 checkpoint ({error}): delete it, or pass another `stage1_checkpoint`."
                ) from error
            different = {
                key: (saved_fingerprint.get(key), fingerprint.get(key))
                for key in dict.fromkeys([*fingerprint, *saved_fingerprint])
                if saved_fingerprint.get(key) != fingerprint.get(key)
            }
            if different:
                details = ", ".join(f"{key}: saved {saved!r}, now {now!r}" for key, (saved, now) in different.items())
                raise InvalidInputError(
                    f"{self.path} was written by a different Stage 1 run ({details}). Delete it to start over, "
                    "or pass another `stage1_checkpoint`."
                )

    def save_round(
        self,
        scores: dict[int, float],
        removed: list[int],
        seconds: float,
        verified: dict[int, float] | None = None,
        loss: float | None = None,
    ) -> None:
        """Appends a finished round and rewrites the file (atomically: a crash leaves the old one)."""
        round_record = {"scores": {str(index): score for index, score in scores.items()}, "removed": removed, "seconds": seconds}
        if verified:
            round_record["verified"] = {str(index): loss for index, loss in verified.items()}
        if loss is not None:
            round_record["loss"] = loss
        self.rounds.append(round_record)
        write_atomically(self.path, json.dumps({"fingerprint": self.fingerprint, "rounds": self.rounds}, indent=1))


@dataclass
class Stage1Plan:
    """What Stage 1 does, resolved for one model (the pruner builds it from `GradMAPConfig`).

    Args:
        metric (`ImportanceMetric`): The score.
        iterative (`bool`): Re-score the remaining layers after every removal.
        num_to_prune (`int`): K.
        protected (`set[int]`, *optional*): Layers never removed; `None` for the metric's own
            ([`ImportanceMetric.protected_layers`]).
        verify_top_k (`int`, *optional*): Size of the shortlist verified each round ([`verify_shortlist`]).
        verify_halving (`bool`, defaults to `False`): Verify the shortlist by successive halving.
        verify_from_scoring_pass (`bool`, defaults to `False`): Start the shortlist's check from the layer inputs the
            round's scoring pass computed (one process, weights in memory; elsewhere the check runs its own pass).
        batch_size (`int`, defaults to 8): Sequences per pass.
        seed (`int`, defaults to 0): The seed of the calibration draw and of random metrics.
        compensate_each_round (`bool`, defaults to `False`): Stage 2 runs after every removal (recorded in
            the fingerprint: it changes what later rounds score).
        max_loss_increase (`float`, *optional*): The budget: stop before a removal that would raise the
            calibration loss more than this fraction above the dense model's (0.1: +10%).
        target_num_parameters (`int`, *optional*): Stop once the model has no more parameters than this.
        loss_curve (`bool`, defaults to `False`): Measure the calibration loss after every removal.
    """

    metric: ImportanceMetric
    iterative: bool
    num_to_prune: int
    protected: set[int] | None = None
    verify_top_k: int | None = None
    verify_halving: bool = False
    verify_from_scoring_pass: bool = False
    batch_size: int = 8
    seed: int = 0
    compensate_each_round: bool = False
    max_loss_increase: float | None = None
    target_num_parameters: int | None = None
    loss_curve: bool = False

    @property
    def measures_loss(self) -> bool:
        """Whether the calibration loss is measured after every removal (for the curve or the budget)."""
        return self.loss_curve or self.max_loss_increase is not None

    @property
    def has_budget(self) -> bool:
        """Whether a budget or a size target decides K (`num_to_prune` is then only the most to remove)."""
        return self.max_loss_increase is not None or self.target_num_parameters is not None

    @property
    def one_per_round(self) -> bool:
        """Whether every round removes one layer (iterative, verified, or followed by a loss or a target),
        rather than all K at once."""
        return self.iterative or self.verify_top_k is not None or self.measures_loss or self.target_num_parameters is not None

    def protected_layers(self, num_layers: int) -> set[int]:
        """The layers never removed, for a model of `num_layers` layers."""
        return self.metric.protected_layers(num_layers) if self.protected is None else set(self.protected)

    def fingerprint(self, model: PreTrainedModel, num_layers: int, calibration_sha256: str) -> dict[str, Any]:
        """What must be the same for a saved Stage 1 round to be valid in this run (the protected layers and
        the shortlist settings only when they are set, so files of earlier runs stay valid)."""
        settings = {
            "protected_layers": sorted(self.protected) if self.protected is not None else None,
            "verify_top_k": self.verify_top_k,
            "compensate_each_round": self.compensate_each_round or None,
            "verify_halving": self.verify_halving or None,
            "max_loss_increase": self.max_loss_increase,
            "target_num_parameters": self.target_num_parameters,
            "loss_curve": self.loss_curve or None,
        }
        return {
            **{key: value for key, value in settings.items() if value is not None},
            "model_type": model.config.model_type,
            "num_layers": num_layers,
            "hidden_size": model.get_input_embeddings().weight.shape[1],  # the embedding width, as saved checkpoints have it
            "importance": self.metric.name,
            "iterative": self.iterative,
            "seed": self.seed,
            "num_layers_to_prune": self.num_to_prune,
            "calibration_sha256": calibration_sha256,
        }


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


def halving_rungs(num_candidates: int, num_samples: int) -> int:
    """The number of rungs successive halving ([`verify_shortlist`]) splits the calibration sequences into.

    Args:
        num_candidates (`int`): k, the size of the shortlist.
        num_samples (`int`): The number of calibration sequences.

    Returns:
        `int`: ceil(log2 k), so that halving after every rung but the last leaves two finalists for the last
        (1 for k <= 2: plain verification), and never more rungs than sequences.
    """
    return max(1, min(math.ceil(math.log2(max(num_candidates, 1))), num_samples))


def verify_shortlist(
    model: PreTrainedModel,
    adapter: DecoderAdapter,
    calibration_ids: torch.LongTensor,
    batch_size: int,
    positions: list[int],
    halving: bool = False,
    progress_bar: bool = True,
    description: str = "Verifying removals",
    layer_inputs: Mapping[int, torch.Tensor] | None = None,
    returns_tuple: bool | None = None,
) -> tuple[dict[int, float], int]:
    """The calibration loss without each shortlisted layer ([`removal_losses`], SLEB's criterion), and the
    layer to remove.

    With `halving=False`, every candidate is measured on every calibration sequence. With `halving=True`,
    successive halving (Jamieson & Talwalkar, AISTATS 2016, "Non-stochastic Best Arm Identification and
    Hyperparameter Optimization", Algorithm 1, after Karnin et al., ICML 2013): the sequences are split into
    R = [`halving_rungs`] contiguous rungs; every candidate still in the race is measured on the next rung,
    and after each rung but the last only the better half (by its mean loss over every rung it has seen)
    goes on. The finalists (two, unless there are fewer rungs than halvings) are measured on every
    sequence, and the one with the lowest loss is removed. A candidate dropped earlier keeps its mean over
    the sequences it was measured on; that mean is not comparable with the finalists' (rungs differ in how
    hard their text is), so it is never the one removed. For a shortlist of 8, the candidates are measured
    on 8 + 4 + 2 thirds of the sequences: 58% of measuring all 8 on all of them (more where a rung ends in
    a part-filled batch; the layers before the deepest candidate still run once per sequence).

    Args:
        model (`PreTrainedModel`): The model as it is now.
        adapter (`DecoderAdapter`): Its adapter.
        calibration_ids (`torch.LongTensor` of shape `(num_samples, seq_len)`): Calibration sequences.
        batch_size (`int`): Sequences per pass.
        positions (`list[int]`): Positions, in the current stack, of the shortlisted layers.
        halving (`bool`, defaults to `False`): Use successive halving.
        progress_bar (`bool`, defaults to `True`): Show a progress bar per rung.
        description (`str`, defaults to `"Verifying removals"`): The progress bar's label.
        layer_inputs (`Mapping[int, torch.Tensor]`, *optional*): Position -> that layer's input on every calibration
            sequence, recorded by the scoring pass ([`~optimum_gradmap.passes.RecordedLayerInputs`]): the candidates
            then start from them, and no pass runs the layers before them. One process only.
        returns_tuple (`bool`, *optional*): With `layer_inputs`: whether the model's layers return a tuple.

    Returns:
        `tuple[dict[int, float], int]`: Position -> mean calibration loss without that layer (over the
        sequences it was measured on), and the position of the layer to remove (the lowest loss over every
        sequence; ties go to the lower position).

    Raises:
        ValueError: with several processes, when a rung has fewer sequences than there are processes.
    """
    num_rungs = halving_rungs(len(positions), calibration_ids.shape[0]) if halving else 1
    rungs = torch.tensor_split(calibration_ids, num_rungs)
    if distributed.world_size() > rungs[-1].shape[0]:
        raise InvalidInputError(
            f"verify_halving splits the {calibration_ids.shape[0]} calibration sequences into {num_rungs} rungs of "
            f"{rungs[-1].shape[0]} or more, fewer than the {distributed.world_size()} processes that share each "
            f"rung: use at least {num_rungs * distributed.world_size()} calibration sequences, or fewer processes."
        )

    if layer_inputs is not None and distributed.world_size() > 1:
        raise InvalidInputError(
            "Recorded layer inputs cover one process's sequences: verify without them under several processes."
        )
    offsets = [0, *itertools.accumulate(rung.shape[0] for rung in rungs)]

    def measure(rung_index: int, candidates: list[int], label: str) -> dict[int, float]:
        """The loss without each of `candidates`, over the sequences of rung `rung_index` (shared among the processes)."""
        if layer_inputs is not None:
            start, end = offsets[rung_index], offsets[rung_index + 1]
            return removal_losses(
                model,
                adapter,
                rungs[rung_index],
                batch_size,
                candidates,
                progress_bar,
                label,
                layer_inputs={position: layer_inputs[position][start:end] for position in candidates},
                returns_tuple=returns_tuple,
            )
        return distributed.mean_over_samples(
            partial(
                removal_losses,
                model,
                adapter,
                batch_size=batch_size,
                positions=candidates,
                progress_bar=progress_bar,
                description=label,
            ),
            rungs[rung_index],
        )

    if num_rungs == 1:  # every candidate on every sequence: the losses as measured
        losses = measure(0, positions, description)
        return losses, min(positions, key=lambda position: (losses[position], position))
    totals = dict.fromkeys(positions, 0.0)
    counts = dict.fromkeys(positions, 0)
    racing = list(positions)
    for rung_index, rung in enumerate(rungs):
        for position, loss in measure(rung_index, racing, f"{description}, rung {rung_index + 1}/{num_rungs}").items():
            totals[position] += loss * rung.shape[0]
            counts[position] += rung.shape[0]
        if rung_index < num_rungs - 1:
            ranked = sorted(racing, key=lambda position: (totals[position] / counts[position], position))
            racing = ranked[: max(2, math.ceil(len(racing) / 2))]
    means = {position: totals[position] / counts[position] for position in positions}
    return means, min(racing, key=lambda position: (means[position], position))


@dataclass
class Round:
    """One finished round of Stage 1.

    Args:
        scores (`dict[int, float]`): The scores of the layers present (dense indices).
        removed (`list[int]`): The layers it removed.
        verified (`dict[int, float]`): With a verified shortlist, the calibration loss without each candidate.
        seconds (`float`): How long it took (as recorded, for a round replayed from a checkpoint).
        loss (`float`, *optional*): The calibration loss after its removal, when it is followed.
    """

    scores: dict[int, float]
    removed: list[int]
    verified: dict[int, float] = field(default_factory=dict)
    seconds: float = 0.0
    loss: float | None = None

    @classmethod
    def from_saved(cls, saved: dict[str, Any]) -> Round:
        """A round as [`Stage1Checkpoint`] saved it."""
        return cls(
            scores={int(index): score for index, score in saved["scores"].items()},
            removed=[int(index) for index in saved["removed"]],
            verified={int(index): loss for index, loss in saved.get("verified", {}).items()},
            seconds=saved["seconds"],
            loss=saved.get("loss"),
        )


def remove_by_importance(
    dense: LayerSnapshot,
    plan: Stage1Plan,
    calibration_ids: torch.LongTensor,
    checkpoint: Stage1Checkpoint | None = None,
    progress_bar: bool = True,
    after_removal: Callable[[int], None] | None = None,
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

    Returns:
        [`Selection`].

    Raises:
        ValueError: when the protected layers leave fewer than K candidates (before any change).
    """
    protected = plan.protected_layers(dense.num_layers)
    candidates = [index for index in range(dense.num_layers) if index not in protected]
    num_to_prune = min(plan.num_to_prune, len(candidates)) if plan.has_budget else plan.num_to_prune
    if len(candidates) < num_to_prune:
        raise InvalidInputError(
            f"importance={plan.metric.name!r} never removes layers {sorted(protected)}, which leaves "
            f"{len(candidates)} candidates for {plan.num_to_prune} removals: prune fewer layers, or set `protected_layers`."
        )
    selection = Selection(kept_layers=list(range(dense.num_layers)))
    num_rounds = num_to_prune if plan.one_per_round else 1
    saved_rounds = checkpoint.rounds if checkpoint is not None else []
    if saved_rounds:
        logger.info(f"Resuming Stage 1 from {checkpoint.path}: {len(saved_rounds)} of {num_rounds} rounds are done.")
    if plan.measures_loss:
        selection.dense_loss = _calibration_loss(dense, plan, calibration_ids, progress_bar)
        logger.info(f"Dense model: calibration loss {selection.dense_loss:.6g}")
    previous_scores: dict[int, float] = {}
    for round_index in logging.tqdm(range(num_rounds), desc=f"Stage 1 ({plan.metric.name})", disable=not progress_bar):
        description = f"Round {round_index + 1}/{num_rounds}"
        if plan.target_num_parameters is not None and dense.model.num_parameters() <= plan.target_num_parameters:
            selection.stopped = (
                f"the model has {dense.model.num_parameters():,} parameters, the target {plan.target_num_parameters:,}"
            )
            break
        started = time.perf_counter()
        replayed = round_index < len(saved_rounds)
        if replayed:
            finished = Round.from_saved(saved_rounds[round_index])
            selection.resumed_seconds += finished.seconds
        else:
            remaining = [index for index in selection.kept_layers if index not in protected]
            finished = _score_round(
                dense, plan, selection.kept_layers, remaining, previous_scores, calibration_ids, progress_bar, description
            )
        previous_scores = finished.scores
        kept = [index for index in selection.kept_layers if index not in finished.removed]
        dense.keep(kept)
        if plan.measures_loss and finished.loss is None:
            finished.loss = _loss_after(dense, plan, finished, calibration_ids, progress_bar)
        if _over_budget(plan, selection, finished):
            dense.keep(selection.kept_layers)  # the removal is refused: the model stays as the last round left it
            break
        selection.scores.append(finished.scores)
        if finished.verified:
            selection.verified.append(finished.verified)
        selection.removed_layers.extend(finished.removed)
        selection.kept_layers = kept
        if finished.loss is not None:
            selection.losses.append(finished.loss)
        if after_removal is not None:
            for index in finished.removed:
                after_removal(index)
        if not replayed:
            finished.seconds = time.perf_counter() - started
            if checkpoint is not None:  # written by the main process; if it fails, every process raises
                distributed.on_main_process(
                    partial(
                        checkpoint.save_round,
                        finished.scores,
                        finished.removed,
                        finished.seconds,
                        finished.verified,
                        finished.loss,
                    )
                )
        _log_round(description, finished, selection.dense_loss)
    _warn_if_target_missed(dense, plan, selection, len(candidates))
    return selection


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


def _records_layer_inputs(plan: Stage1Plan, model: PreTrainedModel) -> bool:
    """Whether this round's scoring pass keeps the layer inputs for the shortlist's check: asked for, with a
    shortlist, one process and the weights in memory (layer streaming exists to hold one layer at a time)."""
    return (
        plan.verify_from_scoring_pass
        and plan.verify_top_k is not None
        and distributed.world_size() == 1
        and not streaming.streams(model)
    )


def _score_round(
    dense: LayerSnapshot,
    plan: Stage1Plan,
    kept: list[int],
    remaining: list[int],
    previous_scores: dict[int, float],
    calibration_ids: torch.LongTensor,
    progress_bar: bool,
    description: str,
) -> Round:
    """Scores the model as it is now (or, for a one-shot metric after its first round, reuses the first
    scores), verifies a shortlist if the plan says so, and says which layer(s) to remove."""
    model, adapter = dense.model, dense.adapter
    recorder = None
    if plan.iterative or not previous_scores:
        positions = [kept.index(index) for index in remaining]
        if _records_layer_inputs(plan, model):
            layers = adapter.get_layers(model)
            recorder = RecordedLayerInputs(model, {position: layers[position] for position in positions}, calibration_ids)
        with recorder or nullcontext():
            scored = score_on_shares(
                plan.metric, model, adapter, calibration_ids, plan.batch_size, positions, progress_bar, description
            )
        scores = {kept[position]: float(score) for position, score in scored.items()}
    else:  # a one-shot metric: the first round's scores of the layers that remain
        scores = {index: previous_scores[index] for index in kept if index in previous_scores}
    ranked = sorted(remaining, key=lambda index: (scores[index], index))
    if plan.verify_top_k is None:
        return Round(scores, ranked[:1] if plan.one_per_round else ranked[: plan.num_to_prune])
    shortlist = ranked[: plan.verify_top_k]
    layer_inputs = recorder.inputs() if recorder is not None else None
    if recorder is not None and layer_inputs is None:
        logger.info("The scoring pass did not run every calibration sequence in order: the shortlist check runs its own pass.")
    if layer_inputs is not None:  # keep the shortlist's inputs only
        layer_inputs = {kept.index(index): layer_inputs[kept.index(index)] for index in shortlist}
    losses, best = verify_shortlist(
        model,
        adapter,
        calibration_ids,
        plan.batch_size,
        [kept.index(index) for index in shortlist],
        halving=plan.verify_halving,
        progress_bar=progress_bar,
        description=description,
        layer_inputs=layer_inputs,
        returns_tuple=recorder.returns_tuple if recorder is not None else None,
    )
    return Round(scores, [kept[best]], verified={kept[position]: loss for position, loss in losses.items()})
