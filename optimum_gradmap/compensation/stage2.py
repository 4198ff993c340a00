# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Stage 2 as one call ([`compensate`]): which kept layers to fit, the fits in forward order, the
rollback if anything fails, and the optional check on validation text. Its settings are in [`settings`], what it
did in [`result`]."""

from __future__ import annotations

import time
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn
from transformers.utils import logging

from .. import distributed
from ..adapters import DecoderAdapter
from ..data import calibration_sha256
from ..evaluation.perplexity import perplexity
from ..passes import RecordedLayerInputs
from ..precision import Precision
from ..surgery import LayerSnapshot
from .activations import FitData, hidden_state_means, hidden_state_means_and_outputs, record_layer_outputs
from .fit import fit_and_fold
from .folding import down_projection_backup
from .next_token import check_next_token_selection, chooses_by_next_token_loss, resolve_selection
from .refinement import refine
from .result import CompensationResult
from .settings import Stage2Settings, warn_if_few_tokens
from .targets import check_num_compensated_layers, compensation_targets, targets_need_drift

logger = logging.get_logger(__name__)


def check_stage2_settings(config: Stage2Settings, adapter: DecoderAdapter) -> None:
    """Refuses, before anything changes, Stage 2 settings that `adapter`'s family cannot run: a next-token
    selection with a norm after the MLP ([`check_next_token_selection`]).

    Raises:
        InvalidInputError: saying which setting and what to use instead.
    """
    check_next_token_selection(config, adapter)


def compensate(
    dense: LayerSnapshot,
    calibration_ids: torch.LongTensor,
    config: Stage2Settings,
    progress_bar: bool = True,
    validation_ids: torch.LongTensor | None = None,
    precision: Precision | None = None,
) -> CompensationResult:
    """Stage 2 as one call, on the model `dense` was taken from, now pruned (Eq. 10-15 of the paper):

    1. the mean drift (Eq. 10) of every kept layer, against the dense model on the same tokens (the
       dense stack is run from `dense`, then the pruned one is put back);
    2. the target layers ([`compensation_targets`], `config.compensation_target`), fitted in forward
       order, each on the model that already carries the earlier corrections;
    3. with a fixed `reg_lambda`, a warning when the calibration set has fewer than
       `MIN_TOKENS_PER_HIDDEN_UNIT` tokens per hidden unit, below which W' was measured to overfit with the
       paper's lambda;
    4. the fit of W' (Eq. 12-14) and its fold into the down projection(s) (Eq. 15); with
       `reg_lambda="auto"`, lambda is chosen by the held-out next-token loss ([`learn_by_next_token_loss`],
       `compensation_selection="next_token_loss"`, the default where it can run) or by cross-validation of the
       hidden state's error ([`learn_compensation`], `"hidden_state"`), and a layer where no lambda beats W' = I
       is left alone;
    5. with `validation_ids`, the perplexity on them with and without the compensation: it is kept
       only if it lowers it (under `torch.distributed`, each process scores its share of them and the losses are
       summed over processes, so that every process takes the same decision);
    6. the drift again, after the folds.

    If anything fails, every folded tensor is put back: the model is left as Stage 1 left it. A
    configuration the adapter cannot compensate exactly is refused before anything runs.

    Args:
        dense ([`LayerSnapshot`]): The dense stack of the pruned model (its `model`, changed in place).
        calibration_ids (`torch.LongTensor` of shape `(num_samples, seq_len)`): Calibration sequences.
        config ([`Stage2Settings`]): The settings in `STAGE2_SETTINGS` are read.
        progress_bar (`bool`, defaults to `True`): Show progress bars.
        validation_ids (`torch.LongTensor`, *optional*): Sequences that decide whether to keep the result.
        precision ([`~optimum_gradmap.precision.Precision`], *optional*): How the passes compute. With bfloat16
            passes (the next-token selection only, where the bound was measured), the drift that chooses the targets
            and the validation are computed in float32, and each fit's choice as
            [`learn_by_next_token_loss`] says. By default the model's own dtype.

    Returns:
        [`CompensationResult`].
    """
    started = time.perf_counter()
    config, kept = _checked(dense, config)
    if precision is None or not chooses_by_next_token_loss(config):
        precision = Precision()  # the model's dtype: no bound was measured for the other choices of lambda
    with precision.passes():
        return _compensate(dense, calibration_ids, config, kept, progress_bar, validation_ids, precision, started)


def _compensate(
    dense: LayerSnapshot,
    calibration_ids: torch.LongTensor,
    config: Stage2Settings,
    kept: list[int],
    progress_bar: bool,
    validation_ids: torch.LongTensor | None,
    precision: Precision,
    started: float,
) -> CompensationResult:
    shared_ids, first_sample = distributed.shard(calibration_ids)  # all of them with one process
    run = _Stage2Run(dense, config, shared_ids, first_sample, progress_bar, precision)
    passes = run.drift_passes(kept)
    result = CompensationResult(drift=passes.drift(passes.pruned_means), calibration_sha256=calibration_sha256(calibration_ids))
    warn_if_few_tokens(calibration_ids, passes.dense_means.shape[-1], config)
    targets = compensation_targets(
        kept, result.drift, dense.num_layers, config.compensation_target, config.num_compensated_layers
    )
    if not targets:
        logger.warning(f"Stage 2 ({config.compensation_target}) found no layer to compensate.")
        result.seconds = time.perf_counter() - started
        return result

    result.backup = down_projection_backup(dense.adapter, [dense.layers[index] for index, _ in targets])
    try:
        run.fold(targets, passes, validation_ids, result)
    except BaseException:
        result.undo()
        raise
    result.seconds = time.perf_counter() - started
    return result


def _checked(dense: LayerSnapshot, config: Stage2Settings) -> tuple[Stage2Settings, list[int]]:
    """Refuses, before anything runs, what the adapter cannot compensate exactly and settings its family cannot run;
    returns `config` with its `"auto"` choices made ([`resolve_selection`]) and the kept layers."""
    dense.adapter.check_supported(dense.model, compensation=True)
    check_stage2_settings(config, dense.adapter)
    config = resolve_selection(config, dense.adapter)
    kept = dense.kept_layers()
    check_num_compensated_layers(config.num_compensated_layers, len(kept), config.compensation_target)
    return config, kept


class _Start(NamedTuple):
    """Where the passes of a fit can start: what kept layer `layer` (an original index) received on every calibration
    sequence of this process, recorded while the layers before it were as they are now."""

    layer: int
    hidden_states: torch.Tensor
    returns_tuple: bool


@dataclass
class _DriftPasses:
    """What the dense and the pruned passes measured: each layer's mean output (this process's share averaged over
    every process), the dense outputs already recorded for the fits, and where the first fit can start.

    Args:
        kept (`list[int]`): The kept layers (original indices).
        dense_means (`torch.Tensor`): The dense model's mean output of every layer.
        pruned_means (`torch.Tensor`): The pruned model's mean output of every kept layer.
        originals (`dict[int, torch.Tensor]`): Dense outputs recorded in the dense pass, by layer.
        start ([`_Start`], *optional*): What the first target received in the pruned pass, where it was recorded.
    """

    kept: list[int]
    dense_means: torch.Tensor
    pruned_means: torch.Tensor
    originals: dict[int, torch.Tensor]
    start: _Start | None

    def drift(self, means: torch.Tensor) -> dict[int, float]:
        """Each kept layer's drift (Eq. 10): the norm of its mean output's shift from the dense model's."""
        return {index: float((self.dense_means[index] - means[p]).norm()) for p, index in enumerate(self.kept)}


@dataclass(frozen=True)
class _Stage2Run:
    """One run of Stage 2: the dense stack of the pruned model, the settings (their `"auto"` choices made), this
    process's calibration sequences (`shared_ids`, from its sequence `first_sample`) and whether progress bars show."""

    dense: LayerSnapshot
    config: Stage2Settings
    shared_ids: torch.LongTensor
    first_sample: int
    progress_bar: bool
    precision: Precision

    def drift_passes(self, kept: list[int]) -> _DriftPasses:
        """The dense pass (the dense stack run from `dense`, then the pruned one put back) and the pruned pass. Where
        the targets do not depend on the drift, the dense outputs they are fitted to are recorded in the dense pass,
        and what the first target receives in the pruned pass: its fit starts there."""
        dense, config = self.dense, self.config
        originals: dict[int, torch.Tensor] = {}
        early: list[tuple[int, int]] = []
        if not targets_need_drift(config.compensation_target):
            early = compensation_targets(kept, {}, dense.num_layers, config.compensation_target, config.num_compensated_layers)
            originals = dict.fromkeys(sorted({end for _, end in early}))
        with nullcontext() if early else self.precision.exact():  # where the drift chooses the targets: in float32
            return self._drift_passes(kept, originals, early)

    def _drift_passes(
        self, kept: list[int], originals: dict[int, torch.Tensor | None], early: list[tuple[int, int]]
    ) -> _DriftPasses:
        dense, config, shared_ids, progress_bar = self.dense, self.config, self.shared_ids, self.progress_bar
        model = dense.model
        with dense.temporarily(range(dense.num_layers)):
            local_means, recorded = hidden_state_means_and_outputs(
                model, dense.layers, shared_ids, config.batch_size, list(originals), progress_bar, "Dense hidden states"
            )
        originals.update(zip(originals, recorded))
        dense_means = distributed.average(local_means, shared_ids.numel())
        first = early[0][0] if early else None
        with RecordedLayerInputs(model, {first: dense.layers[first]} if first is not None else {}, shared_ids) as recorder:
            local = hidden_state_means(
                model, dense.adapter.get_layers(model), shared_ids, config.batch_size, progress_bar, "Pruned hidden states"
            )
            pruned_means = distributed.average(local, shared_ids.numel())
        return _DriftPasses(kept, dense_means, pruned_means, originals, _start_of(first, recorder))

    def fold(
        self,
        targets: list[tuple[int, int]],
        passes: _DriftPasses,
        validation_ids: torch.LongTensor | None,
        result: CompensationResult,
    ) -> None:
        """Fits and folds the targets, refines them (`refinement_steps`), keeps them only if they lower the validation
        perplexity (with `validation_ids`), and measures the drift after them, all recorded in `result`."""
        folds = self.fit_targets(targets, passes.originals, passes.start, result)
        if self.config.refinement_steps and folds:
            layers = [layer for layer, _ in folds]
            result.refinement = refine(
                self.dense, layers, self.shared_ids, self.first_sample, self.config, [result.backup], self.progress_bar
            )
        if validation_ids is not None and folds:
            with self.precision.exact():  # a decision: keep the folds or not
                self.keep_if_validated(folds, validation_ids, result)
        result.drift_after_compensation = passes.drift(self.compensated_means(passes.pruned_means, passes.start))

    def compensated_means(self, pruned_means: torch.Tensor, start: _Start | None) -> torch.Tensor:
        """The mean output of every kept layer after the folds (for the drift after compensation). Stage 2 changes no
        layer before the first target: there the means are the pruned model's, and the pass starts at the first target
        from what it received (`start`, recorded in the pruned pass) where that was recorded."""
        dense, shared_ids = self.dense, self.shared_ids
        model, kept = dense.model, dense.kept_layers()
        first = kept.index(start.layer) if start is not None else 0
        layers = [dense.layers[index] for index in kept[first:]]
        with dense.starting_at(start.layer, shared_ids, start.hidden_states, start.returns_tuple) if start else nullcontext():
            description = "Compensated hidden states"
            local = hidden_state_means(model, layers, shared_ids, self.config.batch_size, self.progress_bar, description)
        return torch.cat([pruned_means[:first], distributed.average(local, shared_ids.numel())])

    def fit_targets(
        self,
        targets: list[tuple[int, int]],
        originals: dict[int, torch.Tensor],
        start: _Start | None,
        result: CompensationResult,
    ) -> list[tuple[nn.Module, torch.Tensor]]:
        """Fits and folds every target in forward order (recording each in `result`); returns the folds made.
        `originals` holds the dense outputs already recorded, by layer; the others are recorded first.

        A fit changes only its layer, and the targets come in forward order: the layers before a target are the same
        as when the previous target ran. So every pass of a fit starts at the previous target
        ([`LayerSnapshot.starting_at`], from what it received, recorded during the previous fit's own statistics pass;
        `start` for the first), not at the first layer: the same numbers, without running the layers before it
        again."""
        dense, config, shared_ids, progress_bar = self.dense, self.config, self.shared_ids, self.progress_bar
        model, adapter = dense.model, dense.adapter
        missing = sorted({end for _, end in targets} - set(originals))
        if missing:
            with dense.temporarily(range(dense.num_layers)):
                layers = [dense.layers[end] for end in missing]
                originals = {
                    **originals,
                    **dict(zip(missing, record_layer_outputs(model, layers, shared_ids, config.batch_size, progress_bar))),
                }
        folds = []
        for index, end in targets:
            layer = dense.layers[index]
            with ExitStack() as passes:
                if start is not None:
                    passes.enter_context(dense.starting_at(start.layer, shared_ids, start.hidden_states, start.returns_tuple))
                recorder = passes.enter_context(RecordedLayerInputs(model, {index: layer}, shared_ids))
                data = FitData(model, adapter, layer, originals[end], shared_ids, self.first_sample)
                fit = fit_and_fold(data, config, progress_bar, self.precision)
            start = _start_of(index, recorder)
            result.targets[index] = end
            if fit.skipped:
                result.skipped_layers[index] = "no lambda beat W' = I on held-out calibration sequences"
                logger.info(f"Layer {index} left uncompensated: no lambda beat W' = I on held-out calibration sequences.")
                continue
            folds.append((layer, fit.matrix))
            result.compensated_layers.append(index)
            result.objective[index] = {"identity": fit.objective_identity, "fitted": fit.objective_fitted}
            result.reg_lambda[index] = fit.reg_lambda
            logger.info(
                f"Compensated layer {index} (fitted to the dense output of layer {end}, lambda {fit.reg_lambda:.3g}): "
                f"objective {fit.objective_identity:.6g} -> {fit.objective_fitted:.6g}"
            )
        return folds

    def keep_if_validated(
        self, folds: list[tuple[nn.Module, torch.Tensor]], validation_ids: torch.LongTensor, result: CompensationResult
    ) -> None:
        """Perplexity on `validation_ids` with the folds and without them; leaves the better model and says so in
        `result`.

        The model validated with the compensation is kept exactly as it was measured: its folded tensors (the fits' W'
        and, with `refinement_steps`, the refinement's R) are copied before they are undone, and copied back if kept.
        """
        dense, batch_size, progress_bar = self.dense, self.config.batch_size, self.progress_bar
        validated = down_projection_backup(dense.adapter, [layer for layer, _ in folds])
        with_compensation = perplexity(dense.model, validation_ids, batch_size, progress_bar, shared_by_processes=True)
        result.undo()
        without = perplexity(dense.model, validation_ids, batch_size, progress_bar, shared_by_processes=True)
        kept = with_compensation < without
        result.validation = {"without": without, "with": with_compensation, "kept": kept}
        if kept:
            validated.restore()
            return
        result.skipped_layers.update(
            {index: "the compensation raised the validation perplexity" for index in result.compensated_layers}
        )
        result.compensated_layers, result.objective, result.reg_lambda = [], {}, {}


def _start_of(layer: int | None, recorder: RecordedLayerInputs) -> _Start | None:
    """What `recorder` kept of `layer`'s inputs, as a [`_Start`]; `None` where it kept nothing."""
    inputs = recorder.inputs() if layer is not None else None
    return _Start(layer, inputs[layer], recorder.returns_tuple) if inputs is not None else None
