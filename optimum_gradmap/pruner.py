# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""The GradMAP pruner: Stage 1 (gradient-based layer selection, Algorithm 1) and Stage 2
(projection compensation), orchestrated on any model that has an architecture adapter."""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging

from .adapters import DecoderAdapter, LayerSnapshot, get_adapter
from .compensation import apply_compensation, hidden_state_means, learn_compensation, record_layer_outputs
from .configuration import GradMAPConfig
from .data import CalibrationData, calibration_sha256, is_text_data, prepare_calibration_data
from .hub import save_checkpoint, upload_checkpoint
from .importance import ImportanceMetric, get_importance_metric
from .report import build_report

if TYPE_CHECKING:
    from .evaluation import EvaluationResult

logger = logging.get_logger(__name__)

# Below this many calibration tokens per hidden unit, W' (hidden x hidden parameters) overfitted on
# SmolLM2-135M: 1.8 tokens per unit raised held-out perplexity by 60%, 7 by 2%, 28 lowered it.
MIN_TOKENS_PER_HIDDEN_UNIT = 16


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
    snapshot: LayerSnapshot | None = field(default=None, repr=False)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable summary (no model, no tensors)."""
        return {
            "original_num_layers": self.original_num_layers,
            "num_layers_to_prune": self.num_layers_to_prune,
            "removed_layers": self.removed_layers,
            "kept_layers": self.kept_layers,
            "compensated_layers": self.compensated_layers,
            "scores": [{str(index): score for index, score in round_scores.items()} for round_scores in self.scores],
            "drift": {str(index): value for index, value in self.drift.items()},
            "drift_after_compensation": {str(index): value for index, value in self.drift_after_compensation.items()},
            "original_num_parameters": self.original_num_parameters,
            "num_parameters": self.model.num_parameters(),
            "compensation_objective": {str(index): values for index, values in self.compensation_objective.items()},
            "timings": self.timings,
        }


class GradMAPPruner:
    """Removes whole decoder layers with GradMAP and repairs what the removal breaks.

    Args:
        config (`GradMAPConfig`): What to do.
        model (`PreTrainedModel`, *optional*): The model to prune when `prune` is called without one.
        tokenizer (`PreTrainedTokenizerBase`, *optional*): Used to tokenize calibration text.
        progress_bar (`bool`, defaults to `True`): Show tqdm progress bars.

    Example:

    ```python
    >>> from optimum_gradmap import GradMAPConfig, GradMAPPruner
    >>> pruner = GradMAPPruner.from_pretrained("HuggingFaceTB/SmolLM2-135M", GradMAPConfig(pruning_ratio=0.25))
    >>> result = pruner.prune()
    >>> result.removed_layers
    >>> pruner.save_pretrained("smollm2-gradmap-25")
    ```
    """

    def __init__(
        self,
        config: GradMAPConfig,
        model: PreTrainedModel | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        progress_bar: bool = True,
    ):
        if not isinstance(config, GradMAPConfig):
            raise TypeError(f"`config` must be a GradMAPConfig, got {type(config).__name__}.")
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.progress_bar = progress_bar
        self.result: PruningResult | None = None

    @classmethod
    def from_pretrained(
        cls,
        model_name_or_path: str | os.PathLike,
        config: GradMAPConfig,
        tokenizer: PreTrainedTokenizerBase | str | None = None,
        **model_kwargs: Any,
    ) -> "GradMAPPruner":
        """Loads a causal LM and its tokenizer (from the Hub or a local folder) into a new pruner.

        Args:
            model_name_or_path (`str` or `os.PathLike`): Hub model id or local checkpoint folder.
            config (`GradMAPConfig`): What to do.
            tokenizer (`PreTrainedTokenizerBase` or `str`, *optional*): A tokenizer, or where to load
                it from; defaults to `model_name_or_path`.
            model_kwargs: Passed to `AutoModelForCausalLM.from_pretrained` (`dtype`, `device_map`, `revision`, ...).
        """
        model = AutoModelForCausalLM.from_pretrained(model_name_or_path, **model_kwargs)
        if tokenizer is None or isinstance(tokenizer, (str, os.PathLike)):
            tokenizer = AutoTokenizer.from_pretrained(tokenizer or model_name_or_path)
        return cls(config, model=model, tokenizer=tokenizer)

    # ----------------------------------------------------------------------------------------- API
    def prune(
        self,
        model: PreTrainedModel | None = None,
        calibration_data: CalibrationData = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        stage1_checkpoint: str | os.PathLike | None = None,
    ) -> PruningResult:
        """Prunes `model` in place: Stage 1, then Stage 2 if `config.compensation`.

        Args:
            model (`PreTrainedModel`, *optional*): Defaults to the pruner's model.
            calibration_data: `None` (use `config.dataset`), a dataset name, a list of strings, a
                list of token-id lists, or a `LongTensor` of shape `(N, T)`.
            tokenizer (`PreTrainedTokenizerBase`, *optional*): For text; defaults to the pruner's
                tokenizer, else the one saved with the model.
            stage1_checkpoint (`str` or `os.PathLike`, *optional*): A JSON file where Stage 1 saves
                its progress after every round, and from which an interrupted run resumes (see
                [`~GradMAPPruner.select_layers`]).

        Returns:
            [`PruningResult`]: `result.model` is the pruned model.

        Raises:
            ValueError: for a model or data that cannot be pruned as configured; the model is left untouched.
        """
        result = self.select_layers(model, calibration_data, tokenizer, stage1_checkpoint)
        if self.config.compensation:
            self.compensate(result)
        result.snapshot = None  # release the removed layers
        return result

    def select_layers(
        self,
        model: PreTrainedModel | None = None,
        calibration_data: CalibrationData = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        stage1_checkpoint: str | os.PathLike | None = None,
    ) -> PruningResult:
        """Stage 1 alone: scores layers with `config.importance` (Eq. 5 by default) and removes K of them (Algorithm 1).

        The returned result keeps the removed layers in memory so that [`~GradMAPPruner.compensate`]
        can compare against the dense model; `prune` runs both and releases them.

        Args:
            model, calibration_data, tokenizer: As in [`~GradMAPPruner.prune`].
            stage1_checkpoint (`str` or `os.PathLike`, *optional*): A JSON file where Stage 1 saves each
                finished round (its scores, the layer it removed, its seconds). When the file exists, the
                rounds it holds are replayed from their saved scores and scoring goes on from the next
                one, so a long iterative run (SLEB, or GradMAP on a large model) that was interrupted
                loses at most the round in progress. The file must come from the same run: same model
                shape, metric, number of layers to remove and calibration set, else a `ValueError`
                says what differs. `result.timings["stage1"]` includes the resumed rounds' seconds.

        Returns:
            [`PruningResult`]: The model has lost its K layers; Stage 2 has not run.
        """
        model = self._resolve_model(model)
        adapter = get_adapter(model)
        adapter.check_supported(model, self.config.compensation)
        num_layers = adapter.num_layers(model)
        num_to_prune = self._check_plan(num_layers)
        calibration_ids = self._calibration_ids(model, calibration_data, tokenizer)
        checkpoint = None
        if stage1_checkpoint is not None:
            if self.config.layers_to_prune is not None:
                raise ValueError("`stage1_checkpoint` has nothing to save: with `layers_to_prune`, Stage 1 does no scoring.")
            fingerprint = self._stage1_fingerprint(model, num_layers, num_to_prune, calibration_ids)
            checkpoint = Stage1Checkpoint(stage1_checkpoint, fingerprint)

        snapshot = adapter.snapshot(model)
        result = PruningResult(
            model=model,
            original_num_layers=num_layers,
            num_layers_to_prune=num_to_prune,
            kept_layers=list(range(num_layers)),
            original_num_parameters=model.num_parameters(),
            calibration_ids=calibration_ids,
            snapshot=snapshot,
        )
        self.result = result
        start = time.perf_counter()
        try:
            resumed_seconds = self._run_stage1(model, adapter, result, checkpoint)
        except BaseException:
            adapter.restore(model, snapshot)
            raise
        result.timings["stage1"] = time.perf_counter() - start + resumed_seconds
        if resumed_seconds:
            result.timings["stage1_resumed"] = resumed_seconds
        logger.info(
            f"Stage 1 removed layers {result.removed_layers} of {num_layers} in {result.timings['stage1']:.1f}s; "
            f"{len(result.kept_layers)} remain."
        )
        return result

    def compensate(self, result: PruningResult) -> PruningResult:
        """Stage 2 on a model pruned by [`~GradMAPPruner.select_layers`]: measures the mean drift of every
        kept layer (Eq. 10), learns W' for the `num_compensated_layers` layers with the largest drift
        (Eq. 12-14) and folds it into their down projections (Eq. 15)."""
        if result.snapshot is None:
            raise ValueError(
                "This result no longer holds the dense model's layers (Stage 2 compares against them): "
                "run `select_layers` then `compensate`, or `prune` with compensation=True."
            )
        if result.compensated_layers:
            raise ValueError(f"Layers {result.compensated_layers} are already compensated.")
        start = time.perf_counter()
        self._run_stage2(result.model, get_adapter(result.model), result)
        result.timings["stage2"] = time.perf_counter() - start
        logger.info(f"Stage 2 compensated layer(s) {result.compensated_layers} in {result.timings['stage2']:.1f}s.")
        return result

    def save_pretrained(
        self,
        save_directory: str | os.PathLike,
        model: PreTrainedModel | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        evaluation: EvaluationResult | None = None,
        base_model: str | None = None,
        license: str | None = None,
        repo_id: str | None = None,
        **save_kwargs: Any,
    ) -> str:
        """Writes a standard checkpoint that plain `AutoModelForCausalLM.from_pretrained` loads: model,
        tokenizer, `gradmap_config.json`, and for a model this pruner pruned, `pruning_report.json`
        with its pictures and a model card (see [`optimum_gradmap.report`]).

        Args:
            save_directory (`str` or `os.PathLike`): Output folder.
            model (`PreTrainedModel`, *optional*): Defaults to the last pruned model.
            tokenizer (`PreTrainedTokenizerBase`, *optional*): Defaults to the pruner's tokenizer.
            evaluation ([`EvaluationResult`], *optional*): Evaluation results for the report and the card.
            base_model (`str`, *optional*): Hub id of the dense model, when its `name_or_path` is a local folder.
            license (`str`, *optional*): The base model's license (the pruned weights inherit it).
            repo_id (`str`, *optional*): Hub repository named in the model card's examples.
            save_kwargs: Passed to the model's `save_pretrained`.

        Returns:
            `str`: The folder.
        """
        if model is None:
            model = self.result.model if self.result is not None else self.model
        if model is None:
            raise ValueError("No model to save: pass `model=` or call `prune` first.")
        report = None
        if self.result is not None and self.result.model is model:
            report = build_report(self.result, self.config, base_model, license=license, evaluation=evaluation)
        return save_checkpoint(
            save_directory, model, tokenizer or self.tokenizer, self.config, report, repo_id=repo_id, **save_kwargs
        )

    def push_to_hub(
        self,
        repo_id: str,
        model: PreTrainedModel | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        private: bool | None = None,
        token: str | bool | None = None,
        commit_message: str | None = None,
        **save_kwargs: Any,
    ) -> str:
        """Saves the checkpoint (as [`~GradMAPPruner.save_pretrained`], which takes `save_kwargs`) into a
        temporary folder and uploads it to the Hub with `huggingface_hub.HfApi` in one commit.

        Args:
            repo_id (`str`): `user/name` or `org/name`; created if missing.
            private (`bool`, *optional*): Visibility of a new repository (the Hub's default if `None`).
            token (`str` or `bool`, *optional*): Defaults to the usual places (`HF_TOKEN`, `hf auth login`); never printed.
            commit_message (`str`, *optional*): Defaults to one that says which layers were removed.

        Returns:
            `str`: The URL of the commit.
        """
        with tempfile.TemporaryDirectory() as folder:
            self.save_pretrained(folder, model=model, tokenizer=tokenizer, repo_id=repo_id, **save_kwargs)
            message = commit_message or self.commit_message()
            return upload_checkpoint(folder, repo_id, private=private, token=token, commit_message=message)

    # ----------------------------------------------------------------------------------- internals
    def _resolve_model(self, model: PreTrainedModel | None) -> PreTrainedModel:
        model = model if model is not None else self.model
        if model is None:
            raise ValueError("No model to prune: pass one to `prune(model, ...)` or build the pruner with `from_pretrained`.")
        if self.model is None:
            self.model = model
        return model

    def _check_plan(self, num_layers: int) -> int:
        num_to_prune = self.config.num_layers_to_remove(num_layers)
        if num_to_prune < 1:
            raise ValueError(
                f"pruning_ratio={self.config.pruning_ratio} of {num_layers} layers rounds to 0 layers: "
                "raise the ratio or give `num_layers_to_prune`."
            )
        if self.config.layers_to_prune is not None and max(self.config.layers_to_prune) >= num_layers:
            raise ValueError(
                f"layers_to_prune={self.config.layers_to_prune} names layers the model does not have: "
                f"it has {num_layers} decoder layers, indexed 0 to {num_layers - 1}."
            )
        if num_to_prune >= num_layers:
            raise ValueError(
                f"Cannot remove {num_to_prune} of the model's {num_layers} decoder layers: at least one must "
                f"remain. Choose num_layers_to_prune <= {num_layers - 1}."
            )
        if self.config.compensation and self.config.num_compensated_layers > num_layers - num_to_prune:
            raise ValueError(
                f"num_compensated_layers={self.config.num_compensated_layers} exceeds the {num_layers - num_to_prune} "
                "layers that remain after pruning."
            )
        return num_to_prune

    def _calibration_ids(
        self, model: PreTrainedModel, calibration_data: CalibrationData, tokenizer: PreTrainedTokenizerBase | None
    ) -> torch.LongTensor:
        tokenizer = tokenizer or self.tokenizer
        if tokenizer is None and is_text_data(calibration_data):
            name = getattr(model, "name_or_path", "") or getattr(model.config, "_name_or_path", "")
            if not name:
                raise ValueError(
                    "Calibration text needs a tokenizer: pass `tokenizer=` (the model has no name to load one from)."
                )
            tokenizer = AutoTokenizer.from_pretrained(name)
            self.tokenizer = tokenizer
        config = self.config
        ids = prepare_calibration_data(
            calibration_data, tokenizer, config.num_samples, config.seq_len, config.seed, config.dataset
        )
        vocab_size = model.get_input_embeddings().weight.shape[0]
        if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
            raise ValueError(f"Calibration token ids must lie in [0, {vocab_size}), the model's vocabulary.")
        return ids

    def _stage1_metric(self) -> tuple[ImportanceMetric, bool]:
        """The configured importance metric, and whether it re-scores after every removal."""
        metric = get_importance_metric(self.config.importance, seed=self.config.seed)
        return metric, metric.iterative if self.config.iterative is None else self.config.iterative

    def _stage1_fingerprint(
        self, model: PreTrainedModel, num_layers: int, num_to_prune: int, calibration_ids: torch.LongTensor
    ) -> dict[str, Any]:
        """What must be the same for a saved Stage 1 round to be valid in this run."""
        return {
            "model_type": model.config.model_type,
            "num_layers": num_layers,
            "hidden_size": model.get_input_embeddings().weight.shape[1],
            "importance": self.config.importance,
            "iterative": self._stage1_metric()[1],
            "seed": self.config.seed,
            "num_layers_to_prune": num_to_prune,
            "calibration_sha256": calibration_sha256(calibration_ids),
        }

    def _run_stage1(
        self,
        model: PreTrainedModel,
        adapter: DecoderAdapter,
        result: PruningResult,
        checkpoint: Stage1Checkpoint | None = None,
    ) -> float:
        """Removes the K layers; returns the seconds of the rounds replayed from `checkpoint`."""
        config = self.config
        if config.layers_to_prune is not None:  # explicit layers: no scoring
            result.removed_layers = list(config.layers_to_prune)
            result.kept_layers = [index for index in result.kept_layers if index not in config.layers_to_prune]
            adapter.keep_layers(model, result.snapshot, result.kept_layers)
            return 0.0
        metric, iterative = self._stage1_metric()
        protected = metric.protected_layers(result.original_num_layers)
        candidates = [index for index in result.kept_layers if index not in protected]
        if len(candidates) < result.num_layers_to_prune:
            raise ValueError(
                f"importance={config.importance!r} never removes layers {sorted(protected)}, which leaves "
                f"{len(candidates)} candidates for {result.num_layers_to_prune} removals: prune fewer layers."
            )
        num_rounds = result.num_layers_to_prune if iterative else 1
        saved_rounds = checkpoint.rounds if checkpoint is not None else []
        if saved_rounds:
            logger.info(f"Resuming Stage 1 from {checkpoint.path}: {len(saved_rounds)} of {num_rounds} rounds are done.")
        resumed_seconds = 0.0
        rounds = logging.tqdm(range(num_rounds), desc=f"Stage 1 ({config.importance})", disable=not self.progress_bar)
        for round_index in rounds:
            started = time.perf_counter()
            kept = result.kept_layers
            if round_index < len(saved_rounds):
                round_scores = {int(index): score for index, score in saved_rounds[round_index]["scores"].items()}
                resumed_seconds += saved_rounds[round_index]["seconds"]
            else:
                layer_scores = metric.score(
                    model,
                    adapter,
                    result.calibration_ids,
                    config.batch_size,
                    progress_bar=self.progress_bar,
                    description=f"Round {round_index + 1}/{num_rounds}",
                )
                round_scores = {original: float(score) for original, score in zip(kept, layer_scores)}
            result.scores.append(round_scores)
            ranked = sorted((index for index in kept if index not in protected), key=lambda index: (round_scores[index], index))
            to_remove = ranked[:1] if iterative else ranked[: result.num_layers_to_prune]
            result.removed_layers.extend(to_remove)
            result.kept_layers = [index for index in kept if index not in to_remove]
            adapter.keep_layers(model, result.snapshot, result.kept_layers)
            if checkpoint is not None and round_index >= len(saved_rounds):
                checkpoint.save_round(round_scores, to_remove, time.perf_counter() - started)
            for index in to_remove:
                logger.info(f"Round {round_index + 1}/{num_rounds}: removed layer {index} (score {round_scores[index]:.6g})")
        return resumed_seconds

    def _run_stage2(self, model: PreTrainedModel, adapter: DecoderAdapter, result: PruningResult) -> None:
        config = self.config
        snapshot, kept, ids = result.snapshot, result.kept_layers, result.calibration_ids
        progress = self.progress_bar

        with _dense(model, adapter, snapshot, kept):
            dense_means = hidden_state_means(model, snapshot.layers, ids, config.batch_size, progress, "Dense hidden states")
        pruned_means = hidden_state_means(
            model, adapter.get_layers(model), ids, config.batch_size, progress, "Pruned hidden states"
        )
        result.drift = {
            original: float((dense_means[original] - pruned_means[position]).norm()) for position, original in enumerate(kept)
        }
        hidden_size = dense_means.shape[-1]
        if ids.numel() < MIN_TOKENS_PER_HIDDEN_UNIT * hidden_size:
            logger.warning(
                f"Stage 2 fits a {hidden_size} x {hidden_size} matrix on {ids.numel()} calibration tokens: with fewer than "
                f"{MIN_TOKENS_PER_HIDDEN_UNIT} x hidden size = {MIN_TOKENS_PER_HIDDEN_UNIT * hidden_size} tokens it can overfit "
                "and raise held-out perplexity. Use more calibration data (the paper uses 128 x 128 tokens)."
            )
        ranked = sorted((index for index in kept if result.drift[index] > 0), key=lambda index: -result.drift[index])
        targets = sorted(ranked[: config.num_compensated_layers])  # fit in forward order
        if not targets:
            logger.warning("No kept layer drifted (only layers after every kept layer were removed): nothing to compensate.")
            return
        with _dense(model, adapter, snapshot, kept):
            originals = record_layer_outputs(model, [snapshot.layers[t] for t in targets], ids, config.batch_size, progress)

        for target, original_outputs in zip(targets, originals):
            layer = snapshot.layers[target]
            fit = learn_compensation(model, adapter, layer, original_outputs, ids, config, progress)
            apply_compensation(adapter, layer, fit.matrix)
            result.compensated_layers.append(target)
            result.compensation_objective[target] = {"identity": fit.objective_identity, "fitted": fit.objective_fitted}
            logger.info(
                f"Compensated layer {target} (drift {result.drift[target]:.4g}): objective "
                f"{fit.objective_identity:.6g} -> {fit.objective_fitted:.6g}"
            )
        compensated_means = hidden_state_means(
            model, adapter.get_layers(model), ids, config.batch_size, progress, "Compensated hidden states"
        )
        result.drift_after_compensation = {
            original: float((dense_means[original] - compensated_means[position]).norm())
            for position, original in enumerate(kept)
        }

    def commit_message(self) -> str:
        """The Hub commit message for the last pruning: which layers were removed and compensated."""
        if self.result is None:
            return "Upload model pruned with GradMAP"
        return (
            f"GradMAP ({self.config.importance}): remove {len(self.result.removed_layers)} of "
            f"{self.result.original_num_layers} layers "
            f"{self.result.removed_layers}, compensate {self.result.compensated_layers}"
        )


@contextmanager
def _dense(model: PreTrainedModel, adapter: DecoderAdapter, snapshot: LayerSnapshot, kept: list[int]) -> Iterator[None]:
    """Temporarily restores the dense layer stack, then re-applies the pruning."""
    adapter.keep_layers(model, snapshot, list(range(snapshot.num_layers)))
    try:
        yield
    finally:
        adapter.keep_layers(model, snapshot, kept)


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
                raise ValueError(
                    f"{self.path} is not a Stage 1 checkpoint ({error}): delete it, or pass another `stage1_checkpoint`."
                ) from error
            different = {
                key: (saved_fingerprint.get(key), value)
                for key, value in fingerprint.items()
                if saved_fingerprint.get(key) != value
            }
            if different:
                details = ", ".join(f"{key}: saved {saved!r}, now {now!r}" for key, (saved, now) in different.items())
                raise ValueError(
                    f"{self.path} was written by a different Stage 1 run ({details}). Delete it to start over, "
                    "or pass another `stage1_checkpoint`."
                )

    def save_round(self, scores: dict[int, float], removed: list[int], seconds: float) -> None:
        """Appends a finished round and rewrites the file (atomically: a crash leaves the old one)."""
        self.rounds.append(
            {"scores": {str(index): score for index, score in scores.items()}, "removed": removed, "seconds": seconds}
        )
        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=directory, suffix=".tmp", delete=False, encoding="utf-8") as file:
            json.dump({"fingerprint": self.fingerprint, "rounds": self.rounds}, file, indent=1)
        os.replace(file.name, self.path)
