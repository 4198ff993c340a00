# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""The GradMAP pruner: orchestrates Stage 1 (layer selection, [`optimum_gradmap.importance.selection`])
and Stage 2 (projection compensation, [`optimum_gradmap.compensation`]) on any model that has an
architecture adapter, and hands back a [`PruningResult`]."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging

from . import surgery
from .checkpoint import save_checkpoint
from .compensation import RunCompensation
from .compensation import stage as stage2
from .configuration import GradMAPConfig
from .data import CalibrationData, check_token_ids, is_text_data, prepare_calibration_data
from .errors import InvalidInputError
from .heal import HealText
from .heal import pruned as healing
from .hub import save_and_upload
from .importance import stage as stage1
from .precision import compute_device, resolve_dtype
from .result import PruningResult

if TYPE_CHECKING:
    from .evaluation import EvaluationResult
    from .planning import DeviceThroughput, PruningPlan

logger = logging.get_logger(__name__)

# `from_pretrained` arguments that say where the model came from: the tokenizer is loaded from the same place.
_LOCATION_KWARGS = ("revision", "token", "cache_dir", "local_files_only", "trust_remote_code", "subfolder")


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
        # Between Stage 1 and the end of Stage 2: the dense stack of `self.result`, and the fits made between Stage 1's
        # removals (`compensate_each_round`), with their backups.
        self._dense: surgery.LayerSnapshot | None = None
        self._run_compensations: list[RunCompensation] = []
        self._calibration_data: CalibrationData = None  # what the last `select_layers` read
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
                `dtype` is read as the CLI's `--dtype` ([`optimum_gradmap.precision.resolve_dtype`]): `"auto"` is
                bfloat16 where the hardware computes it natively and float32 elsewhere (not the checkpoint's dtype,
                which is `"checkpoint"`); a `torch.dtype` is used as it is.
        """
        if "dtype" in model_kwargs:
            device = compute_device(device_map=model_kwargs.get("device_map"))
            model_kwargs = {**model_kwargs, "dtype": resolve_dtype(model_kwargs["dtype"], device)}
        model = AutoModelForCausalLM.from_pretrained(model_name_or_path, **model_kwargs)
        location = {key: model_kwargs[key] for key in _LOCATION_KWARGS if key in model_kwargs}
        if tokenizer is None or isinstance(tokenizer, (str, os.PathLike)):
            tokenizer = AutoTokenizer.from_pretrained(tokenizer or model_name_or_path, **location)
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
        """What a run of `config` on the model will do and cost, told before the run from the model's config alone
        (built on the meta device: no weight is read): the layers to remove, the rounds and passes, the tokens and
        FLOPs of each stage, the peak memory in memory and layer-streamed, the disk the output needs, and the expected
        time of each stage on `device`, from a few seconds' measurement of its throughput. `optimum-gradmap prune
        --dry-run` prints it.

        ```python
        >>> plan = GradMAPPruner.plan("HuggingFaceTB/SmolLM2-135M", GradMAPConfig(pruning_ratio=0.25))
        >>> print(plan)  # a table; plan.to_dict() for JSON
        ```

        Args:
            model_or_path (`PreTrainedModel`, `PretrainedConfig`, `str` or `os.PathLike`): The model (its config is
                used), its config, a local folder or a Hub id (`config.json` alone is read).
            config (`GradMAPConfig`): The run.
            dtype (`torch.dtype` or `str`, defaults to `torch.float32`): The dtype the model computes in.
            device (`str` or `torch.device`, *optional*): Where it computes (defaults to the CPU).
            throughput (`DeviceThroughput`, *optional*): The device's speed; measured on `device` when not given.
                [`~optimum_gradmap.planning.DeviceThroughput.assumed`] plans for a device you do not have.
            kwargs: The other arguments of [`~optimum_gradmap.planning.plan_pruning`] (`device_map`, `max_memory`,
                `execution`, `removed_layers`, `evaluation_tokens`, ...).

        Returns:
            [`~optimum_gradmap.planning.PruningPlan`].
        """
        from .planning import plan_pruning

        return plan_pruning(model_or_path, config, dtype=dtype, device=device, throughput=throughput, **kwargs)

    # ----------------------------------------------------------------------------------------- API
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
        """Prunes `model` in place: Stage 1, then Stage 2 if `config.compensation`, then the heal stage if
        `config.heal_tokens` ([`~GradMAPPruner.heal`]). Every text is read and checked before Stage 1 starts.

        Args:
            model (`PreTrainedModel`, *optional*): Defaults to the pruner's model.
            calibration_data: `None` (use `config.dataset`), a dataset name, a `datasets.Dataset`, a list of strings, a
                list of token-id lists, or a `LongTensor` of shape `(N, T)` ([`~optimum_gradmap.data.prepare_calibration_data`]).
            tokenizer (`PreTrainedTokenizerBase`, *optional*): For text; defaults to the pruner's tokenizer, else the
                one saved with the model.
            stage1_checkpoint (`str` or `os.PathLike`, *optional*): Stage 1's progress file ([`~GradMAPPruner.select_layers`]).
            validation_data (*optional*): Text (any form `calibration_data` takes) whose perplexity decides whether Stage
                2's compensation is kept ([`~GradMAPPruner.compensate`]).
            compensation_data (*optional*): Text Stage 2 fits on; defaults to `config.compensation_dataset`, and without
                it to the calibration sequences.
            heal_data (*optional*): Text the heal stage trains on; defaults to `config.heal_dataset`.
            heal_checkpoint (`str` or `os.PathLike`, *optional*): The heal's state, saved at every held-out check, from
                which an interrupted heal resumes ([`optimum_gradmap.heal.heal`]). A file whose heal text, settings,
                number of processes or model size differ from this run's is refused before Stage 1
                ([`~optimum_gradmap.heal.check_heal_checkpoint_origin`]; the text where it is known then).
            heal_text_cache (`str` or `os.PathLike`, *optional*): The file that caches the dense model's own text
                (`heal_dataset` with `generated`); defaults to one per fingerprint in the user cache.

        Returns:
            [`PruningResult`]: `result.model` is the pruned model.

        Raises:
            InvalidInputError (a `ValueError`): for a model, settings or data that cannot be pruned as configured
                (Stage 2's and the heal stage's included), before anything changes. What depends on the layers Stage 1
                removes is refused where it becomes known, and what Stage 1 and 2 did is undone: with a budget, a
                `num_compensated_layers` larger than the layers Stage 1 leaves; `heal_trainable="before_removed"` when
                every removed run starts at layer 0, `"down_projections"` when Stage 2 compensated no layer, and a heal
                checkpoint that matches this run's heal but not its pruning.
            Exception: any other error once Stage 1 started propagates after the model was put back as it came.
                Ctrl-C during the heal's training steps stops training and keeps its best state
                (`result.heal.interrupted`).
        """
        config = self.config
        model = self._resolve_model(model)
        heal_text = healing.heal_input(model, heal_data, config, self._tokenizers(model, tokenizer), heal_checkpoint)
        compensation_ids, validation_ids = stage2.stage2_ids(
            config, compensation_data, validation_data, self._reader(model, tokenizer)
        )

        def check_fit_data(calibration_ids: torch.LongTensor) -> None:  # Stage 2 fits on them: checked before Stage 1
            if config.compensation and compensation_ids is None:
                stage2.check_fit_ids(calibration_ids, config)

        result = self._select_layers(model, calibration_data, tokenizer, stage1_checkpoint, check_fit_data)
        try:
            if config.compensation:
                fit_ids = compensation_ids if compensation_ids is not None else result.calibration_ids
                stage2.compensate_result(result, self._dense, config, fit_ids, validation_ids, self.progress_bar)
            if config.heal_tokens:
                self._heal(result, config, heal_text, heal_data, tokenizer, None, heal_checkpoint, heal_text_cache)
        except BaseException:
            self._roll_back(result)
            raise
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
        return self._select_layers(model, calibration_data, tokenizer, stage1_checkpoint)

    def _select_layers(
        self,
        model: PreTrainedModel | None,
        calibration_data: CalibrationData,
        tokenizer: PreTrainedTokenizerBase | None,
        stage1_checkpoint: str | os.PathLike | None,
        check_calibration_ids: Callable[[torch.LongTensor], None] | None = None,
    ) -> PruningResult:
        """[`~GradMAPPruner.select_layers`], calling `check_calibration_ids` with the calibration sequences once they
        are read, before anything changes ([`optimum_gradmap.importance.stage`])."""
        model = self._resolve_model(model)
        read = lambda: self._calibration_ids(model, calibration_data, tokenizer)  # noqa: E731
        checked = stage1.check_stage1_input(model, self.config, read, stage1_checkpoint, check_calibration_ids)
        self.release()
        self.result, self._dense, self._run_compensations = stage1.select_layers(
            checked, self.config, calibration_data, self.tokenizer, self.progress_bar
        )
        self._calibration_data = calibration_data  # the dense model's own heal text starts from its first tokens
        return self.result

    def compensate(
        self,
        result: PruningResult,
        validation_data: CalibrationData = None,
        compensation_data: CalibrationData = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        **config_overrides: Any,
    ) -> PruningResult:
        """Stage 2 on a model pruned by [`~GradMAPPruner.select_layers`] (see
        [`optimum_gradmap.compensation.compensate`]): measures the mean drift of every kept layer
        (Eq. 10), learns W' for the layers `compensation_target` names (Eq. 12-14) and folds it into their
        down projections (Eq. 15). If it fails, the model is left as Stage 1 left it.

        Called again on the same result, it first undoes the previous fold, so Stage 2 can be compared
        under other settings on one Stage 1 result:

        ```python
        result = pruner.select_layers(model, data)
        pruner.compensate(result)  # the config's settings
        pruner.compensate(result, solver="adam", reg_lambda=1e-2)  # replaces the first fit
        ```

        Args:
            result ([`PruningResult`]): The last result of this pruner's `select_layers`.
            validation_data (*optional*): Text (any form `calibration_data` takes, drawn with the config's
                `num_samples` and `seq_len` and seed `seed + 1`) whose perplexity decides whether the compensation
                is kept: it is undone if it does not lower it (`result.compensation.validation`).
            compensation_data (*optional*): Text the fits use instead of the calibration sequences of `result` (drawn
                with the config's `num_samples`, `seq_len` and `seed`); defaults to `compensation_dataset`, and
                without it to the calibration sequences. `result.compensation.calibration_sha256` says which.
            tokenizer (`PreTrainedTokenizerBase`, *optional*): For text; defaults to the pruner's tokenizer, else the
                one saved with the model.
            config_overrides: Stage 2 settings of [`GradMAPConfig`] to use instead of the pruner's (those in
                `optimum_gradmap.compensation.STAGE2_SETTINGS`); `result.config` records them.

        Returns:
            [`PruningResult`]: `result`, with `result.compensation` filled in.
        """
        if result is not self.result or self._dense is None:
            raise InvalidInputError(
                "This pruner no longer holds the dense layers of that result (Stage 2 compares against them): "
                "call `compensate` with the result of this pruner's last `select_layers`, before `prune` or `release` "
                "drops them."
            )
        read = self._reader(result.model, tokenizer)
        inputs = stage2.compensate_input(result, self.config, config_overrides, compensation_data, validation_data, read)
        return stage2.compensate_result(result, self._dense, *inputs, self.progress_bar)

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
        distribution into the pruned model on `config.heal_tokens` tokens of other text than the calibration set, and
        merges what was trained into plain weights. `prune` runs it after Stage 2 when `config.heal_tokens > 0`.

        ```python
        result = pruner.select_layers(model, data)
        pruner.compensate(result)
        pruner.heal(result, heal_tokens=200_000, heal_dataset="offline:web_text")
        pruner.release()
        ```

        Args:
            result ([`PruningResult`]): A pruned result.
            heal_data (*optional*): The text to train on (any form `calibration_data` takes); defaults to
                `heal_dataset`.
            tokenizer (`PreTrainedTokenizerBase`, *optional*): For text; defaults to the pruner's tokenizer.
            teacher (`PreTrainedModel`, *optional*): The dense model. Without it, the dense model is the pruned one with
                its removed layers put back and Stage 2's folds undone, which this pruner holds for the result of its
                last `select_layers` until `prune` or `release` drops them (no second copy of the weights).
            checkpoint (`str` or `os.PathLike`, *optional*): A file where the state is saved at every held-out check,
                and from which an interrupted heal resumes.
            text_cache (`str` or `os.PathLike`, *optional*): The file that caches the dense model's own text
                (`heal_dataset` with `generated`); defaults to one per fingerprint in the user cache.
            config_overrides: Heal settings of [`GradMAPConfig`] (those in `optimum_gradmap.heal.HEAL_SETTINGS`) to
                use instead of the pruner's; `heal_tokens` defaults to the config's, and must be > 0.

        Returns:
            [`PruningResult`]: `result`, with `result.heal` filled in and `result.timings["heal"]`.

        Raises:
            InvalidInputError: for settings or text that cannot heal, a result healed already, or no teacher; the model
                is left as it was. Any other error during training leaves the model as it was before the call; Ctrl-C
                keeps the best state so far.
        """
        config = healing.heal_config(result, self.config, config_overrides)
        if teacher is None and (result is not self.result or self._dense is None):
            raise InvalidInputError(
                "This pruner no longer holds the dense layers of that result, which the heal stage's teacher is made of: "
                "call `heal` before `prune` or `release` drops them, or give the dense model as `teacher=`."
            )
        tokenizer_for = self._tokenizers(result.model, tokenizer)
        heal_text = healing.heal_text(result.model, heal_data, config, tokenizer_for, result.compensated_layers)
        return self._heal(result, config, heal_text, heal_data, tokenizer, teacher, checkpoint, text_cache)

    def _heal(
        self,
        result: PruningResult,
        config: GradMAPConfig,
        heal_text: HealText | None,
        heal_data: CalibrationData,
        tokenizer: PreTrainedTokenizerBase | None,
        teacher: PreTrainedModel | None,
        checkpoint: str | os.PathLike | None,
        text_cache: str | os.PathLike | None,
    ) -> PruningResult:
        """The heal stage on checked inputs ([`optimum_gradmap.heal.pruned.heal_result`]), its teacher made of this
        pruner's dense layers unless `teacher` is given."""
        return healing.heal_result(
            result, config, heal_text, heal_data, self._tokenizers(result.model, tokenizer), teacher, self._dense,
            self._run_compensations, checkpoint, text_cache, self.progress_bar,
            prompt_data=self._calibration_data if result is self.result else None,
        )  # fmt: skip

    def cut(self, result: PruningResult, num_layers_to_prune: int) -> PruningResult:
        """Keeps only the first `num_layers_to_prune` removals of a Stage 1 run, without scoring again: removal
        is nested (each round removes one layer from the model the earlier rounds left), so they are the layers a
        run with that K removes. One run to the largest K a user might want (with `loss_curve=True`, its curve
        says what each K costs) then gives any smaller K. Stage 2 is fitted for the K kept: call
        [`~GradMAPPruner.compensate`] after the cut (a compensation made before it is undone).

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
        if result is not self.result or self._dense is None:
            raise InvalidInputError(
                "This pruner no longer holds the dense layers of that result: `cut` needs the result of this pruner's last "
                "`select_layers`, before `prune` or `release` drops them."
            )
        return stage1.cut(result, self._dense, num_layers_to_prune)

    def release(self) -> None:
        """Drops the dense layers kept for Stage 2 (after [`~GradMAPPruner.select_layers`]), freeing their memory."""
        self._dense = None
        self._run_compensations = []
        self._calibration_data = None

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
        """Writes a standard checkpoint that plain `AutoModelForCausalLM.from_pretrained` loads. For the
        model this pruner pruned, this is [`PruningResult.save_pretrained`] (model, tokenizer,
        `gradmap_config.json`, `pruning_report.json` with pictures, model card); another model is saved
        with the tokenizer and `gradmap_config.json` only.

        Args:
            save_directory (`str` or `os.PathLike`): Output folder.
            model (`PreTrainedModel`, *optional*): Defaults to the last pruned model.
            tokenizer (`PreTrainedTokenizerBase`, *optional*): Defaults to the pruner's tokenizer.
            evaluation, base_model, license, repo_id, base_model_revision: See [`PruningResult.save_pretrained`].
            overwrite (`bool`, defaults to `False`): Replace the contents of an existing non-empty folder
                (refused otherwise).
            save_kwargs: Passed to the model's `save_pretrained`.

        Returns:
            `str`: The folder.
        """
        if model is None:
            model = self.result.model if self.result is not None else self.model
        if model is None:
            raise InvalidInputError("No model to save: pass `model=` or call `prune` first.")
        tokenizer = tokenizer or self.tokenizer
        if self.result is not None and self.result.model is model:
            return self.result.save_pretrained(
                save_directory,
                tokenizer=tokenizer,
                evaluation=evaluation,
                base_model=base_model,
                base_model_revision=base_model_revision,
                license=license,
                repo_id=repo_id,
                overwrite=overwrite,
                **save_kwargs,
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
        return save_and_upload(
            lambda folder: self.save_pretrained(folder, model=model, tokenizer=tokenizer, repo_id=repo_id, **save_kwargs),
            repo_id,
            private=private,
            token=token,
            commit_message=commit_message or self.commit_message(),
        )

    def commit_message(self) -> str:
        """The Hub commit message for the last pruning: which layers were removed and compensated."""
        return self.result.commit_message() if self.result is not None else "Upload model pruned with GradMAP"

    # ----------------------------------------------------------------------------------- internals
    def _resolve_model(self, model: PreTrainedModel | None) -> PreTrainedModel:
        model = model if model is not None else self.model
        if model is None:
            raise InvalidInputError(
                "No model to prune: pass one to `prune(model, ...)` or build the pruner with `from_pretrained`."
            )
        if self.model is None:
            self.model = model
        return model

    def _roll_back(self, result: PruningResult) -> None:
        """Puts the model of `result` back as `prune` got it (after an error once Stage 1 started): undoes Stage 2's
        folds, the fits made between removals, and the removals, then forgets the result."""
        if result.compensation is not None:
            result.compensation.undo()
            result.compensation = None
        for done in reversed(self._run_compensations):
            done.backup.restore()
        if self._dense is not None:
            self._dense.restore()
        self.result = None
        self.release()

    def _calibration_ids(
        self,
        model: PreTrainedModel,
        calibration_data: CalibrationData,
        tokenizer: PreTrainedTokenizerBase | None,
        seed: int | None = None,
    ) -> torch.LongTensor:
        config = self.config
        ids = prepare_calibration_data(
            calibration_data,
            self._tokenizer_for(model, calibration_data, tokenizer),
            config.num_samples,
            config.seq_len,
            config.seed if seed is None else seed,
            config.dataset,
            config.text_column,
        )
        check_token_ids(ids, model)
        return ids

    def _reader(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None) -> stage2.ReadIds:
        """Reads text for `model` with [`~GradMAPPruner._calibration_ids`] and a seed (`None`: the config's)."""
        return lambda data, seed: self._calibration_ids(model, data, tokenizer, seed=seed)

    def _tokenizers(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None) -> healing.TokenizerFor:
        """The tokenizer for some data for `model` ([`~GradMAPPruner._tokenizer_for`])."""
        return lambda data: self._tokenizer_for(model, data, tokenizer)

    def _tokenizer_for(
        self, model: PreTrainedModel, data: CalibrationData, tokenizer: PreTrainedTokenizerBase | None
    ) -> PreTrainedTokenizerBase | None:
        """`tokenizer`, else the pruner's, else (for text) the one saved with the model, which the pruner then keeps."""
        tokenizer = tokenizer or self.tokenizer
        if tokenizer is None and is_text_data(data):
            name = getattr(model, "name_or_path", "") or getattr(model.config, "_name_or_path", "")
            if not name:
                raise InvalidInputError(
                    "Calibration text needs a tokenizer: pass `tokenizer=` (the model has no name to load one from)."
                )
            location = self._location or {"revision": getattr(model.config, "_commit_hash", None)}
            tokenizer = AutoTokenizer.from_pretrained(name, **location)
            self.tokenizer = tokenizer
        return tokenizer
