# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""The next-token objectives, their values and their gradients at the final hidden states: the cross-entropy (Stage 1's
loss, SLEB's criterion, Stage 2's held-out loss, perplexity) and the forward KL to the teacher's top-K targets (the
heal's loss and held-out KL; the targets: [`~optimum_gradmap.distillation`]), from the whole logits, or from the final
hidden states a few logits at a time ([`optimum_gradmap.vocabulary`]; an offloaded head a vocabulary slice at a time).

**Top-K KL.** [`top_k_kl`] is KL(p_teacher || p_student) over `K + 1` outcomes, the teacher's top-K tokens and "any
other token", whose probabilities are the sums of the rest:

    sum_{k in top-K} p_k (log p_k - log q_k) + p_rest (log p_rest - log q_rest)

It is the full-vocabulary KL of the two distributions with the tail merged into one outcome: exact where the teacher
puts its mass on its top-K, never larger than the full KL, and it penalises a student that moves mass out of the
top-K.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import distributed
from .passes import calibration_batches
from .vocabulary import (
    VocabularyHead,
    predicting,
    row_chunks,
    rows_loss_gradient,
    sliced_logits,
    sliced_logits_gradient,
    vocabulary_head,
    vocabulary_slices,
)


def summed_next_token_loss(logits: torch.Tensor, input_ids: torch.LongTensor) -> torch.Tensor:
    """The next-token cross-entropy of `logits` for `input_ids`, summed over every predicted token (each row predicted
    from its first token on), computed in float32 and returned as a float64 scalar on the logits' device: summed over
    batches without a host synchronisation.

    Args:
        logits (`torch.Tensor` of shape `(batch, seq_len, vocab)`): The model's logits on `input_ids`.
        input_ids (`torch.LongTensor` of shape `(batch, seq_len)`): The sequences.
    """
    predicted = logits[:, :-1].float()
    labels = input_ids[:, 1:].to(predicted.device)
    return F.cross_entropy(predicted.reshape(-1, predicted.shape[-1]), labels.reshape(-1), reduction="sum").double()


def summed_loss(model: nn.Module, batch: torch.LongTensor, head: VocabularyHead) -> torch.Tensor:
    """[`summed_next_token_loss`]`(model(input_ids=batch).logits, batch)`, the logits formed a few at a time.

    Args:
        model (`nn.Module`): The causal LM (inside its passes' context: gradients off, hooks as they are).
        batch (`torch.LongTensor` of shape `(batch, seq_len)`): The sequences, on the model's input device.
        head ([`VocabularyHead`]): The model's ([`vocabulary_head`]).

    Returns:
        `torch.Tensor`: a float64 scalar on the logits' device.
    """
    if head.final_hidden_states is None:
        return summed_next_token_loss(model(input_ids=batch, use_cache=False).logits, batch)
    return chunked_next_token_loss(head.final_hidden_states(batch), batch, head)


@torch.no_grad()
def chunked_next_token_loss(hidden_states: torch.Tensor, input_ids: torch.LongTensor, head: VocabularyHead) -> torch.Tensor:
    """The next-token cross-entropy summed over every predicted token, from the final hidden states, the logits formed
    at most `MAX_LOGIT_ELEMENTS` at a time (rows of tokens, or slices of the vocabulary for an offloaded head).

    Args:
        hidden_states (`torch.Tensor` of shape `(batch, seq_len, hidden)`): The head's input.
        input_ids (`torch.LongTensor` of shape `(batch, seq_len)`): The sequences (their labels).
        head ([`VocabularyHead`]): The head.

    Returns:
        `torch.Tensor`: a float64 scalar on the hidden states' device.
    """
    rows = hidden_states.reshape(-1, hidden_states.shape[-1])  # every position, as the model's logits: the last ignored
    labels = F.pad(input_ids[:, 1:], (0, 1)).reshape(-1).to(rows.device)
    mask = predicting(*input_ids.shape, rows.device)
    if head.sliced is None:
        total = torch.zeros((), dtype=torch.float64, device=rows.device)
        for part in row_chunks(rows.shape[0], head.vocab_size):
            logits = head.compute_logits(rows[part]).float()
            losses = F.cross_entropy(logits, labels[part].to(logits.device), reduction="none")
            total += losses[mask[part].to(losses.device)].sum().double().to(total.device)
        return total
    log_normaliser = torch.full((rows.shape[0],), float("-inf"), dtype=torch.float32, device=rows.device)
    label_logits = torch.zeros(rows.shape[0], dtype=torch.float32, device=rows.device)
    slices = vocabulary_slices(rows.shape[0], head.vocab_size)
    for start, stop, logits in sliced_logits(rows, head.compute_logits, head.sliced, slices):
        log_normaliser = torch.logaddexp(log_normaliser, torch.logsumexp(logits, dim=-1))
        in_slice = (labels >= start) & (labels < stop)
        label_logits[in_slice] = logits[in_slice, labels[in_slice] - start]
    return (log_normaliser - label_logits)[mask].double().sum()


def causal_lm_loss_gradient(
    hidden_states: torch.Tensor,
    input_ids: torch.LongTensor,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    vocab_size: int,
) -> torch.Tensor:
    """Gradient, with respect to the final hidden states, of the sum over samples of each sample's
    mean next-token cross-entropy (computed in float32), the logits formed a few rows at a time
    ([`rows_loss_gradient`]: a batch's logits, their log-softmax and their gradient never exist at once).

    Args:
        hidden_states (`torch.Tensor` of shape `(batch, seq_len, hidden)`): Input of the language-model head.
        input_ids (`torch.LongTensor` of shape `(batch, seq_len)`): The tokens, also the labels.
        compute_logits (`Callable`): Maps hidden states to logits.
        vocab_size (`int`): Width of the logits, to size the chunks.

    Returns:
        `torch.Tensor` shaped like `hidden_states` (zero at the last position, which predicts nothing).
    """
    seq_len = hidden_states.shape[1]
    labels = input_ids[:, 1:].reshape(-1).to(hidden_states.device)

    def rows_loss(logits: torch.Tensor, rows: slice) -> torch.Tensor:
        return F.cross_entropy(logits, labels[rows], reduction="sum") / (seq_len - 1)

    return rows_loss_gradient(hidden_states, compute_logits, vocab_size, rows_loss)


def vocab_sliced_loss_gradient(
    hidden_states: torch.Tensor,
    input_ids: torch.LongTensor,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    head: nn.Module,
    vocab_size: int,
    max_logits: int | None = None,
) -> torch.Tensor:
    """What [`causal_lm_loss_gradient`] computes, with the head's weight read a slice of the vocabulary at a time
    ([`~optimum_gradmap.weights.rows_only`]), for a head offloaded by Accelerate: the whole weight (the largest
    module of most models) never is in memory. Two passes over the slices: the log-normaliser of every token (a
    running log-sum-exp), then each slice's softmax minus the label ([`sliced_logits_gradient`]).

    Args:
        hidden_states (`torch.Tensor` of shape `(batch, seq_len, hidden)`): Input of the head.
        input_ids (`torch.LongTensor` of shape `(batch, seq_len)`): The tokens, also the labels.
        compute_logits (`Callable`): Maps hidden states to logits with the head as it is (the adapter's).
        head (`nn.Module`): The output embedding that `compute_logits` calls.
        vocab_size (`int`): Rows of its weight.
        max_logits (`int`, *optional*): Logits formed at once, `MAX_LOGIT_ELEMENTS` where `None`; sets the slice size.
    """
    rows = hidden_states[:, :-1].detach().reshape(-1, hidden_states.shape[-1])
    labels = input_ids[:, 1:].reshape(-1).to(rows.device)
    slices = vocabulary_slices(rows.shape[0], vocab_size, max_logits)
    log_normaliser = torch.full((rows.shape[0],), -torch.inf, dtype=torch.float32, device=rows.device)
    with torch.no_grad():
        for _, _, logits in sliced_logits(rows, compute_logits, head, slices):
            log_normaliser = torch.logaddexp(log_normaliser, torch.logsumexp(logits, dim=-1))

    def logits_gradient(logits: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        gradient = torch.exp(logits - log_normaliser[:, None])
        in_slice = (labels >= start) & (labels < stop)
        gradient[in_slice, labels[in_slice] - start] -= 1.0
        return gradient

    return sliced_logits_gradient(hidden_states, compute_logits, head, slices, logits_gradient)


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
    with calibration_batches(model, input_ids, batch_size, description, progress_bar) as batches:
        for batch in batches:  # the logits a few at a time
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
    share, _ = distributed.shard_any(input_ids)
    total, count = next_token_loss_sum(model, share, batch_size, progress_bar, description)
    return distributed.mean_from_sums(total, count)


@dataclass
class TeacherTargets:
    """The teacher's next-token distribution at every position but the last of some sequences, as [`top_k_kl`] reads it.

    Attributes:
        indices (`torch.Tensor` of shape `(N, T - 1, TOP_K)`): Its most likely tokens (int32).
        log_probs (`torch.Tensor` of shape `(N, T - 1, TOP_K)`): Their log-probabilities (float32).
        rest_log_prob (`torch.Tensor` of shape `(N, T - 1)`): The log of the probability of every other token.
        layer_states (`torch.Tensor` of shape `(N, T - 1, S, hidden_size)`, *optional*): The outputs of `S` of its
            decoder layers (bfloat16), kept for [`~optimum_gradmap.heal.loss.hidden_state_mse`].
    """

    indices: torch.Tensor
    log_probs: torch.Tensor
    rest_log_prob: torch.Tensor
    layer_states: torch.Tensor | None = None

    def rows(self, rows: Sequence[int] | slice) -> TeacherTargets:
        """The targets of some of the sequences."""
        layer_states = None if self.layer_states is None else self.layer_states[rows]
        return TeacherTargets(self.indices[rows], self.log_probs[rows], self.rest_log_prob[rows], layer_states)

    @staticmethod
    def concatenate(parts: Sequence[TeacherTargets], dim: int = 0) -> TeacherTargets:
        """The targets of `parts` together: their sequences (`dim=0`), or their positions (`dim=1`). The layers'
        outputs are kept where every part has them."""

        def joined(values: list[torch.Tensor | None]) -> torch.Tensor | None:
            return torch.cat(values, dim) if values and all(value is not None for value in values) else None

        return TeacherTargets(
            torch.cat([part.indices for part in parts], dim),
            torch.cat([part.log_probs for part in parts], dim),
            torch.cat([part.rest_log_prob for part in parts], dim),
            joined([part.layer_states for part in parts]),
        )

    def flat(self) -> TeacherTargets:
        """The targets with one row per position, `(N * (T - 1), K)` and `(N * (T - 1),)`, for the KL's gradients."""
        k = self.indices.shape[-1]
        return TeacherTargets(self.indices.reshape(-1, k), self.log_probs.reshape(-1, k), self.rest_log_prob.reshape(-1))


def rest_log_prob(log_probs: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """log of the total probability of the tokens not in `indices` (exact: a logsumexp over them, not 1 - sum)."""
    return log_probs.scatter(-1, indices.long(), float("-inf")).logsumexp(-1)


def top_k_log_probs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The `k` most likely tokens of `logits` (`(..., vocabulary)`), their log-probabilities (the log-softmax in
    float32) and the log of the rest's probability: `(indices, log_probs, rest_log_prob)`."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    top = log_probs.topk(k, dim=-1)
    return top.indices, top.values, rest_log_prob(log_probs, top.indices)


@torch.no_grad()
def chunked_top_k(
    hidden_states: torch.Tensor, head: VocabularyHead, top_k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[`top_k_log_probs`] at every position but the last, from the final hidden states, the logits formed at most
    `MAX_LOGIT_ELEMENTS` at a time.

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
        for chunk in row_chunks(rows.shape[0], head.vocab_size):
            top = top_k_log_probs(head.compute_logits(rows[chunk]), k)
            parts.append(tuple(part.to(rows.device) for part in top))
        indices, values, rest = (torch.cat(part) for part in zip(*parts))
    else:
        indices, values, rest = _sliced_top_k(rows, head, k)
    indices, values, rest = indices.view(batch, seq_len, k), values.view(batch, seq_len, k), rest.view(batch, seq_len)
    return indices[:, :-1], values[:, :-1], rest[:, :-1]


def _sliced_top_k(rows: torch.Tensor, head: VocabularyHead, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[`chunked_top_k`] with the head's weight read a slice of the vocabulary at a time: a first pass keeps a running
    top-K of the logits and their log-normaliser, a second the log-sum-exp of the logits outside the top-K."""
    num_rows = rows.shape[0]
    slices = vocabulary_slices(num_rows, head.vocab_size)
    log_normaliser = torch.full((num_rows,), float("-inf"), dtype=torch.float32, device=rows.device)
    top_values = torch.empty(num_rows, 0, dtype=torch.float32, device=rows.device)
    top_indices = torch.empty(num_rows, 0, dtype=torch.long, device=rows.device)
    for start, stop, logits in sliced_logits(rows, head.compute_logits, head.sliced, slices):
        log_normaliser = torch.logaddexp(log_normaliser, torch.logsumexp(logits, dim=-1))
        columns = torch.arange(start, stop, device=rows.device).expand(num_rows, -1)
        merged = torch.cat([top_values, logits], dim=1).topk(min(k, top_values.shape[1] + stop - start), dim=-1)
        top_indices = torch.cat([top_indices, columns], dim=1).gather(1, merged.indices)
        top_values = merged.values
    rest = torch.full((num_rows,), float("-inf"), dtype=torch.float32, device=rows.device)
    for start, stop, logits in sliced_logits(rows, head.compute_logits, head.sliced, slices):
        columns = _in_slice(top_indices, start, stop)
        extended = torch.cat([logits, logits.new_zeros(num_rows, 1)], dim=1)
        outside = extended.scatter_(1, columns, float("-inf"))[:, :-1]
        rest = torch.logaddexp(rest, torch.logsumexp(outside, dim=-1))
    return top_indices, top_values - log_normaliser[:, None], rest - log_normaliser


def top_k_kl(logits: torch.Tensor, targets: TeacherTargets) -> torch.Tensor:
    """The forward KL divergence from the teacher's distribution to the student's over the teacher's top-K tokens and
    "any other token" (see the module docstring), per position.

    Args:
        logits (`torch.Tensor` of shape `(N, T - 1, V)`): The student's logits at the positions of `targets`.
        targets ([`TeacherTargets`]): The teacher's.

    Returns:
        `torch.Tensor` of shape `(N, T - 1)`: float32, >= 0 up to rounding.
    """
    log_q = torch.log_softmax(logits.float(), dim=-1)
    indices = targets.indices.to(log_q.device).long()
    log_p = targets.log_probs.to(log_q.device)
    log_p_rest = targets.rest_log_prob.to(log_q.device)
    return _top_k_kl_rows(log_p, log_p_rest, log_q.gather(-1, indices), rest_log_prob(log_q, indices))


def _top_k_kl_rows(
    log_p: torch.Tensor, log_p_rest: torch.Tensor, log_q_top: torch.Tensor, log_q_rest: torch.Tensor
) -> torch.Tensor:
    """[`top_k_kl`] from the two models' log-probabilities of the teacher's top-K tokens and of the rest, in their
    dtype (a teacher with no mass outside its top-K, a vocabulary of at most K tokens, adds nothing for the rest)."""
    top = (log_p.exp() * (log_p - log_q_top)).sum(-1)
    rest = torch.where(log_p_rest > float("-inf"), log_p_rest.exp() * (log_p_rest - log_q_rest), torch.zeros_like(log_p_rest))
    return top + rest


@torch.no_grad()
def chunked_top_k_kl(hidden_states: torch.Tensor, targets: TeacherTargets, head: VocabularyHead) -> torch.Tensor:
    """[`top_k_kl`] summed over every predicted position, from the student's final hidden states, the logits formed at
    most `MAX_LOGIT_ELEMENTS` at a time, in float64 (the KL is a small difference of logs, which float32 sums over
    many slices would blur).

    Args:
        hidden_states (`torch.Tensor` of shape `(batch, seq_len, hidden)`): The student's head input.
        targets ([`TeacherTargets`]): The teacher's, at the `seq_len - 1` predicting positions of each sequence.
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

    mask = predicting(batch, seq_len, rows.device)
    indices = every_position(targets.indices, 0).long()
    log_p = every_position(targets.log_probs, 0.0).double()
    log_p_rest = every_position(targets.rest_log_prob, float("-inf")).double()
    if head.sliced is None:  # the KL of `top_k_kl`, a few rows at a time
        total = torch.zeros((), dtype=torch.float64, device=rows.device)
        for part in row_chunks(rows.shape[0], head.vocab_size):
            log_q = torch.log_softmax(head.compute_logits(rows[part]).float().double(), dim=-1).to(rows.device)
            log_q_top, log_q_rest = log_q.gather(-1, indices[part]), rest_log_prob(log_q, indices[part])
            total += _top_k_kl_rows(log_p[part], log_p_rest[part], log_q_top, log_q_rest)[mask[part]].sum()
        return total
    num_rows = rows.shape[0]
    log_normaliser = torch.full((num_rows,), float("-inf"), dtype=torch.float64, device=rows.device)
    rest_log_normaliser = log_normaliser.clone()
    top_logits = torch.zeros(indices.shape, dtype=torch.float64, device=rows.device)
    slices = vocabulary_slices(num_rows, head.vocab_size)
    for start, stop, logits in sliced_logits(rows, head.compute_logits, head.sliced, slices):
        logits = logits.double()
        log_normaliser = torch.logaddexp(log_normaliser, torch.logsumexp(logits, dim=-1))
        columns = _in_slice(indices, start, stop)
        extended = torch.cat([logits, logits.new_zeros(num_rows, 1)], dim=1)
        top_logits = torch.where(columns < stop - start, extended.gather(1, columns), top_logits)
        outside = extended.scatter_(1, columns, float("-inf"))[:, :-1]
        rest_log_normaliser = torch.logaddexp(rest_log_normaliser, torch.logsumexp(outside, dim=-1))
    kl = _top_k_kl_rows(log_p, log_p_rest, top_logits - log_normaliser[:, None], rest_log_normaliser - log_normaliser)
    return kl[mask].sum()


def top_k_kl_gradient(
    hidden_states: torch.Tensor,
    targets: TeacherTargets,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    vocab_size: int,
) -> torch.Tensor:
    """Gradient, with respect to the final hidden states, of the sum over sequences of each one's mean [`top_k_kl`]
    over its predicted positions (the heal's loss times the batch's sequences), through `compute_logits` by autograd.
    The logits are formed a few rows at a time ([`rows_loss_gradient`]).

    Args:
        hidden_states (`torch.Tensor` of shape `(batch, seq_len, hidden)`): Input of the language-model head.
        targets ([`TeacherTargets`]): The teacher's, at the `seq_len - 1` predicting positions of each sequence.
        compute_logits (`Callable`): Maps hidden states to logits (the head as it is).
        vocab_size (`int`): Width of the logits, to size the chunks.

    Returns:
        `torch.Tensor` shaped like `hidden_states` (zero at the last position, which predicts nothing).
    """
    seq_len = hidden_states.shape[1]
    flat = targets.flat()

    def rows_loss(logits: torch.Tensor, rows: slice) -> torch.Tensor:
        return top_k_kl(logits, flat.rows(rows)).sum() / (seq_len - 1)

    return rows_loss_gradient(hidden_states, compute_logits, vocab_size, rows_loss)


def _in_slice(indices: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Where each row's top-K tokens fall among the tokens `start:stop`: their columns there, `stop - start` (one past
    the slice) for those outside it."""
    return torch.where((indices >= start) & (indices < stop), indices - start, stop - start)


def vocab_sliced_top_k_kl_gradient(
    hidden_states: torch.Tensor,
    targets: TeacherTargets,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    head: nn.Module,
    vocab_size: int,
    max_logits: int | None = None,
) -> torch.Tensor:
    """What [`top_k_kl_gradient`] computes, with the head's weight read a slice of the vocabulary at a time, for a head
    offloaded by Accelerate (as [`vocab_sliced_loss_gradient`] does for the cross-entropy).

    With the student's logits z, q = softmax(z), the teacher's top-K set K with probabilities p_k, the rest's p_rest
    (0 where the teacher has no mass outside K) and q_rest = sum_{j not in K} q_j, the derivative of [`top_k_kl`] in
    z_j is

        (sum_k p_k + p_rest) q_j - p_j [j in K] - p_rest q_j / q_rest [j not in K].

    Two passes over the slices: the log-normaliser of every row and that of the tokens outside its top-K (running
    log-sum-exps), then each slice's gradient of the logits ([`sliced_logits_gradient`]).

    Args:
        hidden_states (`torch.Tensor` of shape `(batch, seq_len, hidden)`): Input of the head.
        targets ([`TeacherTargets`]): The teacher's, at the `seq_len - 1` predicting positions of each sequence.
        compute_logits (`Callable`): Maps hidden states to logits with the head as it is (the adapter's).
        head (`nn.Module`): The output embedding that `compute_logits` calls.
        vocab_size (`int`): Rows of its weight.
        max_logits (`int`, *optional*): Logits formed at once, `MAX_LOGIT_ELEMENTS` where `None`; sets the slice size.

    Returns:
        `torch.Tensor` shaped like `hidden_states` (zero at the last position).
    """
    rows = hidden_states[:, :-1].detach().reshape(-1, hidden_states.shape[-1])
    flat = targets.flat()
    indices = flat.indices.to(rows.device).long()
    teacher_top_k = flat.log_probs.to(rows.device).exp()
    log_p_rest = flat.rest_log_prob.to(rows.device)
    teacher_rest = torch.where(log_p_rest > float("-inf"), log_p_rest.exp(), torch.zeros_like(log_p_rest))
    teacher_mass = teacher_top_k.sum(-1) + teacher_rest
    num_rows = rows.shape[0]
    slices = vocabulary_slices(num_rows, vocab_size, max_logits)
    log_normaliser = torch.full((num_rows,), float("-inf"), dtype=torch.float32, device=rows.device)
    rest_log_normaliser = log_normaliser.clone()

    def top_k_columns(start: int, stop: int) -> torch.Tensor:
        mask = torch.zeros(num_rows, stop - start + 1, dtype=torch.bool, device=rows.device)
        return mask.scatter_(1, _in_slice(indices, start, stop), True)[:, :-1]

    with torch.no_grad():
        for start, stop, logits in sliced_logits(rows, compute_logits, head, slices):
            log_normaliser = torch.logaddexp(log_normaliser, torch.logsumexp(logits, dim=-1))
            rest = torch.logsumexp(logits.masked_fill(top_k_columns(start, stop), float("-inf")), dim=-1)
            rest_log_normaliser = torch.logaddexp(rest_log_normaliser, rest)
    has_rest = (teacher_rest > 0)[:, None]

    def logits_gradient(z: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        in_top_k = top_k_columns(start, stop)
        extended = (num_rows, stop - start + 1)
        top_k_mass = torch.zeros(extended, device=rows.device).scatter_(1, _in_slice(indices, start, stop), teacher_top_k)[:, :-1]
        rest_share = torch.where(
            has_rest & ~in_top_k, teacher_rest[:, None] * torch.exp(z - rest_log_normaliser[:, None]), torch.zeros_like(z)
        )
        return teacher_mass[:, None] * torch.exp(z - log_normaliser[:, None]) - top_k_mass - rest_share

    return sliced_logits_gradient(hidden_states, compute_logits, head, slices, logits_gradient)
