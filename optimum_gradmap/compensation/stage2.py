# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Stage 2 as one call ([`compensate`]): which kept layers to fit, the fits in forward order, the
rollback if anything fails, and the optional check on validation text."""

from __future__ import annotations

import time
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn
from transformers.utils import logging

from .. import distributed
from ..adapters import DecoderAdapter
from ..configuration import GradMAPConfig
from ..data import calibration_sha256
from ..evaluation.perplexity import perplexity
from ..passes import RecordedLayerInputs
from ..surgery import LayerSnapshot
from ..weights import WeightBackup
from .activations import check_outlier_tokens, hidden_state_means, hidden_state_means_and_outputs, record_layer_outputs
from .fit import fit_and_fold
from .folding import down_projection_backup
from .next_token import check_next_token_selection, resolve_selection
from .refinement import refine
from .targets import check_num_compensated_layers, compensation_targets, targets_need_drift

logger = logging.get_logger(__name__)

# Below this many calibration tokens per hidden unit, W' (hidden x hidden parameters) overfitted on
# SmolLM2-135M: 1.8 tokens per unit raised held-out perplexity by 60%, 7 by 2%, 28 lowered it.
MIN_TOKENS_PER_HIDDEN_UNIT = 16
# The GradMAPConfig fields Stage 2 reads: the ones a re-run of Stage 2 may change.
STAGE2_SETTINGS = (
    "compensation_target",
    "compensation_form",
    "compensation_objective",
    "compensation_selection",
    "lambda_search",
    "outlier_tokens",
    "compensation_dataset",
    "refinement_steps",
    "refinement_lr",
    "num_compensated_layers",
    "solver",
    "reg_lambda",
    "adam_lr",
    "adam_steps",
    "batch_size",
)


def check_stage2_settings(config: GradMAPConfig, adapter: DecoderAdapter) -> None:
    """Refuses, before anything changes, Stage 2 settings that `adapter`'s family cannot run: a next-token
    selection ([`check_next_token_selection`]) or clipped outlier weights ([`check_outlier_tokens`]) with a
    norm after the MLP.

    Raises:
        InvalidInputError: saying which setting and what to use instead.
    """
    check_next_token_selection(config, adapter)
    check_outlier_tokens(config, adapter)


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


def compensate(
    dense: LayerSnapshot,
    calibration_ids: torch.LongTensor,
    config: GradMAPConfig,
    progress_bar: bool = True,
    validation_ids: torch.LongTensor | None = None,
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
        config ([`GradMAPConfig`]): The settings in `STAGE2_SETTINGS` are read.
        progress_bar (`bool`, defaults to `True`): Show progress bars.
        validation_ids (`torch.LongTensor`, *optional*): Sequences that decide whether to keep the result.

    Returns:
        [`CompensationResult`].
    """
    started = time.perf_counter()
    model, adapter = dense.model, dense.adapter
    adapter.check_supported(model, compensation=True)
    check_stage2_settings(config, adapter)
    config = resolve_selection(config, adapter)
    kept = dense.kept_layers()
    check_num_compensated_layers(config.num_compensated_layers, len(kept), config.compensation_target)
    shared_ids, first_sample = distributed.shard(calibration_ids)  # all of them with one process

    def means(description: str) -> torch.Tensor:
        local = hidden_state_means(model, adapter.get_layers(model), shared_ids, config.batch_size, progress_bar, description)
        return distributed.average(local, shared_ids.numel())

    # where the targets do not depend on the drift, the dense outputs they are fitted to are recorded in the pass that
    # measures the dense means
    originals: dict[int, torch.Tensor] = {}
    early: list[tuple[int, int]] = []
    if not targets_need_drift(config.compensation_target):
        early = compensation_targets(kept, {}, dense.num_layers, config.compensation_target, config.num_compensated_layers)
        originals = dict.fromkeys(sorted({end for _, end in early}))
    with dense.temporarily(range(dense.num_layers)):
        local_means, recorded = hidden_state_means_and_outputs(
            model, dense.layers, shared_ids, config.batch_size, list(originals), progress_bar, "Dense hidden states"
        )
    originals.update(zip(originals, recorded))
    dense_means = distributed.average(local_means, shared_ids.numel())
    # where the first target is known, what it receives is recorded in the pruned pass: its fit starts there
    first = early[0][0] if early else None
    with RecordedLayerInputs(model, {first: dense.layers[first]} if first is not None else {}, shared_ids) as recorder:
        pruned_means = means("Pruned hidden states")
    start = _start_of(first, recorder)
    drift_of = lambda means: {index: float((dense_means[index] - means[p]).norm()) for p, index in enumerate(kept)}  # noqa: E731
    result = CompensationResult(drift=drift_of(pruned_means), calibration_sha256=calibration_sha256(calibration_ids))
    _warn_if_few_tokens(calibration_ids, dense_means.shape[-1], config)
    targets = compensation_targets(
        kept, result.drift, dense.num_layers, config.compensation_target, config.num_compensated_layers
    )
    if not targets:
        logger.warning(f"Stage 2 ({config.compensation_target}) found no layer to compensate.")
        result.seconds = time.perf_counter() - started
        return result

    result.backup = down_projection_backup(adapter, [dense.layers[index] for index, _ in targets])
    try:
        folds = _fit_targets(dense, targets, originals, start, shared_ids, first_sample, config, progress_bar, result)
        if config.refinement_steps and folds:
            result.refinement = refine(
                dense,
                [layer for layer, _ in folds],
                adapter,
                shared_ids,
                first_sample,
                config.refinement_steps,
                config.refinement_lr,
                config.batch_size,
                [result.backup],
                progress_bar,
            )
        if validation_ids is not None and folds:
            _keep_if_validated(dense, folds, validation_ids, config.batch_size, progress_bar, result)
        compensated_means = _compensated_means(dense, pruned_means, start, shared_ids, config, progress_bar)
        result.drift_after_compensation = drift_of(compensated_means)
    except BaseException:
        result.undo()
        raise
    result.seconds = time.perf_counter() - started
    return result


def _warn_if_few_tokens(calibration_ids: torch.LongTensor, hidden_size: int, config: GradMAPConfig) -> None:
    if calibration_ids.numel() < MIN_TOKENS_PER_HIDDEN_UNIT * hidden_size and config.reg_lambda != "auto":
        logger.warning(
            f"Stage 2 fits a {hidden_size} x {hidden_size} matrix on {calibration_ids.numel()} calibration tokens: with "
            f"fewer than {MIN_TOKENS_PER_HIDDEN_UNIT} x hidden size = {MIN_TOKENS_PER_HIDDEN_UNIT * hidden_size} tokens it "
            "can overfit and raise held-out perplexity. Use more calibration data (the paper uses 128 x 128 tokens), "
            "or reg_lambda='auto'."
        )


class _Start(NamedTuple):
    """Where the passes of a fit can start: what kept layer `layer` (an original index) received on every calibration
    sequence of this process, recorded while the layers before it were as they are now."""

    layer: int
    hidden_states: torch.Tensor
    returns_tuple: bool


def _compensated_means(
    dense: LayerSnapshot,
    pruned_means: torch.Tensor,
    start: _Start | None,
    shared_ids: torch.LongTensor,
    config: GradMAPConfig,
    progress_bar: bool,
) -> torch.Tensor:
    """The mean output of every kept layer after the folds (for the drift after compensation). Stage 2 changes no
    layer before the first target: there the means are the pruned model's, and the pass starts at the first target
    from what it received (`start`, recorded in the pruned pass) where that was recorded."""
    model, kept = dense.model, dense.kept_layers()
    first = kept.index(start.layer) if start is not None else 0
    layers = [dense.layers[index] for index in kept[first:]]
    with dense.starting_at(start.layer, shared_ids, start.hidden_states, start.returns_tuple) if start else nullcontext():
        local = hidden_state_means(model, layers, shared_ids, config.batch_size, progress_bar, "Compensated hidden states")
    return torch.cat([pruned_means[:first], distributed.average(local, shared_ids.numel())])


def _start_of(layer: int | None, recorder: RecordedLayerInputs) -> _Start | None:
    """What `recorder` kept of `layer`'s inputs, as a [`_Start`]; `None` where it kept nothing."""
    inputs = recorder.inputs() if layer is not None else None
    return _Start(layer, inputs[layer], recorder.returns_tuple) if inputs is not None else None


def _fit_targets(
    dense: LayerSnapshot,
    targets: list[tuple[int, int]],
    originals: dict[int, torch.Tensor],
    start: _Start | None,
    shared_ids: torch.LongTensor,
    first_sample: int,
    config: GradMAPConfig,
    progress_bar: bool,
    result: CompensationResult,
) -> list[tuple[nn.Module, torch.Tensor]]:
    """Fits and folds every target in forward order (recording each in `result`); returns the folds made. `originals`
    holds the dense outputs already recorded, by layer; the others are recorded first.

    A fit changes only its layer, and the targets come in forward order: the layers before a target are the same as
    when the previous target ran. So every pass of a fit starts at the previous target ([`LayerSnapshot.starting_at`],
    from what it received, recorded during the previous fit's own statistics pass; `start` for the first), not at
    the first layer: the same numbers, without running the layers before it again."""
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
            fit = fit_and_fold(model, adapter, layer, originals[end], shared_ids, config, progress_bar, first_sample)
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


def _keep_if_validated(
    dense: LayerSnapshot,
    folds: list[tuple[nn.Module, torch.Tensor]],
    validation_ids: torch.LongTensor,
    batch_size: int,
    progress_bar: bool,
    result: CompensationResult,
) -> None:
    """Perplexity on `validation_ids` with the folds and without them; leaves the better model and says so in `result`.

    The model validated with the compensation is kept exactly as it was measured: its folded tensors (the fits' W'
    and, with `refinement_steps`, the refinement's R) are copied before they are undone, and copied back if kept.
    """
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
