# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""[`PruningResult`]: what a pruning run did, and how to save or publish the pruned model."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ._deprecation import warn_deprecated
from .checkpoint import save_checkpoint
from .configuration import GradMAPConfig
from .data import calibration_sha256
from .hub import upload_checkpoint
from .report import build_report

if TYPE_CHECKING:
    from .evaluation import EvaluationResult


@dataclass
class PruningResult:
    """What a GradMAP run did. Layer indices are always indices in the original (dense) model.

    Args:
        model (`PreTrainedModel`): The pruned model (the same object that was passed in, changed in place).
        original_num_layers (`int`): Decoder layers before pruning.
        num_layers_to_prune (`int`): K, the number of layers removed.
        removed_layers (`list[int]`): Removed layers, in removal order.
        kept_layers (`list[int]`): Layers that remain, in model order.
        compensated_layers (`list[int]`): Layers whose down projection received a compensation matrix W'.
        scores (`list[dict[int, float]]`): Stage 1 scores of the layers present in each round.
        drift (`dict[int, float]`): Mean drift (Eq. 10) of each kept layer before compensation.
        drift_after_compensation (`dict[int, float]`): The same, measured again after Stage 2.
        original_num_parameters (`int`): Parameters of the dense model.
        compensation_objective (`dict[int, dict[str, float]]`): For each compensated layer, the Stage 2
            objective at W' = I and at the learned W'.
        timings (`dict[str, float]`): Seconds spent in each stage.
        calibration_ids (`torch.LongTensor`): The calibration sequences used.
        calibration_source (`str`, *optional*): Where they came from (a dataset name, data given directly).
        config ([`GradMAPConfig`]): The configuration of the run (with the Stage 2 settings last used).
        tokenizer (`PreTrainedTokenizerBase`, *optional*): The tokenizer, saved with the model.
        verified (`list[dict[int, float]]`): With `verify_top_k`, the calibration loss without each
            shortlisted layer, every round (with `verify_halving`, a candidate dropped before the last rung
            has its mean over the rungs it was measured on).
        compensation_targets (`dict[int, int]`): For each layer Stage 2 fitted, the dense layer whose
            output it was fitted to (itself with `"max_drift"`, the end of a removed run with `"span_end"`).
        compensation_lambda (`dict[int, float]`): For each compensated layer, the lambda its fit used.
        uncompensated_layers (`dict[int, str]`): Target layers Stage 2 left as they were, and why.
        compensation_validation (`dict`, *optional*): With validation data, its perplexity without and
            with the compensation, and whether the compensation was kept.
        compensated_during_stage1 (`list[dict]`): With `compensate_each_round`, each fit made after a
            removal: the layer, its target, its lambda (`None`: left alone).
        dense_layer_config (`dict[str, Any]`): The dense model's values of every config field that layer
            surgery rewrites (layer count, `layer_types`, `max_window_layers`, ...): with `kept_layers`, they
            let [`validate_checkpoint`] recompute what the saved config must say.
    """

    model: PreTrainedModel
    original_num_layers: int
    num_layers_to_prune: int
    removed_layers: list[int] = field(default_factory=list)
    kept_layers: list[int] = field(default_factory=list)
    compensated_layers: list[int] = field(default_factory=list)
    scores: list[dict[int, float]] = field(default_factory=list)
    drift: dict[int, float] = field(default_factory=dict)
    drift_after_compensation: dict[int, float] = field(default_factory=dict)
    original_num_parameters: int = 0
    compensation_objective: dict[int, dict[str, float]] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    calibration_ids: torch.LongTensor | None = field(default=None, repr=False)
    calibration_source: str | None = None
    config: GradMAPConfig | None = None
    tokenizer: PreTrainedTokenizerBase | None = field(default=None, repr=False, compare=False)
    verified: list[dict[int, float]] = field(default_factory=list)
    compensation_targets: dict[int, int] = field(default_factory=dict)
    compensation_lambda: dict[int, float] = field(default_factory=dict)
    uncompensated_layers: dict[int, str] = field(default_factory=dict)
    compensation_validation: dict[str, float] | None = None
    compensated_during_stage1: list[dict[str, Any]] = field(default_factory=list)
    dense_layer_config: dict[str, Any] = field(default_factory=dict)

    @property
    def snapshot(self) -> None:
        """Deprecated: the result no longer holds the dense model's layers (the pruner does, until `release`)."""
        warn_deprecated(
            "PruningResult.snapshot",
            "nothing: it is always None now; the pruner holds the dense layers between `select_layers` and "
            "`compensate`, and `GradMAPPruner.release()` frees them",
        )
        return None

    @property
    def calibration_sha256(self) -> str | None:
        """The SHA-256 of the calibration token ids: equal for the same sequences in the same order."""
        return calibration_sha256(self.calibration_ids) if self.calibration_ids is not None else None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable summary (no model, no tensors)."""
        return {
            "original_num_layers": self.original_num_layers,
            "num_layers_to_prune": self.num_layers_to_prune,
            "removed_layers": self.removed_layers,
            "kept_layers": self.kept_layers,
            "compensated_layers": self.compensated_layers,
            "scores": [{str(index): score for index, score in round_scores.items()} for round_scores in self.scores],
            "verified": [{str(index): loss for index, loss in losses.items()} for losses in self.verified],
            "drift": {str(index): value for index, value in self.drift.items()},
            "drift_after_compensation": {str(index): value for index, value in self.drift_after_compensation.items()},
            "original_num_parameters": self.original_num_parameters,
            "num_parameters": self.model.num_parameters(),
            "compensation_objective": {str(index): values for index, values in self.compensation_objective.items()},
            "compensation_targets": {str(index): target for index, target in self.compensation_targets.items()},
            "compensation_lambda": {str(index): value for index, value in self.compensation_lambda.items()},
            "uncompensated_layers": {str(index): why for index, why in self.uncompensated_layers.items()},
            "compensation_validation": self.compensation_validation,
            "compensated_during_stage1": self.compensated_during_stage1,
            "dense_layer_config": self.dense_layer_config,
            "timings": self.timings,
            "calibration_source": self.calibration_source,
            "calibration_sha256": self.calibration_sha256,
        }

    def commit_message(self) -> str:
        """A Hub commit message that says which layers were removed and compensated."""
        importance = self.config.importance_name if self.config is not None else "gradmap"
        return (
            f"GradMAP ({importance}): remove {len(self.removed_layers)} of {self.original_num_layers} layers "
            f"{self.removed_layers}, compensate {self.compensated_layers}"
        )

    def save_pretrained(
        self,
        save_directory: str | os.PathLike,
        tokenizer: PreTrainedTokenizerBase | None = None,
        evaluation: EvaluationResult | None = None,
        base_model: str | None = None,
        base_model_revision: str | None = None,
        license: str | None = None,
        repo_id: str | None = None,
        overwrite: bool = False,
        dense_evaluation: EvaluationResult | None = None,
        **save_kwargs: Any,
    ) -> str:
        """Writes a standard checkpoint that plain `AutoModelForCausalLM.from_pretrained` loads: model,
        tokenizer, `gradmap_config.json`, `pruning_report.json` with its pictures, and a model card
        (see [`optimum_gradmap.report`]). The folder is checked with [`validate_checkpoint`].

        Args:
            save_directory (`str` or `os.PathLike`): Output folder.
            tokenizer (`PreTrainedTokenizerBase`, *optional*): Defaults to the result's tokenizer.
            evaluation ([`EvaluationResult`], *optional*): Evaluation results for the report and the card.
            base_model (`str`, *optional*): Hub id of the dense model, when its `name_or_path` is a local folder.
            base_model_revision (`str`, *optional*): Its revision; defaults to the commit it was loaded from, if known.
            license (`str`, *optional*): The base model's license (the pruned weights inherit it).
            repo_id (`str`, *optional*): Hub repository named in the model card's examples.
            overwrite (`bool`): Replace the contents of an existing non-empty folder (refused otherwise). The
                save is atomic either way (see [`save_checkpoint`]).
            dense_evaluation ([`EvaluationResult`], *optional*): The same evaluation of the dense model, measured
                before pruning: the model card then shows what pruning cost.
            save_kwargs: Passed to the model's `save_pretrained`.

        Returns:
            `str`: The folder.
        """
        if self.config is None:
            raise ValueError("This result has no `config`: it cannot say how the model was pruned.")
        report = build_report(
            self.model,
            self.to_dict(),
            self.config,
            base_model,
            base_model_revision=base_model_revision,
            license=license,
            evaluation=evaluation,
            dense_evaluation=dense_evaluation,
        )
        return save_checkpoint(
            save_directory,
            self.model,
            tokenizer or self.tokenizer,
            self.config,
            report,
            repo_id=repo_id,
            overwrite=overwrite,
            **save_kwargs,
        )

    def push_to_hub(
        self,
        repo_id: str,
        tokenizer: PreTrainedTokenizerBase | None = None,
        private: bool | None = None,
        token: str | bool | None = None,
        commit_message: str | None = None,
        **save_kwargs: Any,
    ) -> str:
        """Saves the checkpoint (as [`~PruningResult.save_pretrained`], which takes `save_kwargs`) into a
        temporary folder and uploads it to the Hub with `huggingface_hub.HfApi` in one commit.

        Args:
            repo_id (`str`): `user/name` or `org/name`; created if missing.
            tokenizer (`PreTrainedTokenizerBase`, *optional*): Defaults to the result's tokenizer.
            private (`bool`, *optional*): Visibility of a new repository (the Hub's default if `None`).
            token (`str` or `bool`, *optional*): Defaults to the usual places (`HF_TOKEN`, `hf auth login`); never printed.
            commit_message (`str`, *optional*): Defaults to [`~PruningResult.commit_message`].

        Returns:
            `str`: The URL of the commit.
        """
        with tempfile.TemporaryDirectory() as folder:
            self.save_pretrained(folder, tokenizer=tokenizer, repo_id=repo_id, **save_kwargs)
            message = commit_message or self.commit_message()
            return upload_checkpoint(folder, repo_id, private=private, token=token, commit_message=message)
