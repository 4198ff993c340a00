# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""The logits a few at a time: a model split at its head for forward passes ([`vocabulary_head`]), and how every
objective over the vocabulary ([`optimum_gradmap.objectives`]) forms its logits without a batch's whole
`(batch, seq_len, vocab)` logits or their log-softmax: chunks of rows of at most `MAX_LOGIT_ELEMENTS` logits
([`row_chunks`]), or, for a head Accelerate offloaded, slices of the vocabulary ([`sliced_logits`], the weight read a
slice at a time by [`~optimum_gradmap.weights.rows_only`]) reduced with running log-sum-exps.

A forward pass is split at the head where a gradient pass found that split exact (checked on a few tokens by
[`~optimum_gradmap.streaming.split_at_lm_head`]; elsewhere, SLEB's scores or a teacher loaded apart, the whole logits
are used): for a 128k vocabulary, 8 x 128 tokens make 0.5 GB of float32 logits, as much again for their log-softmax.
The results equal those of the whole logits up to float rounding (the sums are taken in another order).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .adapters import get_adapter
from .streaming import split_is_known_exact
from .weights import is_offloaded_module, rows_only

# A loss over the vocabulary, or its gradient, forms at most this many logits at once (read at each call).
MAX_LOGIT_ELEMENTS = 2**22


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


def row_chunks(num_rows: int, vocab_size: int) -> list[slice]:
    """The chunks of `num_rows` rows whose logits over `vocab_size` tokens make at most `MAX_LOGIT_ELEMENTS` at once."""
    chunk = max(1, MAX_LOGIT_ELEMENTS // vocab_size)
    return [slice(start, start + chunk) for start in range(0, num_rows, chunk)]


def vocabulary_slices(num_rows: int, vocab_size: int, max_logits: int | None = None) -> list[tuple[int, int]]:
    """The `(start, stop)` slices of the vocabulary whose logits of `num_rows` rows make at most `max_logits`
    (`MAX_LOGIT_ELEMENTS` where `None`) at once."""
    step = max(1, (max_logits or MAX_LOGIT_ELEMENTS) // max(1, num_rows))
    return [(start, min(start + step, vocab_size)) for start in range(0, vocab_size, step)]


def sliced_logits(
    rows: torch.Tensor, compute_logits: Callable, head: nn.Module, slices: Sequence[tuple[int, int]]
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """`(start, stop, logits)` of each slice of the vocabulary, the float32 logits of `rows` for its tokens, with the
    head's weight read that slice at a time ([`~optimum_gradmap.weights.rows_only`])."""
    for start, stop in slices:
        with rows_only(head, start, stop):
            logits = compute_logits(rows).float().to(rows.device)
        yield start, stop, logits


def predicting(batch: int, seq_len: int, device: torch.device) -> torch.Tensor:
    """Which of a batch's flattened positions predict a next token (all but each sequence's last)."""
    return (torch.arange(seq_len, device=device) < seq_len - 1).repeat(batch)


def rows_loss_gradient(
    hidden_states: torch.Tensor,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    vocab_size: int,
    rows_loss: Callable[[torch.Tensor, slice], torch.Tensor],
) -> torch.Tensor:
    """Gradient, with respect to the final hidden states, of a loss summed over the predicting positions, with the
    logits formed a few rows at a time ([`row_chunks`]) and dropped as soon as their rows' gradient is known: a
    batch's `(batch, seq_len, vocab)` logits and their gradient never exist at once.

    Args:
        hidden_states (`torch.Tensor` of shape `(batch, seq_len, hidden)`): Input of the language-model head.
        compute_logits (`Callable`): Maps hidden states to logits.
        vocab_size (`int`): Width of the logits, to size the chunks.
        rows_loss (`Callable`): Maps the float32 logits of some predicting positions and their slice of the flattened
            `(batch * (seq_len - 1))` positions to their summed loss.

    Returns:
        `torch.Tensor` shaped like `hidden_states` (zero at the last position, which predicts nothing).
    """
    batch, seq_len, width = hidden_states.shape
    rows = hidden_states[:, :-1].detach().reshape(-1, width)
    row_grads = torch.empty_like(rows)
    for part in row_chunks(rows.shape[0], vocab_size):
        with torch.enable_grad():
            chunk_rows = rows[part].requires_grad_(True)
            loss = rows_loss(compute_logits(chunk_rows).float(), part)
            (row_grads[part],) = torch.autograd.grad(loss, chunk_rows)
    return F.pad(row_grads.view(batch, seq_len - 1, width), (0, 0, 0, 1))


def sliced_logits_gradient(
    hidden_states: torch.Tensor,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    head: nn.Module,
    slices: Sequence[tuple[int, int]],
    logits_gradient: Callable[[torch.Tensor, int, int], torch.Tensor],
) -> torch.Tensor:
    """Gradient, with respect to the final hidden states, of a loss summed over the predicting positions, each
    sequence's divided by its `seq_len - 1` predictions, through `compute_logits` (so a soft-cap is exact) with the
    head's weight read a slice of the vocabulary at a time.

    Args:
        hidden_states (`torch.Tensor` of shape `(batch, seq_len, hidden)`): Input of the head.
        compute_logits (`Callable`): Maps hidden states to logits with the head as it is (the adapter's).
        head (`nn.Module`): The output embedding that `compute_logits` calls.
        slices (`Sequence[tuple[int, int]]`): The slices of the vocabulary ([`vocabulary_slices`]).
        logits_gradient (`Callable`): Maps a slice's float32 logits, its start and stop to the loss's gradient there.

    Returns:
        `torch.Tensor` shaped like `hidden_states` (zero at the last position, which predicts nothing).
    """
    batch, seq_len, width = hidden_states.shape
    rows = hidden_states[:, :-1].detach().reshape(-1, width)
    gradient = torch.zeros_like(rows, dtype=torch.float32)
    for start, stop in slices:
        with rows_only(head, start, stop), torch.enable_grad():
            leaf = rows.detach().requires_grad_(True)
            logits = compute_logits(leaf).float()
            with torch.no_grad():
                logits_grad = logits_gradient(logits.detach(), start, stop)
            (part,) = torch.autograd.grad(logits, leaf, logits_grad / (seq_len - 1))
        gradient += part.float()
    return F.pad(gradient.to(rows.dtype).view(batch, seq_len - 1, width), (0, 0, 0, 1))
