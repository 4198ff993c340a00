# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Stage 1's cost: its rounds, the passes each makes (scoring, the shortlist's check, the loss a budget follows) and
what it holds at its peak."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

from ..configuration import GradMAPConfig
from ..importance import ImportanceMetric, get_importance_metric
from ..importance.selection import halving_rungs
from ..vocabulary import MAX_LOGIT_ELEMENTS
from .counts import ZERO, Count, Work, is_count
from .shape import ModelShape

# The tokens of the check `split_at_lm_head` makes before every gradient scoring pass: one sequence of at most 16.
SPLIT_CHECK_TOKENS = 16
GRADIENT_PASSES = ("per_sample_gradient", "gradient", "parameter_gradient")


@dataclass
class Stage1Outline:
    """How Stage 1 runs, resolved from the config: what the plan prints about it."""

    metric: str
    scoring_pass: str | None
    iterative: bool
    num_to_remove: int
    rounds: Count
    scoring_rounds: Count
    verify_top_k: int | None
    rungs: int
    protected: list[int]


def stage1(config: GradMAPConfig, shape: ModelShape, streamed: bool) -> tuple[Work, Stage1Outline, list[str]]:
    """Stage 1's work (see the package docstring), its outline, and what the plan cannot count."""
    metric = get_importance_metric(config.importance, seed=config.seed)
    iterative = metric.iterative if config.iterative is None else config.iterative
    num_layers = shape.num_layers
    num_to_remove = config.num_layers_to_remove(num_layers)
    protected = config.resolved_protected_layers(num_layers)
    protected = metric.protected_layers(num_layers) if protected is None else protected
    notes: list[str] = []
    if config.layers_to_prune is not None:
        outline = Stage1Outline(metric.name, None, False, len(config.layers_to_prune), ZERO, ZERO, None, 0, sorted(protected))
        return Work(), outline, notes
    candidates = num_layers - len(protected)
    num_to_remove = min(num_to_remove, candidates) if config.has_budget else num_to_remove
    fewest, most = _round_range(config, shape, protected, num_to_remove, iterative)
    scoring_pass = metric.scoring_pass
    if scoring_pass is None:
        notes.append(
            f"Stage 1: the metric {metric.name!r} does not declare its passes (`scoring_pass`): its scoring is not counted."
        )
    if config.compensate_each_round:
        notes.append("Stage 1: the fits of `compensate_each_round` between removals are not counted.")
    rungs = (
        halving_rungs(min(config.verify_top_k, candidates), config.num_samples)
        if config.verify_top_k and config.verify_halving
        else 1
    )
    scoring_rounds = Count(fewest if iterative else 1, most if iterative else 1)
    outline = Stage1Outline(
        metric.name,
        scoring_pass,
        iterative,
        num_to_remove,
        Count(fewest, most),
        scoring_rounds,
        config.verify_top_k,
        rungs,
        sorted(protected),
    )
    low = _rounds_work(config, shape, metric, outline, fewest, streamed)
    high = _rounds_work(config, shape, metric, outline, most, streamed)
    work = Work(
        **{
            item.name: Count(getattr(low, item.name).low, getattr(high, item.name).high)
            for item in fields(Work)
            if is_count(item)
        },
        per_sample_norms=scoring_pass == "per_sample_gradient",
        weight_gradients=scoring_pass == "parameter_gradient",
    )
    return work, outline, notes


def _measures_loss(config: GradMAPConfig) -> bool:
    """Whether Stage 1 follows the calibration loss after each removal (a loss curve or a loss budget)."""
    return config.loss_curve or config.max_loss_increase is not None


def _round_range(
    config: GradMAPConfig, shape: ModelShape, protected: set[int], num_to_remove: int, iterative: bool
) -> tuple[int, int]:
    """The fewest and the most rounds Stage 1 may run (one round removes one layer, or all of them at once)."""
    one_per_round = (
        iterative or config.verify_top_k is not None or _measures_loss(config) or config.target_num_parameters is not None
    )
    most = num_to_remove if one_per_round else 1
    fewest = most
    if config.target_num_parameters is not None:
        sizes = sorted(shape.layer_parameters[index] for index in range(shape.num_layers) if index not in protected)
        excess = shape.num_parameters - config.target_num_parameters

        def needed(ordered: list[int]) -> int:
            removed, count = 0, 0
            while removed < excess and count < len(ordered):
                removed, count = removed + ordered[count], count + 1
            return count

        fewest, most = min(needed(sizes[::-1]), most), min(needed(sizes), most)
        fewest = max(fewest, 1)
    if config.max_loss_increase is not None:
        fewest = 1
    return fewest, most


def _rounds_work(
    config: GradMAPConfig, shape: ModelShape, metric: ImportanceMetric, outline: Stage1Outline, count: int, streamed: bool
) -> Work:
    """The work of `count` rounds: each round's scoring (every round, or the first), its shortlist's check and the
    loss a budget follows; with a loss followed, the dense model's loss before the first round."""
    num_layers, tokens, protected = shape.num_layers, config.num_samples * config.seq_len, set(outline.protected)
    measures_loss = _measures_loss(config)
    work = Work()
    if measures_loss:  # the dense model's calibration loss, before the first round
        work = Work(layer_forward=Count.of(num_layers * tokens), head_forward=Count.of(tokens))
    for index in range(count):
        present = num_layers - index
        round_work = Work()
        if outline.iterative or index == 0:
            round_work = round_work + scoring(config, outline.scoring_pass, num_layers, present, protected, streamed)
        if config.verify_top_k is not None:
            round_work = round_work + _verification(config, num_layers, present, protected)
        if measures_loss and config.verify_top_k is None and not metric.scores_are_losses:
            round_work = round_work + Work(layer_forward=Count.of((present - 1) * tokens), head_forward=Count.of(tokens))
        work = work + round_work
    return work


def scoring(
    config: GradMAPConfig, scoring_pass: str | None, num_layers: int, present: int, protected: set[int], streamed: bool
) -> Work:
    """One scoring pass of a metric over a stack of `present` layers (see `ImportanceMetric.scoring_pass`), on the
    calibration sequences of `config`."""
    samples, seq_len = config.num_samples, config.seq_len
    tokens = samples * seq_len
    if scoring_pass in GRADIENT_PASSES:
        check = min(SPLIT_CHECK_TOKENS, seq_len)  # split_at_lm_head: the whole model and decoder + head, on one sequence
        work = Work(
            layer_forward=Count.of(2 * check * present),
            head_forward=Count.of(2 * check),
            layer_gradient=Count.of(present * tokens),
            head_gradient=Count.of(samples * (seq_len - 1)),
        )
        if streamed:  # the forward pass that stores each layer's input, before the recomputing backward pass
            work.layer_forward = work.layer_forward + present * tokens
        return work
    if scoring_pass == "forward":  # the whole model's forward pass, logits included
        return Work(layer_forward=Count.of(present * tokens), head_forward=Count.of(tokens))
    if scoring_pass == "removal_losses":  # SLEB: every candidate
        candidates = present - len(protected)
        layers = _removal_range(num_layers, present, protected, candidates)
        return Work(layer_forward=layers * tokens, head_forward=Count.of(candidates * tokens))
    return Work()


def _verification(config: GradMAPConfig, num_layers: int, present: int, protected: set[int]) -> Work:
    """The check of a round's shortlist ([`verify_shortlist`]): every racing candidate's removal loss on each rung
    (the better half goes on after each rung but the last)."""
    shortlist = min(config.verify_top_k, present - len(protected))
    rungs = halving_rungs(shortlist, config.num_samples) if config.verify_halving else 1
    work, racing = Work(), shortlist
    for index, part in enumerate(_split(config.num_samples, rungs)):
        tokens = len(part) * config.seq_len
        layers = _removal_range(num_layers, present, protected, racing)
        work = work + Work(layer_forward=layers * tokens, head_forward=Count.of(racing * tokens))
        if index < rungs - 1:
            racing = max(2, math.ceil(racing / 2))
    return work


def _split(count: int, parts: int) -> list[range]:
    """`torch.tensor_split`'s parts of `range(count)`."""
    base, extra = divmod(count, parts)
    bounds = [0]
    for index in range(parts):
        bounds.append(bounds[-1] + base + (1 if index < extra else 0))
    return [range(bounds[index], bounds[index + 1]) for index in range(parts)]


def _protected_positions(num_layers: int, protected: set[int]) -> tuple[int, int, bool]:
    """The protected layers that stay at the bottom and the top of the stack whatever is removed (a run from layer 0,
    a run to the last layer), and whether others sit in between (their positions then depend on what is removed)."""
    bottom = 0
    while bottom in protected:
        bottom += 1
    top = 0
    while num_layers - 1 - top in protected and num_layers - 1 - top >= bottom:
        top += 1
    return bottom, top, len(protected) > bottom + top


def _removal_layers(present: int, positions: Sequence[int]) -> int:
    """Layer runs per sequence of [`removal_losses`] for candidates at `positions` of a stack of `present` layers: the
    pass up to the deepest candidate, then, for each candidate, the layers after it."""
    return max(positions) + 1 + sum(present - 1 - position for position in positions)


def _removal_range(num_layers: int, present: int, protected: set[int], candidates: int) -> Count:
    """[`_removal_layers`] for `candidates` of the non-protected layers of the current stack: exact when they are all
    of them and the protected layers sit at the ends of the stack, else between the deepest and the shallowest
    placements (the candidates then lie among the positions between the end-protected layers)."""
    bottom, top, scattered = _protected_positions(num_layers, protected)
    free = list(range(bottom, present - top))
    if candidates == len(free) and not scattered:
        return Count.of(_removal_layers(present, free))
    deepest = _removal_layers(present, free[len(free) - candidates :])
    shallowest = _removal_layers(present, free[:candidates])
    return Count(deepest, shallowest)


def stage1_memory(config: GradMAPConfig, shape: ModelShape, outline: Stage1Outline) -> dict[str, float]:
    """Stage 1's peak beyond the weights, in memory and layer-streamed (the first round, every layer present)."""
    batch, seq_len = config.batch_size, config.seq_len
    tokens, d, size = batch * seq_len, shape.hidden_size, shape.dtype_bytes
    logits_chunk = min(MAX_LOGIT_ELEMENTS, shape.vocab_size * seq_len * batch) * 4 * 3
    activations = tokens * shape.total("activation_bytes")
    one_layer = tokens * max(layer.activation_bytes for layer in shape.layers)
    per_sample = tokens * shape.total("per_sample_bytes") if outline.scoring_pass == "per_sample_gradient" else 0.0
    one_per_sample = tokens * max(layer.per_sample_bytes for layer in shape.layers) if per_sample else 0.0
    embeddings = 2 * tokens * d * size
    in_memory = streamed = 0.0
    if outline.scoring_pass in GRADIENT_PASSES:
        in_memory = activations + per_sample + logits_chunk + embeddings
        if outline.scoring_pass == "parameter_gradient":
            in_memory += shape.weight_bytes  # the parameters' gradients
        stored_inputs = shape.num_layers * tokens * d * size
        streamed = stored_inputs + one_layer + one_per_sample + logits_chunk + embeddings
    elif outline.scoring_pass in ("forward", "removal_losses"):
        inputs = (
            (shape.num_layers - len(outline.protected)) * tokens * d * size if outline.scoring_pass == "removal_losses" else 0
        )
        in_memory = streamed = logits_bytes(shape, batch, seq_len) + inputs + one_layer / 2
    if outline.verify_top_k:
        check = logits_bytes(shape, batch, seq_len) + outline.verify_top_k * tokens * d * size + one_layer / 2
        in_memory, streamed = max(in_memory, check), max(streamed, check)
    return {"in_memory": in_memory, "streamed": streamed}


def logits_bytes(shape: ModelShape, batch: int, seq_len: int) -> float:
    """What a forward-only pass over the vocabulary holds at once ([`optimum_gradmap.vocabulary`]): the batch's final
    hidden states, and one chunk of at most `MAX_LOGIT_ELEMENTS` logits (their dtype) with the float32 reduction's
    copies of them (the log-softmax, or a slice's log-sum-exp)."""
    hidden = batch * seq_len * shape.hidden_size * shape.dtype_bytes
    return hidden + min(MAX_LOGIT_ELEMENTS, batch * seq_len * shape.vocab_size) * (shape.dtype_bytes + 8)
