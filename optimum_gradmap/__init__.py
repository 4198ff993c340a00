# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""optimum-gradmap: layer pruning of causal LMs with GradMAP, as a Hugging Face Optimum plugin."""

from .adapters import DecoderAdapter, UnsupportedArchitectureError, register_adapter, remove_layers, supported_model_types
from .configuration import GradMAPConfig
from .evaluation import EvaluationResult, PerplexityResult, evaluate, load_evaluation_segments, perplexity
from .hub import InvalidCheckpointError, load_report, validate_checkpoint
from .pruner import GradMAPPruner, PruningResult

__version__ = "0.1.0"

__all__ = [
    "DecoderAdapter",
    "EvaluationResult",
    "GradMAPConfig",
    "GradMAPPruner",
    "InvalidCheckpointError",
    "PerplexityResult",
    "PruningResult",
    "UnsupportedArchitectureError",
    "evaluate",
    "load_evaluation_segments",
    "load_report",
    "perplexity",
    "register_adapter",
    "remove_layers",
    "supported_model_types",
    "validate_checkpoint",
]
