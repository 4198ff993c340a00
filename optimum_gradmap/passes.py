# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Calibration passes: running a model over calibration (or evaluation) sequences, batch by batch,
and the hooks that read what its layers see.

Every pass of the library (the importance metrics, Stage 2, perplexity) goes through
[`calibration_batches`], which owns what they must all get right:

- the model runs in eval mode (no dropout), and its mode is restored on exit;
- gradient mode is set for the block (off unless asked for), and restored on exit;
- with `freeze_parameters=True` no parameter requires a gradient during the block (a backward pass
  then computes only activation gradients), and every `requires_grad` flag is restored on exit;
- each batch is moved to the device of the model's input embeddings.

```python
with calibration_batches(model, input_ids, batch_size=8, description="Perplexity") as batches:
    for batch in batches:
        logits = model(input_ids=batch, use_cache=False).logits
```
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn
from transformers.utils import logging


def input_device(model: nn.Module) -> torch.device:
    """The device a model's input ids go to: that of its input embeddings (their execution device
    where Accelerate offloaded them)."""
    embeddings = model.get_input_embeddings()
    device = embeddings.weight.device
    if device.type == "meta":
        hook = getattr(embeddings, "_hf_hook", None)
        hooks = getattr(hook, "hooks", [hook]) if hook is not None else []
        device = next(
            (torch.device(h.execution_device) for h in hooks if getattr(h, "execution_device", None) is not None), device
        )
    return device


@contextmanager
def calibration_mode(model: nn.Module, grad: bool = False, freeze_parameters: bool = False) -> Iterator[None]:
    """Eval mode, gradient mode `grad` and optionally frozen parameters for the block; the model's
    training mode, the gradient mode and every `requires_grad` flag are restored on exit."""
    was_training = model.training
    requires_grad = {name: parameter.requires_grad for name, parameter in model.named_parameters()} if freeze_parameters else {}
    model.eval()
    if freeze_parameters:
        for parameter in model.parameters():
            parameter.requires_grad_(False)
    try:
        with torch.set_grad_enabled(grad):
            yield
    finally:
        for name, parameter in model.named_parameters() if freeze_parameters else ():
            parameter.requires_grad_(requires_grad.get(name, parameter.requires_grad))
        model.train(was_training)


@contextmanager
def calibration_batches(
    model: nn.Module,
    input_ids: torch.LongTensor,
    batch_size: int,
    description: str = "Calibration pass",
    progress_bar: bool = True,
    grad: bool = False,
    freeze_parameters: bool = False,
) -> Iterator[Iterator[torch.LongTensor]]:
    """A pass over `input_ids` in batches, in [`calibration_mode`]: yields an iterator over the
    batches, each already on the model's input device, with a progress bar.

    Args:
        model (`nn.Module`): The causal LM.
        input_ids (`torch.LongTensor` of shape `(num_samples, seq_len)`): The sequences.
        batch_size (`int`): Sequences per batch.
        description (`str`): Progress bar label.
        progress_bar (`bool`, defaults to `True`): Show a progress bar.
        grad (`bool`, defaults to `False`): Enable gradients inside the block.
        freeze_parameters (`bool`, defaults to `False`): No parameter requires a gradient inside the block.
    """
    device = input_device(model)
    starts = range(0, input_ids.shape[0], batch_size)

    def batches() -> Iterator[torch.LongTensor]:
        for start in logging.tqdm(starts, desc=description, leave=False, disable=not progress_bar):
            yield input_ids[start : start + batch_size].to(device)
            if device.type == "cpu":  # what the batch freed, back to the system before the next one
                release_freed_memory()

    with calibration_mode(model, grad=grad, freeze_parameters=freeze_parameters):
        yield batches()


def release_freed_memory() -> None:
    """Hands the pages of the memory freed so far back to the system (glibc's `malloc_trim(0)`; nothing elsewhere).
    glibc keeps the heap blocks a pass frees for its next allocations, and the next pass's tensors, of other sizes,
    fit them badly: without it a process's own memory grew from pass to pass by more than its live tensors. A pass
    on the CPU calls it after each batch (milliseconds)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # another C library (musl)
        return None


class StopForward(Exception):
    """Raised by a forward hook to end a pass once everything it was run for has been read (the layers after it,
    the final norm and the head are then not run). [`run_model`] catches it."""


def run_model(model: nn.Module, batch: torch.LongTensor) -> object | None:
    """`model(input_ids=batch, use_cache=False)`, ended early without error where a hook raised [`StopForward`].

    Returns:
        The model's output, or `None` when a hook ended the pass.
    """
    try:
        return model(input_ids=batch, use_cache=False)
    except StopForward:
        return None


@contextmanager
def stop_after(module: nn.Module) -> Iterator[None]:
    """Inside the block, every forward pass ends (with [`StopForward`]) as soon as `module` has run: its own forward
    hooks, registered before this block, have seen its output."""

    def stop(module: nn.Module, args: tuple, output: object) -> None:
        raise StopForward

    with forward_hooks([(module, stop)]):
        yield


def for_each_layer_output(
    model: nn.Module,
    layers: Sequence[nn.Module],
    input_ids: torch.LongTensor,
    batch_size: int,
    consume: Callable[[int, torch.Tensor], None],
    description: str = "Calibration pass",
    progress_bar: bool = True,
) -> None:
    """Runs a [`calibration_batches`] pass and calls `consume(position, hidden_states)` with the output of
    each of `layers` (its position in `layers`, and the hidden states it returned) for every batch. Each forward
    pass ends once every one of `layers` has run: the layers after them and the head are not computed."""
    seen: set[int] = set()

    def read(position: int, output: object) -> None:
        consume(position, layer_output(output))
        seen.add(position)
        if len(seen) == len(layers):
            raise StopForward

    hooks = [(layer, lambda module, args, output, p=p: read(p, output)) for p, layer in enumerate(layers)]
    with calibration_batches(model, input_ids, batch_size, description, progress_bar) as batches, forward_hooks(hooks):
        for batch in batches:
            seen.clear()
            run_model(model, batch)


def layer_input(args: tuple, kwargs: dict) -> torch.Tensor:
    """The hidden states a decoder layer receives (first positional argument or `hidden_states=`)."""
    return args[0] if args else kwargs["hidden_states"]


def layer_output(output: object) -> torch.Tensor:
    """The hidden states a decoder layer returns (alone, or first of a tuple)."""
    return output[0] if isinstance(output, (tuple, list)) else output


@contextmanager
def forward_hooks(hooks: Sequence[tuple[nn.Module, Callable]]) -> Iterator[None]:
    """Registers `(module, hook)` forward hooks, called as `hook(module, args, output)`, for the block."""
    handles = [module.register_forward_hook(hook) for module, hook in hooks]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def forward_pre_hooks(hooks: Sequence[tuple[nn.Module, Callable]]) -> Iterator[None]:
    """Registers `(module, hook)` forward pre-hooks, called as `hook(module, args, kwargs)`, for the block."""
    handles = [module.register_forward_pre_hook(hook, with_kwargs=True) for module, hook in hooks]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


class RecordedLayerInputs:
    """Keeps what some decoder layers receive during the passes over a calibration set run inside the block, so
    that a later computation on the same model and sequences can start from them instead of running the layers
    before them again (the verified shortlist does, [`~optimum_gradmap.importance.selection.verify_shortlist`]).

    Every call of the input embeddings opens a batch, identified by its token ids; the layers' inputs that follow
    belong to it. A batch is kept when its ids are the next rows of `input_ids` and each layer ran once on it, so
    other passes in the block (a check on a few tokens, say) are ignored. [`~RecordedLayerInputs.inputs`] gives
    the inputs only if the kept batches cover every row of `input_ids` in order.

    Memory: one `(num_samples, seq_len, hidden)` tensor per layer, in the dtype and on the device of its input.

    Args:
        model (`nn.Module`): The causal LM.
        layers (`dict[int, nn.Module]`): The layers whose inputs to keep, by any key.
        input_ids (`torch.LongTensor` of shape `(num_samples, seq_len)`): The calibration sequences of the passes.
    """

    def __init__(self, model: nn.Module, layers: dict[int, nn.Module], input_ids: torch.LongTensor):
        self.model = model
        self.layers = dict(layers)
        self.input_ids = input_ids
        self.returns_tuple: bool | None = None
        self._kept: dict[int, list[torch.Tensor]] = {key: [] for key in self.layers}
        self._batch: dict[int, list[torch.Tensor]] = {}
        self._batch_ids: torch.LongTensor | None = None
        self._rows = 0
        self._handles: list = []

    def __enter__(self) -> "RecordedLayerInputs":
        embeddings = self.model.get_input_embeddings()
        self._handles.append(embeddings.register_forward_pre_hook(self._open_batch, with_kwargs=True))
        for key, layer in self.layers.items():
            self._handles.append(
                layer.register_forward_pre_hook(
                    lambda module, args, kwargs, key=key: self._keep(key, args, kwargs), with_kwargs=True
                )
            )
        first = next(iter(self.layers.values()), None)
        if first is not None:
            self._handles.append(first.register_forward_hook(self._note_output))
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._close_batch()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _open_batch(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._close_batch()
        ids = args[0] if args else kwargs.get("input")
        self._batch_ids = ids if isinstance(ids, torch.Tensor) else None
        self._batch = {key: [] for key in self.layers}

    def _keep(self, key: int, args: tuple, kwargs: dict) -> None:
        if self._batch_ids is not None:
            self._batch[key].append(layer_input(args, kwargs).detach())

    def _note_output(self, module: nn.Module, args: tuple, output: object) -> None:
        self.returns_tuple = isinstance(output, (tuple, list))

    def _close_batch(self) -> None:
        ids, self._batch_ids = self._batch_ids, None
        if ids is None or ids.dim() != 2:
            return
        expected = self.input_ids[self._rows : self._rows + ids.shape[0]]
        if expected.shape != ids.shape or not torch.equal(expected, ids.to(expected.device)):
            return
        if any(len(inputs) != 1 for inputs in self._batch.values()):
            return
        for key, inputs in self._batch.items():
            self._kept[key].append(inputs[0])
        self._rows += ids.shape[0]

    def inputs(self) -> dict[int, torch.Tensor] | None:
        """Each layer's inputs over every calibration sequence, `(num_samples, seq_len, hidden)`, by its key; `None`
        where the passes did not cover the calibration set in order, batch by batch. Call it once, after the block."""
        if self._rows != self.input_ids.shape[0] or self.returns_tuple is None:
            return None
        return {key: torch.cat(self._kept.pop(key)) for key in list(self._kept)}  # one layer's batches freed at a time
