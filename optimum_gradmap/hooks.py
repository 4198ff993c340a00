# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Forward hooks and batched forward passes, shared by the importance metrics and Stage 2."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn
from transformers.utils import logging


def layer_input(args: tuple, kwargs: dict) -> torch.Tensor:
    """The hidden states a decoder layer receives (first positional argument or `hidden_states=`)."""
    return args[0] if args else kwargs["hidden_states"]


def layer_output(output: object) -> torch.Tensor:
    """The hidden states a decoder layer returns (alone, or first of a tuple)."""
    return output[0] if isinstance(output, (tuple, list)) else output


@contextmanager
def forward_hooks(hooks: Sequence[tuple[nn.Module, Callable]]) -> Iterator[None]:
    """Registers `(module, hook)` forward hooks for the duration of the block."""
    handles = [module.register_forward_hook(hook) for module, hook in hooks]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def run_batches(
    model: nn.Module, input_ids: torch.LongTensor, batch_size: int, description: str, progress_bar: bool
) -> Iterator[torch.LongTensor]:
    """Runs `model` (no cache) on `input_ids` batch by batch, yielding each batch after its forward pass."""
    device = model.get_input_embeddings().weight.device
    starts = range(0, input_ids.shape[0], batch_size)
    for start in logging.tqdm(starts, desc=description, leave=False, disable=not progress_bar):
        batch = input_ids[start : start + batch_size]
        model(input_ids=batch.to(device), use_cache=False)
        yield batch


@contextmanager
def forward_pre_hooks(hooks: Sequence[tuple[nn.Module, Callable]]) -> Iterator[None]:
    """Registers `(module, hook)` forward pre-hooks, called as `hook(module, args, kwargs)`, for the block."""
    handles = [module.register_forward_pre_hook(hook, with_kwargs=True) for module, hook in hooks]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
