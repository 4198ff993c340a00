# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Layer importance and selection: which decoder layers Stage 1 removes.

- the interface ([`ImportanceMetric`]) and its registry ([`register_importance_metric`]) live in the leaf
  [`optimum_gradmap.metric_registry`], which the configuration reads without loading this package.
- [`metrics`]: every metric (GradMAP and its bound, ShortGPT's Block Influence, SLEB, Taylor+, the
  Taylor gate, relative magnitude, random), selected by `GradMAPConfig(importance=...)`.
- [`gradient`]: GradMAP's exact per-sample gradient norms in batched passes (Eq. 5).
- [`selection`]: the removal loop (Algorithm 1), its budget and its parameter target.
- [`rounds`]: Stage 1's state: its plan, each finished round, what it decided, and the resume checkpoint.
- [`shortlist`]: the verified shortlist (`verify_top_k`), raced by successive halving with `verify_halving`.

The pipeline's Stage 1 step ([`optimum_gradmap.pipeline.stage1`]) checks its input, runs the removals and undoes them.
"""

from ..metric_registry import (
    IMPORTANCE_METRICS,
    ImportanceMetric,
    importance_metric_names,
    register_importance_metric,
)
from .gradient import (
    PerSampleGradientNorms,
    broadcast_per_sample_sq_norms,
    gradient_importance,
    linear_per_sample_sq_norms,
    module_per_sample_sq_norms,
)
from .metrics import (
    BlockInfluence,
    GradMAPImportance,
    RelativeMagnitude,
    SLEBImportance,
    TaylorImportance,
    get_importance_metric,
)
from .rounds import Round, Selection, Stage1Checkpoint, Stage1Plan, Stage1Settings
from .selection import remove_by_importance, remove_explicit_layers

__all__ = [
    "IMPORTANCE_METRICS",
    "BlockInfluence",
    "GradMAPImportance",
    "ImportanceMetric",
    "PerSampleGradientNorms",
    "RelativeMagnitude",
    "SLEBImportance",
    "Round",
    "Selection",
    "Stage1Checkpoint",
    "Stage1Plan",
    "Stage1Settings",
    "TaylorImportance",
    "broadcast_per_sample_sq_norms",
    "get_importance_metric",
    "gradient_importance",
    "importance_metric_names",
    "linear_per_sample_sq_norms",
    "module_per_sample_sq_norms",
    "register_importance_metric",
    "remove_by_importance",
    "remove_explicit_layers",
]
