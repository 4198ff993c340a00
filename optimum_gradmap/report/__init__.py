# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""The pruning report written beside every checkpoint: `pruning_report.json`, its pictures and a
model card (`README.md`).

- `pruning_report.json`: base model and revision, library versions, the GradMAP config (every field:
  `GradMAPConfig(**report["gradmap_config"])` rebuilds it), how to reproduce the run (`reproduce`: the exact
  `optimum-gradmap` command line, or a Python snippet when it was made through the API, see [`reproduction`]),
  removed / kept / compensated layers (original indices), Stage 1 scores of every round, drift per layer
  before and after compensation, timings, environment, and evaluation results when run, with the fidelity to
  the dense model where measured (the KL divergence beside each perplexity, the zero-shot flips). Every top-level
  figure describes the checkpoint's own weights: a checkpoint `optimum-gradmap heal` wrote holds the evaluation run
  again after the heal, and what the pruning run measured before it under `evaluation_before_heal`.
- `importance.png`: each layer's Stage 1 score in every round; `drift.png`: each kept layer's mean
  drift (Eq. 10) before and after compensation; `loss_curve.png` (when the loss was followed): the
  calibration loss after each removal, the budget and the K chosen; `heal_kl.png` (after a heal): the held-out KL
  from the dense model as the heal trained. They need matplotlib (`pip install matplotlib`);
  without it the report and the model card are written without pictures.
- `README.md`: a Hub model card (`huggingface_hub.ModelCard`) that says what was removed, what it
  cost, how to load the model, and how to reproduce it (the command or the Python snippet, and the versions).

The modules: [`content`] (the report's content and the files' names), [`pictures`], [`cost_table`] and
[`model_card`] (the card and its table), [`folder`] (writing them all, reading the report back) and [`summary`] (the
report for the terminal)."""

from .content import (
    API_SNIPPET,
    CURVE_PICTURE,
    DRIFT_PICTURE,
    HEAL_PICTURE,
    IMPORTANCE_PICTURE,
    MODEL_CARD_NAME,
    REPORT_NAME,
    build_report,
    environment,
    library_version,
    reproduction,
    run_steps,
    stage_before_heal,
    versions,
)
from .cost_table import cost_table
from .folder import load_report, write_report
from .model_card import build_model_card
from .pictures import write_pictures
from .summary import curve_lines, format_report

__all__ = [
    "API_SNIPPET",
    "CURVE_PICTURE",
    "DRIFT_PICTURE",
    "HEAL_PICTURE",
    "IMPORTANCE_PICTURE",
    "MODEL_CARD_NAME",
    "REPORT_NAME",
    "build_model_card",
    "build_report",
    "cost_table",
    "curve_lines",
    "environment",
    "format_report",
    "library_version",
    "load_report",
    "reproduction",
    "run_steps",
    "stage_before_heal",
    "versions",
    "write_pictures",
    "write_report",
]
