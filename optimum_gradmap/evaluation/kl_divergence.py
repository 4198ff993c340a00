# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""The next-token KL divergence of a model from a reference model (the dense one) on evaluation segments: the mean over
every predicted token of KL(p_reference || p_model), with its standard error over segments (Dutta et al., "Accuracy is
Not All You Need", NeurIPS 2024; see [`optimum_gradmap.evaluation.fidelity`]). [`perplexity_and_kl`] gives the
perplexity from the same pass of the model."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import InvalidInputError
from ..objectives import summed_next_token_loss
from ..passes import calibration_batches, calibration_mode, input_device


@dataclass
class KLDivergence:
    """The next-token KL divergence of a model from a reference model on evaluation segments (see the module docstring).

    Attributes:
        mean (`float`): KL(p_reference || p_model) in nats, averaged over every predicted token of every segment.
        stderr (`float`, *optional*): Its standard error: the standard deviation over segments of each segment's mean,
            / sqrt(num_segments) (`None` for one segment).
        num_segments (`int`): Segments evaluated.
        num_predicted_tokens (`int`): Tokens whose divergence was averaged (`segment_length - 1` per segment).
    """

    mean: float
    stderr: float | None
    num_segments: int
    num_predicted_tokens: int


def _segment_kl(logits: torch.Tensor, reference_logits: torch.Tensor) -> torch.Tensor:
    """Each row's mean over its predicted positions (`[:-1]`) of KL(softmax(reference) || softmax(model)), computed in
    float32 from the log-softmax of both, one row at a time (a row's vocabulary-sized tensors only); float64 on the
    logits' device (no host synchronisation: the caller brings the rows back once)."""
    if logits.shape != reference_logits.shape:
        raise InvalidInputError(
            f"The model's logits have shape {tuple(logits.shape)}, the reference model's {tuple(reference_logits.shape)}: "
            "the KL divergence needs two models with the same vocabulary (the same tokenizer)."
        )
    means = []
    for row, reference_row in zip(logits, reference_logits):
        log_q = torch.log_softmax(row[:-1].float(), dim=-1)
        log_p = torch.log_softmax(reference_row[:-1].to(log_q.device).float(), dim=-1)
        p = log_p.exp()
        terms = torch.where(p > 0, p * (log_p - log_q), torch.zeros((), dtype=p.dtype, device=p.device))  # 0 log 0 = 0
        means.append(terms.sum(dim=-1).double().mean())
    return torch.stack(means)


def next_token_kl_per_segment(
    model: nn.Module,
    reference_model: nn.Module,
    segments: torch.LongTensor,
    batch_size: int = 8,
    progress_bar: bool = True,
) -> torch.Tensor:
    """Each segment's mean next-token KL divergence of `model` from `reference_model` (see the module docstring).

    Both models run batch by batch, each on its own device (the batch goes to each model's input device), in eval
    mode without gradients; no logits are kept beyond a batch.

    Args:
        model (`nn.Module`): The causal LM measured (the pruned one).
        reference_model (`nn.Module`): The causal LM it is measured against (the dense one), with the same vocabulary.
        segments (`torch.LongTensor` of shape `(num_segments, segment_length)`): Evaluation segments, possibly none.
        batch_size (`int`, defaults to 8): Segments per forward pass of each model.
        progress_bar (`bool`, defaults to `True`): Show a progress bar.

    Returns:
        `torch.Tensor` of shape `(num_segments,)`: float64, on CPU.
    """
    return _kl_and_loss_per_segment(model, reference_model, segments, batch_size, progress_bar)[0]


def _kl_and_loss_per_segment(
    model: nn.Module, reference_model: nn.Module, segments: torch.LongTensor, batch_size: int, progress_bar: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """[`next_token_kl_per_segment`], and from the same logits the model's next-token loss summed over every predicted
    token, batch by batch as [`~optimum_gradmap.objectives.next_token_loss_sum`] sums it (the same float64 scalar).
    Both are summed on the logits' device and brought to the CPU once, after the last batch (no per-batch sync)."""
    reference_device = input_device(reference_model)
    means, total = [], None
    with (
        calibration_mode(reference_model),
        calibration_batches(model, segments, batch_size, "KL divergence", progress_bar) as batches,
    ):
        for batch in batches:
            logits = model(input_ids=batch, use_cache=False).logits
            reference_logits = reference_model(input_ids=batch.to(reference_device), use_cache=False).logits
            means.append(_segment_kl(logits, reference_logits))
            batch_total = summed_next_token_loss(logits, batch)
            total = batch_total if total is None else total + batch_total.to(total.device)
    if not means:
        return torch.zeros(0, dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    return torch.cat([row.to(means[0].device) for row in means]).cpu(), total.cpu()


def perplexity_and_kl(
    model: nn.Module,
    reference_model: nn.Module,
    segments: torch.LongTensor,
    batch_size: int = 8,
    progress_bar: bool = True,
    shared_by_processes: bool = False,
) -> tuple[float, KLDivergence]:
    """The perplexity of `model` on `segments` ([`~optimum_gradmap.evaluation.perplexity`]) and its next-token KL
    divergence from `reference_model` ([`next_token_kl`]), from one pass of each model: `model` runs once for both.

    Args:
        model, reference_model, segments, batch_size, progress_bar, shared_by_processes: As in [`next_token_kl`].

    Returns:
        `tuple[float, KLDivergence]`.
    """
    from .. import distributed

    _check_segments(segments)
    share = distributed.shard_any(segments)[0] if shared_by_processes else segments
    means, total = _kl_and_loss_per_segment(model, reference_model, share, batch_size, progress_bar)
    count = share.shape[0] * (share.shape[1] - 1)
    loss = distributed.mean_from_sums(total, count) if shared_by_processes else float(total) / count
    return math.exp(loss), _kl_result(distributed.gather_rows(means) if shared_by_processes else means, segments)


def _check_segments(segments: torch.LongTensor) -> None:
    if segments.dim() != 2 or segments.shape[0] == 0 or segments.shape[1] < 2:
        raise InvalidInputError(
            f"The KL divergence needs at least one segment of two tokens or more; got segments of shape {tuple(segments.shape)}."
        )


def _kl_result(means: torch.Tensor, segments: torch.LongTensor) -> KLDivergence:
    count = means.numel()
    stderr = float(means.std() / math.sqrt(count)) if count > 1 else None
    return KLDivergence(float(means.mean()), stderr, count, count * (segments.shape[1] - 1))


def next_token_kl(
    model: nn.Module,
    reference_model: nn.Module,
    segments: torch.LongTensor,
    batch_size: int = 8,
    progress_bar: bool = True,
    shared_by_processes: bool = False,
) -> KLDivergence:
    """The next-token KL divergence KL(p_reference || p_model) of `model` from `reference_model`, averaged over every
    predicted token of `segments` (those perplexity averages over), with its standard error over segments. The
    measure of Dutta et al., "Accuracy is Not All You Need" (NeurIPS 2024).

    Args:
        model (`nn.Module`): The causal LM measured (the pruned one).
        reference_model (`nn.Module`): The causal LM it is measured against (the dense one), with the same vocabulary;
            its parameters may be on another device than `model`'s.
        segments (`torch.LongTensor` of shape `(num_segments, segment_length)`): From
            [`~optimum_gradmap.evaluation.load_evaluation_segments`].
        batch_size (`int`, defaults to 8): Segments per forward pass of each model.
        progress_bar (`bool`, defaults to `True`): Show a progress bar.
        shared_by_processes (`bool`, defaults to `False`): Under `torch.distributed`, every process calls this with the
            same segments, measures its contiguous share of them ([`~optimum_gradmap.distributed.shard_any`]) and
            gets the result on all of them (the segments' means are gathered,
            [`~optimum_gradmap.distributed.gather_rows`]). Without it, each process measures every segment.

    Returns:
        [`KLDivergence`].

    Raises:
        InvalidInputError: for no segment, segments of one token, or models whose vocabularies differ.
    """
    return perplexity_and_kl(model, reference_model, segments, batch_size, progress_bar, shared_by_processes)[1]
