# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Evaluation of dense and pruned models.

- [`perplexity`]: perplexity under a named protocol (segment length) on a named dataset.
- [`zero_shot`]: the paper's seven zero-shot tasks through lm-evaluation-harness.
- [`speed`]: decoding throughput and prefill latency with the KV cache.
- [`suite`]: [`evaluate`], one call for a chosen set of these, returning an [`EvaluationResult`].
"""

from .perplexity import PerplexityResult, evaluation_segments, load_evaluation_segments, perplexity, protocol_name
from .speed import SpeedResult, inference_speed
from .suite import EvaluationResult, evaluate
from .zero_shot import PAPER_TASKS, TaskResult, ZeroShotResult, zero_shot_accuracy

__all__ = [
    "PAPER_TASKS",
    "EvaluationResult",
    "PerplexityResult",
    "SpeedResult",
    "TaskResult",
    "ZeroShotResult",
    "evaluate",
    "evaluation_segments",
    "inference_speed",
    "load_evaluation_segments",
    "perplexity",
    "protocol_name",
    "zero_shot_accuracy",
]
