# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""The steps that end a command's run, after the ones that change the model: [`Evaluate`] (held-out perplexity of the
dense model and of the model the run made, `prune --evaluate`) and [`Save`] (the checkpoint, its report and card)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from transformers.utils import logging

from .. import distributed
from ..checkpoint import check_output_location
from ..data import check_dataset_name
from ..errors import InvalidInputError
from ..evaluation import EvaluationResult, evaluate
from .run import Run, Step

logger = logging.get_logger(__name__)


@dataclasses.dataclass(frozen=True)
class Evaluate(Step):
    """Held-out perplexity of the dense model (measured in its check, before any step changes the model) and of the
    model the run made, on 128-token segments. With several processes each scores its share of the segments and every
    process gets the perplexity of all of them ([`~optimum_gradmap.evaluation.evaluate`] with
    `shared_by_processes=True`).

    Args:
        datasets (`tuple[str, ...]`): The datasets; empty: those of `evaluate`.
        max_segments (`int`, *optional*): Only the first segments of each (`None`: all).
        announce (`bool`, defaults to `False`): Print the dense model's figures as soon as they are measured (by the
            main process), before the run goes on.
    """

    name = "Evaluation"
    changes_weights = False
    datasets: tuple[str, ...] = ()
    max_segments: int | None = None
    announce: bool = False

    def check_settings(self) -> None:
        for dataset in self.datasets:
            check_dataset_name(dataset, "evaluation")
        if self.max_segments is not None and self.max_segments < 1:
            raise InvalidInputError(f"--max-segments must be at least 1, got {self.max_segments}.")

    def check(self, run: Run) -> None:
        """Measures the dense model, kept in `run.dense_evaluation`."""
        run.dense_evaluation = self.measure(run)
        for entry in run.dense_evaluation.perplexities if self.announce and distributed.is_main_process() else ():
            print(f"dense model: {entry.dataset} perplexity {entry.perplexity:.3f} ({entry.protocol})", flush=True)

    def plan(self, planner: Any) -> None:
        planner.plan_evaluation()

    def run(self, run: Run) -> None:
        """Measures the model the run made, kept in `run.evaluation`."""
        run.evaluation = self.measure(run)

    def measure(self, run: Run) -> EvaluationResult:
        datasets = {"perplexity_datasets": list(self.datasets)} if self.datasets else {}
        return evaluate(
            run.model,
            run.tokenizer,
            **datasets,
            segment_length=128,
            max_segments=self.max_segments,
            progress_bar=run.progress_bar,
            shared_by_processes=True,
        )


@dataclasses.dataclass(frozen=True)
class Save(Step):
    """Writes the result as a standard checkpoint with its report and model card
    ([`~optimum_gradmap.PruningResult.save_pretrained`]), by the main process; the others wait for it. The folder is
    checked before any weight is read; the save is atomic, so a failed one leaves nothing behind.

    Args:
        directory (`str`, *optional*): The output folder (`None`: the dry run's, which plans the disk alone).
        overwrite (`bool`): Replace the contents of an existing non-empty folder.
        keep_safe (`tuple[str, ...]`): Folders never written (the model's own).
        card (`dict`): The model card's `base_model`, `base_model_revision`, `license`, `repo_id` and `command`.
    """

    name = "Save"
    changes_weights = False
    directory: str | None = None
    overwrite: bool = False
    keep_safe: tuple[str, ...] = ()
    card: dict[str, Any] = dataclasses.field(default_factory=dict)

    def check_settings(self) -> None:
        if self.directory is not None:
            check_output_location(self.directory, self.overwrite, keep_safe=self.keep_safe)

    def plan(self, planner: Any) -> None:
        planner.plan_save()

    def run(self, run: Run) -> None:
        run.result.save_pretrained(
            self.directory,
            evaluation=run.evaluation,
            dense_evaluation=run.dense_evaluation,
            overwrite=self.overwrite,
            **self.card,
        )
        logger.info(f"Saved the checkpoint to {os.path.abspath(self.directory)}")
