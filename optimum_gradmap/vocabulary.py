# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Forward-only quantities over the vocabulary, formed a few tokens at a time: the next-token loss (of a batch, and its
mean over sequences: SLEB's criterion, Stage 2's held-out loss, perplexity), the teacher's top-K targets and the KL to
them, without a batch's `(batch, seq_len, vocab)` logits or their log-softmax.

A model's forward pass returns the logits of every position at once: for a 128k vocabulary, 8 x 128 tokens make
0.5 GB of float32 logits, as much again for their log-softmax, whatever the model's size. Here the model is split
at its head where a gradient pass found that split exact ([`~optimum_gradmap.streaming.split_at_lm_head`]
checks it on a few tokens; elsewhere, SLEB's scores or a teacher loaded apart, the whole logits are used, as before):
the decoder gives the final hidden states, and the head maps them to logits at most `passes.MAX_LOGIT_ELEMENTS` at a
time (every position's, as the model's forward does, the last one's ignored), which are reduced (to a summed
cross-entropy, or to the top-K log-probabilities and the rest's) and dropped. Where Accelerate keeps the head
offloaded, its weight is read a slice of the vocabulary at a time ([`~optimum_gradmap.weights.rows_only`]) and the
reductions run over the slices (running log-sum-exps), as Stage 1's loss gradient does
([`~optimum_gradmap.streaming.vocab_sliced_loss_gradient`]).

The results equal those of the whole logits up to float rounding (the sums are taken in another order).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import passes
from .adapters import get_adapter
from .streaming import split_is_known_exact
from .weights import is_offloaded_module, rows_only


@dataclass
class VocabularyHead:
    """How a model's logits are formed a few at a time: its decoder's final hidden states, then `compute_logits`.

    Attributes:
        final_hidden_states (`Callable`, *optional*): Maps a batch of token ids to the final hidden states; `None`
            where the adapter's split does not reproduce the model (the whole logits are used then).
        compute_logits (`Callable`, *optional*): Maps final hidden states to logits.
        vocab_size (`int`): The width of the logits.
        sliced (`nn.Module`, *optional*): The offloaded output embedding, read a slice of the vocabulary at a time.
    """

    final_hidden_states: Callable[[torch.LongTensor], torch.Tensor] | None
    compute_logits: Callable[[torch.Tensor], torch.Tensor] | None
    vocab_size: int
    sliced: nn.Module | None = None


def vocabulary_head(model: nn.Module) -> VocabularyHead:
    """The [`VocabularyHead`] of `model`: its split at the head where a gradient pass found it exact
    ([`~optimum_gradmap.streaming.split_at_lm_head`] checks it on a few tokens), else the whole logits (no
    check is run here: it would be a pass of the whole model, which hooks on the layers may not expect).

    Args:
        model (`nn.Module`): A causal LM.
    """
    output_embeddings = model.get_output_embeddings()
    vocab_size = output_embeddings.weight.shape[0]
    if not split_is_known_exact(model):
        return VocabularyHead(None, None, vocab_size)
    adapter = get_adapter(model)
    return VocabularyHead(
        lambda batch: adapter.final_hidden_states(model, input_ids=batch, use_cache=False),
        lambda hidden_states: adapter.compute_logits(model, hidden_states),
        vocab_size,
        output_embeddings if is_offloaded_module(output_embeddings) else None,
    )


def summed_loss(model: nn.Module, batch: torch.LongTensor, head: VocabularyHead) -> torch.Tensor:
    """`passes.summed_next_token_loss(model(input_ids=batch).logits, batch)`, the logits formed a few at a time.

    Args:
        model (`nn.Module`): The causal LM (inside its passes' context: gradients off, hooks as they are).
        batch (`torch.LongTensor` of shape `(batch, seq_len)`): The sequences, on the model's input device.
        head ([`VocabularyHead`]): The model's ([`vocabulary_head`]).

    Returns:
        `torch.Tensor`: a float64 scalar on the logits' device.
    """
    if head.final_hidden_states is None:
        return passes.summed_next_token_loss(model(input_ids=batch, use_cache=False).logits, batch)
    return chunked_next_token_loss(head.final_hidden_states(batch), batch, head)


def _vocabulary_slices(num_rows: int, vocab_size: int) -> list[tuple[int, int]]:
    step = max(1, passes.MAX_LOGIT_ELEMENTS // max(1, num_rows))
    return [(start, min(start + step, vocab_size)) for start in range(0, vocab_size, step)]


@torch.no_grad()
def chunked_next_token_loss(hidden_states: torch.Tensor, input_ids: torch.LongTensor, head: VocabularyHead) -> torch.Tensor:
    """The next-token cross-entropy summed over every predicted token, from the final hidden states, the logits
    formed at most `passes.MAX_LOGIT_ELEMENTS` at a time (rows of tokens, or slices of the vocabulary for an
    offloaded head).

    Args:
        hidden_states (`torch.Tensor` of shape `(batch, seq_len, hidden)`): The head's input.
        input_ids (`torch.LongTensor` of shape `(batch, seq_len)`): The sequences (their labels).
        head ([`VocabularyHead`]): The head.

    Returns:
        `torch.Tensor`: a float64 scalar on the hidden states' device.
    """
    rows = hidden_states.reshape(-1, hidden_states.shape[-1])  # every position, as the model's logits: the last ignored
    labels = F.pad(input_ids[:, 1:], (0, 1)).reshape(-1).to(rows.device)
    predicting = _predicting(*input_ids.shape, rows.device)
    if head.sliced is None:
        total = torch.zeros((), dtype=torch.float64, device=rows.device)
        chunk = max(1, passes.MAX_LOGIT_ELEMENTS // head.vocab_size)
        for start in range(0, rows.shape[0], chunk):
            logits = head.compute_logits(rows[start : start + chunk]).float()
            losses = F.cross_entropy(logits, labels[start : start + chunk].to(logits.device), reduction="none")
            total += losses[predicting[start : start + chunk].to(losses.device)].sum().double().to(total.device)
        return total
    log_normaliser = torch.full((rows.shape[0],), float("-inf"), dtype=torch.float32, device=rows.device)
    label_logits = torch.zeros(rows.shape[0], dtype=torch.float32, device=rows.device)
    for start, stop in _vocabulary_slices(rows.shape[0], head.vocab_size):
        with rows_only(head.sliced, start, stop):
            logits = head.compute_logits(rows).float().to(rows.device)
        log_normaliser = torch.logaddexp(log_normaliser, torch.logsumexp(logits, dim=-1))
        in_slice = (labels >= start) & (labels < stop)
        label_logits[in_slice] = logits[in_slice, labels[in_slice] - start]
    return (log_normaliser - label_logits)[predicting].double().sum()


def _predicting(batch: int, seq_len: int, device: torch.device) -> torch.Tensor:
    """Which of a batch's flattened positions predict a next token (all but each sequence's last)."""
    return (torch.arange(seq_len, device=device) < seq_len - 1).repeat(batch)


@torch.no_grad()
def chunked_top_k(
    hidden_states: torch.Tensor, head: VocabularyHead, top_k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The `top_k` most likely next tokens at every position but the last, their log-probabilities (the log-softmax
    in float32) and the log of the rest's probability (a log-sum-exp over the other tokens), from the final hidden
    states, the logits formed at most `passes.MAX_LOGIT_ELEMENTS` at a time: what
    [`~optimum_gradmap.distillation.targets_from_logits`] computes from the whole logits.

    Args:
        hidden_states (`torch.Tensor` of shape `(batch, seq_len, hidden)`): The head's input.
        head ([`VocabularyHead`]): The head.
        top_k (`int`): Tokens kept per position.

    Returns:
        `(indices, log_probs, rest_log_prob)`: shapes `(batch, seq_len - 1, K)` (int64), `(batch, seq_len - 1, K)` and
        `(batch, seq_len - 1)`, on the hidden states' device.
    """
    batch, seq_len, width = hidden_states.shape
    rows = hidden_states.reshape(-1, width)  # every position, as the model's logits: the last dropped at the end
    k = min(top_k, head.vocab_size)
    if head.sliced is None:
        parts = []
        chunk = max(1, passes.MAX_LOGIT_ELEMENTS // head.vocab_size)
        for start in range(0, rows.shape[0], chunk):
            log_probs = torch.log_softmax(head.compute_logits(rows[start : start + chunk]).float(), dim=-1)
            top = log_probs.topk(k, dim=-1)
            rest = log_probs.scatter(-1, top.indices, float("-inf")).logsumexp(-1)
            parts.append((top.indices.to(rows.device), top.values.to(rows.device), rest.to(rows.device)))
        indices, values, rest = (torch.cat(part) for part in zip(*parts))
    else:
        indices, values, rest = _sliced_top_k(rows, head, k)
    indices, values, rest = indices.view(batch, seq_len, k), values.view(batch, seq_len, k), rest.view(batch, seq_len)
    return indices[:, :-1], values[:, :-1], rest[:, :-1]


def _sliced_top_k(rows: torch.Tensor, head: VocabularyHead, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[`chunked_top_k`] with the head's weight read a slice of the vocabulary at a time: a first pass keeps a running
    top-K of the logits and their log-normaliser, a second the log-sum-exp of the logits outside the top-K."""
    num_rows = rows.shape[0]
    slices = _vocabulary_slices(num_rows, head.vocab_size)
    log_normaliser = torch.full((num_rows,), float("-inf"), dtype=torch.float32, device=rows.device)
    top_values = torch.empty(num_rows, 0, dtype=torch.float32, device=rows.device)
    top_indices = torch.empty(num_rows, 0, dtype=torch.long, device=rows.device)
    for start, stop in slices:
        with rows_only(head.sliced, start, stop):
            logits = head.compute_logits(rows).float().to(rows.device)
        log_normaliser = torch.logaddexp(log_normaliser, torch.logsumexp(logits, dim=-1))
        columns = torch.arange(start, stop, device=rows.device).expand(num_rows, -1)
        merged = torch.cat([top_values, logits], dim=1).topk(min(k, top_values.shape[1] + stop - start), dim=-1)
        top_indices = torch.cat([top_indices, columns], dim=1).gather(1, merged.indices)
        top_values = merged.values
    rest = torch.full((num_rows,), float("-inf"), dtype=torch.float32, device=rows.device)
    for start, stop in slices:
        with rows_only(head.sliced, start, stop):
            logits = head.compute_logits(rows).float().to(rows.device)
        in_slice = (top_indices >= start) & (top_indices < stop)
        columns = torch.where(in_slice, top_indices - start, stop - start)
        extended = torch.cat([logits, logits.new_zeros(num_rows, 1)], dim=1)
        outside = extended.scatter_(1, columns, float("-inf"))[:, :-1]
        rest = torch.logaddexp(rest, torch.logsumexp(outside, dim=-1))
    return top_indices, top_values - log_normaliser[:, None], rest - log_normaliser


@torch.no_grad()
def chunked_top_k_kl(hidden_states: torch.Tensor, targets: object, head: VocabularyHead) -> torch.Tensor:
    """[`~optimum_gradmap.distillation.top_k_kl`] summed over every predicted position, from the student's final
    hidden states, the logits formed at most `passes.MAX_LOGIT_ELEMENTS` at a time.

    Args:
        hidden_states (`torch.Tensor` of shape `(batch, seq_len, hidden)`): The student's head input.
        targets ([`~optimum_gradmap.distillation.TeacherTargets`]): The teacher's, at the `seq_len - 1` predicting
            positions of each sequence.
        head ([`VocabularyHead`]): The student's head.

    Returns:
        `torch.Tensor`: a float64 scalar on the hidden states' device.
    """
    batch, seq_len, width = hidden_states.shape
    rows = hidden_states.reshape(-1, width)  # every position, as the model's logits: the last one's KL ignored

    def every_position(values: torch.Tensor, fill: float) -> torch.Tensor:  # the targets, a row added for the last
        padded = torch.full((batch, seq_len, *values.shape[2:]), fill, dtype=values.dtype, device=rows.device)
        padded[:, :-1] = values.to(rows.device)
        return padded.reshape(batch * seq_len, *values.shape[2:])

    predicting = _predicting(batch, seq_len, rows.device)
    indices = every_position(targets.indices, 0).long()
    log_p = every_position(targets.log_probs, 0.0).double()
    log_p_rest = every_position(targets.rest_log_prob, float("-inf")).double()
    if head.sliced is None:  # the KL of `distillation.top_k_kl`, a few rows at a time
        total = torch.zeros((), dtype=torch.float64, device=rows.device)
        chunk = max(1, passes.MAX_LOGIT_ELEMENTS // head.vocab_size)
        for start in range(0, rows.shape[0], chunk):
            part = slice(start, start + chunk)
            # float64, as the sliced reduction below: the KL is a small difference of logs
            log_q = torch.log_softmax(head.compute_logits(rows[part]).float().double(), dim=-1).to(rows.device)
            log_q_top = log_q.gather(-1, indices[part])
            log_q_rest = log_q.scatter(-1, indices[part], float("-inf")).logsumexp(-1)
            kl = _top_k_kl_rows(log_p[part], log_p_rest[part], log_q_top, log_q_rest)
            total += kl[predicting[part]].sum()
        return total
    num_rows = rows.shape[0]
    # the running log-sum-exps in float64: the KL is a small difference of logs, which float32 sums over many
    # slices would blur
    log_normaliser = torch.full((num_rows,), float("-inf"), dtype=torch.float64, device=rows.device)
    rest_log_normaliser = log_normaliser.clone()
    top_logits = torch.zeros(indices.shape, dtype=torch.float64, device=rows.device)
    for start, stop in _vocabulary_slices(num_rows, head.vocab_size):
        with rows_only(head.sliced, start, stop):
            logits = head.compute_logits(rows).float().to(rows.device).double()
        log_normaliser = torch.logaddexp(log_normaliser, torch.logsumexp(logits, dim=-1))
        in_slice = (indices >= start) & (indices < stop)
        columns = torch.where(in_slice, indices - start, stop - start)
        extended = torch.cat([logits, logits.new_zeros(num_rows, 1)], dim=1)
        top_logits = torch.where(in_slice, extended.gather(1, columns), top_logits)
        outside = extended.scatter_(1, columns, float("-inf"))[:, :-1]
        rest_log_normaliser = torch.logaddexp(rest_log_normaliser, torch.logsumexp(outside, dim=-1))
    kl = _top_k_kl_rows(log_p, log_p_rest, top_logits - log_normaliser[:, None], rest_log_normaliser - log_normaliser)
    return kl[predicting].sum()


def _top_k_kl_rows(
    log_p: torch.Tensor, log_p_rest: torch.Tensor, log_q_top: torch.Tensor, log_q_rest: torch.Tensor
) -> torch.Tensor:
    """The forward KL over the teacher's top-K tokens and "any other token", per row, in float64 (a teacher with no
    mass outside its top-K adds nothing for the rest)."""
    log_q_top, log_q_rest = log_q_top.double(), log_q_rest.double()
    top = (log_p.exp() * (log_p - log_q_top)).sum(-1)
    rest = torch.where(log_p_rest > float("-inf"), log_p_rest.exp() * (log_p_rest - log_q_rest), torch.zeros_like(log_p_rest))
    return top + rest


def next_token_loss_sum(
    model: nn.Module,
    input_ids: torch.LongTensor,
    batch_size: int,
    progress_bar: bool = True,
    description: str = "Next-token loss",
) -> tuple[torch.Tensor, int]:
    """The next-token cross-entropy of `model` summed over every predicted token of `input_ids`, and the number of
    those tokens: what a mean over several processes' shares adds up (a share may hold no sequence at all).

    Returns:
        `tuple[torch.Tensor, int]`: The sum (a float64 scalar on CPU; 0 for no sequence) and the count of predicted
        tokens.
    """
    total = None
    head = vocabulary_head(model)
    with passes.calibration_batches(model, input_ids, batch_size, description, progress_bar) as batches:
        for batch in batches:  # the logits a few at a time ([`optimum_gradmap.vocabulary`])
            batch_total = summed_loss(model, batch, head)
            total = batch_total if total is None else total + batch_total
    if total is None:
        return torch.zeros((), dtype=torch.float64), 0
    return total.cpu(), input_ids.shape[0] * (input_ids.shape[1] - 1)


def mean_next_token_loss(
    model: nn.Module,
    input_ids: torch.LongTensor,
    batch_size: int,
    progress_bar: bool = True,
    description: str = "Next-token loss",
) -> float:
    """The mean next-token cross-entropy of `model` over every predicted token of `input_ids`: the calibration
    loss of SLEB's criterion on calibration sequences, the log of the perplexity on evaluation segments.

    Args:
        model (`nn.Module`): A causal LM, run as it is.
        input_ids (`torch.LongTensor` of shape `(num_sequences, sequence_length)`): Each row is predicted
            from its first token on (`sequence_length - 1` predictions per row).
        batch_size (`int`): Sequences per forward pass.
        progress_bar (`bool`, defaults to `True`): Show a progress bar.
        description (`str`, defaults to `"Next-token loss"`): The progress bar's label.

    Returns:
        `float`: The mean loss in nats per predicted token.

    Raises:
        ValueError: for no sequence, or sequences of one token (nothing to predict).
    """
    if input_ids.dim() != 2 or input_ids.shape[0] == 0 or input_ids.shape[1] < 2:
        raise ValueError(
            f"The next-token loss needs at least one sequence of two tokens or more; got input ids of shape "
            f"{tuple(input_ids.shape)}."
        )
    total, count = next_token_loss_sum(model, input_ids, batch_size, progress_bar, description)
    return float(total) / count


def shared_mean_next_token_loss(
    model: nn.Module,
    input_ids: torch.LongTensor,
    batch_size: int,
    progress_bar: bool = True,
    description: str = "Next-token loss",
) -> float:
    """[`mean_next_token_loss`] with the sequences shared among processes ([`optimum_gradmap.distributed`]): every
    process calls it with the same `input_ids`, scores its contiguous share of them (possibly none) and the summed
    losses and token counts are all-reduced, so that every process gets the mean over all of them, that of one
    process on every sequence. Without a process group it is [`mean_next_token_loss`]."""
    from . import distributed

    share, _ = distributed.shard_any(input_ids)
    total, count = next_token_loss_sum(model, share, batch_size, progress_bar, description)
    return distributed.mean_from_sums(total, count)
