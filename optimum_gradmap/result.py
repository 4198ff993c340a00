# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""[`PruningResult`]: what a pruning run did, and how to save or publish the pruned model."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .checkpoint import save_checkpoint
from .compensation import CompensationResult
from .configuration import GradMAPConfig
from .data import calibration_sha256
from .errors import InvalidInputError
from .heal import HealResult
from .hub import save_and_upload
from .quantize.stage import QuantizationResult
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
        scores (`list[dict[int, float]]`): Stage 1 scores of the layers present in each round.
        verified (`list[dict[int, float]]`): With `verify_top_k`, the calibration loss without each
            shortlisted layer, every round (with `verify_halving`, a candidate dropped before the last rung
            has its mean over the rungs it was measured on).
        original_num_parameters (`int`): Parameters of the dense model.
        timings (`dict[str, float]`): Seconds spent in each stage.
        calibration_ids (`torch.LongTensor`): The calibration sequences used.
        calibration_source (`str`, *optional*): Where they came from (a dataset name, data given directly).
        config ([`GradMAPConfig`]): The configuration of the run (with the Stage 2 settings last used).
        tokenizer (`PreTrainedTokenizerBase`, *optional*): The tokenizer, saved with the model.
        compensation ([`CompensationResult`], *optional*): What Stage 2 did (drift before and after, the
            compensated layers, their targets, lambdas and objectives, the layers left alone and why);
            `None` before Stage 2 runs, and without it.
        compensated_during_stage1 (`list[dict]`): With `compensate_each_round`, each fit made after a
            removal: the layer, its target, its lambda (`None`: left alone).
        dense_layer_config (`dict[str, Any]`): The dense model's values of every config field that layer
            surgery rewrites (layer count, `layer_types`, `max_window_layers`, ...): with `kept_layers`, they
            let [`validate_checkpoint`] recompute what the saved config must say.
        dense_loss (`float`, *optional*): The dense model's calibration loss, when the loss was followed
            (`max_loss_increase`, `loss_curve`).
        loss_curve (`list[float]`): The calibration loss after each removal, in removal order (the curve).
        stopped (`str`, *optional*): Why Stage 1 stopped before K removals (a budget, a parameter target).
        rejected (`dict[str, float]`, *optional*): The removal a budget refused: its layer and the loss it gave.
        precision (`dict`, *optional*): How Stage 1's and Stage 2's passes computed (`computed_in`), how many
            decisions they made (`decisions`), each one recomputed in float32 because its margin lay within the bound
            (`recomputed`: the decision, its candidates, the seconds) and the seconds of those (`recompute_seconds`),
            and Stage 2's lambdas chosen among strengths the bound cannot tell apart (`within_bound`)
            ([`optimum_gradmap.precision`]).
        heal ([`~optimum_gradmap.heal.HealResult`], *optional*): What the heal stage did (what it trained, on which
            text, the held-out KL curve); `None` without it.
        quantization ([`~optimum_gradmap.quantize.QuantizationResult`], *optional*): What the quantization step did
            (its scheme, recipe and calibration); `None` without it.
        steps (`list[str]`): The steps of the pipeline that made the model, in the order they ran (`"Stage 1"`,
            `"Stage 2"`, `"Heal"`, `"Quantize"`).
    """

    model: PreTrainedModel
    original_num_layers: int
    num_layers_to_prune: int
    removed_layers: list[int] = field(default_factory=list)
    kept_layers: list[int] = field(default_factory=list)
    scores: list[dict[int, float]] = field(default_factory=list)
    verified: list[dict[int, float]] = field(default_factory=list)
    original_num_parameters: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    calibration_ids: torch.LongTensor | None = field(default=None, repr=False)
    calibration_source: str | None = None
    config: GradMAPConfig | None = None
    tokenizer: PreTrainedTokenizerBase | None = field(default=None, repr=False, compare=False)
    compensation: CompensationResult | None = None
    compensated_during_stage1: list[dict[str, Any]] = field(default_factory=list)
    dense_layer_config: dict[str, Any] = field(default_factory=dict)
    dense_loss: float | None = None
    loss_curve: list[float] = field(default_factory=list)
    stopped: str | None = None
    precision: dict[str, Any] | None = None
    rejected: dict[str, float] | None = None
    heal: HealResult | None = None
    quantization: QuantizationResult | None = None
    steps: list[str] = field(default_factory=list)

    @property
    def compensated_layers(self) -> list[int]:
        """The layers whose down projection received W' (`compensation.compensated_layers`; none without Stage 2)."""
        return self.compensation.compensated_layers if self.compensation is not None else []

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
            "scores": [{str(index): score for index, score in round_scores.items()} for round_scores in self.scores],
            "verified": [{str(index): loss for index, loss in losses.items()} for losses in self.verified],
            "original_num_parameters": self.original_num_parameters,
            "num_parameters": self.model.num_parameters(),
            "compensation": self.compensation.to_dict() if self.compensation is not None else None,
            "compensated_during_stage1": self.compensated_during_stage1,
            "dense_layer_config": self.dense_layer_config,
            "dense_loss": self.dense_loss,
            "loss_curve": self.loss_curve,
            "stopped": self.stopped,
            "rejected": self.rejected,
            "precision": self.precision,
            "heal": self.heal.to_dict() if self.heal is not None else None,
            "quantization": self.quantization.to_dict() if self.quantization is not None else None,
            "steps": self.steps,
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
        command: str | None = None,
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
            command (`str`, *optional*): The command line that made the model (`optimum-gradmap prune ...`, which
                passes its own): the report's `reproduce` entry and the model card's "Reproduce" section give it.
                `None`: they say the model was made through the Python API, with a snippet that rebuilds the config.
            save_kwargs: Passed to the model's `save_pretrained`.

        Returns:
            `str`: The folder.
        """
        if self.config is None:
            raise InvalidInputError("This result has no `config`: it cannot say how the model was pruned.")
        report = build_report(
            self.model,
            self.to_dict(),
            self.config,
            base_model,
            base_model_revision=base_model_revision,
            license=license,
            evaluation=evaluation,
            dense_evaluation=dense_evaluation,
            command=command,
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

        With several processes ([`optimum_gradmap.distributed`]), the main process saves and uploads; every
        process returns the URL.

        Returns:
            `str`: The URL of the commit.
        """
        return save_and_upload(
            lambda folder: self.save_pretrained(folder, tokenizer=tokenizer, repo_id=repo_id, **save_kwargs),
            repo_id,
            private=private,
            token=token,
            commit_message=commit_message or self.commit_message(),
        )


def refuse_after_heal(result: PruningResult, what: str) -> None:
    """Refuses to change a healed result's stack or folds: the heal stage trained the model they left."""
    if result.heal is not None:
        raise InvalidInputError(
            f"This result was healed already: {what} would build on weights the heal stage changed (the pruner's dense "
            "layers no longer make the dense model with them). Heal last and once, or start again from the dense model."
        )
