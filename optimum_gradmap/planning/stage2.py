# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Stage 2's cost: its fits over the layouts Stage 1 may leave (exact for a known one), the held-out losses the
next-token selection scores, and what it holds at its peak."""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from ..adapters import DecoderAdapter
from ..compensation import lambda_search
from ..compensation.next_token import GOLDEN_SECTION, chooses_by_next_token_loss, resolve_selection, searched_losses
from ..compensation.refinement import CHECK_EVERY as REFINEMENT_CHECK_EVERY
from ..compensation.solvers import AUTO_NUM_FOLDS, AUTO_RIDGE_GRID
from ..compensation.targets import compensation_targets
from ..compensation.through_norm import NORM_RIDGE_GRID
from ..configuration import GradMAPConfig
from ..distillation import TOP_K
from .counts import ZERO, Count, Work, is_count
from .shape import ModelShape
from .stage1 import logits_bytes

# Layouts of removed layers tried where Stage 1's choice is not known yet (Stage 2's counts depend on it).
SAMPLED_LAYOUTS = 64


@dataclass
class Stage2Outline:
    """How Stage 2 runs, resolved from the config and the family."""

    target: str
    selection: str
    fits: Count
    evaluations_per_fit: Count
    rows_fit: bool


def golden_search_evaluations(grid_size: int) -> Count:
    """How many strengths the golden-section search scores on a grid of `grid_size` ([`searched_losses`]): from the
    fewest any outcome of its comparisons leaves, to the whole grid at most (each strength is scored once): a tie
    makes the search go on to the stronger strengths while their losses stay within the tolerance, and strong
    strengths all give nearly W' = I, so ties are common where W' = I is near the best. Likely: the mean count for a
    loss with one minimum and no tie, over where the minimum lies (4.4 of 9; SmolLM2-135M's five fits at 25% scored
    4.2 on average, docs/benchmarks/scale.md)."""
    outcomes: set[int] = set()

    def explore(low: int, high: int, scored: frozenset[int]) -> None:
        if high - low <= 2:
            outcomes.add(len(scored | set(range(low, high + 1))))
            return
        step = round((high - low) * GOLDEN_SECTION)
        left, right = low + step, max(high - step, low + step + 1)
        scored = scored | {left, right}
        explore(low, right, scored)
        explore(left, high, scored)

    explore(0, grid_size - 1, frozenset())
    # likely: a loss with one minimum and no tie (what the measured fits mostly give), the minimum at any strength
    grid = list(range(grid_size))
    single_minimum = [
        len(searched_losses(lambda index, best=best: (index - best) ** 2 + 1e-3 * index, grid, "golden")) for best in grid
    ]
    return Count(min(outcomes), grid_size, sum(single_minimum) / grid_size)


def stage2(
    config: GradMAPConfig,
    shape: ModelShape,
    adapter: DecoderAdapter,
    removals: list[list[int]],
    validation: bool,
) -> tuple[Work, Stage2Outline]:
    """Stage 2's work over `removals`, the layouts Stage 1 may leave (its removed layers: one, exact, where it is
    known), and its outline."""
    resolved = resolve_selection(config, adapter)
    selection = "next_token_loss" if chooses_by_next_token_loss(resolved) else "hidden_state"
    post_norm = adapter.mlp_output_norm_path is not None
    num_layers = shape.num_layers
    works: list[Work] = []
    fits: list[Count] = []
    for removed in removals:
        kept = [index for index in range(num_layers) if index not in removed]
        for targets in _target_sets(resolved, kept, num_layers):
            works.append(_layout_work(resolved, shape, kept, targets, post_norm, validation))
            fits.append(Count.of(len(targets)))
    work, fits = _median_over(works), _median_over(fits)
    rows_fit = post_norm or resolved.compensation_objective == "cosine"
    outline = Stage2Outline(resolved.compensation_target, selection, fits, _evaluations(resolved, rows_fit), rows_fit)
    return work, outline


def _layout_work(
    config: GradMAPConfig, shape: ModelShape, kept: list[int], targets: list[tuple[int, int]], post_norm: bool, validation: bool
) -> Work:
    """Stage 2's work for one layout: the kept layers and the targets fitted (see `compensation.stage2.compensate`)."""
    samples, seq_len = config.num_samples, config.seq_len
    tokens, num_layers, num_kept = samples * seq_len, shape.num_layers, len(kept)
    position = {index: kept.index(index) for index in kept}
    early = config.compensation_target != "max_drift"
    work = Work(layer_forward=Count.of((num_layers + num_kept) * tokens))  # the dense and the pruned means
    if not targets:
        return work
    if not early:  # the dense outputs the targets are fitted to, recorded once the targets are known
        work = work + Work(layer_forward=Count.of((max(end for _, end in targets) + 1) * tokens))
    start = targets[0][0] if early else None
    first_start = start
    rows_fit = post_norm or config.compensation_objective == "cosine"
    for index, _ in targets:
        first = position[start] if start is not None else 0
        run = position[index] - first + 1
        work = work + Work(layer_forward=Count.of(run * tokens))
        work = work + _fit_work(config, shape, num_kept - position[index], post_norm, rows_fit)
        start = index
    work = work + _refinement_work(config, num_layers, num_kept)
    if validation:  # the validation perplexity with and without the compensation
        work = work + Work(layer_forward=Count.of(2 * num_kept * tokens), head_forward=Count.of(2 * tokens))
    after_first = num_kept - (position[first_start] if first_start is not None else 0)
    return work + Work(layer_forward=Count.of(after_first * tokens))  # the drift after compensation


def _fit_work(config: GradMAPConfig, shape: ModelShape, after: int, post_norm: bool, rows_fit: bool) -> Work:
    """One target's fit: its statistics and solve, and the held-out losses of the next-token selection over the `after`
    kept layers from the target on."""
    samples, seq_len = config.num_samples, config.seq_len
    tokens, held_out, d = samples * seq_len, samples // AUTO_NUM_FOLDS, shape.hidden_size
    if rows_fit:
        steps = config.adam_steps * ((len(NORM_RIDGE_GRID) + 1) if post_norm and config.reg_lambda == "auto" else 1)
        work = Work(device_float64_flops=Count.of(6 * tokens * d * d * steps))
        if config.compensation_objective == "cosine" and config.reg_lambda == "auto":
            work = work + Work(host_eigh=Count.of(AUTO_NUM_FOLDS), host_float64_flops=Count.of(28 * AUTO_NUM_FOLDS * 2 * d**3))
        return work
    work = Work(device_float64_flops=Count.of(4 * d * d * tokens))
    if chooses_by_next_token_loss(config):
        evaluations = _evaluations(config, rows_fit)
        return work + Work(
            layer_forward=evaluations * (after * held_out * seq_len),
            head_forward=evaluations * (held_out * seq_len),
            host_eigh=Count.of(1),
            host_float64_flops=Count.of(21 * 2 * d**3),
        )
    if config.reg_lambda == "auto":  # cross-validation: per fold, one eigendecomposition and the grid's products
        cubes = AUTO_NUM_FOLDS * (3 * len(AUTO_RIDGE_GRID) + 1)
        work = work + Work(host_eigh=Count.of(AUTO_NUM_FOLDS), host_float64_flops=Count.of(cubes * 2 * d**3))
    solve = config.adam_steps * 6 * d**3 if config.solver == "adam" else 4 * 2 * d**3
    return work + Work(host_float64_flops=Count.of(solve))


def _refinement_work(config: GradMAPConfig, num_layers: int, num_kept: int) -> Work:
    """The refinement steps after the fits (`refinement_steps`): the dense targets, the steps and the held-out checks."""
    if not config.refinement_steps:
        return Work()
    samples, seq_len = config.num_samples, config.seq_len
    tokens, held_out = samples * seq_len, samples // AUTO_NUM_FOLDS
    rows = min(config.batch_size, samples - held_out)
    checks = 1 + config.refinement_steps // REFINEMENT_CHECK_EVERY
    return Work(
        layer_forward=Count.of(num_layers * tokens + checks * num_kept * held_out * seq_len),
        head_forward=Count.of(tokens + checks * held_out * seq_len),
        layer_gradient=Count.of(config.refinement_steps * rows * seq_len * num_kept),
        head_gradient=Count.of(config.refinement_steps * rows * seq_len),
    )


def _evaluations(config: GradMAPConfig, rows_fit: bool) -> Count:
    """The held-out next-token losses one fit of the next-token selection scores (`config` resolved for the family):
    W' = I, then the strengths."""
    if not chooses_by_next_token_loss(config) or rows_fit:
        return ZERO
    searched = (
        Count.of(len(AUTO_RIDGE_GRID)) if lambda_search.SEARCH == "grid" else golden_search_evaluations(len(AUTO_RIDGE_GRID))
    )
    return searched + 1


def layouts(num_layers: int, num_removed: int, protected: set[int]) -> list[list[int]]:
    """Removed-layer sets that span what Stage 1 may choose: every contiguous run, evenly spread layers, and a
    fixed sample of random sets (seed 0)."""
    candidates = [index for index in range(num_layers) if index not in protected]
    num_removed = min(num_removed, len(candidates))
    spans = [candidates[start : start + num_removed] for start in range(len(candidates) - num_removed + 1)]
    step = len(candidates) / num_removed
    spans.append([candidates[int(step * index)] for index in range(num_removed)])
    spans.append([candidates[min(len(candidates) - 1, int(step * index + step / 2))] for index in range(num_removed)])
    generator = random.Random(0)
    spans += [sorted(generator.sample(candidates, num_removed)) for _ in range(SAMPLED_LAYOUTS)]
    return spans


def _median_over(items: Sequence[Any]) -> Any:
    """The range over `items` (`Count`s, or `Work`s count by count) that are the outcomes the run may have, with the
    median of their typical values as the likely one: one outcome is returned as it is. Over Stage 1's layouts, most
    are scattered sets, as GradMAP's choices on real models are (the paper: "broadly distributed across the entire
    network depth")."""
    if len(items) == 1:
        return items[0]
    if isinstance(items[0], Count):
        low, high = min(item.low for item in items), max(item.high for item in items)
        return Count(low, high, statistics.median(item.typical for item in items))
    spans = {item.name: _median_over([getattr(work, item.name) for work in items]) for item in fields(Work) if is_count(item)}
    return Work(
        **spans,
        per_sample_norms=any(work.per_sample_norms for work in items),
        weight_gradients=any(work.weight_gradients for work in items),
    )


def _target_sets(config: GradMAPConfig, kept: list[int], num_layers: int) -> list[list[tuple[int, int]]]:
    """The targets Stage 2 may fit for the kept layers: exact for `span_end`; for `max_drift` (the drift decides),
    every run of Z consecutive kept layers and the Z spread evenly."""
    if config.compensation_target != "max_drift":
        return [compensation_targets(kept, {}, num_layers, config.compensation_target, config.num_compensated_layers)]
    count = min(config.num_compensated_layers, len(kept))
    sets = [kept[start : start + count] for start in range(len(kept) - count + 1)]
    step = len(kept) / count
    sets.append([kept[int(step * index)] for index in range(count)])
    return [[(index, index) for index in chosen] for chosen in sets]


def stage2_memory(config: GradMAPConfig, shape: ModelShape, outline: Stage2Outline) -> dict[str, float]:
    """Stage 2's peak beyond the weights: on the device, the hidden states recorded where the fits start, the float64
    statistics and batches, the held-out inputs and a batch's logits; on the host, the dense outputs the targets are
    fitted to (float32), the backups of the folded down projections (one per target, and the one a fit tries) and the
    solves' d x d float64 matrices."""
    samples, seq_len, batch = config.num_samples, config.seq_len, config.batch_size
    d, size = shape.hidden_size, shape.dtype_bytes
    tokens = samples * seq_len
    folds = AUTO_NUM_FOLDS if config.reg_lambda == "auto" else 1
    device = 2 * tokens * d * size  # what the current target and the next one receive, recorded
    device += folds * 2 * d * d * 8 + 5 * batch * seq_len * d * 8
    if outline.selection == "next_token_loss":
        device += (samples // AUTO_NUM_FOLDS) * seq_len * d * size + logits_bytes(shape, batch, seq_len)
    if outline.rows_fit:  # every token's Y, X_F and X_O, float64, for the Adam fits
        device += 3 * tokens * d * 8
    host = outline.fits.high * tokens * d * 4 + 6 * d * d * 8
    host += (outline.fits.high + 1) * d * shape.intermediate_size * size
    if config.refinement_steps:
        host += tokens * TOP_K * 12
    return {"device": device, "host": host}
