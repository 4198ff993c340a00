# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Evaluation of dense and pruned models.

- [`perplexity`]: perplexity under a named protocol (segment length) on a named dataset.
- [`zero_shot`]: the paper's seven zero-shot tasks (lm-evaluation-harness's definitions), every question recorded.
- [`loglikelihood`]: answers' log-likelihoods, each question's context computed once.
- [`comparison`]: two models compared question by question (paired difference, McNemar, retained %, and with a
  reference their flips against it).
- [`fidelity`]: fidelity to the dense model (Dutta et al., "Accuracy is Not All You Need", NeurIPS 2024): flips (the
  questions whose right/wrong changed, also split by the dense model's answer margins within each task) and the
  next-token KL divergence on the perplexity segments; [`kl_divergence`] computes the KL divergence, [`margins`] the
  reference's answer margins and their quartiles within each task.
- [`speed`]: decoding throughput and prefill latency with the KV cache.
- [`suite`]: [`evaluate`], one call for a chosen set of these, returning an [`EvaluationResult`].
"""

from .comparison import PairedAccuracy, PairedFlips, ZeroShotComparison, compare_zero_shot, mcnemar_p_value
from .fidelity import FlipsResult, MarginFlips, TaskFlips, answer_shares, check_flips_reference, flips
from .kl_divergence import KLDivergence, next_token_kl, next_token_kl_per_segment, perplexity_and_kl
from .margins import margin_quartiles, margin_quartiles_by_task, question_margin
from .perplexity import PerplexityResult, evaluation_segments, load_evaluation_segments, perplexity, protocol_name
from .speed import SpeedResult, inference_speed
from .suite import EvaluationResult, evaluate, records_path
from .zero_shot import (
    PAPER_TASKS,
    SCREENING_SUBSETS,
    STANDARD_SUBSETS,
    QuestionRecord,
    TaskResult,
    ZeroShotResult,
    zero_shot_accuracy,
)

__all__ = [
    "PAPER_TASKS",
    "SCREENING_SUBSETS",
    "STANDARD_SUBSETS",
    "PairedAccuracy",
    "PairedFlips",
    "QuestionRecord",
    "ZeroShotComparison",
    "compare_zero_shot",
    "mcnemar_p_value",
    "records_path",
    "EvaluationResult",
    "FlipsResult",
    "KLDivergence",
    "MarginFlips",
    "PerplexityResult",
    "SpeedResult",
    "TaskFlips",
    "TaskResult",
    "ZeroShotResult",
    "answer_shares",
    "check_flips_reference",
    "evaluate",
    "evaluation_segments",
    "flips",
    "inference_speed",
    "load_evaluation_segments",
    "margin_quartiles",
    "margin_quartiles_by_task",
    "next_token_kl",
    "next_token_kl_per_segment",
    "perplexity_and_kl",
    "perplexity",
    "protocol_name",
    "question_margin",
    "zero_shot_accuracy",
]
