# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""optimum-gradmap: layer pruning of causal LMs with GradMAP, as a Hugging Face Optimum plugin."""

from .adapters import DecoderAdapter, UnsupportedArchitectureError, register_adapter, supported_model_types
from .checkpoint import InvalidCheckpointError, validate_checkpoint
from .configuration import GradMAPConfig
from .evaluation import EvaluationResult, PerplexityResult, evaluate, load_evaluation_segments, perplexity
from .importance import ImportanceMetric, register_importance_metric
from .pruner import GradMAPPruner
from .report import load_report
from .result import PruningResult
from .surgery import remove_layers

__version__ = "0.1.0"

__all__ = [
    "DecoderAdapter",
    "EvaluationResult",
    "GradMAPConfig",
    "GradMAPPruner",
    "ImportanceMetric",
    "InvalidCheckpointError",
    "PerplexityResult",
    "PruningResult",
    "UnsupportedArchitectureError",
    "evaluate",
    "load_evaluation_segments",
    "load_report",
    "perplexity",
    "register_adapter",
    "register_importance_metric",
    "remove_layers",
    "supported_model_types",
    "validate_checkpoint",
]
