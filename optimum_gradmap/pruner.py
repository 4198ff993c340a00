# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""The GradMAP pruner: runs the steps a configuration asks for ([`optimum_gradmap.pipeline`]: Stage 1, Stage 2, the
heal, quantization) on any model that has an architecture adapter, and hands back a [`PruningResult`]."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging

from .checkpoint import save_checkpoint
from .compensation import STAGE2_SETTINGS, Stage2Settings
from .configuration import GradMAPConfig
from .data import CalibrationData
from .errors import InvalidInputError
from .heal import HEAL_SETTINGS, HealSettings
from .hub import save_and_upload
from .loading import load_model_and_tokenizer
from .pipeline import (
    Compensate,
    Heal,
    Run,
    RunInputs,
    SelectLayers,
    Step,
    check_inputs_have_steps,
    check_steps,
    cut,
    plan_pruning,
    pruning_steps,
    run_checked_steps,
)
from .result import PruningResult, refuse_after_heal

if TYPE_CHECKING:
    from .evaluation import EvaluationResult
    from .planning import DeviceThroughput, PruningPlan

logger = logging.get_logger(__name__)


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
        # The last run, until `prune` or `release` drops it: the dense stack of `self.result` (which Stage 2 compares
        # against and the heal's teacher is made of), the fits made between Stage 1's removals, and what it read.
        self._run: Run | None = None
        # Where `from_pretrained` loaded the model from (`revision`, `token`, ...): a tokenizer loaded later comes from there too.
        self._location: dict[str, Any] = {}

    @classmethod
    def from_pretrained(
        cls,
        model_name_or_path: str | os.PathLike,
        config: GradMAPConfig,
        tokenizer: PreTrainedTokenizerBase | str | None = None,
        **model_kwargs: Any,
    ) -> GradMAPPruner:
        """Loads a causal LM and its tokenizer (from the Hub or a local folder) into a new pruner.

        Args:
            model_name_or_path (`str` or `os.PathLike`): Hub model id or local checkpoint folder.
            config (`GradMAPConfig`): What to do.
            tokenizer (`PreTrainedTokenizerBase` or `str`, *optional*): A tokenizer, or where to load
                it from; defaults to `model_name_or_path`, with the same `revision`, `token`,
                `cache_dir`, `local_files_only`, `trust_remote_code` and `subfolder` as the model.
            model_kwargs: Passed to `AutoModelForCausalLM.from_pretrained` (`dtype`, `device_map`, `revision`, ...).
                `dtype` is read as the CLI's `--dtype` ([`optimum_gradmap.precision.resolve_dtype`]: `"auto"` is
                bfloat16 where the hardware computes it natively, `"checkpoint"` the checkpoint's dtype).
        """
        model, tokenizer, location = load_model_and_tokenizer(model_name_or_path, tokenizer, **model_kwargs)
        pruner = cls(config, model=model, tokenizer=tokenizer)
        pruner._location = location
        return pruner

    @staticmethod
    def plan(
        model_or_path: PreTrainedModel | PretrainedConfig | str | os.PathLike,
        config: GradMAPConfig,
        dtype: torch.dtype | str = torch.float32,
        device: str | torch.device | None = None,
        throughput: DeviceThroughput | None = None,
        **kwargs: Any,
    ) -> PruningPlan:
        """What a run of `config` on the model will do and cost, told before the run from the model's config alone (no
        weight is read): the layers to remove, the work, peak memory, disk and expected time of each stage
        ([`~optimum_gradmap.pipeline.plan_pruning`]). `optimum-gradmap prune --dry-run` prints it.

        ```python
        >>> plan = GradMAPPruner.plan("HuggingFaceTB/SmolLM2-135M", GradMAPConfig(pruning_ratio=0.25))
        >>> print(plan)  # a table; plan.to_dict() for JSON
        ```

        Args:
            model_or_path (`PreTrainedModel`, `PretrainedConfig`, `str` or `os.PathLike`): The model (its config is
                used), its config, a local folder or a Hub id (`config.json` alone is read).
            config (`GradMAPConfig`): The run.
            dtype, device, throughput, kwargs: As in [`~optimum_gradmap.pipeline.plan_pruning`]: the dtype the model
                computes in (defaults to float32), where (defaults to the CPU), the device's speed (measured on `device`
                when not given), and `device_map`, `max_memory`, `execution`, `removed_layers`, ....

        Returns:
            [`~optimum_gradmap.planning.PruningPlan`].
        """
        return plan_pruning(model_or_path, config, dtype=dtype, device=device, throughput=throughput, **kwargs)

    def prune(
        self,
        model: PreTrainedModel | None = None,
        calibration_data: CalibrationData = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        stage1_checkpoint: str | os.PathLike | None = None,
        validation_data: CalibrationData = None,
        compensation_data: CalibrationData = None,
        heal_data: CalibrationData = None,
        heal_checkpoint: str | os.PathLike | None = None,
        heal_text_cache: str | os.PathLike | None = None,
    ) -> PruningResult:
        """Prunes `model` in place with the steps `config` asks for ([`~optimum_gradmap.pipeline.pruning_steps`]):
        Stage 1, then Stage 2 if `config.compensation`, the heal if `config.heal_tokens` ([`~GradMAPPruner.heal`]) and
        quantization if `config.quantization` ([`optimum_gradmap.quantize`]). Every check of every step (its settings,
        the model, every text) runs before Stage 1 starts; when a step fails, every step that ran is undone, the last
        first.

        Args:
            model (`PreTrainedModel`, *optional*): Defaults to the pruner's model.
            calibration_data (*optional*): Stage 1's text, in any form [`~optimum_gradmap.data.prepare_calibration_data`]
                takes (a dataset name, a `datasets.Dataset`, strings, token-id lists, a `LongTensor` of shape `(N, T)`);
                defaults to `config.dataset`.
            tokenizer (`PreTrainedTokenizerBase`, *optional*): For text; defaults to the pruner's tokenizer, else the
                one saved with the model.
            stage1_checkpoint (`str` or `os.PathLike`, *optional*): Stage 1's progress file ([`~GradMAPPruner.select_layers`]).
            validation_data, compensation_data (*optional*): Stage 2's text ([`~GradMAPPruner.compensate`]).
            heal_data (*optional*): Text the heal stage trains on; defaults to `config.heal_dataset`.
            heal_checkpoint, heal_text_cache (`str` or `os.PathLike`, *optional*): The heal's resumable state and the
                cache of the dense model's own text ([`~GradMAPPruner.heal`]'s `checkpoint` and `text_cache`). A
                checkpoint from another run is refused before Stage 1 ([`~optimum_gradmap.heal.check_heal_checkpoint_origin`]).

        Returns:
            [`PruningResult`]: `result.model` is the pruned model.

        Raises:
            InvalidInputError (a `ValueError`): for a model, settings or data that cannot be pruned as configured
                (Stage 2's and the heal stage's included), before anything changes. What depends on the layers Stage 1
                removes is refused where it becomes known, and what Stage 1 and 2 did is undone: with a budget, a
                `num_compensated_layers` larger than the layers Stage 1 leaves; a `heal_trainable` that finds nothing to
                train, and a heal checkpoint that matches this run's heal but not its pruning.
            Exception: any other error once Stage 1 started propagates after every step that ran was undone (the
                model as it came; see [`~optimum_gradmap.pipeline.Quantize`] for the one case it cannot be).
                Ctrl-C during the heal's training keeps its best state (`result.heal.interrupted`).
        """
        inputs = RunInputs(
            calibration_data=calibration_data,
            validation_data=validation_data,
            compensation_data=compensation_data,
            heal_data=heal_data,
            stage1_checkpoint=stage1_checkpoint,
            heal_checkpoint=heal_checkpoint,
            heal_text_cache=heal_text_cache,
        )
        check_inputs_have_steps(self.config, inputs)
        steps = pruning_steps(self.config)  # Stage 1, Stage 2, the heal, quantization: those the config asks for
        result = self._run_steps(steps, steps, model, tokenizer, inputs)
        self.release()
        return result

    def select_layers(
        self,
        model: PreTrainedModel | None = None,
        calibration_data: CalibrationData = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        stage1_checkpoint: str | os.PathLike | None = None,
    ) -> PruningResult:
        """Stage 1 alone: scores layers with `config.importance` (Eq. 5 by default) and removes K of them (Algorithm 1).

        The pruner keeps the removed layers in memory so that [`~GradMAPPruner.compensate`] can compare
        against the dense model; `prune` runs both stages and releases them, [`~GradMAPPruner.release`]
        releases them after your own calls.

        Args:
            model, calibration_data, tokenizer: As in [`~GradMAPPruner.prune`].
            stage1_checkpoint (`str` or `os.PathLike`, *optional*): A JSON file where Stage 1 saves each finished
                round; when it exists, its rounds are replayed and scoring goes on from the next one
                ([`~optimum_gradmap.importance.Stage1Checkpoint`]). A file from another run (model shape, metric,
                number of layers to remove, calibration set) is refused. `result.timings["stage1"]` includes the
                resumed rounds' seconds.

        Returns:
            [`PruningResult`]: The model has lost its K layers; Stage 2 has not run.
        """
        inputs = RunInputs(calibration_data=calibration_data, stage1_checkpoint=stage1_checkpoint)
        checked = [step for step in pruning_steps(self.config) if isinstance(step, (SelectLayers, Compensate))]
        return self._run_steps(checked, checked[:1], model, tokenizer, inputs)  # Stage 2's input checked too

    def compensate(
        self,
        result: PruningResult,
        validation_data: CalibrationData = None,
        compensation_data: CalibrationData = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        **config_overrides: Any,
    ) -> PruningResult:
        """Stage 2 on a model pruned by [`~GradMAPPruner.select_layers`] ([`optimum_gradmap.compensation.compensate`]):
        measures the mean drift of every kept layer (Eq. 10), learns W' for the layers `compensation_target` names
        (Eq. 12-14) and folds it into their down projections (Eq. 15). If it fails, the model is left as Stage 1 left
        it. Called again on the same result, it first undoes the previous fold:

        ```python
        result = pruner.select_layers(model, data)
        pruner.compensate(result)  # the config's settings
        pruner.compensate(result, solver="adam", reg_lambda=1e-2)  # replaces the first fit
        ```

        Args:
            result ([`PruningResult`]): The last result of this pruner's `select_layers`.
            validation_data (*optional*): Text (any form `calibration_data` takes, drawn with seed `seed + 1`: other
                windows than the calibration ones) whose perplexity decides whether the compensation is kept
                (`result.compensation.validation`).
            compensation_data (*optional*): Text the fits use instead of the calibration sequences; defaults to
                `compensation_dataset` (`result.compensation.calibration_sha256` says which sequences were used).
            tokenizer (`PreTrainedTokenizerBase`, *optional*): For text; defaults to the pruner's tokenizer, else the
                one saved with the model.
            config_overrides: Stage 2 settings of [`GradMAPConfig`] (`optimum_gradmap.compensation.STAGE2_SETTINGS`)
                to use instead of the pruner's; `result.config` records them.

        Returns:
            [`PruningResult`]: `result`, with `result.compensation` filled in.
        """
        self._check_holds_dense(
            result,
            " (Stage 2 compares against them): call `compensate` with the result of this pruner's last `select_layers`, "
            "before `prune` or `release` drops them.",
        )
        unknown = sorted(set(config_overrides) - set(STAGE2_SETTINGS))
        if unknown:
            raise InvalidInputError(f"{unknown} are not Stage 2 settings; these are: {list(STAGE2_SETTINGS)}.")
        config = dataclasses.replace(self.config, compensation=True, **config_overrides)  # the pruner's, not the last run's
        run = self._run
        run.inputs = dataclasses.replace(run.inputs, compensation_data=compensation_data, validation_data=validation_data)
        run.tokenizer = tokenizer or run.tokenizer
        run.fit_ids = run.validation_ids = None
        self._run_checked([Compensate(Stage2Settings.from_config(config))], run)
        return result

    def heal(
        self,
        result: PruningResult,
        heal_data: CalibrationData = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        teacher: PreTrainedModel | None = None,
        checkpoint: str | os.PathLike | None = None,
        text_cache: str | os.PathLike | None = None,
        **config_overrides: Any,
    ) -> PruningResult:
        """The heal stage on a pruned result ([`optimum_gradmap.heal`]): distils the dense model's next-token
        distribution into the pruned model and merges what was trained into plain weights. `prune` runs it after
        Stage 2 when `config.heal_tokens` is set.

        ```python
        result = pruner.select_layers(model, data)
        pruner.compensate(result)
        pruner.heal(result, heal_tokens=200_000, heal_dataset="offline:web_text")
        pruner.release()
        ```

        Args:
            result ([`PruningResult`]): A pruned result.
            heal_data (*optional*): The text to train on (any form `calibration_data` takes); defaults to `heal_dataset`.
            tokenizer (`PreTrainedTokenizerBase`, *optional*): For text; defaults to the pruner's tokenizer.
            teacher (`PreTrainedModel`, *optional*): The dense model; defaults to the pruned one with its removed layers
                put back and Stage 2's folds undone, which this pruner holds until `prune` or `release` drops them.
            checkpoint (`str` or `os.PathLike`, *optional*): A file where the state is saved at every held-out check,
                and from which an interrupted heal resumes.
            text_cache (`str` or `os.PathLike`, *optional*): The cache of the dense model's own text (`heal_dataset`
                with `generated`); defaults to one per fingerprint in the user cache.
            config_overrides: Heal settings of [`GradMAPConfig`] (`optimum_gradmap.heal.HEAL_SETTINGS`) to use instead
                of the result's; `heal_tokens` must be set.

        Returns:
            [`PruningResult`]: `result`, with `result.heal` filled in and `result.timings["heal"]`.

        Raises:
            InvalidInputError: for settings or text that cannot heal, a result healed already, or no teacher; the model
                is left as it was. Any other error leaves the model as it was; Ctrl-C keeps the best state so far.
        """
        unknown = sorted(set(config_overrides) - set(HEAL_SETTINGS))
        if unknown:
            raise InvalidInputError(f"{unknown} are not heal settings; these are: {list(HEAL_SETTINGS)}.")
        config = dataclasses.replace(result.config or self.config, **config_overrides)  # how the result was pruned
        if not config.heal_tokens:
            raise InvalidInputError("The heal stage needs a budget: give `heal_tokens` (e.g. heal_tokens=200_000).")
        refuse_after_heal(result, "a second heal")
        if teacher is None:
            self._check_holds_dense(
                result,
                ", which the heal stage's teacher is made of: call `heal` before `prune` or `release` drops them, or "
                "give the dense model as `teacher=`.",
            )
        inputs = RunInputs(heal_data=heal_data, heal_checkpoint=checkpoint, heal_text_cache=text_cache, teacher=teacher)
        if result is self.result and self._run is not None:  # the run that made it: its dense stack and calibration text
            run = self._run
            run.inputs = dataclasses.replace(inputs, calibration_data=run.inputs.calibration_data)
            run.tokenizer = tokenizer or run.tokenizer
        else:
            run = Run(result.model, config, inputs, tokenizer or self.tokenizer, self._location, self.progress_bar)
            run.result = result
        run.heal_text = None
        self._run_checked([Heal(HealSettings.from_config(config))], run)
        return result

    def cut(self, result: PruningResult, num_layers_to_prune: int) -> PruningResult:
        """Keeps only the first `num_layers_to_prune` removals of a Stage 1 run, without scoring again: removal is
        nested (each round removes one layer from the model the earlier rounds left), so one run to the largest K (with
        `loss_curve=True`, its curve says what each K costs) gives any smaller K. Stage 2 is fitted for the K kept:
        call [`~GradMAPPruner.compensate`] after the cut (a compensation made before it is undone).

        ```python
        result = pruner.select_layers(model)  # e.g. GradMAPConfig(num_layers_to_prune=12, loss_curve=True)
        pruner.cut(result, 8)  # the model now lacks the first 8 layers removed; the other 4 are back
        pruner.compensate(result)
        ```

        Args:
            result ([`PruningResult`]): The last result of this pruner's `select_layers`.
            num_layers_to_prune (`int`): How many of its removals to keep, from 1 to as many as it made.

        Returns:
            [`PruningResult`]: `result`, describing the model with the first `num_layers_to_prune` layers removed.
        """
        self._check_holds_dense(
            result, ": `cut` needs the result of this pruner's last `select_layers`, before `prune` or `release` drops them."
        )
        return cut(result, self._run.dense, num_layers_to_prune)

    def release(self) -> None:
        """Drops the dense layers kept for Stage 2 (after [`~GradMAPPruner.select_layers`]), freeing their memory."""
        self._run = None

    def save_pretrained(
        self,
        save_directory: str | os.PathLike,
        model: PreTrainedModel | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        evaluation: EvaluationResult | None = None,
        base_model: str | None = None,
        license: str | None = None,
        repo_id: str | None = None,
        base_model_revision: str | None = None,
        overwrite: bool = False,
        **save_kwargs: Any,
    ) -> str:
        """Writes a standard checkpoint that plain `AutoModelForCausalLM.from_pretrained` loads: for the model this
        pruner pruned, [`PruningResult.save_pretrained`] (with the report and model card); another model is saved
        with the tokenizer and `gradmap_config.json` only.

        Args:
            save_directory (`str` or `os.PathLike`): Output folder.
            model (`PreTrainedModel`, *optional*): Defaults to the last pruned model.
            tokenizer (`PreTrainedTokenizerBase`, *optional*): Defaults to the pruner's tokenizer.
            evaluation, base_model, license, repo_id, base_model_revision, overwrite, save_kwargs: See
                [`PruningResult.save_pretrained`].

        Returns:
            `str`: The folder.
        """
        if model is None:
            model = self.result.model if self.result is not None else self.model
        if model is None:
            raise InvalidInputError("No model to save: pass `model=` or call `prune` first.")
        tokenizer = tokenizer or self.tokenizer
        if self.result is not None and self.result.model is model:
            card = dict(evaluation=evaluation, base_model=base_model, base_model_revision=base_model_revision, license=license)
            return self.result.save_pretrained(
                save_directory, tokenizer=tokenizer, repo_id=repo_id, overwrite=overwrite, **card, **save_kwargs
            )
        return save_checkpoint(save_directory, model, tokenizer, self.config, repo_id=repo_id, overwrite=overwrite, **save_kwargs)

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
        temporary folder and uploads it to the Hub with `huggingface_hub.HfApi` in one commit; for the
        model this pruner pruned, this is [`PruningResult.push_to_hub`].

        Args:
            repo_id (`str`): `user/name` or `org/name`; created if missing.
            model (`PreTrainedModel`, *optional*): Defaults to the last pruned model.
            tokenizer, private, token, commit_message, save_kwargs: See [`PruningResult.push_to_hub`].

        Returns:
            `str`: The URL of the commit.
        """
        tokenizer = tokenizer or self.tokenizer
        if self.result is not None and (model is None or model is self.result.model):
            return self.result.push_to_hub(
                repo_id, tokenizer=tokenizer, private=private, token=token, commit_message=commit_message, **save_kwargs
            )
        save = lambda folder: self.save_pretrained(folder, model=model, tokenizer=tokenizer, repo_id=repo_id, **save_kwargs)  # noqa: E731
        message = commit_message or self.commit_message()
        return save_and_upload(save, repo_id, private=private, token=token, commit_message=message)

    def commit_message(self) -> str:
        """The Hub commit message for the last pruning: which layers were removed and compensated."""
        return self.result.commit_message() if self.result is not None else "Upload model pruned with GradMAP"

    def _resolve_model(self, model: PreTrainedModel | None) -> PreTrainedModel:
        model = model if model is not None else self.model
        if model is None:
            raise InvalidInputError(
                "No model to prune: pass one to `prune(model, ...)` or build the pruner with `from_pretrained`."
            )
        if self.model is None:
            self.model = model
        return model

    def _check_holds_dense(self, result: PruningResult, why: str) -> None:
        """Refuses a result whose dense layers this pruner no longer holds (`why` ends the message)."""
        if result is not self.result or self._run is None or self._run.dense is None:
            raise InvalidInputError(f"This pruner no longer holds the dense layers of that result{why}")

    def _run_steps(
        self,
        checked: Sequence[Step],
        steps: Sequence[Step],
        model: PreTrainedModel | None,
        tokenizer: PreTrainedTokenizerBase | None,
        inputs: RunInputs,
    ) -> PruningResult:
        """A new run of `steps` on `model`, after every check of `checked` (the steps, or more): the last run is
        released once the checks pass, and this one is kept for `compensate`, `heal` and `cut` (forgotten where a step
        failed: every step that started is undone)."""
        model = self._resolve_model(model)
        run = Run(model, self.config, inputs, tokenizer or self.tokenizer, self._location, self.progress_bar)
        check_steps(checked, run)
        self.release()
        self.result = None
        run_checked_steps(steps, run)
        self.result, self._run = run.result, run
        if tokenizer is None and self.tokenizer is None:
            self.tokenizer = run.tokenizer  # the one saved with the model, loaded for text: kept
        return run.result

    def _run_checked(self, steps: Sequence[Step], run: Run) -> None:
        """Checks `steps`, then runs them on an existing `run` (a step that fails is undone: the model is as it was)."""
        check_steps(steps, run)
        run_checked_steps(steps, run)
