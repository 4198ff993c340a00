# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""One decoder layer's cost ([`LayerCost`]): measured on the meta device (its FLOPs under `FlopCounterMode`, the
bytes autograd keeps under `saved_tensors_hooks`), or estimated from its parameters where it cannot run there."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.utils import logging

from .. import streaming
from ..adapters import DecoderAdapter
from ..importance.gradient import uses_gram_form
from ..weights import is_linear_map

logger = logging.get_logger(__name__)


@dataclass
class LayerCost:
    """One decoder layer, measured on the meta device for one batch of `batch_size x seq_len` tokens.

    Args:
        parameters (`int`): Its parameters.
        forward_flops (`float`): FLOPs of its forward pass, per token.
        backward_flops (`float`): FLOPs of its input-gradient backward pass (parameters frozen), per token.
        per_sample_flops (`float`): FLOPs the per-sample gradient norms add (GradMAP's score), per token.
        activation_bytes (`float`): Bytes autograd keeps for its backward pass, per token.
        per_sample_bytes (`float`): Bytes the per-sample norms' hooks keep until the backward pass, per token.
        linear_input_bytes (`float`): Bytes of the inputs of its linear maps, per token (what LoRA's adapters keep).
        measured (`bool`): Whether it was run on the meta device (else estimated from its parameters).
    """

    parameters: int
    forward_flops: float
    backward_flops: float
    per_sample_flops: float
    activation_bytes: float
    per_sample_bytes: float
    linear_input_bytes: float
    measured: bool = True


@contextmanager
def _without_packed_sequence_check() -> Iterator[None]:
    """The masks' check for packed sequences reads the position ids' values, which meta tensors have none of: it is
    replaced, for the duration, by the answer for unpacked sequences (`None`). The calibration sequences are never
    packed."""
    from transformers import masking_utils

    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return
    masking_utils.find_packed_sequence_indices = lambda *args, **kwargs: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


@torch.no_grad()
def record_layer_calls(model: PreTrainedModel, adapter: DecoderAdapter, hidden: torch.Tensor) -> streaming.LayerCalls:
    """How the decoder calls each layer on a batch shaped like `hidden`, recorded on the meta device."""
    decoder = lambda inputs_embeds: adapter.final_hidden_states(model, inputs_embeds=inputs_embeds, use_cache=False)  # noqa: E731
    with _without_packed_sequence_check():
        return streaming.LayerCalls(decoder, adapter.get_layers(model), hidden)


def measure_layer(
    layer: nn.Module, calls: streaming.LayerCalls, position: int, hidden: torch.Tensor, dtype_bytes: int
) -> LayerCost:
    """Runs one decoder layer forward and backward on the meta device, counting FLOPs and the bytes autograd keeps."""
    from torch.utils.flop_counter import FlopCounterMode

    batch, seq_len, _ = hidden.shape
    tokens = batch * seq_len
    parameter_ids = {id(parameter) for parameter in layer.parameters()}
    saved: dict[int, torch.Tensor] = {}  # the storages autograd keeps (views counted once), held for their ids

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        base = tensor._base if tensor._base is not None else tensor
        if id(tensor) not in parameter_ids and id(base) not in parameter_ids and tensor.device.type == "meta":
            saved[id(base)] = base
        return tensor

    linear_calls: list[tuple[torch.Tensor, int, int]] = []  # (input, d_in, d_out), in call order; inputs kept alive

    def note_linear(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        linear_calls.append((args[0], args[0].shape[-1], output.shape[-1]))

    handles = [module.register_forward_hook(note_linear) for module in layer.modules() if is_linear_map(module)]
    inputs = hidden.detach().requires_grad_(True)
    try:
        with FlopCounterMode(display=False) as counter:
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                output = calls.run_layer(position, inputs)
            forward_flops = counter.get_total_flops()
            torch.autograd.backward(output, torch.empty_like(output), inputs=[inputs])
            backward_flops = counter.get_total_flops() - forward_flops
    finally:
        for handle in handles:
            handle.remove()
    per_sample_flops, per_sample_bytes, linear_input_bytes = _per_sample_cost(linear_calls, seq_len, dtype_bytes)
    return LayerCost(
        parameters=sum(parameter.numel() for parameter in layer.parameters()),
        forward_flops=forward_flops / tokens,
        backward_flops=backward_flops / tokens,
        per_sample_flops=per_sample_flops / seq_len,
        activation_bytes=sum(tensor.numel() * tensor.element_size() for tensor in saved.values()) / tokens,
        per_sample_bytes=per_sample_bytes / seq_len,
        linear_input_bytes=linear_input_bytes,
    )


def _per_sample_cost(
    linear_calls: list[tuple[torch.Tensor, int, int]], seq_len: int, dtype_bytes: int
) -> tuple[float, float, float]:
    """What the per-sample gradient norms add for the linear maps called (per sequence: FLOPs and the bytes their
    hooks keep), and the bytes of the maps' inputs per token."""
    per_sample_flops = per_sample_bytes = linear_input_bytes = 0.0
    previous_input = None
    for linear_input, d_in, d_out in linear_calls:
        linear_input_bytes += d_in * dtype_bytes
        if uses_gram_form(seq_len, d_in, d_out):  # the Grams of the inputs (shared by consecutive maps) and gradients
            if linear_input is not previous_input:
                per_sample_flops += 2 * seq_len * seq_len * d_in
                per_sample_bytes += seq_len * seq_len * 4
            per_sample_flops += 2 * seq_len * seq_len * d_out + 2 * seq_len * seq_len
        else:  # the per-sample weight gradient, formed; the input is kept until the backward pass
            per_sample_flops += 2 * seq_len * d_in * d_out + 2 * d_in * d_out
            per_sample_bytes += seq_len * d_in * dtype_bytes
        previous_input = linear_input
    return per_sample_flops, per_sample_bytes, linear_input_bytes


def estimated_layer(layer: nn.Module, text_config: PretrainedConfig, seq_len: int, dtype_bytes: int) -> LayerCost:
    """A layer's cost from its parameters, where it cannot run on the meta device (mixture-of-experts routing reads
    values): 2 FLOPs per parameter used per token (experts' weights in the share each token is routed to) and the
    attention's 4 T x (heads x head_dim); the backward pass as much again; autograd's activations about twice the
    widths the matrix products write."""
    experts = getattr(text_config, "num_local_experts", None) or getattr(text_config, "num_experts", None) or 1
    routed = getattr(text_config, "num_experts_per_tok", None) or experts
    used = 0.0
    linear_input_bytes = 0.0
    for module in layer.modules():
        for parameter in module.parameters(recurse=False):
            if parameter.dim() == 3:  # stacked expert weights
                used += parameter.numel() * routed / experts
            elif parameter.dim() == 2:
                used += parameter.numel()
        if is_linear_map(module):
            linear_input_bytes += module.weight.shape[-1] * dtype_bytes
    heads = getattr(text_config, "num_attention_heads", 1)
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
    forward = 2 * used + 4 * seq_len * heads * head_dim
    return LayerCost(
        parameters=sum(parameter.numel() for parameter in layer.parameters()),
        forward_flops=forward,
        backward_flops=forward,
        per_sample_flops=3 * forward,  # the block's per-sample vector-Jacobian products (mixture-of-experts units)
        activation_bytes=2 * dtype_bytes * forward / (2 * text_config.hidden_size),
        per_sample_bytes=0.0,
        linear_input_bytes=linear_input_bytes,
        measured=False,
    )


def layer_costs(
    model: PreTrainedModel, adapter: DecoderAdapter, text_config: PretrainedConfig, batch_size: int, seq_len: int
) -> list[LayerCost]:
    """Every decoder layer's [`LayerCost`] at `batch_size x seq_len` (layers with the same parameter shapes measured
    once)."""
    layers = adapter.get_layers(model)
    dtype = next(model.parameters()).dtype
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    hidden = torch.empty(batch_size, seq_len, text_config.hidden_size, device="meta", dtype=dtype)
    try:
        calls = record_layer_calls(model, adapter, hidden)
    except Exception as error:  # noqa: BLE001 - a family whose decoder reads values: estimated from parameters
        logger.info(f"The plan estimates the layers' cost from their parameters (the decoder cannot run on meta: {error}).")
        calls = None
    costs: list[LayerCost] = []
    by_shape: dict[tuple, LayerCost] = {}
    for position, layer in enumerate(layers):
        signature = tuple((name, tuple(parameter.shape)) for name, parameter in layer.named_parameters())
        if signature not in by_shape:
            cost = None
            if calls is not None:
                try:
                    cost = measure_layer(layer, calls, position, hidden, dtype_bytes)
                except Exception as error:  # noqa: BLE001 - e.g. mixture-of-experts routing on meta tensors
                    logger.info(f"The plan estimates layer {position}'s cost from its parameters ({error}).")
            by_shape[signature] = cost or estimated_layer(layer, text_config, seq_len, dtype_bytes)
        costs.append(by_shape[signature])
    return costs
