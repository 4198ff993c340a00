# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""The cost of a run, told before the run: [`PruningPlan`], what [`GradMAPPruner.plan`] and `optimum-gradmap prune
--dry-run` (`heal --dry-run`) print.

Like Accelerate's `accelerate estimate-memory`, the plan builds the model from its config alone on the meta device
(no weight is read, none is allocated) and counts the parameters of every module. It then goes past the memory of the
weights: it counts the passes each stage makes for the configured method, and from them the tokens, the FLOPs, the
peak memory (in memory and layer-streamed), the disk the output takes and the seconds each stage is expected to take.

**What is counted.** Every pass of the library runs decoder layers over tokens, and most form logits. The plan counts,
per stage, the *layer-tokens* each pass runs (a layer run over one token; a pass of the whole model over N x T
tokens is L x N x T of them), split into those run without gradients and those run with gradients and then
differentiated, and the *head tokens* whose logits are formed (with or without gradients). The counts follow the code
path by path (the instrumented runs of tests/test_planning.py check them against forward hooks on every layer and the
head). Where a count depends on what the run finds (which layers a shortlist holds, which runs of layers Stage 1
removes, how many strengths the golden-section search scores), the plan gives its range.

**FLOPs.** Each decoder layer is run once on the meta device under `torch.utils.flop_counter.FlopCounterMode`, for one
calibration batch: its forward FLOPs (its matrix products, 2 x parameters per token, and attention's T^2 terms) and
those of its input-gradient backward (the parameters are frozen in every gradient pass but the heal's). Stage 1's
per-sample gradient norms (GradMAP's score) add, for each linear map, the Gram matrices of its inputs and output
gradients (2 T^2 (d_in + d_out) per sample) or the per-sample weight gradient (2 T d_in d_out), whichever the code
uses. The head's logits cost 2 x vocabulary x hidden per token, as many again for their gradient. Stage 2's
statistics are float64 products on the device (4 d^2 per token), its solves float64 eigendecompositions and products
on the host CPU.

**Time.** [`DeviceThroughput`] says how fast the device runs each kind of work, in FLOP/s: measured in a few seconds
by building one decoder layer of the model's family from its config (random weights, the compute dtype) on the device
and timing its forward, its gradient pass with and without the per-sample norms, and the head's logits on one
calibration batch ([`DeviceThroughput.measure`]); or stated for a device one does not have
([`DeviceThroughput.assumed`]: its peak FLOP/s times an assumed efficiency, labelled as such). Each stage's seconds
are its FLOPs of each kind divided by that kind's rate.

**Memory.** The weights (the dense model's for the whole run: the layers Stage 1 removes stay referenced for Stage 2,
the same tensors, not copies), plus what each stage holds at its peak: the activations autograd keeps for one batch
(measured on the meta device with `saved_tensors_hooks`, so an attention kernel that keeps less than the T^2
scores of the math path, as flash attention does, makes this an over-estimate), the per-sample norms' Gram
matrices, the logits formed at once, Stage 2's recorded hidden states and float64 statistics, the heal's teacher
targets, adapters and optimizer state. Layer-streamed, the device holds one layer's weights at a time and the layer
inputs of a batch (layers x batch x tokens x hidden).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import random
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any
from unittest import mock

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.utils import logging

from . import streaming, surgery
from .adapters import DecoderAdapter, get_adapter
from .compensation.next_token import GOLDEN_SECTION, chooses_by_next_token_loss, resolve_selection, searched_losses
from .compensation.refinement import CHECK_EVERY as REFINEMENT_CHECK_EVERY
from .compensation.solvers import AUTO_NUM_FOLDS, AUTO_RIDGE_GRID
from .compensation.targets import compensation_targets
from .compensation.through_norm import NORM_RIDGE_GRID
from .configuration import GradMAPConfig
from .distillation import TOP_K, uses_head_inputs, uses_layer_states
from .errors import InvalidInputError
from .generation import is_generated
from .heal import AUTO_TIME_SHARE
from .importance.gradient import PerSampleGradientNorms, _uses_gram_form, causal_lm_loss_gradient
from .importance.metrics import get_importance_metric
from .importance.selection import halving_rungs
from .passes import MAX_LOGIT_ELEMENTS, summed_next_token_loss
from .weights import is_linear_map

logger = logging.get_logger(__name__)

# The tokens of the check `split_at_lm_head` makes before every gradient scoring pass: one sequence of at most 16.
_SPLIT_CHECK_TOKENS = 16
# Files a checkpoint holds besides the weights and the tokenizer: config, generation config, gradmap_config.json,
# pruning_report.json, its pictures and the model card (measured on a saved SmolLM2-135M checkpoint: about 0.2 MB).
_REPORT_BYTES = 300_000
# The host's float64 speed and the bandwidth of offloaded weights, where nothing was measured (labelled as assumed).
_ASSUMED_HOST_FLOAT64_FLOPS = 50e9
_ASSUMED_OFFLOAD_BYTES_PER_SECOND = {"cpu": 12e9, "disk": 1.5e9}
# On a CPU device, the resident memory a pass's tensors take, per byte of them alive at once: glibc's malloc raises its
# mmap threshold after the first large frees (up to 32 MiB), so a pass's later tensors come from the heap, which keeps
# freed blocks and fragments. Measured on SmolLM2-135M's Stage 1 pass (float32, 8 x 128): the resident memory rose by
# 1.448 GiB and stayed; with a fixed threshold (MALLOC_MMAP_THRESHOLD_=131072) by 0.978 GiB, the live tensors, and the
# plan's 1.10 GiB of activations hold them. 1.448 / 0.978 = 1.48 (docs/benchmarks/scale.md, issue 64).
HOST_ALLOCATOR_OVERHEAD = 1.48


def _allocator_overhead(device: torch.device) -> float:
    """How many bytes of resident memory a byte of a pass's tensors takes on `device` (see `HOST_ALLOCATOR_OVERHEAD`)."""
    return HOST_ALLOCATOR_OVERHEAD if device.type == "cpu" else 1.0


# Layouts of removed layers tried where Stage 1's choice is not known yet (Stage 2's counts depend on it).
_SAMPLED_LAYOUTS = 64
# The float64 work of a symmetric eigendecomposition with its vectors, in units of d^3 (LAPACK's syevd, about 9 d^3).
_EIGH_FLOPS_PER_CUBE = 9.0


# ----------------------------------------------------------------------------------------------- counts and ranges
@dataclass(frozen=True)
class Count:
    """A quantity known exactly (`low == high`) or only within a range, because it depends on what the run finds.

    Args:
        low (`float`): The smallest value the run can give.
        high (`float`): The largest.
        likely (`float`, *optional*): The value the run gives when it finds nothing unusual (the count of a
            golden-section search whose losses have one minimum, the median over the layouts Stage 1 may leave), where
            that is known better than the range's middle; `None`: the middle.
    """

    low: float = 0.0
    high: float = 0.0
    likely: float | None = None

    @classmethod
    def of(cls, value: float) -> Count:
        """An exact count."""
        return cls(value, value)

    @property
    def exact(self) -> bool:
        return self.low == self.high

    @property
    def middle(self) -> float:
        return (self.low + self.high) / 2

    @property
    def typical(self) -> float:
        """The value to expect: `likely` where it is known, else the range's middle."""
        return self.middle if self.likely is None else self.likely

    def __add__(self, other: Count | float) -> Count:
        other = other if isinstance(other, Count) else Count.of(other)
        likely = None if self.likely is None and other.likely is None else self.typical + other.typical
        return Count(self.low + other.low, self.high + other.high, likely)

    __radd__ = __add__

    def __mul__(self, factor: float) -> Count:
        return Count(self.low * factor, self.high * factor, None if self.likely is None else self.likely * factor)

    __rmul__ = __mul__

    def __truediv__(self, divisor: float) -> Count:
        return self * (1 / divisor)

    def to_dict(self) -> dict[str, float] | float:
        if self.exact:
            return self.low
        return {"low": self.low, "high": self.high} | ({} if self.likely is None else {"likely": self.likely})


ZERO = Count()


@dataclass
class Work:
    """What a stage computes, in the units [`DeviceThroughput`] turns into seconds.

    Args:
        layer_forward (`Count`): Layer-tokens run forward without gradients (one decoder layer over one token).
        layer_gradient (`Count`): Layer-tokens run forward with gradients and then differentiated.
        head_forward (`Count`): Tokens whose logits are formed without gradients.
        head_gradient (`Count`): Tokens whose logits are formed with gradients and differentiated.
        device_float64_flops (`Count`): float64 products on the device (Stage 2's statistics and Adam fits on rows).
        host_float64_flops (`Count`): float64 products on the host (Stage 2's solves).
        host_eigh (`Count`): d x d float64 eigendecompositions on the host.
        per_sample_norms (`bool`): The gradient passes compute per-sample gradient norms (GradMAP's score).
        weight_gradients (`bool`): The gradient passes form the parameters' gradients (Taylor+, a full heal).
    """

    layer_forward: Count = ZERO
    layer_gradient: Count = ZERO
    head_forward: Count = ZERO
    head_gradient: Count = ZERO
    device_float64_flops: Count = ZERO
    host_float64_flops: Count = ZERO
    host_eigh: Count = ZERO
    per_sample_norms: bool = False
    weight_gradients: bool = False

    def __add__(self, other: Work) -> Work:
        sums = {item.name: getattr(self, item.name) + getattr(other, item.name) for item in fields(self) if _is_count(item)}
        return Work(
            **sums,
            per_sample_norms=self.per_sample_norms or other.per_sample_norms,
            weight_gradients=self.weight_gradients or other.weight_gradients,
        )

    def to_dict(self) -> dict[str, Any]:
        return {item.name: _plain(getattr(self, item.name)) for item in fields(self)}


def _is_count(item: Any) -> bool:
    return item.type in ("Count", Count)


def _plain(value: Any) -> Any:
    if isinstance(value, Count):
        return value.to_dict()
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return value


# ------------------------------------------------------------------------------------------------- the model's shape
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


@dataclass
class ModelShape:
    """What the plan needs to know of a model, read from its config alone (see [`describe_model`]).

    Args:
        name (`str`): Where the config came from.
        model_type (`str`): The family.
        num_layers (`int`): Decoder layers.
        hidden_size (`int`), vocab_size (`int`): The residual stream's width and the vocabulary.
        intermediate_size (`int`): The widest input of a linear map in a layer (the down projection's).
        num_parameters (`int`): All parameters (tied ones once).
        layer_parameters (`list[int]`): Each decoder layer's.
        head_parameters (`int`): The output embedding's (0 when tied to the input embedding).
        dtype (`torch.dtype`): The dtype the model computes in.
        layers (`list[LayerCost]`): Each decoder layer's cost at the calibration batch's shape.
        heal_layers (`list[LayerCost]`, *optional*): The same at the heal batch's shape.
        lora_parameters_per_rank (`int`): LoRA's parameters per unit of rank over one layer's linear maps (in + out).
    """

    name: str
    model_type: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    intermediate_size: int
    num_parameters: int
    layer_parameters: list[int]
    head_parameters: int
    dtype: torch.dtype
    layers: list[LayerCost] = field(default_factory=list)
    heal_layers: list[LayerCost] = field(default_factory=list)
    lora_parameters_per_rank: int = 0

    @property
    def dtype_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def weight_bytes(self) -> int:
        return self.num_parameters * self.dtype_bytes

    def mean(self, attribute: str, heal: bool = False) -> float:
        layers = self.heal_layers if heal and self.heal_layers else self.layers
        return sum(getattr(layer, attribute) for layer in layers) / len(layers)

    def total(self, attribute: str, heal: bool = False) -> float:
        layers = self.heal_layers if heal and self.heal_layers else self.layers
        return sum(getattr(layer, attribute) for layer in layers)


def load_model_config(model_or_path: PreTrainedModel | PretrainedConfig | str | os.PathLike, **kwargs: Any) -> PretrainedConfig:
    """The config of `model_or_path`: a `PretrainedConfig` as it is, a model's `config` (a copy), or
    `AutoConfig.from_pretrained` of a local folder or a Hub id (`kwargs` go to it: `revision`, `token`, ...). No weight
    is read.

    Args:
        model_or_path (`PreTrainedModel`, `PretrainedConfig`, `str` or `os.PathLike`): The model.
        kwargs: Passed to `AutoConfig.from_pretrained`.

    Returns:
        `PretrainedConfig`.
    """
    if isinstance(model_or_path, PretrainedConfig):
        return copy.deepcopy(model_or_path)
    if isinstance(model_or_path, nn.Module):
        config = getattr(model_or_path, "config", None)
        if not isinstance(config, PretrainedConfig):
            raise InvalidInputError(f"{type(model_or_path).__name__} has no transformers config to plan from.")
        return copy.deepcopy(config)
    return AutoConfig.from_pretrained(model_or_path, **kwargs)


def empty_model(config: PretrainedConfig, dtype: torch.dtype) -> PreTrainedModel:
    """The causal LM of `config` on the meta device: every module and its parameters' shapes, no storage."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def _layer_dependent_config(config: PretrainedConfig, adapter: DecoderAdapter, kept: Sequence[int]) -> PretrainedConfig:
    """A copy of `config` describing only the layers `kept` (surgery's rewrite of every layer-dependent field)."""
    config = copy.deepcopy(config)
    text = config.get_text_config(decoder=True)
    num_layers = getattr(text, adapter.layer_count_field)
    values = {name: copy.deepcopy(getattr(text, name)) for name in surgery.layer_dependent_fields(adapter, text, num_layers)}
    surgery.rewrite_fields(adapter, text, values, num_layers, kept)
    return config


@torch.no_grad()
def _record_layer_calls(model: PreTrainedModel, adapter: DecoderAdapter, hidden: torch.Tensor) -> streaming.LayerCalls:
    """How the decoder calls each layer on a batch shaped like `hidden`, recorded on the meta device. The masks'
    check for packed sequences reads values, which meta tensors have none of: it is skipped (the calibration
    sequences are never packed)."""
    from transformers import masking_utils

    decoder = lambda inputs_embeds: adapter.final_hidden_states(model, inputs_embeds=inputs_embeds, use_cache=False)  # noqa: E731
    if hasattr(masking_utils, "find_packed_sequence_indices"):
        with mock.patch.object(masking_utils, "find_packed_sequence_indices", lambda *args, **kwargs: None):
            return streaming.LayerCalls(decoder, adapter.get_layers(model), hidden)
    return streaming.LayerCalls(decoder, adapter.get_layers(model), hidden)


def _measure_layer(
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
    per_sample_flops = per_sample_bytes = linear_input_bytes = 0.0
    previous_input = None
    for linear_input, d_in, d_out in linear_calls:
        linear_input_bytes += d_in * dtype_bytes
        if _uses_gram_form(seq_len, d_in, d_out):  # the Grams of the inputs (shared by consecutive maps) and gradients
            if linear_input is not previous_input:
                per_sample_flops += 2 * seq_len * seq_len * d_in
                per_sample_bytes += seq_len * seq_len * 4
            per_sample_flops += 2 * seq_len * seq_len * d_out + 2 * seq_len * seq_len
        else:  # the per-sample weight gradient, formed; the input is kept until the backward pass
            per_sample_flops += 2 * seq_len * d_in * d_out + 2 * d_in * d_out
            per_sample_bytes += seq_len * d_in * dtype_bytes
        previous_input = linear_input
    return LayerCost(
        parameters=sum(parameter.numel() for parameter in layer.parameters()),
        forward_flops=forward_flops / tokens,
        backward_flops=backward_flops / tokens,
        per_sample_flops=per_sample_flops / seq_len,
        activation_bytes=sum(tensor.numel() * tensor.element_size() for tensor in saved.values()) / tokens,
        per_sample_bytes=per_sample_bytes / seq_len,
        linear_input_bytes=linear_input_bytes,
    )


def _estimated_layer(layer: nn.Module, text_config: PretrainedConfig, seq_len: int, dtype_bytes: int) -> LayerCost:
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


def _layer_costs(
    model: PreTrainedModel, adapter: DecoderAdapter, text_config: PretrainedConfig, batch_size: int, seq_len: int
) -> list[LayerCost]:
    """Every decoder layer's [`LayerCost`] at `batch_size x seq_len` (layers with the same parameter shapes measured
    once)."""
    layers = adapter.get_layers(model)
    dtype = next(model.parameters()).dtype
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    hidden = torch.empty(batch_size, seq_len, text_config.hidden_size, device="meta", dtype=dtype)
    try:
        calls = _record_layer_calls(model, adapter, hidden)
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
                    cost = _measure_layer(layer, calls, position, hidden, dtype_bytes)
                except Exception as error:  # noqa: BLE001 - e.g. mixture-of-experts routing on meta tensors
                    logger.info(f"The plan estimates layer {position}'s cost from its parameters ({error}).")
            by_shape[signature] = cost or _estimated_layer(layer, text_config, seq_len, dtype_bytes)
        costs.append(by_shape[signature])
    return costs


def describe_model(
    config: PretrainedConfig,
    dtype: torch.dtype,
    batch_size: int,
    seq_len: int,
    heal_batch_size: int | None = None,
    heal_seq_len: int | None = None,
    name: str = "",
) -> ModelShape:
    """Builds the model of `config` on the meta device and measures what the plan needs ([`ModelShape`]).

    Args:
        config (`PretrainedConfig`): The model's config.
        dtype (`torch.dtype`): The dtype it computes in.
        batch_size (`int`), seq_len (`int`): The calibration batch's shape.
        heal_batch_size (`int`, *optional*), heal_seq_len (`int`, *optional*): The heal batch's, when it is planned.
        name (`str`, defaults to `""`): Where the config came from.

    Returns:
        [`ModelShape`].
    """
    adapter = get_adapter(config)
    model = empty_model(config, dtype)
    model.eval()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    text = config.get_text_config(decoder=True)
    layers = adapter.get_layers(model)
    output, input_embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    tied = output is not None and output.weight is input_embeddings.weight
    head_parameters = 0 if output is None or tied else sum(parameter.numel() for parameter in output.parameters())
    input_widths = [
        module.weight.shape[-1] if isinstance(module, nn.Linear) else module.weight.shape[0]  # Conv1D: (in, out)
        for layer in layers
        for module in layer.modules()
        if is_linear_map(module)
    ]
    lora_per_rank = sum(sum(module.weight.shape) for module in layers[0].modules() if is_linear_map(module))
    shape = ModelShape(
        name=name or getattr(config, "_name_or_path", "") or text.model_type,
        model_type=text.model_type,
        num_layers=len(layers),
        hidden_size=text.hidden_size,
        vocab_size=input_embeddings.weight.shape[0],
        intermediate_size=max(input_widths, default=text.hidden_size),
        num_parameters=model.num_parameters(),
        layer_parameters=[sum(parameter.numel() for parameter in layer.parameters()) for layer in layers],
        head_parameters=head_parameters,
        dtype=dtype,
        lora_parameters_per_rank=lora_per_rank,
    )
    shape.layers = _layer_costs(model, adapter, text, batch_size, seq_len)
    if heal_batch_size is not None and (heal_batch_size, heal_seq_len) != (batch_size, seq_len):
        shape.heal_layers = _layer_costs(model, adapter, text, heal_batch_size, heal_seq_len)
    return shape


# ------------------------------------------------------------------------------------------------- device throughput
@dataclass
class DeviceThroughput:
    """How fast a device runs each kind of work the plan counts, in FLOP/s (the FLOPs the plan counts for that work,
    divided by the seconds it takes).

    Args:
        device (`str`): The device, in words.
        dtype (`str`): The dtype the rates hold for.
        forward_flops_per_second (`float`): Decoder layers run forward without gradients.
        gradient_flops_per_second (`float`): Decoder layers run forward with gradients and then differentiated (input
            gradients; the FLOPs of both passes).
        per_sample_flops_per_second (`float`): The same with GradMAP's per-sample gradient norms (their Gram matrices
            or per-sample weight gradients counted in).
        head_flops_per_second (`float`): Logits and their cross-entropy, without gradients.
        head_gradient_flops_per_second (`float`): Logits, their cross-entropy and its gradient.
        float64_flops_per_second (`float`): float64 matrix products on the device (Stage 2's statistics).
        host_float64_flops_per_second (`float`): float64 matrix products on the host CPU (Stage 2's solves).
        host_eigh_flops_per_second (`float`): float64 eigendecompositions on the host, counted as 9 d^3 FLOPs each.
        source (`str`): How the figures were obtained (measured, or stated and assumed).
        measured (`bool`): Whether they were measured on this machine.
        measurement_seconds (`float`): How long the measurement took.
    """

    device: str
    dtype: str
    forward_flops_per_second: float
    gradient_flops_per_second: float
    per_sample_flops_per_second: float
    head_flops_per_second: float
    head_gradient_flops_per_second: float
    float64_flops_per_second: float
    host_float64_flops_per_second: float
    host_eigh_flops_per_second: float
    source: str
    measured: bool = False
    measurement_seconds: float = 0.0

    @classmethod
    def assumed(
        cls,
        peak_flops_per_second: float,
        efficiency: float,
        device: str,
        dtype: str = "bfloat16",
        float64_flops_per_second: float | None = None,
        host_float64_flops_per_second: float = _ASSUMED_HOST_FLOAT64_FLOPS,
    ) -> DeviceThroughput:
        """Rates for a device one does not have: its peak FLOP/s in `dtype` times an assumed `efficiency` for every
        kind of work on the device, labelled as such in the plan.

        ```python
        h100 = DeviceThroughput.assumed(989e12, 0.4, "NVIDIA H100 SXM (989 TFLOP/s bf16 dense)", float64_flops_per_second=67e12)
        ```

        Args:
            peak_flops_per_second (`float`): The device's peak in `dtype` (dense, no sparsity).
            efficiency (`float`): The share of it the passes are assumed to reach (0.4: 40% of the peak).
            device (`str`): The device, in words (with its peak, for the reader).
            dtype (`str`, defaults to `"bfloat16"`): The dtype of the peak.
            float64_flops_per_second (`float`, *optional*): The device's float64 peak; defaults to a sixteenth of
                `peak_flops_per_second` (times `efficiency` like the others).
            host_float64_flops_per_second (`float`, defaults to 5e10): The host CPU's float64 rate (Stage 2's solves).

        Returns:
            [`DeviceThroughput`].
        """
        if not 0 < efficiency <= 1:
            raise InvalidInputError(f"`efficiency` is a share of the peak, in (0, 1]; got {efficiency!r}.")
        rate = peak_flops_per_second * efficiency
        float64 = (float64_flops_per_second or peak_flops_per_second / 16) * efficiency
        return cls(
            device=device,
            dtype=dtype,
            forward_flops_per_second=rate,
            gradient_flops_per_second=rate,
            per_sample_flops_per_second=rate,
            head_flops_per_second=rate,
            head_gradient_flops_per_second=rate,
            float64_flops_per_second=float64,
            host_float64_flops_per_second=host_float64_flops_per_second,
            host_eigh_flops_per_second=host_float64_flops_per_second / 3,
            source=(
                f"assumed, not measured: {device}, {peak_flops_per_second / 1e12:g} TFLOP/s peak in {dtype} at "
                f"{efficiency:.0%} efficiency; host CPU {host_float64_flops_per_second / 1e9:g} GFLOP/s in float64"
            ),
        )

    @classmethod
    def measure(
        cls,
        model_or_path: PreTrainedModel | PretrainedConfig | str | os.PathLike,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        batch_size: int = 8,
        seq_len: int = 128,
        min_seconds: float = 0.25,
    ) -> DeviceThroughput:
        """Measures the rates on `device`: one decoder layer of the model's family, built from its config with random
        weights in `dtype` (the vocabulary cut to a slice: no layer depends on it), run on one batch of
        `batch_size x seq_len` random hidden states (forward; forward and input-gradient backward; the same with the
        per-sample norm hooks of GradMAP's score), a slice of the head's logits with their cross-entropy (scaled to
        the whole vocabulary), and float64 products on the device and the host. A few seconds for a 7B-sized
        layer on a GPU; each timing is the median of repeats lasting at least `min_seconds` together (3 at most).

        Args:
            model_or_path (`PreTrainedModel`, `PretrainedConfig`, `str` or `os.PathLike`): The model (its config is
                read).
            dtype (`torch.dtype`, defaults to `torch.float32`): The dtype the model computes in.
            device (`str` or `torch.device`, defaults to `"cpu"`): Where it computes.
            batch_size (`int`, defaults to 8), seq_len (`int`, defaults to 128): The calibration batch's shape.
            min_seconds (`float`, defaults to 0.25): How long each timing repeats at least.

        Returns:
            [`DeviceThroughput`].
        """
        started = time.perf_counter()
        config = load_model_config(model_or_path)
        device = torch.device(device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise InvalidInputError(
                f"Cannot measure the throughput of {device}: no CUDA device here. For a device you do not have, state "
                "its throughput: `throughput=DeviceThroughput.assumed(peak_flops_per_second, efficiency, device)`."
            )
        adapter = get_adapter(config)
        text = config.get_text_config(decoder=True)
        num_layers = getattr(text, adapter.layer_count_field)
        shape = describe_model(config, dtype, batch_size, seq_len)
        representative = max(range(num_layers), key=lambda index: (shape.layer_parameters[index], -index))
        one_layer = _layer_dependent_config(config, adapter, [representative])
        one_text = one_layer.get_text_config(decoder=True)
        vocab_size = shape.vocab_size
        one_text.vocab_size = min(vocab_size, 512)
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):  # ids beyond the cut vocabulary
            value = getattr(one_text, name, None)
            if isinstance(value, int) and value >= one_text.vocab_size:
                setattr(one_text, name, None)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(one_layer, dtype=dtype)
        model.eval()
        for parameter in model.parameters():
            parameter.requires_grad_(False)
        layers = adapter.get_layers(model)
        cost = shape.layers[representative]
        generator = torch.Generator(device=device).manual_seed(0)
        hidden = torch.randn(batch_size, seq_len, shape.hidden_size, generator=generator, device=device, dtype=dtype)
        decoder = lambda inputs_embeds: adapter.final_hidden_states(model, inputs_embeds=inputs_embeds, use_cache=False)  # noqa: E731
        with torch.no_grad():
            calls = streaming.LayerCalls(decoder, layers, hidden)
        gradient = torch.randn_like(hidden)
        tokens = batch_size * seq_len

        def forward() -> None:
            with torch.no_grad():
                calls.run_layer(0, hidden)

        def gradient_pass() -> None:
            with torch.enable_grad():
                inputs = hidden.detach().requires_grad_(True)
                torch.autograd.backward(calls.run_layer(0, inputs), gradient, inputs=[inputs])

        def per_sample_pass() -> None:
            with PerSampleGradientNorms([layers[0]], adapter.get_per_sample_units(layers[0])) as norms:
                norms.start_batch(batch_size, seq_len)
                gradient_pass()

        width = min(vocab_size, 8192)
        head = nn.Linear(shape.hidden_size, width, bias=False, device=device, dtype=dtype)
        labels = torch.randint(0, width, (batch_size, seq_len), generator=generator, device=device)
        head_hidden = hidden.detach()

        def head_forward() -> None:
            with torch.no_grad():
                summed_next_token_loss(head(head_hidden), labels)

        def head_gradient() -> None:
            causal_lm_loss_gradient(head_hidden, labels, head, vocab_size)  # chunked as Stage 1 chunks the whole head

        side = min(shape.hidden_size, 1024)
        rows = torch.randn(tokens, side, generator=generator, device=device, dtype=torch.float64)
        host = torch.randn(256, 256, dtype=torch.float64)
        symmetric = host @ host.T

        layer_forward = cost.forward_flops * tokens
        layer_backward = cost.backward_flops * tokens
        head_flops = 2 * shape.hidden_size * width * tokens
        seconds = {
            "forward": _timed(forward, device, min_seconds),
            "gradient": _timed(gradient_pass, device, min_seconds),
            "per_sample": _timed(per_sample_pass, device, min_seconds),
            "head": _timed(head_forward, device, min_seconds),
            "head_gradient": _timed(head_gradient, device, min_seconds),
            "float64": _timed(lambda: rows.T @ rows, device, min_seconds / 2),
            "host": _timed(lambda: host @ host, torch.device("cpu"), min_seconds / 2),
            "eigh": _timed(lambda: torch.linalg.eigh(symmetric), torch.device("cpu"), min_seconds / 2),
        }
        head_tokens = batch_size * (seq_len - 1)  # the loss gradient forms the logits of the predicting positions
        elapsed = time.perf_counter() - started
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        dtype_name = str(dtype).replace("torch.", "")
        return cls(
            device=f"{name} ({device})",
            dtype=dtype_name,
            forward_flops_per_second=layer_forward / seconds["forward"],
            gradient_flops_per_second=(layer_forward + layer_backward) / seconds["gradient"],
            per_sample_flops_per_second=(layer_forward + layer_backward + cost.per_sample_flops * tokens) / seconds["per_sample"],
            head_flops_per_second=head_flops / seconds["head"],
            head_gradient_flops_per_second=2 * head_flops * head_tokens / tokens / seconds["head_gradient"],
            float64_flops_per_second=2 * tokens * side * side / seconds["float64"],
            host_float64_flops_per_second=2 * 256**3 / seconds["host"],
            host_eigh_flops_per_second=_EIGH_FLOPS_PER_CUBE * 256**3 / seconds["eigh"],
            source=(
                f"measured in {elapsed:.1f} s on {name} ({device}), {dtype_name}: one decoder layer (layer "
                f"{representative}'s shape) on a {batch_size} x {seq_len} batch, and the head"
            ),
            measured=True,
            measurement_seconds=elapsed,
        )

    def seconds(self, work: Work, shape: ModelShape, heal: bool = False) -> Count:
        """The seconds `work` takes on this device, for a model of `shape`."""
        forward = shape.mean("forward_flops", heal)
        backward = shape.mean("backward_flops", heal)
        per_sample = shape.mean("per_sample_flops", heal)
        gradient_rate = self.per_sample_flops_per_second if work.per_sample_norms else self.gradient_flops_per_second
        gradient_flops = forward + backward + (per_sample if work.per_sample_norms else 0.0)
        gradient_flops += forward if work.weight_gradients else 0.0
        head = 2 * shape.hidden_size * shape.vocab_size
        return (
            work.layer_forward * (forward / self.forward_flops_per_second)
            + work.layer_gradient * (gradient_flops / gradient_rate)
            + work.head_forward * (head / self.head_flops_per_second)
            + work.head_gradient * (2 * head / self.head_gradient_flops_per_second)
            + work.device_float64_flops / self.float64_flops_per_second
            + work.host_float64_flops / self.host_float64_flops_per_second
            + work.host_eigh * (_EIGH_FLOPS_PER_CUBE * shape.hidden_size**3 / self.host_eigh_flops_per_second)
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _timed(work: Callable[[], Any], device: torch.device, min_seconds: float, max_repeats: int = 3) -> float:
    """The median seconds of `work` on `device` after one warm-up call (the device synchronised around each call)."""

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    work()
    synchronize()
    times: list[float] = []
    while len(times) < max_repeats and (not times or sum(times) < min_seconds):
        start = time.perf_counter()
        work()
        synchronize()
        times.append(time.perf_counter() - start)
    times.sort()
    return max(times[len(times) // 2], 1e-9)


def flops(work: Work, shape: ModelShape, heal: bool = False) -> Count:
    """The FLOPs `work` makes for a model of `shape` (device and host, every dtype).

    Args:
        work ([`Work`]): What a stage computes.
        shape ([`ModelShape`]): The model.
        heal (`bool`, defaults to `False`): Use the layers' cost at the heal batch's shape.

    Returns:
        `Count`.
    """
    forward = shape.mean("forward_flops", heal)
    gradient = forward + shape.mean("backward_flops", heal)
    gradient += shape.mean("per_sample_flops", heal) if work.per_sample_norms else 0.0
    gradient += forward if work.weight_gradients else 0.0
    head = 2 * shape.hidden_size * shape.vocab_size
    return (
        work.layer_forward * forward
        + work.layer_gradient * gradient
        + work.head_forward * head
        + work.head_gradient * (2 * head)
        + work.device_float64_flops
        + work.host_float64_flops
        + work.host_eigh * (_EIGH_FLOPS_PER_CUBE * shape.hidden_size**3)
    )


# ----------------------------------------------------------------------------------------------------- Stage 1
def _protected_positions(num_layers: int, protected: set[int]) -> tuple[int, int, bool]:
    """The protected layers that stay at the bottom and the top of the stack whatever is removed (a run from layer 0,
    a run to the last layer), and whether others sit in between (their positions then depend on what is removed)."""
    bottom = 0
    while bottom in protected:
        bottom += 1
    top = 0
    while num_layers - 1 - top in protected and num_layers - 1 - top >= bottom:
        top += 1
    return bottom, top, len(protected) > bottom + top


def _removal_layers(present: int, positions: Sequence[int], recorded: bool) -> int:
    """Layer runs per sequence of [`removal_losses`] for candidates at `positions` of a stack of `present` layers: the
    pass up to the deepest candidate (unless its inputs were recorded), then, for each candidate, the layers after it."""
    before = 0 if recorded else max(positions) + 1
    return before + sum(present - 1 - position for position in positions)


def _removal_range(num_layers: int, present: int, protected: set[int], candidates: int, recorded: bool) -> Count:
    """[`_removal_layers`] for `candidates` of the non-protected layers of the current stack: exact when they are all
    of them and the protected layers sit at the ends of the stack, else between the deepest and the shallowest
    placements (the candidates then lie among the positions between the end-protected layers)."""
    bottom, top, scattered = _protected_positions(num_layers, protected)
    free = list(range(bottom, present - top))
    if candidates == len(free) and not scattered:
        return Count.of(_removal_layers(present, free, recorded))
    deepest = _removal_layers(present, free[len(free) - candidates :], recorded)
    shallowest = _removal_layers(present, free[:candidates], recorded)
    return Count(deepest, shallowest)


@dataclass
class Stage1Outline:
    """How Stage 1 runs, resolved from the config: what the plan prints about it."""

    metric: str
    scoring_pass: str | None
    iterative: bool
    num_to_remove: int
    rounds: Count
    scoring_rounds: Count
    verify_top_k: int | None
    rungs: int
    protected: list[int]


def _stage1(config: GradMAPConfig, shape: ModelShape, streamed: bool) -> tuple[Work, Stage1Outline, list[str]]:
    """Stage 1's work (see the module docstring), its outline, and what the plan cannot count."""
    metric = get_importance_metric(config.importance, seed=config.seed)
    iterative = metric.iterative if config.iterative is None else config.iterative
    num_layers = shape.num_layers
    num_to_remove = config.num_layers_to_remove(num_layers)
    protected = config.resolved_protected_layers(num_layers)
    protected = metric.protected_layers(num_layers) if protected is None else protected
    notes: list[str] = []
    if config.layers_to_prune is not None:
        outline = Stage1Outline(metric.name, None, False, len(config.layers_to_prune), ZERO, ZERO, None, 0, sorted(protected))
        return Work(), outline, notes
    candidates = num_layers - len(protected)
    num_to_remove = min(num_to_remove, candidates) if config.has_budget else num_to_remove
    measures_loss = config.loss_curve or config.max_loss_increase is not None
    one_per_round = iterative or config.verify_top_k is not None or measures_loss or config.target_num_parameters is not None
    most = num_to_remove if one_per_round else 1
    fewest = most
    if config.target_num_parameters is not None:
        sizes = sorted(shape.layer_parameters[index] for index in range(num_layers) if index not in protected)
        excess = shape.num_parameters - config.target_num_parameters

        def needed(ordered: list[int]) -> int:
            removed, count = 0, 0
            while removed < excess and count < len(ordered):
                removed, count = removed + ordered[count], count + 1
            return count

        fewest, most = min(needed(sizes[::-1]), most), min(needed(sizes), most)
        fewest = max(fewest, 1)
    if config.max_loss_increase is not None:
        fewest = 1
    scoring_pass = metric.scoring_pass
    if scoring_pass is None:
        notes.append(
            f"Stage 1: the metric {metric.name!r} does not declare its passes (`scoring_pass`): its scoring is not counted."
        )
    if config.compensate_each_round:
        notes.append("Stage 1: the fits of `compensate_each_round` between removals are not counted.")
    samples, seq_len = config.num_samples, config.seq_len
    tokens = samples * seq_len
    rungs = halving_rungs(min(config.verify_top_k, candidates), samples) if config.verify_top_k and config.verify_halving else 1
    recorded = config.verify_from_scoring_pass and not streamed

    def round_work(index: int) -> Work:
        present = num_layers - index
        work = Work()
        if iterative or index == 0:
            work = work + _scoring(scoring_pass, num_layers, present, protected, samples, seq_len, streamed)
        if config.verify_top_k is not None:
            work = work + _verification(config, num_layers, present, protected, recorded)
        if measures_loss and config.verify_top_k is None and not metric.scores_are_losses:
            work = work + Work(layer_forward=Count.of((present - 1) * tokens), head_forward=Count.of(tokens))
        return work

    def rounds_work(count: int) -> Work:
        work = Work()
        if measures_loss:  # the dense model's calibration loss, before the first round
            work = Work(layer_forward=Count.of(num_layers * tokens), head_forward=Count.of(tokens))
        for index in range(count):
            work = work + round_work(index)
        return work

    low, high = rounds_work(fewest), rounds_work(most)
    work = Work(
        **{
            item.name: Count(getattr(low, item.name).low, getattr(high, item.name).high)
            for item in fields(Work)
            if _is_count(item)
        },
        per_sample_norms=scoring_pass == "per_sample_gradient",
        weight_gradients=scoring_pass == "parameter_gradient",
    )
    scoring_rounds = Count(fewest if iterative else 1, most if iterative else 1)
    outline = Stage1Outline(
        metric.name,
        scoring_pass,
        iterative,
        num_to_remove,
        Count(fewest, most),
        scoring_rounds,
        config.verify_top_k,
        rungs,
        sorted(protected),
    )
    return work, outline, notes


def _scoring(
    scoring_pass: str | None, num_layers: int, present: int, protected: set[int], samples: int, seq_len: int, streamed: bool
) -> Work:
    """One scoring pass of a metric over a stack of `present` layers (see `ImportanceMetric.scoring_pass`)."""
    tokens = samples * seq_len
    if scoring_pass in ("per_sample_gradient", "gradient", "parameter_gradient"):
        check = min(_SPLIT_CHECK_TOKENS, seq_len)  # split_at_lm_head: the whole model and decoder + head, on one sequence
        work = Work(
            layer_forward=Count.of(2 * check * present),
            head_forward=Count.of(2 * check),
            layer_gradient=Count.of(present * tokens),
            head_gradient=Count.of(samples * (seq_len - 1)),
        )
        if streamed:  # the forward pass that stores each layer's input, before the recomputing backward pass
            work.layer_forward = work.layer_forward + present * tokens
        return work
    if scoring_pass == "forward":  # the whole model's forward pass, logits included
        return Work(layer_forward=Count.of(present * tokens), head_forward=Count.of(tokens))
    if scoring_pass == "removal_losses":  # SLEB: every candidate
        candidates = present - len(protected)
        layers = _removal_range(num_layers, present, protected, candidates, recorded=False)
        return Work(layer_forward=layers * tokens, head_forward=Count.of(candidates * tokens))
    return Work()


def _verification(config: GradMAPConfig, num_layers: int, present: int, protected: set[int], recorded: bool) -> Work:
    """The check of a round's shortlist ([`verify_shortlist`]): every racing candidate's removal loss on each rung
    (the better half goes on after each rung but the last)."""
    shortlist = min(config.verify_top_k, present - len(protected))
    rungs = halving_rungs(shortlist, config.num_samples) if config.verify_halving else 1
    work, racing = Work(), shortlist
    for index, part in enumerate(_split(config.num_samples, rungs)):
        tokens = len(part) * config.seq_len
        layers = _removal_range(num_layers, present, protected, racing, recorded)
        work = work + Work(layer_forward=layers * tokens, head_forward=Count.of(racing * tokens))
        if index < rungs - 1:
            racing = max(2, math.ceil(racing / 2))
    return work


def _split(count: int, parts: int) -> list[range]:
    """`torch.tensor_split`'s parts of `range(count)`."""
    base, extra = divmod(count, parts)
    bounds = [0]
    for index in range(parts):
        bounds.append(bounds[-1] + base + (1 if index < extra else 0))
    return [range(bounds[index], bounds[index + 1]) for index in range(parts)]


# ----------------------------------------------------------------------------------------------------- Stage 2
def golden_search_evaluations(grid_size: int) -> Count:
    """How many strengths `lambda_search="golden"` scores on a grid of `grid_size` ([`searched_losses`]): from the
    fewest any outcome of its comparisons leaves, to the whole grid at most (each strength is scored once): a tie
    makes the search go on to the stronger strengths while their losses stay within the tolerance, and strong
    strengths all give nearly W' = I, so ties are common where W' = I is near the best. Likely: the mean count for a
    loss with one minimum and no tie, over where the minimum lies (4.4 of 9; SmolLM2-135M's five fits at 25% scored
    4.2 on average, docs/benchmarks/scale.md)."""
    outcomes: set[int] = set()

    def explore(low: int, high: int, scored: frozenset[int]) -> None:
        if high - low <= 2:
            outcomes.add(len(scored | set(range(low, high + 1))))
            return
        step = round((high - low) * GOLDEN_SECTION)
        left, right = low + step, max(high - step, low + step + 1)
        scored = scored | {left, right}
        explore(low, right, scored)
        explore(left, high, scored)

    explore(0, grid_size - 1, frozenset())
    # likely: a loss with one minimum and no tie (what the measured fits mostly give), the minimum at any strength
    grid = list(range(grid_size))
    single_minimum = [
        len(searched_losses(lambda index, best=best: (index - best) ** 2 + 1e-3 * index, grid, "golden")) for best in grid
    ]
    return Count(min(outcomes), grid_size, sum(single_minimum) / grid_size)


@dataclass
class Stage2Outline:
    """How Stage 2 runs, resolved from the config and the family."""

    target: str
    selection: str
    fits: Count
    evaluations_per_fit: Count
    rows_fit: bool


def _stage2_layout(
    config: GradMAPConfig,
    shape: ModelShape,
    kept: list[int],
    targets: list[tuple[int, int]],
    selection: str,
    post_norm: bool,
    validation: bool,
) -> Work:
    """Stage 2's work for one layout: the kept layers and the targets fitted (see `compensation.stage2.compensate`)."""
    samples, seq_len, batch = config.num_samples, config.seq_len, config.batch_size
    tokens, num_layers, num_kept = samples * seq_len, shape.num_layers, len(kept)
    held_out = samples // AUTO_NUM_FOLDS
    d = shape.hidden_size
    position = {index: kept.index(index) for index in kept}
    early = config.compensation_target != "max_drift"
    work = Work(layer_forward=Count.of((num_layers + num_kept) * tokens))  # the dense and the pruned means
    if not targets:
        return work
    if not early:  # the dense outputs the targets are fitted to, recorded once the targets are known
        work = work + Work(layer_forward=Count.of((max(end for _, end in targets) + 1) * tokens))
    start = targets[0][0] if early else None
    first_start = start
    rows_fit = post_norm or config.compensation_objective == "cosine"
    evaluations = _evaluations(config, selection, rows_fit)
    for index, _ in targets:
        first = position[start] if start is not None else 0
        run = position[index] - first + 1
        work = work + Work(layer_forward=Count.of(run * tokens))
        if rows_fit:
            rows = tokens
            steps = config.adam_steps * ((len(NORM_RIDGE_GRID) + 1) if post_norm and config.reg_lambda == "auto" else 1)
            work = work + Work(device_float64_flops=Count.of(6 * rows * d * d * steps))
            if config.compensation_objective == "cosine" and config.reg_lambda == "auto":
                work = work + Work(
                    host_eigh=Count.of(AUTO_NUM_FOLDS), host_float64_flops=Count.of(28 * AUTO_NUM_FOLDS * 2 * d**3)
                )
        else:
            work = work + Work(device_float64_flops=Count.of(4 * d * d * tokens))
            if selection == "next_token_loss":
                after = num_kept - position[index]
                work = work + Work(
                    layer_forward=evaluations * (after * held_out * seq_len),
                    head_forward=evaluations * (held_out * seq_len),
                    host_eigh=Count.of(1),
                    host_float64_flops=Count.of(21 * 2 * d**3),
                )
            else:
                if config.reg_lambda == "auto":  # cross-validation: per fold, one eigendecomposition and the grid's products
                    cubes = AUTO_NUM_FOLDS * (3 * len(AUTO_RIDGE_GRID) + 1)
                    work = work + Work(host_eigh=Count.of(AUTO_NUM_FOLDS), host_float64_flops=Count.of(cubes * 2 * d**3))
                solve = config.adam_steps * 6 * d**3 if config.solver == "adam" else 4 * 2 * d**3
                work = work + Work(host_float64_flops=Count.of(solve))
        start = index
    if config.refinement_steps:
        train = samples - held_out
        rows = min(batch, train)
        checks = 1 + config.refinement_steps // REFINEMENT_CHECK_EVERY
        work = work + Work(
            layer_forward=Count.of(num_layers * tokens + checks * num_kept * held_out * seq_len),
            head_forward=Count.of(tokens + checks * held_out * seq_len),
            layer_gradient=Count.of(config.refinement_steps * rows * seq_len * num_kept),
            head_gradient=Count.of(config.refinement_steps * rows * seq_len),
        )
    if validation:  # the validation perplexity with and without the compensation
        work = work + Work(layer_forward=Count.of(2 * num_kept * tokens), head_forward=Count.of(2 * tokens))
    after_first = num_kept - (position[first_start] if first_start is not None else 0)
    return work + Work(layer_forward=Count.of(after_first * tokens))  # the drift after compensation


def _evaluations(config: GradMAPConfig, selection: str, rows_fit: bool) -> Count:
    """The held-out next-token losses one fit of the next-token selection scores: W' = I, then the strengths."""
    if selection != "next_token_loss" or rows_fit:
        return ZERO
    searched = (
        Count.of(len(AUTO_RIDGE_GRID)) if config.lambda_search == "grid" else golden_search_evaluations(len(AUTO_RIDGE_GRID))
    )
    return searched + 1


def _layouts(num_layers: int, num_removed: int, protected: set[int]) -> list[list[int]]:
    """Removed-layer sets that span what Stage 1 may choose: every contiguous run, evenly spread layers, and a
    fixed sample of random sets (seed 0)."""
    candidates = [index for index in range(num_layers) if index not in protected]
    num_removed = min(num_removed, len(candidates))
    layouts = [candidates[start : start + num_removed] for start in range(len(candidates) - num_removed + 1)]
    step = len(candidates) / num_removed
    layouts.append([candidates[int(step * index)] for index in range(num_removed)])
    layouts.append([candidates[min(len(candidates) - 1, int(step * index + step / 2))] for index in range(num_removed)])
    generator = random.Random(0)
    layouts += [sorted(generator.sample(candidates, num_removed)) for _ in range(_SAMPLED_LAYOUTS)]
    return layouts


def _stage2(
    config: GradMAPConfig,
    shape: ModelShape,
    adapter: DecoderAdapter,
    removed_layers: list[int] | None,
    protected: list[int],
    removable: Count,
    validation: bool,
) -> tuple[Work, Stage2Outline]:
    """Stage 2's work over the layouts Stage 1 may leave (exact for a known one), and its outline."""
    resolved = resolve_selection(config, adapter)
    selection = "next_token_loss" if chooses_by_next_token_loss(resolved) else "hidden_state"
    post_norm = adapter.mlp_output_norm_path is not None
    num_layers = shape.num_layers
    if removed_layers is not None:
        layouts = [sorted(removed_layers)]
    else:
        layouts = []
        for count in sorted({int(removable.low), int(removable.high)}):
            layouts += _layouts(num_layers, count, set(protected))
    works: list[Work] = []
    fits: list[Count] = []
    for removed in layouts:
        kept = [index for index in range(num_layers) if index not in removed]
        for targets in _target_sets(resolved, kept, num_layers):
            works.append(_stage2_layout(resolved, shape, kept, targets, selection, post_norm, validation))
            fits.append(Count.of(len(targets)))
    work, fits = _median_over(works), _median_over(fits)
    rows_fit = post_norm or resolved.compensation_objective == "cosine"
    outline = Stage2Outline(resolved.compensation_target, selection, fits, _evaluations(resolved, selection, rows_fit), rows_fit)
    return work, outline


def _median_over(items: Sequence[Any]) -> Any:
    """The range over `items` (`Count`s, or `Work`s count by count) that are the outcomes the run may have, with the
    median of their typical values as the likely one: one outcome is returned as it is. Over Stage 1's layouts, most
    are scattered sets, as GradMAP's choices on real models are (the paper: "broadly distributed across the entire
    network depth")."""
    if len(items) == 1:
        return items[0]
    if isinstance(items[0], Count):
        low, high = min(item.low for item in items), max(item.high for item in items)
        return Count(low, high, statistics.median(item.typical for item in items))
    spans = {item.name: _median_over([getattr(work, item.name) for work in items]) for item in fields(Work) if _is_count(item)}
    return Work(
        **spans,
        per_sample_norms=any(work.per_sample_norms for work in items),
        weight_gradients=any(work.weight_gradients for work in items),
    )


def _target_sets(config: GradMAPConfig, kept: list[int], num_layers: int) -> list[list[tuple[int, int]]]:
    """The targets Stage 2 may fit for the kept layers: exact for `span_end`; for `max_drift` (the drift decides),
    every run of Z consecutive kept layers and the Z spread evenly."""
    if config.compensation_target != "max_drift":
        return [compensation_targets(kept, {}, num_layers, config.compensation_target, config.num_compensated_layers)]
    count = min(config.num_compensated_layers, len(kept))
    sets = [kept[start : start + count] for start in range(len(kept) - count + 1)]
    step = len(kept) / count
    sets.append([kept[int(step * index)] for index in range(count)])
    return [[(index, index) for index in chosen] for chosen in sets]


# ----------------------------------------------------------------------------------------------------- heal
# heal_tokens="auto" is planned from the cost of this many heal steps, scaled to Stage 1's planned time.
_AUTO_REFERENCE_STEPS = 64


def _heal(
    config: GradMAPConfig, shape: ModelShape, num_kept: int, teacher_layers: int, streamed: bool = False
) -> tuple[Work, dict[str, int]]:
    """The heal stage's work: the teacher's pass over every sequence, the held-out checks and the training steps
    (layer-streamed: each step's forward pass that stores the layers' inputs, and the head split's check, two passes
    over at most 16 tokens of one sequence)."""
    seq_len, batch = config.heal_seq_len, config.heal_batch_size
    train = -(-config.heal_tokens // seq_len)
    validation = config.heal_validation_sequences
    steps = -(-train // batch)
    checks = 1 + steps // config.heal_check_every + (1 if steps % config.heal_check_every else 0)
    streaming_forward = num_kept * (train * seq_len + 2 * min(_SPLIT_CHECK_TOKENS, seq_len)) if streamed else 0
    work = Work(
        layer_forward=Count.of(
            teacher_layers * (train + validation) * seq_len + checks * num_kept * validation * seq_len + streaming_forward
        ),
        head_forward=Count.of(
            (train + validation) * seq_len
            + checks * validation * seq_len
            + (2 * min(_SPLIT_CHECK_TOKENS, seq_len) if streamed else 0)
        ),
        layer_gradient=Count.of(num_kept * train * seq_len),
        head_gradient=Count.of(train * (seq_len - 1 if streamed else seq_len)),  # streamed: the predicting positions
        weight_gradients=config.heal_trainable == "all",
    )
    return work, {"train_sequences": train, "validation_sequences": validation, "steps": steps, "checks": checks}


def _evaluation(shape: ModelShape, num_kept: Count, tokens: int) -> Work:
    """Perplexity of the dense and of the pruned model over `tokens` evaluation tokens (`prune --evaluate`)."""
    return Work(layer_forward=(num_kept + shape.num_layers) * tokens, head_forward=Count.of(2 * tokens))


# ----------------------------------------------------------------------------------------------------- memory
def _logits_bytes(shape: ModelShape, batch: int, seq_len: int) -> float:
    """A model forward's logits (its dtype) and the float32 cross-entropy's copies of them."""
    return batch * seq_len * shape.vocab_size * (shape.dtype_bytes + 8)


def _stage1_memory(config: GradMAPConfig, shape: ModelShape, outline: Stage1Outline) -> dict[str, float]:
    """Stage 1's peak beyond the weights, in memory and layer-streamed (the first round, every layer present)."""
    batch, seq_len = config.batch_size, config.seq_len
    tokens, d, size = batch * seq_len, shape.hidden_size, shape.dtype_bytes
    logits_chunk = min(MAX_LOGIT_ELEMENTS, shape.vocab_size * seq_len * batch) * 4 * 3
    activations = tokens * shape.total("activation_bytes")
    one_layer = tokens * max(layer.activation_bytes for layer in shape.layers)
    per_sample = tokens * shape.total("per_sample_bytes") if outline.scoring_pass == "per_sample_gradient" else 0.0
    one_per_sample = tokens * max(layer.per_sample_bytes for layer in shape.layers) if per_sample else 0.0
    embeddings = 2 * tokens * d * size
    in_memory = streamed = 0.0
    if outline.scoring_pass in ("per_sample_gradient", "gradient", "parameter_gradient"):
        in_memory = activations + per_sample + logits_chunk + embeddings
        if outline.scoring_pass == "parameter_gradient":
            in_memory += shape.weight_bytes  # the parameters' gradients
        stored_inputs = shape.num_layers * tokens * d * size
        streamed = stored_inputs + one_layer + one_per_sample + logits_chunk + embeddings
    elif outline.scoring_pass in ("forward", "removal_losses"):
        inputs = (
            (shape.num_layers - len(outline.protected)) * tokens * d * size if outline.scoring_pass == "removal_losses" else 0
        )
        in_memory = streamed = _logits_bytes(shape, batch, seq_len) + inputs + one_layer / 2
    if outline.verify_top_k:
        check = _logits_bytes(shape, batch, seq_len) + outline.verify_top_k * tokens * d * size + one_layer / 2
        in_memory, streamed = max(in_memory, check), max(streamed, check)
        if config.verify_from_scoring_pass:
            in_memory += shape.num_layers * config.num_samples * seq_len * d * size
    return {"in_memory": in_memory, "streamed": streamed}


def _stage2_memory(config: GradMAPConfig, shape: ModelShape, outline: Stage2Outline) -> dict[str, float]:
    """Stage 2's peak beyond the weights: on the device, the hidden states recorded where the fits start, the float64
    statistics and batches, the held-out inputs and a batch's logits; on the host, the dense outputs the targets are
    fitted to (float32), the backups of the folded down projections (one per target, and the one a fit tries) and the
    solves' d x d float64 matrices."""
    samples, seq_len, batch = config.num_samples, config.seq_len, config.batch_size
    d, size = shape.hidden_size, shape.dtype_bytes
    tokens = samples * seq_len
    folds = AUTO_NUM_FOLDS if config.reg_lambda == "auto" else 1
    device = 2 * tokens * d * size  # what the current target and the next one receive, recorded
    device += folds * 2 * d * d * 8 + 5 * batch * seq_len * d * 8
    if outline.selection == "next_token_loss":
        device += (samples // AUTO_NUM_FOLDS) * seq_len * d * size + _logits_bytes(shape, batch, seq_len)
    if outline.rows_fit:  # every token's Y, X_F and X_O, float64, for the Adam fits
        device += 3 * tokens * d * 8
    host = outline.fits.high * tokens * d * 4 + 6 * d * d * 8
    host += (outline.fits.high + 1) * d * shape.intermediate_size * size
    if config.refinement_steps:
        host += tokens * TOP_K * 12
    return {"device": device, "host": host}


def _heal_memory(config: GradMAPConfig, shape: ModelShape, num_kept: int, counts: dict[str, int]) -> dict[str, float]:
    """The heal's peak beyond the weights: the training batch's activations and logits, the trained parameters'
    gradients and AdamW state (float32), and on the host the teacher's targets (with its head inputs for a logit loss,
    whose `d x d` matrix is on the device; its seam layers' outputs for `kl_hidden_mse`) and two copies of the trained
    state."""
    batch, seq_len = config.heal_batch_size, config.heal_seq_len
    tokens = batch * seq_len
    mean_activation = shape.mean("activation_bytes", heal=True) + (
        shape.mean("linear_input_bytes", heal=True) if config.heal_trainable == "lora" else 0.0
    )
    activations = tokens * num_kept * mean_activation
    logits = tokens * shape.vocab_size * (4 * 3 + shape.dtype_bytes)
    trained = _trained_parameters(config, shape, num_kept)
    optimizer = trained * 4 * (3 if config.heal_trainable != "lora" else 4)  # (the adapters) + gradient + two moments
    targets = (counts["train_sequences"] + counts["validation_sequences"]) * (seq_len - 1) * (TOP_K * 8 + 4)
    gram = 0
    if uses_head_inputs(config.heal_loss):  # the teacher's head inputs, bfloat16, held twice (the text's, the heal's rows)
        targets += 2 * counts["train_sequences"] * (seq_len - 1) * shape.hidden_size * 2
        gram = shape.hidden_size**2 * 4  # the logit loss's d x d matrix, on the device
    if uses_layer_states(config.heal_loss):  # the teacher's outputs of the seam layers, bfloat16, held twice likewise
        seams = min(num_kept, shape.num_layers - num_kept)  # at most one kept layer after each removed one
        targets += 2 * counts["train_sequences"] * (seq_len - 1) * seams * shape.hidden_size * 2
    # layer-streamed steps (an offloaded model): the kept layers' inputs and one layer's activations, the head by slices
    stored_inputs = num_kept * tokens * shape.hidden_size * shape.dtype_bytes
    one_layer = tokens * max(layer.activation_bytes for layer in shape.layers)
    logits_chunk = min(MAX_LOGIT_ELEMENTS, shape.vocab_size * tokens) * 4 * 3
    streamed = stored_inputs + one_layer + logits_chunk + optimizer
    return {
        "device": activations + logits + optimizer + gram,
        "streamed": streamed,
        "host": targets + 2 * trained * 4,
        "trained": trained,
    }


def _trained_parameters(config: GradMAPConfig, shape: ModelShape, num_kept: int) -> int:
    """How many parameters the heal trains (LoRA's adapters, or the weights `heal_trainable` names, roughly)."""
    mean_layer = sum(shape.layer_parameters) / shape.num_layers
    if config.heal_trainable == "lora":
        return config.heal_lora_rank * shape.lora_parameters_per_rank * num_kept
    if config.heal_trainable == "norms":
        return 2 * shape.hidden_size * (num_kept + 1)
    if config.heal_trainable == "all":
        return int(mean_layer * num_kept)
    if config.heal_trainable == "down_projections":
        return shape.hidden_size * shape.intermediate_size
    return int(mean_layer)


# ----------------------------------------------------------------------------------------------------- the plan
@dataclass
class StagePlan:
    """One stage of the run.

    Args:
        name (`str`): `"Stage 1"`, `"Stage 2"`, `"Heal"`, `"Evaluation"`.
        passes (`str`): What runs, in words.
        tokens (`int`): The tokens the stage reads (the calibration set, the heal text, ...).
        work ([`Work`]): What it computes.
        flops (`Count`): Its FLOPs.
        seconds (`Count`, *optional*): Its expected seconds on the device (none without a throughput).
        peak_bytes_in_memory (`Count`): Peak memory with every weight on the device (the weights included).
        peak_bytes_streamed (`Count`, *optional*): Peak device memory layer-streamed, the weights offloaded but those
            the device map keeps on the device (all of them without a device map), one layer's weights included;
            `None` where the stage cannot run offloaded.
        host_bytes (`float`): Host memory the stage holds beside the device (its part of the peak on a CPU).
    """

    name: str
    passes: str
    tokens: int
    work: Work
    flops: Count
    seconds: Count | None
    peak_bytes_in_memory: Count
    peak_bytes_streamed: Count | None
    host_bytes: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {item.name: _plain(getattr(self, item.name)) for item in fields(self)}


@dataclass
class PruningPlan:
    """What a GradMAP run will do and cost, told before the run from the model's config alone: the layers to remove,
    the rounds and passes, the tokens and FLOPs of each stage, the peak memory in memory and layer-streamed, the disk
    the output needs and the expected seconds on the device. `print(plan)` shows it as a table; `to_dict()` gives it
    as JSON-serialisable values. Ranges (`low-high`) are where the run's own findings decide.

    Args:
        model (`str`): The model planned.
        model_type (`str`): Its family.
        dtype (`str`): The dtype it computes in.
        num_layers (`int`): Its decoder layers.
        num_parameters (`int`): Its parameters.
        weight_bytes (`int`): Its weights' bytes in `dtype`.
        largest_layer_bytes (`int`): The largest decoder layer's bytes (what layer streaming holds at once).
        num_layers_to_remove (`int`): K (the most a budget may remove).
        rounds (`Count`): Stage 1's rounds (a range with a budget: known only as Stage 1 goes).
        budget (`str`, *optional*): The budget or size target that decides K as Stage 1 goes.
        stage1 (`str`): How Stage 1 runs (metric, rounds, passes per round).
        stage2 (`str`): How Stage 2 runs.
        execution (`str`): How the gradient passes run: `"in_memory"` or `"layer_streamed"`.
        stages (`list[StagePlan]`): The stages.
        output_bytes (`Count`): The disk the output checkpoint takes (weights of the kept layers, tokenizer, report).
        throughput ([`DeviceThroughput`], *optional*): What the times are based on.
        notes (`list[str]`): What the plan assumes or cannot count.
    """

    model: str
    model_type: str
    dtype: str
    num_layers: int
    num_parameters: int
    weight_bytes: int
    largest_layer_bytes: int
    num_layers_to_remove: int
    rounds: Count
    budget: str | None
    stage1: str
    stage2: str
    execution: str
    stages: list[StagePlan]
    output_bytes: Count
    throughput: DeviceThroughput | None
    notes: list[str] = field(default_factory=list)

    @property
    def seconds(self) -> Count | None:
        """The whole run's expected seconds (`None` without a throughput)."""
        if any(stage.seconds is None for stage in self.stages):
            return None
        return sum((stage.seconds for stage in self.stages), ZERO)

    @property
    def peak_bytes(self) -> Count:
        """The run's peak memory, as it will run (`execution`)."""
        peaks = [
            stage.peak_bytes_streamed
            if self.execution == "layer_streamed" and stage.peak_bytes_streamed
            else stage.peak_bytes_in_memory
            for stage in self.stages
        ]
        return Count(max(peak.low for peak in peaks), max(peak.high for peak in peaks)) if peaks else ZERO

    def stage(self, name: str) -> StagePlan:
        """The stage called `name`."""
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(f"No stage {name!r} in this plan: {[stage.name for stage in self.stages]}.")

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON-serialisable values (a range as `{"low": ..., "high": ...}`)."""
        values = {item.name: _plain(getattr(self, item.name)) for item in fields(self)}
        values["seconds"] = _plain(self.seconds)
        values["peak_bytes"] = _plain(self.peak_bytes)
        return values

    def __str__(self) -> str:
        lines = [
            f"GradMAP plan for {self.model} ({self.model_type}, {self.num_layers} layers, "
            f"{_count_text(self.num_parameters)} parameters, {self.dtype}: {_bytes_text(self.weight_bytes)})",
        ]
        removal = f"Remove {self.num_layers_to_remove} of {self.num_layers} layers"
        lines.append(f"{removal} ({self.budget})" if self.budget else removal)
        lines.append(f"Stage 1: {self.stage1}")
        if self.stage2:
            lines.append(f"Stage 2: {self.stage2}")
        rows = [["Stage", "Passes", "Tokens", "TFLOP", "Time", "Peak, in memory", "Peak, layer-streamed"]]
        for stage in self.stages:
            rows.append(
                [
                    stage.name,
                    stage.passes,
                    _count_text(stage.tokens),
                    _range_text(stage.flops / 1e12, _flop_text),
                    _range_text(stage.seconds, _seconds_text) if stage.seconds is not None else "-",
                    _range_text(stage.peak_bytes_in_memory, _bytes_text),
                    _range_text(stage.peak_bytes_streamed, _bytes_text) if stage.peak_bytes_streamed is not None else "n/a",
                ]
            )
        total_seconds = self.seconds
        rows.append(
            [
                "Total",
                f"gradient passes {self.execution.replace('_', '-')}",
                "",
                _range_text(sum((stage.flops for stage in self.stages), ZERO) / 1e12, _flop_text),
                _range_text(total_seconds, _seconds_text) if total_seconds is not None else "-",
                _range_text(_max_over(stage.peak_bytes_in_memory for stage in self.stages), _bytes_text),
                _range_text(
                    _max_over(stage.peak_bytes_streamed for stage in self.stages if stage.peak_bytes_streamed), _bytes_text
                ),
            ]
        )
        lines.append(_table(rows))
        lines.append(f"Disk: the output checkpoint takes {_range_text(self.output_bytes, _bytes_text)}.")
        if self.throughput is not None:
            rates = self.throughput
            tera = lambda value: f"{value / 1e12:.3g}"  # noqa: E731
            lines.append(
                f"Throughput ({rates.source}): layer forward {tera(rates.forward_flops_per_second)}, gradient pass "
                f"{tera(rates.gradient_flops_per_second)}, with per-sample norms {tera(rates.per_sample_flops_per_second)}, "
                f"head {tera(rates.head_flops_per_second)} TFLOP/s."
            )
        lines += [f"Note: {note}" for note in self.notes]
        return "\n".join(lines)


def _max_over(counts: Iterable[Count]) -> Count:
    counts = list(counts)
    return Count(max(count.low for count in counts), max(count.high for count in counts)) if counts else ZERO


def _table(rows: list[list[str]]) -> str:
    """A box-drawn table (Accelerate's `estimate-memory` draws one too), left-aligned, with a rule under the header
    and above the last row."""
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]

    def rule(left: str, middle: str, right: str) -> str:
        return left + middle.join("─" * (width + 2) for width in widths) + right

    def line(row: list[str]) -> str:
        return "│" + "│".join(f" {cell:<{width}} " for cell, width in zip(row, widths)) + "│"

    body = [rule("┌", "┬", "┐"), line(rows[0]), rule("├", "┼", "┤")]
    body += [line(row) for row in rows[1:-1]]
    body += [rule("├", "┼", "┤"), line(rows[-1]), rule("└", "┴", "┘")]
    return "\n".join(body)


def _count_text(value: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g}{unit}"
    return f"{value:.0f}"


def _bytes_text(value: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value:.0f} B"


def _flop_text(value: float) -> str:
    return f"{value:.3g}"


def _seconds_text(value: float) -> str:
    if value >= 3600:
        return f"{value / 3600:.2g} h"
    if value >= 60:
        return f"{value / 60:.2g} min"
    return f"{value:.2g} s"


def _range_text(count: Count | None, text: Callable[[float], str]) -> str:
    if count is None:
        return "-"
    low, high = text(count.low), text(count.high)
    if low == high:
        return low
    return f"{low} to {high}" + ("" if count.likely is None else f" (likely {text(count.likely)})")


def _counted(count: Count, word: str) -> str:
    """`count` and `word`, in the plural unless the count is exactly one."""
    text = _range_text(count, lambda value: f"{value:.0f}")
    return f"{text} {word}" if text == "1" else f"{text} {word}es" if word.endswith("s") else f"{text} {word}s"


def _stage1_passes(outline: Stage1Outline) -> str:
    kinds = {
        "per_sample_gradient": "gradient pass",
        "gradient": "gradient pass",
        "parameter_gradient": "gradient pass",
        "forward": "forward pass",
        "removal_losses": "removal-loss pass",
    }
    text = _counted(outline.rounds, "round")
    if outline.scoring_pass in kinds:
        text += f", {_counted(outline.scoring_rounds, kinds[outline.scoring_pass])}"
    if outline.verify_top_k:
        text += ", shortlist checks"
    return text


def _stage2_passes(outline: Stage2Outline) -> str:
    text = _counted(outline.fits, "fit")
    if outline.evaluations_per_fit != ZERO:
        evaluations = _range_text(outline.evaluations_per_fit, lambda value: f"{value:.0f}")
        text += f" x (1 + {evaluations} passes)"
    elif outline.fits.high:
        text += " x 1 pass"
    return text


def _stage1_text(outline: Stage1Outline, config: GradMAPConfig) -> str:
    if outline.scoring_pass is None and config.layers_to_prune is not None:
        return f"no scoring: layers_to_prune={config.layers_to_prune} names the layers"
    kinds = {
        "per_sample_gradient": "a forward and backward pass with per-sample gradient norms",
        "gradient": "a forward and backward pass",
        "parameter_gradient": "a forward and backward pass with parameter gradients",
        "forward": "a forward pass",
        "removal_losses": "the removal loss of every candidate",
        "none": "no pass",
        None: "passes the metric does not declare",
    }
    rounds = _range_text(outline.rounds, lambda value: f"{value:.0f}")
    how = "iterative" if outline.iterative else "one-shot"
    text = f"{outline.metric} ({how}), {rounds} round(s); scored by {kinds[outline.scoring_pass]}"
    text += " every round" if outline.iterative else " once"
    if outline.verify_top_k:
        halving = f", successive halving over {outline.rungs} rungs" if outline.rungs > 1 else ""
        text += f"; every round a shortlist of {outline.verify_top_k} checked by its removal losses{halving}"
    if outline.protected:
        text += f"; layers {outline.protected} protected"
    return text


def _stage2_text(outline: Stage2Outline, config: GradMAPConfig) -> str:
    fits = _range_text(outline.fits, lambda value: f"{value:.0f}")
    text = f"{fits} fit(s) ({outline.target}), lambda by the {outline.selection.replace('_', ' ')}"
    if outline.evaluations_per_fit != ZERO:
        evaluations = _range_text(outline.evaluations_per_fit, lambda value: f"{value:.0f}")
        text += f" ({evaluations} held-out losses per fit)"
    if config.refinement_steps:
        text += f", then {config.refinement_steps} refinement steps"
    return text


def _placements(shape: ModelShape, config: PretrainedConfig, device_map: Any, max_memory: Any) -> dict[str, Any]:
    """Where `device_map` puts each module: itself when it is a dict, else what Accelerate infers for it and
    `max_memory` on the meta model, as `from_pretrained(device_map="auto")` infers it."""
    if isinstance(device_map, dict):
        return device_map
    import logging as std_logging

    from accelerate import infer_auto_device_map

    model = empty_model(config, shape.dtype)
    no_split = getattr(model, "_no_split_modules", None) or []
    accelerate_logger = std_logging.getLogger("accelerate.utils.modeling")
    level = accelerate_logger.level
    accelerate_logger.setLevel(std_logging.ERROR)  # a plan for GPUs this machine lacks is what it is for
    try:
        return infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=no_split, dtype=shape.dtype)
    finally:
        accelerate_logger.setLevel(level)


def _offloaded_shares(shape: ModelShape, config: PretrainedConfig, device_map: Any, max_memory: Any) -> dict[str, float]:
    """The shares of the decoder layers Accelerate would offload to the CPU and to disk for `device_map` and
    `max_memory` ([`_placements`])."""
    if device_map is None:
        return {}
    placements = _placements(shape, config, device_map, max_memory)
    prefix = get_adapter(config).layers_path + "."
    layers = {name: place for name, place in placements.items() if name.startswith(prefix) or name == prefix[:-1]}
    if prefix[:-1] in layers:  # the whole layer list in one place
        return {layers[prefix[:-1]]: 1.0} if layers[prefix[:-1]] in ("cpu", "disk") else {}
    count = shape.num_layers
    return {
        place: sum(1 for value in layers.values() if value == place) / count
        for place in ("cpu", "disk")
        if any(value == place for value in layers.values())
    }


def _shard_bytes() -> int:
    """The checkpoint's shard size in bytes ([`optimum_gradmap.checkpoint.DEFAULT_MAX_SHARD_SIZE`])."""
    from transformers.utils.hub import convert_file_size_to_int

    from .checkpoint import DEFAULT_MAX_SHARD_SIZE

    return convert_file_size_to_int(DEFAULT_MAX_SHARD_SIZE)


def _process_bytes() -> int:
    """This process's resident memory now (0 where `/proc` cannot tell): the interpreter, torch and transformers, which
    the pruning process holds too. Part of the peak where the device is the host CPU."""
    try:
        with open("/proc/self/statm") as file:
            return int(file.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return 0


def _weights_kept_on_device(
    shape: ModelShape, config: PretrainedConfig, device_map: Any, max_memory: Any, device: torch.device
) -> float | None:
    """The bytes of the weights `device_map` (inferred on the meta model for `"auto"`, as `from_pretrained` infers it)
    keeps on the compute device for the whole run: on a CPU device the modules it places on `"cpu"`, on an accelerator
    those it places on that device. `None` without a device map."""
    if device_map is None:
        return None
    placements = _placements(shape, config, device_map, max_memory)
    model = empty_model(config, shape.dtype)
    here = {"cpu"} if device.type == "cpu" else {device.index or 0, str(device), device.type}
    kept = 0.0
    for name, parameter in model.named_parameters():
        place = next(
            (placements[prefix] for prefix in _prefixes(name) if prefix in placements),
            None,
        )
        if place in here:
            kept += parameter.numel() * shape.dtype_bytes
    return kept


def _prefixes(name: str) -> list[str]:
    """`"a.b.c"` -> `["a.b.c", "a.b", "a", ""]`: the device map's keys that may hold a parameter, longest first."""
    parts = name.split(".")
    return [".".join(parts[:end]) for end in range(len(parts), -1, -1)]


def _transfer_seconds(work: Work, shape: ModelShape, batch_tokens: int, shares: dict[str, float]) -> Count:
    """The seconds spent bringing offloaded layers' weights to the device: once per call of such a layer (a batch),
    at an assumed bandwidth for each place."""
    calls = (work.layer_forward + work.layer_gradient) / batch_tokens
    layer_bytes = sum(shape.layer_parameters) / shape.num_layers * shape.dtype_bytes
    return sum(
        (calls * (share * layer_bytes / _ASSUMED_OFFLOAD_BYTES_PER_SECOND[place]) for place, share in shares.items()), ZERO
    )


def plan_pruning(
    model_or_path: PreTrainedModel | PretrainedConfig | str | os.PathLike,
    config: GradMAPConfig,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device | None = None,
    throughput: DeviceThroughput | None = None,
    execution: str | None = None,
    device_map: str | dict[str, Any] | None = None,
    max_memory: dict[int | str, str] | None = None,
    removed_layers: Sequence[int] | None = None,
    validation: bool = False,
    evaluation_tokens: int = 0,
    tokenizer_bytes: int | None = None,
    measure: bool = True,
    name: str | None = None,
) -> PruningPlan:
    """The plan of a pruning run ([`GradMAPPruner.plan`]): see [`PruningPlan`] and the module docstring.

    Args:
        model_or_path (`PreTrainedModel`, `PretrainedConfig`, `str` or `os.PathLike`): The model, its config, a local
            folder or a Hub id (only `config.json` is read).
        config ([`GradMAPConfig`]): The run.
        dtype (`torch.dtype` or `str`, defaults to `torch.float32`): The dtype the model computes in (`"checkpoint"`:
            the one its config names).
        device (`str` or `torch.device`, *optional*): Where it computes (defaults to the CPU).
        throughput ([`DeviceThroughput`], *optional*): The device's rates; measured on `device` when not given and
            `measure` is on.
        execution (`str`, *optional*): `"in_memory"` or `"layer_streamed"`; defaults to what `config.execution` chooses
            (`"auto"`: layer-streamed where `device_map` offloads layers).
        device_map (`str` or `dict`, *optional*), max_memory (`dict`, *optional*): As `from_pretrained` takes them:
            where Accelerate would offload layers, inferred on the meta model.
        removed_layers (`Sequence[int]`, *optional*): The layers Stage 1 will remove, when known (a Stage 1
            checkpoint, an earlier run): Stage 2's counts then are exact.
        validation (`bool`, defaults to `False`): Stage 2 checks its compensation on validation text.
        evaluation_tokens (`int`, defaults to 0): Tokens of `prune --evaluate`'s perplexity (dense and pruned).
        tokenizer_bytes (`int`, *optional*): The tokenizer's files; read from a local folder when not given.
        measure (`bool`, defaults to `True`): Measure the throughput when none is given (else no time is told).
        name (`str`, *optional*): The model's name in the plan; defaults to `model_or_path`.

    Returns:
        [`PruningPlan`].
    """
    model_config = load_model_config(model_or_path)
    if name is None:
        name = os.fspath(model_or_path) if isinstance(model_or_path, (str, os.PathLike)) else model_config._name_or_path
    dtype = _resolve_dtype(dtype, model_config)
    device = torch.device(device if device is not None else "cpu")
    adapter = get_adapter(model_config)
    num_layers = getattr(model_config.get_text_config(decoder=True), adapter.layer_count_field)
    num_to_remove = config.num_layers_to_remove(num_layers)
    if num_to_remove < 1 or num_to_remove >= num_layers:
        raise InvalidInputError(
            f"The config removes {num_to_remove} of the model's {num_layers} decoder layers: at least one must go and one "
            "must remain."
        )
    if config.layers_to_prune is not None:
        removed_layers = list(config.layers_to_prune)
    heal = bool(config.heal_tokens)
    shape = describe_model(
        model_config,
        dtype,
        config.batch_size,
        config.seq_len,
        config.heal_batch_size if heal else None,
        config.heal_seq_len if heal else None,
        name,
    )
    shares = _offloaded_shares(shape, model_config, device_map, max_memory)
    mode = execution or config.execution
    streamed = mode == "layer_streamed" or (mode == "auto" and bool(shares))
    on_cpu = device.type == "cpu"
    # on the CPU the process itself counts: the interpreter and its libraries, read before the throughput's measurement
    process = _process_bytes() if on_cpu else 0
    if throughput is None and measure:
        throughput = DeviceThroughput.measure(model_config, dtype, device, config.batch_size, config.seq_len)
    weights, largest = shape.weight_bytes, max(shape.layer_parameters) * shape.dtype_bytes
    # layer-streamed, the device holds the weights the device map keeps there (none without one) and one layer at a time
    kept_on_device = _weights_kept_on_device(shape, model_config, device_map, max_memory, device) if shares else None
    resident = largest + (kept_on_device if kept_on_device is not None else 0)
    batch_tokens = config.batch_size * config.seq_len
    calibration_tokens = config.num_samples * config.seq_len

    overhead = _allocator_overhead(device)

    def stage(
        name: str,
        passes: str,
        tokens: int,
        work: Work,
        beside_weights: float,
        streamed_peak: float | None,
        host: float,
        heal: bool = False,
    ) -> StagePlan:
        in_memory = weights + overhead * beside_weights + process
        streamed_peak = streamed_peak + process if streamed_peak is not None else None
        plan = _stage_plan(name, passes, tokens, work, shape, throughput, in_memory, streamed_peak, host, heal)
        if plan.seconds is not None and shares:
            plan.seconds = plan.seconds + _transfer_seconds(work, shape, batch_tokens, shares)
        return plan

    work1, outline1, notes = _stage1(config, shape, streamed)
    stages = []
    if config.layers_to_prune is None:
        memory = _stage1_memory(config, shape, outline1)
        passes = _stage1_passes(outline1)
        stages.append(
            stage("Stage 1", passes, calibration_tokens, work1, memory["in_memory"], resident + memory["streamed"], 0.0)
        )
    if removed_layers is not None:
        removable = Count.of(len(removed_layers))
    else:
        removable = Count(1 if config.has_budget else outline1.num_to_remove, outline1.num_to_remove)
    num_kept = Count(num_layers - removable.high, num_layers - removable.low)
    stage2_text = ""
    if config.compensation:
        removed = list(removed_layers) if removed_layers is not None else None
        work2, outline2 = _stage2(config, shape, adapter, removed, outline1.protected, removable, validation)
        memory = _stage2_memory(config, shape, outline2)
        stage2_text = _stage2_text(outline2, config)
        beside = memory["device"] + (memory["host"] if on_cpu else 0.0)
        passes = _stage2_passes(outline2)
        stages.append(stage("Stage 2", passes, calibration_tokens, work2, beside, resident + beside, memory["host"]))
    if heal:
        num_kept_layers = int(num_kept.high)
        if config.heal_tokens == "auto":  # as many tokens as fit in Stage 1's planned time
            batch_tokens = config.heal_batch_size * config.heal_seq_len

            def heal_seconds(steps: int) -> Count | None:
                budget = dataclasses.replace(config, heal_tokens=steps * batch_tokens)
                work, _ = _heal(budget, shape, num_kept_layers, num_layers, streamed)
                return stage("Heal", "", 0, work, 0.0, None, 0.0, heal=True).seconds

            # the heal's time is a fixed part (the held-out sequences' teacher pass, the first check) and a part per
            # step: two budgets give both
            first, second = heal_seconds(_AUTO_REFERENCE_STEPS), heal_seconds(2 * _AUTO_REFERENCE_STEPS)
            stage1_plan = next((done.seconds for done in stages if done.name == "Stage 1"), None)
            if first is None or second is None or stage1_plan is None:
                notes.append("heal_tokens='auto': planned at a reference budget (no Stage 1 time to size it by).")
                config = dataclasses.replace(config, heal_tokens=_AUTO_REFERENCE_STEPS * batch_tokens)
            else:
                per_step = (second.high - first.high) / _AUTO_REFERENCE_STEPS
                fixed = first.high - per_step * _AUTO_REFERENCE_STEPS
                steps = max(1, math.floor((AUTO_TIME_SHARE * stage1_plan.high - fixed) / per_step))
                config = dataclasses.replace(config, heal_tokens=steps * batch_tokens)
                notes.append(
                    f"heal_tokens='auto': about {config.heal_tokens:,} tokens, Stage 1's planned time (the run measures its own)."
                )
            if is_generated(config.heal_dataset):
                notes.append("The dense model's own text (`generated`) is not in the heal's planned time.")
        work3, counts = _heal(config, shape, num_kept_layers, num_layers, streamed)
        memory = _heal_memory(config, shape, num_kept_layers, counts)
        beside = memory["device"] + (memory["host"] if on_cpu else 0.0)
        tokens = (counts["train_sequences"] + counts["validation_sequences"]) * config.heal_seq_len
        passes = f"{counts['steps']} steps, {counts['checks']} checks"
        streamed_heal = resident + memory["streamed"] + (memory["host"] if on_cpu else 0.0)
        stages.append(stage("Heal", passes, tokens, work3, beside, streamed_heal, memory["host"], heal=True))
    if evaluation_tokens:
        logits = _logits_bytes(shape, config.batch_size, config.seq_len)
        work4 = _evaluation(shape, num_kept, evaluation_tokens)
        stages.append(
            stage("Evaluation", "dense and pruned perplexity", evaluation_tokens, work4, logits, resident + logits, 0.0)
        )
    if tokenizer_bytes is None:
        tokenizer_bytes = _tokenizer_bytes(model_or_path)
        if tokenizer_bytes is None:
            notes.append("Disk: the tokenizer's files are not counted (no local folder to read their size from).")
    output_bytes = (
        _kept_parameters(shape, removable, outline1.protected) * shape.dtype_bytes + (tokenizer_bytes or 0) + _REPORT_BYTES
    )
    # Saving: an offloaded model is written a shard at a time, each shard's weights read into memory first
    shard = min(_shard_bytes(), output_bytes.high)
    save = stage("Save", "the checkpoint, shard by shard", 0, Work(), 0.0, resident + shard, 0.0)
    save.seconds = Count.of(output_bytes.high / _ASSUMED_OFFLOAD_BYTES_PER_SECOND["disk"]) if throughput is not None else None
    stages.append(save)
    if process:
        notes.append(f"Peaks include this process's own resident memory ({_bytes_text(process)}: Python, torch, transformers).")
    if on_cpu:
        notes.append(
            f"In memory, what the passes hold beside the weights is counted {HOST_ALLOCATOR_OVERHEAD:g}x: the C allocator "
            "keeps freed blocks (MALLOC_MMAP_THRESHOLD_=131072 returns them, at a cost in time)."
        )
    if shares:
        places = ", ".join(f"{share:.0%} of the layers on {place}" for place, share in shares.items())
        bandwidths = ", ".join(f"{place} {_ASSUMED_OFFLOAD_BYTES_PER_SECOND[place] / 1e9:g} GB/s" for place in shares)
        notes.append(f"Offloaded ({places}): the times include bringing their weights to the device at an assumed {bandwidths}.")
    if any(not layer.measured for layer in shape.layers):
        notes.append(
            "Some layers cannot run on the meta device: their FLOPs and activations are estimated from their parameters."
        )
    notes.append("Activations are measured on the math attention path (its T^2 scores kept): flash attention keeps less.")
    return PruningPlan(
        model=shape.name,
        model_type=shape.model_type,
        dtype=str(dtype).replace("torch.", ""),
        num_layers=num_layers,
        num_parameters=shape.num_parameters,
        weight_bytes=weights,
        largest_layer_bytes=largest,
        num_layers_to_remove=outline1.num_to_remove,
        rounds=outline1.rounds,
        budget=_budget_text(config, outline1),
        stage1=_stage1_text(outline1, config),
        stage2=stage2_text,
        execution="layer_streamed" if streamed else "in_memory",
        stages=stages,
        output_bytes=output_bytes,
        throughput=throughput,
        notes=notes,
    )


def _stage_plan(
    name: str,
    passes: str,
    tokens: int,
    work: Work,
    shape: ModelShape,
    throughput: DeviceThroughput | None,
    in_memory: float,
    streamed: float | None,
    host: float,
    heal: bool = False,
) -> StagePlan:
    return StagePlan(
        name=name,
        passes=passes,
        tokens=tokens,
        work=work,
        flops=flops(work, shape, heal),
        seconds=throughput.seconds(work, shape, heal) if throughput is not None else None,
        peak_bytes_in_memory=Count.of(in_memory),
        peak_bytes_streamed=Count.of(streamed) if streamed is not None else None,
        host_bytes=host,
    )


def _budget_text(config: GradMAPConfig, outline: Stage1Outline) -> str | None:
    """What decides K, in words: a budget (K is then the most removed, and the rounds are known only as they go)."""
    if config.max_loss_increase is not None:
        return (
            f"a budget: stop before the calibration loss rises {config.max_loss_increase:+.0%}; up to "
            f"{outline.num_to_remove} rounds, the number is known only as Stage 1 goes"
        )
    if config.target_num_parameters is not None:
        return f"a size target of {_count_text(config.target_num_parameters)} parameters: {_counted(outline.rounds, 'round')}"
    if config.pruning_ratio is not None:
        return f"pruning_ratio={config.pruning_ratio:g}"
    return None


def _kept_parameters(shape: ModelShape, removable: Count, protected: list[int]) -> Count:
    """The parameters left after removing `removable` of the non-protected layers (the largest ones, or the smallest)."""
    sizes = sorted(size for index, size in enumerate(shape.layer_parameters) if index not in protected)
    low = shape.num_parameters - sum(sizes[len(sizes) - int(removable.high) :])
    high = shape.num_parameters - sum(sizes[: int(removable.low)])
    return Count(low, high)


def _tokenizer_bytes(model_or_path: Any) -> int | None:
    """The size of the tokenizer's files in a local model folder; `None` elsewhere."""
    if not isinstance(model_or_path, (str, os.PathLike)) or not os.path.isdir(model_or_path):
        return None
    names = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model")
    return sum(
        os.path.getsize(os.path.join(model_or_path, name)) for name in names if os.path.isfile(os.path.join(model_or_path, name))
    )


def _resolve_dtype(dtype: torch.dtype | str, config: PretrainedConfig) -> torch.dtype:
    """`dtype` as a `torch.dtype`: `"checkpoint"` (or `"auto"` as `resolve_dtype` returns it) is the config's."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in ("checkpoint", "auto"):
        saved = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
        return getattr(torch, saved) if isinstance(saved, str) else saved
    if dtype in ("float32", "bfloat16", "float16"):
        return getattr(torch, dtype)
    raise InvalidInputError(f"dtype={dtype!r}: expected float32, bfloat16, float16 or checkpoint.")


def plan_heal(
    pruned: PreTrainedModel | PretrainedConfig | str | os.PathLike,
    teacher: PreTrainedModel | PretrainedConfig | str | os.PathLike,
    config: GradMAPConfig,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device | None = None,
    throughput: DeviceThroughput | None = None,
    measure: bool = True,
    device_map: str | dict[str, Any] | None = None,
    max_memory: dict[int | str, str] | None = None,
) -> PruningPlan:
    """The plan of `optimum-gradmap heal` on a pruned checkpoint: its tokens, FLOPs, peak memory (the teacher is loaded
    for its pass beside the student) and time. Only the configs are read.

    Args:
        pruned (`PreTrainedModel`, `PretrainedConfig`, `str` or `os.PathLike`): The pruned checkpoint.
        teacher (`PreTrainedModel`, `PretrainedConfig`, `str` or `os.PathLike`): The dense model it was pruned from.
        config ([`GradMAPConfig`]): Its `heal_*` settings are read (`heal_tokens` > 0).
        dtype, device, throughput, measure, device_map, max_memory: As in [`plan_pruning`]; with a device map that
            offloads layers, both models are offloaded and the training steps run layer-streamed.

    Returns:
        [`PruningPlan`] with the heal stage alone.
    """
    if not config.heal_tokens:
        raise InvalidInputError("The heal needs a budget: give `heal_tokens` (e.g. heal_tokens=200_000).")
    if config.heal_tokens == "auto":
        raise InvalidInputError(
            "heal --dry-run plans a number of tokens: `auto` takes them from Stage 1's time measured in the run itself. "
            "Give --heal-tokens N to see what N tokens cost."
        )
    pruned_config, teacher_config = load_model_config(pruned), load_model_config(teacher)
    dtype = _resolve_dtype(dtype, teacher_config)
    device = torch.device(device if device is not None else "cpu")
    name = os.fspath(pruned) if isinstance(pruned, (str, os.PathLike)) else getattr(pruned_config, "_name_or_path", "")
    teacher_shape = describe_model(teacher_config, dtype, config.heal_batch_size, config.heal_seq_len, name=str(teacher))
    student = describe_model(pruned_config, dtype, config.heal_batch_size, config.heal_seq_len, name=name)
    process = _process_bytes() if device.type == "cpu" else 0
    if throughput is None and measure:
        throughput = DeviceThroughput.measure(teacher_config, dtype, device, config.heal_batch_size, config.heal_seq_len)
    work, counts = _heal(config, teacher_shape, student.num_layers, teacher_shape.num_layers)
    memory = _heal_memory(config, student, student.num_layers, counts)
    host = memory["host"] if device.type == "cpu" else 0.0
    training = student.weight_bytes + _allocator_overhead(device) * memory["device"]
    peak = Count.of(max(student.weight_bytes + teacher_shape.weight_bytes, training) + host)
    streamed = None
    if _offloaded_shares(student, pruned_config, device_map, max_memory):
        largest = max(teacher_shape.layer_parameters) * teacher_shape.dtype_bytes
        student_kept = _weights_kept_on_device(student, pruned_config, device_map, max_memory, device) or 0.0
        teacher_kept = _weights_kept_on_device(teacher_shape, teacher_config, device_map, max_memory, device) or 0.0
        teacher_pass = (
            student_kept + teacher_kept + largest + _logits_bytes(teacher_shape, config.heal_batch_size, config.heal_seq_len)
        )
        streamed = max(teacher_pass, student_kept + largest + memory["streamed"]) + host + process
    stage = _stage_plan(
        "Heal",
        f"{counts['steps']} steps, {counts['checks']} checks",
        (counts["train_sequences"] + counts["validation_sequences"]) * config.heal_seq_len,
        work,
        teacher_shape,
        throughput,
        peak.low + process,
        streamed,
        memory["host"],
        heal=True,
    )
    trained = f"{config.heal_trainable} ({_count_text(memory['trained'])} parameters)"
    return PruningPlan(
        model=name,
        model_type=student.model_type,
        dtype=str(dtype).replace("torch.", ""),
        num_layers=student.num_layers,
        num_parameters=student.num_parameters,
        weight_bytes=student.weight_bytes,
        largest_layer_bytes=max(student.layer_parameters) * student.dtype_bytes,
        num_layers_to_remove=teacher_shape.num_layers - student.num_layers,
        rounds=ZERO,
        budget=None,
        stage1=f"none (the checkpoint was pruned from {teacher_shape.name}'s {teacher_shape.num_layers} layers)",
        stage2=f"none; heal trains {trained} on {config.heal_tokens:,} tokens of {config.heal_dataset}",
        execution="layer_streamed" if streamed is not None else "in_memory",
        stages=[stage],
        output_bytes=Count.of(student.weight_bytes + (_tokenizer_bytes(pruned) or 0) + _REPORT_BYTES),
        throughput=throughput,
        notes=["The teacher is loaded for its pass beside the student: in memory, the peak holds both models' weights."],
    )
