# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""The report's pictures: `importance.png` (each layer's Stage 1 score in every round), `loss_curve.png` (the
calibration loss after each removal, when it was followed), `drift.png` (each kept layer's mean drift before and after
compensation) and `heal_kl.png` (the heal's held-out KL). They need matplotlib (`pip install matplotlib`), drawn with
its Agg canvas directly: the process's pyplot backend is left as it is."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from transformers.utils import logging

from .content import CURVE_PICTURE, DRIFT_PICTURE, HEAL_PICTURE, IMPORTANCE_PICTURE

logger = logging.get_logger(__name__)


def write_pictures(report: dict[str, Any], directory: str | os.PathLike) -> list[str]:
    """Draws `importance.png`, `drift.png`, `loss_curve.png` and `heal_kl.png` (those the report has data for) into
    `directory`.

    Returns:
        `list[str]`: The file names written; empty when matplotlib is not installed (logged).
    """
    try:
        from matplotlib import colormaps  # noqa: F401 (the importance picture's colours)
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        logger.warning("matplotlib is not installed: the pruning report has no pictures (`pip install matplotlib`).")
        return []

    compensation, heal = report.get("compensation") or {}, report.get("heal") or {}
    # (file, whether the report has its data, how to draw it, whether its layout is tightened)
    pictures: list[tuple[str, bool, Callable[[Any, dict[str, Any]], None], bool]] = [
        (IMPORTANCE_PICTURE, bool(report["scores"]), _draw_importance, True),
        (CURVE_PICTURE, report.get("dense_loss") is not None, _draw_curve, False),
        (DRIFT_PICTURE, bool(compensation.get("drift")), _draw_drift, True),
        (HEAL_PICTURE, bool(heal.get("kl_curve")), _draw_heal, True),
    ]
    written = []
    for name, has_data, draw, tight in pictures:
        if not has_data:
            continue
        figure = Figure(figsize=(9, 4.5))
        FigureCanvasAgg(figure)
        draw(figure.add_subplot(), report)
        if tight:
            figure.tight_layout()
        figure.savefig(os.path.join(directory, name), dpi=110)
        written.append(name)
    return written


def _draw_importance(axis: Any, report: dict[str, Any]) -> None:
    """Each layer's Stage 1 score in every round, the removed layers marked."""
    from matplotlib import colormaps

    num_layers, removed = report["original_num_layers"], report["removed_layers"]
    metric = report["gradmap_config"].get("importance", "gradmap")
    colours = colormaps["viridis"]([i / max(1, len(report["scores"]) - 1) for i in range(len(report["scores"]))])
    for round_index, (round_scores, colour) in enumerate(zip(report["scores"], colours)):
        indices = sorted(int(index) for index in round_scores)
        values = [round_scores[str(index)] for index in indices]
        label = f"round {round_index + 1}: removed {removed[round_index]}" if len(report["scores"]) > 1 else "scores"
        axis.plot(indices, values, marker="o", markersize=3, color=colour, label=label)
    for index in removed:
        axis.axvline(index, color="tab:red", alpha=0.25, linewidth=3)
    axis.set_yscale("log" if all(v > 0 for r in report["scores"] for v in r.values()) else "linear")
    axis.set_xlim(-0.5, num_layers - 0.5)
    axis.set_xlabel("layer index in the dense model (red bands: removed layers)")
    axis.set_ylabel(f"importance score ({metric}; lower is removed first)")
    axis.set_title(f"Stage 1 importance of each layer, every round ({len(removed)} of {num_layers} layers removed)")
    axis.legend(fontsize=7, ncol=2)


def _draw_drift(axis: Any, report: dict[str, Any]) -> None:
    """Each kept layer's mean drift (Eq. 10) after Stage 1 and after Stage 2, the compensated layers marked."""
    compensation = report["compensation"]
    indices = sorted(int(index) for index in compensation["drift"])
    drift = [compensation["drift"][str(i)] for i in indices]
    axis.plot(indices, drift, marker="o", markersize=4, label="after Stage 1 (pruned)")
    if compensation["drift_after_compensation"]:
        after = [compensation["drift_after_compensation"][str(i)] for i in indices]
        axis.plot(indices, after, marker="s", markersize=4, label="after Stage 2 (compensated)")
    for index in compensation["compensated_layers"]:
        axis.axvline(index, color="tab:green", alpha=0.3, linewidth=3, label=f"compensated layer {index}")
    axis.set_xlim(-0.5, report["original_num_layers"] - 0.5)
    axis.set_xlabel("kept layer index in the dense model")
    axis.set_ylabel("drift: L2 norm of the mean hidden-state shift (Eq. 10)")
    axis.set_title("Drift of each kept layer's mean output from the dense model's")
    axis.legend(fontsize=8)


def _draw_heal(axis: Any, report: dict[str, Any]) -> None:
    """The heal's held-out KL from the dense model against the tokens trained, the state kept marked."""
    heal = report["heal"]
    tokens, kl = zip(*heal["kl_curve"])
    axis.plot(tokens, kl, marker="o", markersize=3, label="held-out KL from the dense model")
    axis.plot(
        [heal["best_tokens"]],
        [heal["best_kl"]],
        marker="*",
        color="tab:green",
        markersize=14,
        linestyle="none",
        label=f"kept: {heal['best_kl']:.4f} after {heal['best_tokens']:,} tokens",
    )
    axis.set_xlabel(f"tokens trained ({heal['dataset']})")
    axis.set_ylabel("next-token KL (top-64 and the rest), nats/token")
    axis.set_title(f"Heal: distillation from the dense model ({heal['trainable']})")
    axis.legend(fontsize=8)


def _draw_curve(axis: Any, report: dict[str, Any]) -> None:
    """The calibration loss against the number of layers removed, the budget line, the refused removal and the K chosen."""
    dense, curve = report["dense_loss"], report["loss_curve"]
    axis.plot(range(len(curve) + 1), [dense, *curve], marker="o", markersize=4, label="calibration loss after each removal")
    budget = report["gradmap_config"].get("max_loss_increase")
    if budget is not None:
        axis.axhline(
            dense * (1 + budget), color="tab:red", linestyle="--", label=f"budget: {100 * budget:+g}% over the dense model"
        )
    if report.get("rejected"):
        rejected = report["rejected"]
        axis.plot(
            [len(curve) + 1],
            [rejected["loss"]],
            marker="x",
            color="tab:red",
            markersize=9,
            linestyle="none",
            label=f"refused: removing layer {rejected['layer']}",
        )
    axis.plot(
        [len(curve)],
        [[dense, *curve][-1]],
        marker="*",
        color="tab:green",
        markersize=14,
        linestyle="none",
        label=f"chosen: {len(curve)} layers removed",
    )
    axis.set_xlabel("layers removed (in removal order)")
    axis.set_ylabel("calibration loss (mean next-token cross-entropy)")
    axis.set_title(f"What each number of removed layers costs ({report['gradmap_config'].get('importance', 'gradmap')})")
    axis.legend(fontsize=8)
