# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Layer-streamed execution: gradient passes that hold one decoder layer's weights and activations at a time.

A model too large for the compute device is dispatched by Accelerate (`device_map` with `"cpu"` or
`"disk"` entries, or `device_map="auto"` with `max_memory`): its offloaded weights live on CPU or in
the safetensors files, and each module's hook brings them to the execution device for its forward
pass only. A forward pass then needs one layer's weights at a time; a backward pass through
autograd does not, because the graph keeps every layer's weights (and activations) alive until it
is traversed. [`streamed_backward`] therefore computes the same gradients as
[`~optimum_gradmap.importance.gradient.loss_gradient_passes`] layer by layer:

1. a forward pass without gradients, one layer at a time, keeping only each layer's input;
2. the loss gradient at the final hidden states (through the final norm, a few logits at a time);
3. a backward pass from the last layer to the first, each layer recomputed from its stored input
   with gradients on, and differentiated at once: the hooks of the scores see the same forward and
   backward computations as in memory, and the gradient at the layer's input goes to the layer before.

Peak memory: one layer's weights, the stored layer inputs (layers x batch x tokens x hidden) and one
layer's activations. Scores are identical to the in-memory passes (same computations, same order).

Which passes stream is set by [`execution_mode`] (the pruner enters it with `GradMAPConfig.execution`):
`"auto"` streams when the model has offloaded weights, `"layer_streamed"` always, `"in_memory"` never.
Forward-only passes (SLEB's removal losses, Stage 2's statistics, perplexity) need no change: under
Accelerate's hooks they already hold one layer's weights at a time.

The decoder's own forward is used for everything around the layers (embedding scale, attention masks,
position embeddings, the final norm), with stand-ins in its layer list, so no family needs code here.
[`DecoderGradient`] runs a model's gradient passes either way, split at its head ([`split_at_lm_head`]).
"""

from __future__ import annotations

import contextvars
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch import nn
from transformers.utils import logging

from .adapters import DecoderAdapter
from .passes import input_device, layer_input, layer_output, release_freed_memory
from .weights import is_offloaded_module, materialized, rows_only

logger = logging.get_logger(__name__)

_EXECUTION = contextvars.ContextVar("optimum_gradmap_execution", default="auto")


def is_offloaded(model: nn.Module) -> bool:
    """Whether some of `model`'s weights are offloaded by Accelerate (kept on CPU or disk and brought to
    the execution device for each forward pass only)."""
    return any(is_offloaded_module(module) for module in model.modules())


@contextmanager
def execution_mode(mode: str) -> Iterator[None]:
    """Sets how gradient passes run inside the block: `"auto"` (layer-streamed when the model has
    offloaded weights), `"layer_streamed"` or `"in_memory"` (`GradMAPConfig.execution`, which checks it)."""
    token = _EXECUTION.set(mode)
    try:
        yield
    finally:
        _EXECUTION.reset(token)


def streams(model: nn.Module) -> bool:
    """Whether gradient passes over `model` run layer-streamed under the current [`execution_mode`]."""
    mode = _EXECUTION.get()
    return mode == "layer_streamed" or (mode == "auto" and is_offloaded(model))


class _StopDecoder(Exception):
    """Ends the recording pass once the last layer's call is known."""


class _StandIn(nn.Module):
    """Takes a decoder layer's place in its list for one pass: records the call it receives, and
    returns what it is told to (its input when told nothing). Attribute reads fall back to the layer
    (decoders read e.g. `attention_type` from their layers)."""

    def __init__(self, layer: nn.Module, on_call: Callable[[tuple, dict], Any]):
        super().__init__()
        object.__setattr__(self, "_layer", layer)  # not a submodule: its hooks and parameters stay out of this pass
        object.__setattr__(self, "_on_call", on_call)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_layer"), name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._on_call(args, kwargs)


@contextmanager
def _stand_ins(layers: nn.ModuleList, on_call: Callable[[int, tuple, dict], Any]) -> Iterator[None]:
    originals = list(layers)
    try:
        for position, layer in enumerate(originals):
            layers[position] = _StandIn(layer, lambda args, kwargs, p=position: on_call(p, args, kwargs))
        yield
    finally:
        for position, layer in enumerate(originals):
            layers[position] = layer


class LayerCalls:
    """How the decoder calls each of its layers for one batch: the first layer's input hidden states,
    and every layer's other arguments (attention mask, position embeddings, ...), recorded by one pass
    of the decoder with stand-ins in its layer list (no layer runs).

    Args:
        decoder (`Callable`): Maps `inputs_embeds` to the decoder's final hidden states.
        layers (`nn.ModuleList`): The decoder's layer list.
        inputs_embeds (`torch.Tensor`): The batch's input embeddings.
    """

    def __init__(self, decoder: Callable[[torch.Tensor], torch.Tensor], layers: nn.ModuleList, inputs_embeds: torch.Tensor):
        self._decoder = decoder
        self._layers = layers
        self._inputs_embeds = inputs_embeds
        self.arguments: list[tuple[tuple, dict]] = [((), {})] * len(layers)
        self.hidden_states: torch.Tensor | None = None
        self.returns_tuple = False

        def record(position: int, args: tuple, kwargs: dict) -> Any:
            hidden = layer_input(args, kwargs)
            if position == 0:
                self.hidden_states = hidden
            rest = {key: value for key, value in kwargs.items() if key != "hidden_states"}
            self.arguments[position] = (args[1:] if args else (), rest)
            if position == len(layers) - 1:
                raise _StopDecoder
            return hidden

        with torch.no_grad(), _stand_ins(layers, record):
            try:
                decoder(inputs_embeds)
            except _StopDecoder:
                pass

    def run_layer(self, position: int, hidden_states: torch.Tensor) -> torch.Tensor:
        """Runs layer `position` on `hidden_states` as the decoder would, and returns its output hidden states."""
        args, kwargs = self.arguments[position]
        output = self._layers[position](hidden_states, *args, **kwargs)
        self.returns_tuple = isinstance(output, (tuple, list))
        return layer_output(output)

    def finish(self, last_hidden_states: torch.Tensor) -> torch.Tensor:
        """What the decoder returns when its last layer outputs `last_hidden_states` (its final norm
        and whatever follows the layers), differentiable in `last_hidden_states`."""
        last = len(self._layers) - 1

        def replay(position: int, args: tuple, kwargs: dict) -> Any:
            hidden = last_hidden_states if position == last else layer_input(args, kwargs)
            return (hidden,) if self.returns_tuple else hidden

        with _stand_ins(self._layers, replay):
            return self._decoder(self._inputs_embeds)


def vocab_sliced_embeddings(
    embeddings: nn.Module, input_ids: torch.LongTensor, vocab_size: int, max_rows: int = 2**14
) -> torch.Tensor:
    """`embeddings(input_ids)` with the embedding's weight read `max_rows` rows (tokens) at a time
    ([`~optimum_gradmap.weights.rows_only`]), for an embedding offloaded by Accelerate: each slice looks up
    the tokens it holds, through the module's own forward (so a scaled embedding stays exact).

    Args:
        embeddings (`nn.Module`): The input embedding (weight `(vocab_size, hidden)`).
        input_ids (`torch.LongTensor`): The tokens.
        vocab_size (`int`): Rows of its weight.
        max_rows (`int`): Rows read at once.
    """
    output = None
    padding_idx = getattr(embeddings, "padding_idx", None)  # only the gradient of that row depends on it
    try:
        if padding_idx is not None:
            embeddings.padding_idx = None
        for start in range(0, vocab_size, max_rows):
            stop = min(start + max_rows, vocab_size)
            in_slice = (input_ids >= start) & (input_ids < stop)
            if not in_slice.any():
                continue
            with rows_only(embeddings, start, stop), torch.no_grad():
                part = embeddings((input_ids - start).clamp(0, stop - start - 1))
            if output is None:
                output = torch.zeros_like(part)
            output[in_slice] = part[in_slice]
    finally:
        if padding_idx is not None:
            embeddings.padding_idx = padding_idx
    return output


def streamed_backward(
    calls: LayerCalls,
    layers: Sequence[nn.Module],
    compute_hidden_grads: Callable[[torch.Tensor], torch.Tensor],
    parameters: Sequence[nn.Parameter] = (),
) -> torch.Tensor:
    """One batch's layer-streamed forward and backward passes (steps 1 to 3 of the module docstring).

    Args:
        calls (`LayerCalls`): The batch's recorded layer calls.
        layers (`Sequence[nn.Module]`): The decoder layers, in order.
        compute_hidden_grads (`Callable`): Maps the decoder's final hidden states to the loss gradient there.
        parameters (`Sequence[nn.Parameter]`, *optional*): Parameters whose `.grad` accumulates: those of the
            layers (in memory: LoRA's adapters, or weights that are not offloaded), and those of what follows the
            layers up to the final hidden states (the final norm).

    Returns:
        `torch.Tensor`: The loss gradient at the first layer's input.
    """
    wanted = {id(parameter) for parameter in parameters}
    in_layers = {id(parameter) for layer in layers for parameter in layer.parameters()}
    after_layers = [parameter for parameter in parameters if id(parameter) not in in_layers]
    inputs = []
    hidden = calls.hidden_states.detach()
    with torch.no_grad():
        for position in range(len(layers)):
            inputs.append(hidden)
            hidden = calls.run_layer(position, hidden)
            if hidden.device.type == "cpu":
                release_freed_memory()
    with torch.enable_grad():
        last = hidden.detach().requires_grad_(True)
        final = calls.finish(last)
        torch.autograd.backward(final, compute_hidden_grads(final), inputs=[last, *after_layers])
    gradient = last.grad
    for position in reversed(range(len(layers))):
        hidden_in = inputs.pop().requires_grad_(True)
        with materialized(layers[position]):  # offloaded weights stay put until the layer's backward is done
            with torch.enable_grad():
                hidden_out = calls.run_layer(position, hidden_in)
            layer_parameters = [p for p in layers[position].parameters() if id(p) in wanted]
            torch.autograd.backward(hidden_out, gradient, inputs=[hidden_in, *layer_parameters])
        gradient = hidden_in.grad
        del hidden_in, hidden_out
        if gradient.device.type == "cpu":  # the layer's activations and weights, freed, back to the system
            release_freed_memory()
    return gradient


def split_at_lm_head(
    model: nn.Module, adapter: DecoderAdapter, input_ids: torch.LongTensor
) -> tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor], int]:
    """Splits a causal LM into the decoder (input embeddings to final hidden states) and the head (hidden states to
    logits), as the adapter describes them, and checks on a few tokens of `input_ids` that the two together give the
    model's own logits. Where they do not (a head the adapter does not know), the decoder is the whole model and the
    head is the identity: exact still, only the whole batch's logits are then formed at once.

    Returns:
        `(decoder, head, width)`: the two maps and the width of the head's output.
    """

    def decoder(inputs_embeds: torch.Tensor) -> torch.Tensor:
        return adapter.final_hidden_states(model, inputs_embeds=inputs_embeds, use_cache=False)

    def head(hidden_states: torch.Tensor) -> torch.Tensor:
        return adapter.compute_logits(model, hidden_states)

    def whole_model(inputs_embeds: torch.Tensor) -> torch.Tensor:
        return model(inputs_embeds=inputs_embeds, use_cache=False).logits

    with torch.no_grad():
        inputs_embeds = model.get_input_embeddings()(input_ids[:1, :16].to(input_device(model)))
        expected = whole_model(inputs_embeds)
        try:
            logits = head(decoder(inputs_embeds))
        except (torch.OutOfMemoryError, MemoryError):  # not a sign of a head we do not know: the whole batch would fail too
            raise
        except (RuntimeError, TypeError, AttributeError, ValueError, NotImplementedError, KeyError, IndexError) as error:
            logger.warning(f"Scoring with the whole model's logits: splitting off its head failed ({error}).")
            _EXACT_SPLITS[model] = False
            return whole_model, nn.Identity(), expected.shape[-1]
    tolerance = 1e-4 if expected.dtype == torch.float32 else 1e-2
    if logits.shape != expected.shape or (logits - expected).abs().max() > tolerance * expected.abs().max():
        logger.warning(
            f"Scoring with the whole model's logits: `{type(adapter).__name__}.compute_logits` does not reproduce "
            f"{type(model).__name__}'s logits. Override it to score with less memory."
        )
        _EXACT_SPLITS[model] = False
        return whole_model, nn.Identity(), expected.shape[-1]
    _EXACT_SPLITS[model] = True
    return decoder, head, expected.shape[-1]


# The verdict of each model's last [`split_at_lm_head`] check (weak keys: no model is kept alive by it).
_EXACT_SPLITS: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


def split_is_known_exact(model: nn.Module) -> bool:
    """Whether the last [`split_at_lm_head`] check of `model` (a gradient pass makes one) found its split exact."""
    return _EXACT_SPLITS.get(model, False)


class DecoderGradient:
    """A causal LM split at its head for gradient passes: runs a batch from its input embeddings to the final hidden
    states and back from a loss gradient given there ([`~DecoderGradient.loss_gradient`]), through autograd in memory,
    or layer-streamed under [`execution_mode`] ([`streamed_backward`]: one layer's weights at a time, an offloaded
    embedding or head read a slice of the vocabulary at a time). What Stage 1's passes
    ([`~optimum_gradmap.importance.gradient.loss_gradient_passes`]) and the heal's training steps share.

    Args:
        model (`nn.Module`): A causal LM.
        adapter (`DecoderAdapter`): Its adapter (how to split off the head, where the layers are).
        input_ids (`torch.LongTensor`): Sequences of the passes: a few of their tokens check the split
            ([`split_at_lm_head`]).

    Attributes:
        compute_logits (`Callable`): The head: maps final hidden states to logits.
        vocab_size (`int`): The width of its output.
        layer_streamed (`bool`): Whether the passes run layer-streamed ([`streams`]).
        sliced_head (`nn.Module`, *optional*): The output embedding a loss gradient reads a slice of the vocabulary
            at a time (layer-streamed passes with the head offloaded), else `None`.
    """

    def __init__(self, model: nn.Module, adapter: DecoderAdapter, input_ids: torch.LongTensor):
        self._model, self._adapter = model, adapter
        self._decoder, self.compute_logits, self.vocab_size = split_at_lm_head(model, adapter, input_ids)
        self.layer_streamed = streams(model)
        output_embeddings = model.get_output_embeddings()
        split = self.layer_streamed and not isinstance(self.compute_logits, nn.Identity)
        self.sliced_head = output_embeddings if split and is_offloaded_module(output_embeddings) else None

    def backward(
        self,
        batch: torch.LongTensor,
        loss_gradient: Callable[[torch.Tensor], torch.Tensor],
        parameters: Sequence[nn.Parameter] = (),
        first_layer: nn.Module | None = None,
    ) -> None:
        """One batch's forward and backward passes.

        Args:
            batch (`torch.LongTensor` of shape `(batch, seq_len)`): The tokens, on the model's input device.
            loss_gradient (`Callable`): Maps the final hidden states to the loss gradient there.
            parameters (`Sequence[nn.Parameter]`, *optional*): Parameters whose `.grad` accumulates.
            first_layer (`nn.Module`, *optional*): With the weights in memory and no `parameters`, the backward pass
                stops at this layer's input: the layers before it run forward only (what the gradients of this layer
                and the later ones need).
        """
        embeddings = self._model.get_input_embeddings()
        if self.sliced_head is not None and is_offloaded_module(embeddings):
            inputs_embeds = vocab_sliced_embeddings(embeddings, batch, embeddings.weight.shape[0])
        else:
            inputs_embeds = embeddings(batch).detach().requires_grad_(True)
        if self.layer_streamed:
            layers = self._adapter.get_layers(self._model)
            calls = LayerCalls(self._decoder, layers, inputs_embeds.detach())
            streamed_backward(calls, layers, loss_gradient, parameters)
            return
        if first_layer is None or parameters:
            hidden_states = self._decoder(inputs_embeds)
            torch.autograd.backward(hidden_states, loss_gradient(hidden_states), inputs=[inputs_embeds, *parameters])
            return
        started: list[torch.Tensor] = []

        def start_gradient(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            hidden = (args[0] if args else kwargs["hidden_states"]).detach().requires_grad_(True)
            started.append(hidden)
            return ((hidden, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": hidden})

        handle = first_layer.register_forward_pre_hook(start_gradient, with_kwargs=True)
        try:  # nothing before the first layer requires a gradient: those layers build no graph
            hidden_states = self._decoder(inputs_embeds.detach())
        finally:
            handle.remove()
        torch.autograd.backward(hidden_states, loss_gradient(hidden_states), inputs=started)

    def loss_gradient(self, plain: Callable, sliced: Callable, **inputs: Any) -> Callable[[torch.Tensor], torch.Tensor]:
        """A loss's gradient at the final hidden states, for [`~DecoderGradient.backward`].

        Args:
            plain (`Callable`): The gradient through the head ([`~optimum_gradmap.objectives.causal_lm_loss_gradient`]).
            sliced (`Callable`): Its form with the head read a slice of the vocabulary at a time, used where
                `sliced_head` is set ([`~optimum_gradmap.objectives.vocab_sliced_loss_gradient`]).
            inputs: What the loss compares with (`input_ids=` the labels, or `targets=` the teacher's).
        """
        if self.sliced_head is None:
            return partial(plain, compute_logits=self.compute_logits, vocab_size=self.vocab_size, **inputs)
        return partial(sliced, compute_logits=self.compute_logits, head=self.sliced_head, vocab_size=self.vocab_size, **inputs)
