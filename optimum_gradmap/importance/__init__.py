# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Layer importance and selection: which decoder layers Stage 1 removes.

- [`registry`]: the interface ([`ImportanceMetric`]) and its registry ([`register_importance_metric`]).
- [`metrics`]: every metric (GradMAP and its bound, ShortGPT's Block Influence, SLEB, Taylor+, the
  Taylor gate, relative magnitude, random), selected by `GradMAPConfig(importance=...)`.
- [`gradient`]: GradMAP's exact per-sample gradient norms in batched passes (Eq. 5).
- [`selection`]: the removal loop (Algorithm 1), its budget and its parameter target.
- [`rounds`]: Stage 1's state: its plan, each finished round, what it decided, and the resume checkpoint.
- [`shortlist`]: the verified shortlist (`verify_top_k`), raced by successive halving with `verify_halving`.
- [`stage`]: Stage 1's entry for [`~optimum_gradmap.GradMAPPruner`]: its checks, the removals, the cut and the
  rollback (imported as `optimum_gradmap.importance.stage`: it builds the [`~optimum_gradmap.PruningResult`]).
"""

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
    RandomImportance,
    RelativeMagnitude,
    SLEBImportance,
    TaylorImportance,
    get_importance_metric,
)
from .registry import (
    IMPORTANCE_METRICS,
    ImportanceMetric,
    importance_metric_names,
    register_importance_metric,
)
from .selection import Round, Selection, Stage1Checkpoint, Stage1Plan, remove_by_importance, remove_explicit_layers

__all__ = [
    "IMPORTANCE_METRICS",
    "BlockInfluence",
    "GradMAPImportance",
    "ImportanceMetric",
    "PerSampleGradientNorms",
    "RandomImportance",
    "RelativeMagnitude",
    "SLEBImportance",
    "Round",
    "Selection",
    "Stage1Checkpoint",
    "Stage1Plan",
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
