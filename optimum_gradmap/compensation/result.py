# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""What Stage 2 did ([`CompensationResult`]): the drift before and after, the layers compensated and how, and the
backup that undoes it."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..weights import WeightBackup


@dataclass
class CompensationResult:
    """What Stage 2 did. Layer indices are indices in the dense model.

    Args:
        drift (`dict[int, float]`): Mean drift (Eq. 10) of each kept layer before compensation.
        drift_after_compensation (`dict[int, float]`): The same, measured again after the folds.
        compensated_layers (`list[int]`): Layers whose down projection received W', in fitting order.
        objective (`dict[int, dict[str, float]]`): For each compensated layer, the objective at W' = I
            (`"identity"`) and at the learned W' (`"fitted"`).
        targets (`dict[int, int]`): For each fitted layer, the dense layer whose output it was fitted to.
        reg_lambda (`dict[int, float]`): For each compensated layer, the lambda of Eq. 14 its fit used.
        skipped_layers (`dict[int, str]`): Target layers left as they were, and why.
        validation (`dict[str, float]`, *optional*): With validation data, its perplexity without and with
            the compensation, and whether the compensation was kept.
        refinement (`dict[str, float]`, *optional*): With `refinement_steps`, the held-out distillation loss
            before and after the refinement, and the step kept.
        seconds (`float`): Time Stage 2 took.
        calibration_sha256 (`str`, *optional*): The SHA-256 of the sequences the fits used (the calibration set, or
            `compensation_dataset`'s sequences), as `optimum_gradmap.data.calibration_sha256` gives it.
        backup (`WeightBackup`, *optional*): The folded tensors as they were before the fold; `restore()`
            undoes Stage 2 (to re-run it with other settings).
    """

    drift: dict[int, float] = field(default_factory=dict)
    drift_after_compensation: dict[int, float] = field(default_factory=dict)
    compensated_layers: list[int] = field(default_factory=list)
    objective: dict[int, dict[str, float]] = field(default_factory=dict)
    targets: dict[int, int] = field(default_factory=dict)
    reg_lambda: dict[int, float] = field(default_factory=dict)
    skipped_layers: dict[int, str] = field(default_factory=dict)
    validation: dict[str, float] | None = None
    refinement: dict[str, float] | None = None
    seconds: float = 0.0
    calibration_sha256: str | None = None
    backup: WeightBackup | None = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict:
        """A JSON-serialisable summary (layer indices as strings, no backup)."""
        by_layer = lambda values: {str(index): value for index, value in values.items()}  # noqa: E731
        return {
            "compensated_layers": self.compensated_layers,
            "drift": by_layer(self.drift),
            "drift_after_compensation": by_layer(self.drift_after_compensation),
            "objective": by_layer(self.objective),
            "targets": by_layer(self.targets),
            "reg_lambda": by_layer(self.reg_lambda),
            "skipped_layers": by_layer(self.skipped_layers),
            "validation": self.validation,
            "refinement": self.refinement,
            "seconds": self.seconds,
            "calibration_sha256": self.calibration_sha256,
        }

    def undo(self) -> None:
        """Puts the folded tensors back as they were before Stage 2."""
        if self.backup is not None:
            self.backup.restore()
