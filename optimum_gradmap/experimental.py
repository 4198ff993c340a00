# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Variants kept off the public surface, for the benchmark tables that still measure them. Importing this module
registers them; nothing else in the library imports it, and they may change or go without notice.

- `random` (Stage 1): uniform random scores, the baseline row of the layer-selection and Stage 2 tables.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from .adapters import DecoderAdapter
from .metric_registry import ImportanceMetric, register_importance_metric


@register_importance_metric
class RandomImportance(ImportanceMetric):
    """Random layer selection (a baseline): uniform random scores from a generator seeded with
    `GradMAPConfig.seed`, so a run is reproducible. Scored once."""

    name = "random"
    scoring_pass = "none"

    def score(
        self,
        model: PreTrainedModel,
        adapter: DecoderAdapter,
        input_ids: torch.LongTensor,
        batch_size: int,
        progress_bar: bool = True,
        description: str = "Scoring layers",
    ) -> list[float]:
        generator = torch.Generator().manual_seed(self.seed)
        return torch.rand(adapter.num_layers(model), generator=generator, dtype=torch.float64).tolist()
