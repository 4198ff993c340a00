# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Stage 1's state: its settings ([`Stage1Settings`]), what it is asked to do on one model ([`Stage1Plan`]), each
finished round ([`Round`]), what it decided
([`Selection`]), and the resume checkpoint that keeps the finished rounds ([`Stage1Checkpoint`])."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedModel

from ..configuration import ExecutionMode
from ..errors import InvalidInputError
from ..files import write_atomically
from ..metric_registry import ImportanceMetric
from ..settings import LayerAmount, StepSettings


@dataclass(frozen=True)
class Stage1Settings(StepSettings, LayerAmount):
    """Stage 1's settings: the fields of [`~optimum_gradmap.GradMAPConfig`] that say how many layers go and how they
    are chosen, under the same names (their meaning is told there), frozen; `Stage1Settings.from_config(config)`
    takes them from a config. [`Stage1Plan`] is what they resolve to on one model."""

    pruning_ratio: float | None
    num_layers_to_prune: int | None
    layers_to_prune: list[int] | None
    max_loss_increase: float | None
    target_num_parameters: int | None
    loss_curve: bool
    importance: str | ImportanceMetric
    iterative: bool | None
    protected_layers: list[int] | None
    verify_top_k: int | None
    verify_halving: bool
    compensate_each_round: bool
    execution: ExecutionMode
    batch_size: int
    seed: int


@dataclass(frozen=True)
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
