# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Log-likelihoods of continuations, each question's shared context computed once.

A multiple-choice question asks for the log-likelihood of every answer after the same context. Scored
one answer at a time (as lm-evaluation-harness does for answers longer than one token), the context is
computed once per answer. Here every question is one packed row: its context, then each answer's tokens,
with an attention mask that lets each answer see the context and itself only, and positions that restart
after the context for every answer. The model computes the context once and every answer after it, the
same log-likelihoods (up to float rounding) for fewer tokens: on HellaSwag, about 175 tokens a question
instead of 4 x 110. Rows are sorted by length and batched. The pairs are tokenized as lm-eval does
(`_encode_pair`: trailing spaces of the context go to the answer; the answer's tokens are those of the
whole text after the context's).

Logits are formed only where an answer's token is predicted: the decoder runs to the final hidden states and
the head (the adapter's, `DecoderAdapter.compute_logits`) maps those positions only, which on SmolLM2-135M
(vocabulary 49,152) saves about a fifth of the work. A model whose attention ignores a custom 4-D mask, or
whose head the adapter does not reproduce, would give other numbers: the first batch is checked against
answers scored one at a time through the whole model, and the scorer falls back to that (with a warning) if
they differ.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase
from transformers.utils import logging

from ..adapters import UnsupportedArchitectureError, get_adapter
from ..passes import calibration_mode, input_device

logger = logging.get_logger(__name__)

# Logits formed at once, at most (rows x positions x vocabulary): sets how many rows go in a batch.
_MAX_LOGIT_ELEMENTS = 2**27
# Largest difference (nats) between packed and one-at-a-time log-likelihoods accepted by the check.
_PACKING_TOLERANCE = 1e-3


@dataclass(frozen=True)
class Request:
    """One answer to score: `continuation` (token ids) after `context` (token ids, never empty)."""

    context: tuple[int, ...]
    continuation: tuple[int, ...]


def encode_pair(tokenizer: PreTrainedTokenizerBase, context: str, continuation: str, prefix_token_id: int) -> Request:
    """Tokenizes a (context, continuation) pair as lm-evaluation-harness does for causal models: trailing
    spaces of the context move to the continuation, the whole text is tokenized, and the continuation is
    what follows the context's own tokens. An empty context is `prefix_token_id` (BOS or EOS)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    if not context:
        return Request((prefix_token_id,), tuple(encode(continuation)))
    context_ids, whole = encode(context), encode(context + continuation)
    return Request(tuple(context_ids), tuple(whole[len(context_ids) :]))


@dataclass
class _PackedRow:
    """One question as one row: token ids, positions, the mask's segment and answer of each token, and for
    each request the row positions whose logits predict its tokens, and those tokens."""

    ids: list[int]
    positions: list[int]
    segments: list[int]
    answers: list[int]
    predictions: list[tuple[list[int], list[int]]]


def _pack(requests: Sequence[Request]) -> _PackedRow:
    row = _PackedRow([], [], [], [], [None] * len(requests))
    contexts: dict[tuple[int, ...], list[int]] = {}
    for index, request in enumerate(requests):
        contexts.setdefault(request.context, []).append(index)
    for segment, (context, indices) in enumerate(contexts.items()):
        last_context = len(row.ids) + len(context) - 1
        row.ids += context
        row.positions += range(len(context))
        row.segments += [segment] * len(context)
        row.answers += [-1] * len(context)
        for index in indices:
            continuation = requests[index].continuation
            start = len(row.ids)
            inputs = continuation[:-1]  # the last token predicts nothing
            row.ids += inputs
            row.positions += range(len(context), len(context) + len(inputs))
            row.segments += [segment] * len(inputs)
            row.answers += [index] * len(inputs)
            row.predictions[index] = ([last_context, *range(start, start + len(inputs))], list(continuation))
    return row


def _attention_mask(rows: Sequence[_PackedRow], length: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive 4-D mask `(rows, 1, length, length)`: token i sees token j <= i of its own segment when j
    is a context token or a token of i's own answer; padding sees itself only."""
    segments = torch.full((len(rows), length), -2, dtype=torch.long)
    answers = torch.full((len(rows), length), -1, dtype=torch.long)
    for position, row in enumerate(rows):
        segments[position, : len(row.ids)] = torch.tensor(row.segments)
        answers[position, : len(row.ids)] = torch.tensor(row.answers)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    same_segment = segments[:, :, None] == segments[:, None, :]
    visible_answer = (answers[:, None, :] == -1) | (answers[:, None, :] == answers[:, :, None])
    padding = segments == -2
    allowed = (same_segment & visible_answer & causal) & ~padding[:, None, :]
    allowed |= torch.eye(length, dtype=torch.bool) & padding[:, :, None]
    mask = torch.zeros(allowed.shape, dtype=dtype)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


def _decoder_and_head(model: nn.Module) -> tuple[Callable | None, Callable | None]:
    """The model's decoder (to its final hidden states) and head (hidden states to logits), as its family's
    adapter describes them, so that logits are formed at the positions scored only; `(None, None)` for a
    family without an adapter (the whole model's logits are then formed)."""
    try:
        adapter = get_adapter(model)
    except UnsupportedArchitectureError:
        return None, None
    return (lambda **inputs: adapter.final_hidden_states(model, **inputs)), (lambda hidden: adapter.compute_logits(model, hidden))


def _score_rows(model: nn.Module, rows: Sequence[_PackedRow], fast: bool) -> list[list[tuple[float, bool]]]:
    """Log-likelihood and greediness of every request of `rows`, in one forward pass: packed rows through the
    decoder, with logits at the scored positions only (`fast`), or rows of one request each through the whole
    model."""
    device = input_device(model)
    length = max(len(row.ids) for row in rows)
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    positions = torch.zeros(len(rows), length, dtype=torch.long)
    for index, row in enumerate(rows):
        ids[index, : len(row.ids)] = torch.tensor(row.ids)
        positions[index, : len(row.ids)] = torch.tensor(row.positions)
    decoder, head = _decoder_and_head(model) if fast else (None, None)
    if fast:
        dtype = model.get_input_embeddings().weight.dtype
        inputs = {"attention_mask": _attention_mask(rows, length, dtype).to(device), "position_ids": positions.to(device)}
    else:
        lengths = torch.tensor([len(row.ids) for row in rows])
        inputs = {"attention_mask": (torch.arange(length)[None] < lengths[:, None]).long().to(device)}
    # every scored position of the batch at once: one head call, one log-softmax
    row_index = torch.tensor([index for index, row in enumerate(rows) for where, _ in row.predictions for _ in where])
    position_index = torch.tensor([p for row in rows for where, _ in row.predictions for p in where])
    targets = torch.tensor([t for row in rows for _, wanted in row.predictions for t in wanted])
    if decoder is not None:
        hidden = decoder(input_ids=ids.to(device), use_cache=False, **inputs)
        logits = head(hidden[row_index.to(hidden.device), position_index.to(hidden.device)])
    else:
        logits = model(input_ids=ids.to(device), use_cache=False, **inputs).logits
        logits = logits[row_index.to(logits.device), position_index.to(logits.device)]
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    targets = targets.to(log_probs.device)
    chosen = log_probs.gather(-1, targets[:, None])[:, 0].cpu()
    greedy = (log_probs.argmax(-1) == targets).cpu()
    results, start = [], 0
    for row in rows:
        scored = []
        for where, _ in row.predictions:
            stop = start + len(where)
            scored.append((float(chosen[start:stop].sum()), bool(greedy[start:stop].all())))
            start = stop
        results.append(scored)
    return results


def _one_at_a_time(requests: Sequence[Request]) -> list[_PackedRow]:
    return [_pack([request]) for request in requests]


def score_questions(
    model: nn.Module,
    questions: Sequence[Sequence[Request]],
    batch_size: int = 8,
    progress_bar: bool = True,
    description: str = "Scoring answers",
) -> list[list[tuple[float, bool]]]:
    """For every question, the log-likelihood of each of its requests and whether it is the greedy
    continuation, each question's contexts computed once (see the module docstring).

    Args:
        model (`nn.Module`): A causal LM.
        questions (`Sequence[Sequence[Request]]`): The requests of each question.
        batch_size (`int`, defaults to 8): Questions per forward pass (fewer where the logits would be large).
        progress_bar (`bool`, defaults to `True`): Show a progress bar.
        description (`str`): Its label.

    Returns:
        `list[list[tuple[float, bool]]]`: Per question, `(log-likelihood, greedy)` of each request, in order.
    """
    rows = [_pack(requests) for requests in questions]
    order = sorted(range(len(rows)), key=lambda index: -len(rows[index].ids))
    vocabulary = model.get_output_embeddings().weight.shape[0]
    results: list[list[tuple[float, bool]] | None] = [None] * len(rows)
    packed = True
    with calibration_mode(model):
        bar = logging.tqdm(total=len(rows), desc=description, leave=False, disable=not progress_bar)
        start = 0
        while start < len(order):
            longest = len(rows[order[start]].ids)
            size = max(1, min(batch_size, _MAX_LOGIT_ELEMENTS // (longest * vocabulary)))
            batch = order[start : start + size]
            if packed:
                scored = _score_rows(model, [rows[index] for index in batch], fast=True)
                if start == 0:  # the first batch: check that the model follows the packed mask
                    packed = _packing_agrees(model, [questions[index] for index in batch[:2]], scored[:2])
            if not packed:
                scored = [_score_questions_one_at_a_time(model, questions[index]) for index in batch]
            for index, found in zip(batch, scored):
                results[index] = found
            start += size
            bar.update(len(batch))
        bar.close()
    return results


def _score_questions_one_at_a_time(model: nn.Module, requests: Sequence[Request]) -> list[tuple[float, bool]]:
    return [found for (found,) in _score_rows(model, _one_at_a_time(requests), fast=False)]


def _packing_agrees(model: nn.Module, questions: Sequence[Sequence[Request]], packed: Sequence[list[tuple[float, bool]]]) -> bool:
    """Whether the packed log-likelihoods equal those of the requests scored one at a time."""
    for requests, found in zip(questions, packed):
        expected = _score_questions_one_at_a_time(model, requests)
        difference = max(abs(a - b) for (a, _), (b, _) in zip(found, expected))
        if difference > _PACKING_TOLERANCE * max(1.0, max(abs(b) for b, _ in expected)):
            logger.warning(
                f"{type(model).__name__} does not follow a packed attention mask (log-likelihoods differ by {difference:.3g}): "
                "scoring every answer on its own, which computes each context once per answer."
            )
            return False
    return True
