# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""The plan in words: counts, bytes, FLOPs and seconds as text, ranges as "low to high (likely x)", each stage's
outline as a sentence, and the box-drawn table `print(plan)` shows."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from ..configuration import GradMAPConfig
from .counts import ZERO, Count
from .stage1 import Stage1Outline
from .stage2 import Stage2Outline


def max_over(counts: Iterable[Count]) -> Count:
    """The largest of `counts`, bound by bound (`ZERO` for none)."""
    counts = list(counts)
    return Count(max(count.low for count in counts), max(count.high for count in counts)) if counts else ZERO


def table(rows: list[list[str]]) -> str:
    """A box-drawn table (Accelerate's `estimate-memory` draws one too), left-aligned, with a rule under the header
    and above the last row."""
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]

    def rule(left: str, middle: str, right: str) -> str:
        return left + middle.join("─" * (width + 2) for width in widths) + right

    def line(row: list[str]) -> str:
        return "│" + "│".join(f" {cell:<{width}} " for cell, width in zip(row, widths)) + "│"

    body = [rule("┌", "┬", "┐"), line(rows[0]), rule("├", "┼", "┤")]
    body += [line(row) for row in rows[1:-1]]
    body += [rule("├", "┼", "┤"), line(rows[-1]), rule("└", "┴", "┘")]
    return "\n".join(body)


def count_text(value: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g}{unit}"
    return f"{value:.0f}"


def bytes_text(value: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value:.0f} B"


def flop_text(value: float) -> str:
    return f"{value:.3g}"


def seconds_text(value: float) -> str:
    if value >= 3600:
        return f"{value / 3600:.2g} h"
    if value >= 60:
        return f"{value / 60:.2g} min"
    return f"{value:.2g} s"


def range_text(count: Count | None, text: Callable[[float], str]) -> str:
    if count is None:
        return "-"
    low, high = text(count.low), text(count.high)
    if low == high:
        return low
    return f"{low} to {high}" + ("" if count.likely is None else f" (likely {text(count.likely)})")


def counted(count: Count, word: str) -> str:
    """`count` and `word`, in the plural unless the count is exactly one."""
    text = range_text(count, lambda value: f"{value:.0f}")
    return f"{text} {word}" if text == "1" else f"{text} {word}es" if word.endswith("s") else f"{text} {word}s"


def stage1_passes(outline: Stage1Outline) -> str:
    kinds = {
        "per_sample_gradient": "gradient pass",
        "gradient": "gradient pass",
        "parameter_gradient": "gradient pass",
        "forward": "forward pass",
        "removal_losses": "removal-loss pass",
    }
    text = counted(outline.rounds, "round")
    if outline.scoring_pass in kinds:
        text += f", {counted(outline.scoring_rounds, kinds[outline.scoring_pass])}"
    if outline.verify_top_k:
        text += ", shortlist checks"
    return text


def stage2_passes(outline: Stage2Outline) -> str:
    text = counted(outline.fits, "fit")
    if outline.evaluations_per_fit != ZERO:
        evaluations = range_text(outline.evaluations_per_fit, lambda value: f"{value:.0f}")
        text += f" x (1 + {evaluations} passes)"
    elif outline.fits.high:
        text += " x 1 pass"
    return text


def stage1_text(outline: Stage1Outline, config: GradMAPConfig) -> str:
    if outline.scoring_pass is None and config.layers_to_prune is not None:
        return f"no scoring: layers_to_prune={config.layers_to_prune} names the layers"
    kinds = {
        "per_sample_gradient": "a forward and backward pass with per-sample gradient norms",
        "gradient": "a forward and backward pass",
        "parameter_gradient": "a forward and backward pass with parameter gradients",
        "forward": "a forward pass",
        "removal_losses": "the removal loss of every candidate",
        "none": "no pass",
        None: "passes the metric does not declare",
    }
    rounds = range_text(outline.rounds, lambda value: f"{value:.0f}")
    how = "iterative" if outline.iterative else "one-shot"
    text = f"{outline.metric} ({how}), {rounds} round(s); scored by {kinds[outline.scoring_pass]}"
    text += " every round" if outline.iterative else " once"
    if outline.verify_top_k:
        halving = f", successive halving over {outline.rungs} rungs" if outline.rungs > 1 else ""
        text += f"; every round a shortlist of {outline.verify_top_k} checked by its removal losses{halving}"
    if outline.protected:
        text += f"; layers {outline.protected} protected"
    return text


def stage2_text(outline: Stage2Outline, config: GradMAPConfig) -> str:
    fits = range_text(outline.fits, lambda value: f"{value:.0f}")
    text = f"{fits} fit(s) ({outline.target}), lambda by the {outline.selection.replace('_', ' ')}"
    if outline.evaluations_per_fit != ZERO:
        evaluations = range_text(outline.evaluations_per_fit, lambda value: f"{value:.0f}")
        text += f" ({evaluations} held-out losses per fit)"
    if config.refinement_steps:
        text += f", then {config.refinement_steps} refinement steps"
    return text


def budget_text(config: GradMAPConfig, outline: Stage1Outline) -> str | None:
    """What decides K, in words: a budget (K is then the most removed, and the rounds are known only as they go)."""
    if config.max_loss_increase is not None:
        return (
            f"a budget: stop before the calibration loss rises {config.max_loss_increase:+.0%}; up to "
            f"{outline.num_to_remove} rounds, the number is known only as Stage 1 goes"
        )
    if config.target_num_parameters is not None:
        return f"a size target of {count_text(config.target_num_parameters)} parameters: {counted(outline.rounds, 'round')}"
    if config.pruning_ratio is not None:
        return f"pruning_ratio={config.pruning_ratio:g}"
    return None
