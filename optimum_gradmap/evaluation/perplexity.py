# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Perplexity of causal LMs under a named protocol.

Perplexity follows the paper's protocol: the evaluation text is tokenized into one stream, cut
into non-overlapping segments of `segment_length` tokens (128 in the paper; 2048 in many other papers),
and perplexity is exp of the mean next-token negative log-likelihood over every predicted token of
every segment. Always report the protocol (segment length) and the dataset with the number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase
from transformers.utils import logging

from ..data import load_text, tokenize_text
from ..errors import InvalidInputError
from ..objectives import mean_next_token_loss, shared_mean_next_token_loss

logger = logging.get_logger(__name__)


def evaluation_segments(token_ids: torch.LongTensor, segment_length: int, max_segments: int | None = None) -> torch.LongTensor:
    """Cuts a token stream into non-overlapping `segment_length` segments (the incomplete tail is dropped)."""
    num_segments = token_ids.numel() // segment_length
    if max_segments is not None:
        num_segments = min(num_segments, max_segments)
    if num_segments < 1:
        raise InvalidInputError(
            f"The evaluation text has {token_ids.numel()} tokens, fewer than one segment of {segment_length}."
        )
    return token_ids[: num_segments * segment_length].view(num_segments, segment_length)


def load_evaluation_segments(
    dataset: str,
    tokenizer: PreTrainedTokenizerBase,
    segment_length: int = 128,
    max_segments: int | None = None,
) -> torch.LongTensor:
    """Evaluation segments of a named dataset (see [`optimum_gradmap.data`]): its evaluation split,
    tokenized into one stream and cut into non-overlapping `segment_length` segments.

    For `"wikipedia"` and `"offline:wikipedia"` these come from held-out articles that calibration never uses.
    """
    return evaluation_segments(tokenize_text(load_text(dataset, "evaluation"), tokenizer), segment_length, max_segments)


def perplexity(
    model: nn.Module,
    segments: torch.LongTensor,
    batch_size: int = 8,
    progress_bar: bool = True,
    shared_by_processes: bool = False,
) -> float:
    """Perplexity of `model` on pre-cut segments: exp(mean next-token NLL over all predicted tokens).

    Args:
        model (`nn.Module`): A causal LM.
        segments (`torch.LongTensor` of shape `(num_segments, segment_length)`): From [`load_evaluation_segments`].
        batch_size (`int`, defaults to 8): Segments per forward pass.
        progress_bar (`bool`, defaults to `True`): Show a progress bar.
        shared_by_processes (`bool`, defaults to `False`): Under `torch.distributed`, every process calls this with
            the same segments, scores its share of them and gets the perplexity of all
            ([`~optimum_gradmap.objectives.shared_mean_next_token_loss`]). Without it, each process scores every segment
            (as a call on the main process alone needs).
    """
    if shared_by_processes:
        return math.exp(shared_mean_next_token_loss(model, segments, batch_size, progress_bar, description="Perplexity"))
    return math.exp(mean_next_token_loss(model, segments, batch_size, progress_bar, description="Perplexity"))


def protocol_name(segment_length: int) -> str:
    """How a perplexity was measured, to print next to the number."""
    return f"non-overlapping {segment_length}-token segments"


@dataclass
class PerplexityResult:
    """One perplexity and how it was measured.

    Attributes:
        dataset (`str`): The dataset's name in [`optimum_gradmap.data.load_text`] (`"offline:wikipedia"` is
            the held-out offline Wikipedia, never WikiText-2; `"wikitext2"` is the Hub's test split).
        protocol (`str`): See [`protocol_name`].
        segment_length (`int`): Segment length.
        num_segments (`int`): Segments evaluated.
        num_predicted_tokens (`int`): Tokens whose negative log-likelihood was averaged.
        perplexity (`float`): exp of that average.
        kl_to_reference (`float`, *optional*): With a reference model, the next-token KL divergence
            KL(p_reference || p_model) in nats, averaged over the same predicted tokens
            ([`~optimum_gradmap.evaluation.next_token_kl`]; Dutta et al., "Accuracy is Not All You Need", NeurIPS 2024).
        kl_stderr (`float`, *optional*): Its standard error over segments.
        reference (`str`, *optional*): The reference model's name.
    """

    dataset: str
    protocol: str
    segment_length: int
    num_segments: int
    num_predicted_tokens: int
    perplexity: float
    kl_to_reference: float | None = None
    kl_stderr: float | None = None
    reference: str | None = None
