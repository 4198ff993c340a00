# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Layer importance and selection: which decoder layers Stage 1 removes.

- [`metrics`]: the interface ([`ImportanceMetric`]), its registry ([`register_importance_metric`])
  and every metric (GradMAP, ShortGPT's Block Influence, SLEB, Taylor+, relative magnitude,
  random), selected by `GradMAPConfig(importance=...)`.
- [`gradient`]: GradMAP's exact per-sample gradient norms in batched passes (Eq. 5).
- [`selection`]: the removal loop (Algorithm 1) and the Stage 1 resume checkpoint.
"""

from .gradient import (
    PerSampleGradientNorms,
    broadcast_per_sample_sq_norms,
    causal_lm_loss_gradient,
    frozen_for_scoring,
    gradient_importance,
    linear_per_sample_sq_norms,
    module_per_sample_sq_norms,
    split_at_lm_head,
)
from .metrics import (
    IMPORTANCE_METRICS,
    BlockInfluence,
    GradMAPImportance,
    ImportanceMetric,
    RandomImportance,
    RelativeMagnitude,
    SLEBImportance,
    TaylorImportance,
    get_importance_metric,
    importance_metric_names,
    register_importance_metric,
)
from .selection import Selection, Stage1Checkpoint, remove_by_importance, remove_explicit_layers, stage1_fingerprint

__all__ = [
    "IMPORTANCE_METRICS",
    "BlockInfluence",
    "GradMAPImportance",
    "ImportanceMetric",
    "PerSampleGradientNorms",
    "RandomImportance",
    "RelativeMagnitude",
    "SLEBImportance",
    "Selection",
    "Stage1Checkpoint",
    "TaylorImportance",
    "broadcast_per_sample_sq_norms",
    "causal_lm_loss_gradient",
    "frozen_for_scoring",
    "get_importance_metric",
    "gradient_importance",
    "importance_metric_names",
    "linear_per_sample_sq_norms",
    "module_per_sample_sq_norms",
    "register_importance_metric",
    "remove_by_importance",
    "remove_explicit_layers",
    "split_at_lm_head",
    "stage1_fingerprint",
]
