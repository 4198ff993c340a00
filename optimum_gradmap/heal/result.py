# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""What the heal stage did: [`HealResult`], kept in the pruning report."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class HealResult:
    """What the heal stage did.

    Attributes:
        trainable (`str`): What was trained (`heal_trainable`).
        num_trainable_parameters (`int`): How many parameters were trained (LoRA's adapters for `lora`).
        dataset (`str`): The text it was trained on.
        train_sha256 (`str`), validation_sha256 (`str`): The SHA-256 of the training and held-out token ids.
        budget_tokens (`int`): The tokens of the training sequences, all of which an uninterrupted run trains on: the
            budget (`heal_tokens`) rounded up to whole `heal_seq_len`-token sequences.
        trained_tokens (`int`): The tokens trained on (fewer after an interruption).
        steps (`int`), num_steps (`int`): Steps taken, of those planned.
        learning_rate (`float`), batch_size (`int`), seq_len (`int`): The settings.
        loss (`str`): What was minimised (`heal_loss`).
        autocast (`bool`): Whether the passes ran under bfloat16 autocast.
        teacher_seconds (`float`): The teacher's pass over every sequence.
        seconds (`float`): The whole stage, teacher included.
        kl_curve (`list[list[float]]`): `[tokens trained, held-out KL]` at each check, the start included.
        start_kl (`float`), best_kl (`float`): The held-out KL before training and of the state kept.
        best_tokens (`int`): The tokens trained when the state kept was reached (0: the start).
        interrupted (`bool`): Whether training was stopped by Ctrl-C (the best state so far was kept).
        generation_seconds (`float`): The seconds spent on the dense model's own text (`generated` in
            `heal_dataset`), included in `seconds`.
        budget_seconds (`float`, *optional*): With `heal_tokens="auto"`, the time the heal was given (a share
            `AUTO_TIME_SHARE` of Stage 1's); `budget_tokens` is then the number it chose.
        stopped_at_budget (`bool`): Whether training stopped before its last step because the time was up (the best
            state so far was kept).
        budget_basis (`str`, *optional*): With `heal_tokens="auto"`, where Stage 1's time came from: `"measured"` (the
            run's own Stage 1) or `"predicted"` (the plan's Stage 1 for the layers removed, where no Stage 1 scored:
            `layers_to_prune`, `--cut-from`), or `"resumed"` (the count an interrupted run chose, kept in its
            checkpoint).
    """

    trainable: str
    num_trainable_parameters: int
    dataset: str
    train_sha256: str
    validation_sha256: str
    budget_tokens: int
    trained_tokens: int = 0
    steps: int = 0
    num_steps: int = 0
    learning_rate: float = 0.0
    batch_size: int = 0
    seq_len: int = 0
    loss: str = "kl"
    autocast: bool = False
    teacher_seconds: float = 0.0
    seconds: float = 0.0
    kl_curve: list[list[float]] = field(default_factory=list)
    start_kl: float = math.nan
    best_kl: float = math.nan
    best_tokens: int = 0
    interrupted: bool = False
    generation_seconds: float = 0.0
    budget_seconds: float | None = None
    stopped_at_budget: bool = False
    budget_basis: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The result, JSON-serialisable."""
        return asdict(self)

    def summary(self) -> str:
        """One line: what was trained, on what, and the held-out KL before and after."""
        stopped = " (interrupted: the best state so far was kept)" if self.interrupted else ""
        if self.stopped_at_budget:
            stopped = " (stopped when its time was up: the best state so far was kept)"
        if self.budget_seconds is not None:
            basis = f", from Stage 1's {self.budget_basis} time" if self.budget_basis in ("measured", "predicted") else ""
            if self.budget_basis == "resumed":
                basis = ", the count of the interrupted run it resumed"
            stopped += f" (heal_tokens='auto' chose {self.budget_tokens:,} tokens for {self.budget_seconds:.0f} s{basis})"
        kept = "" if self.best_tokens else " (no state beat the start: the model is as it came)"
        loss = "" if self.loss == "kl" else f" with heal_loss={self.loss!r}"
        return (
            f"Healed {self.trainable} ({self.num_trainable_parameters:,} parameters){loss} on {self.trained_tokens:,} tokens of "
            f"{self.dataset}{stopped}: held-out KL from the dense model {self.start_kl:.4f} -> {self.best_kl:.4f}{kept} "
            f"in {self.seconds:.0f} s."
        )
