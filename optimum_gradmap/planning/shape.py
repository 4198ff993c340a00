# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""The model's shape, read from its config alone: [`ModelShape`] (its layers, widths, parameters and each layer's
cost), built by [`describe_model`] on the meta device (no weight is read, none is allocated)."""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from .. import surgery
from ..adapters import DecoderAdapter, get_adapter
from ..errors import InvalidInputError
from ..weights import is_linear_map
from .layers import LayerCost, layer_costs

# The most parameter bytes of the layer the throughput is measured on: a wider layer is measured narrowed (the same
# family and layer type, its widths divided; the rates are FLOPs over seconds, so the seconds scale with the FLOPs).
MEASURED_LAYER_BYTES = 512 * 2**20
# The widths a narrowed layer divides (those its config names), beside the attention heads.
_WIDTHS = ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size", "ffn_dim", "n_inner")


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
        kv_width (`int`): The width of one token's keys (as of its values) in one layer's KV cache.
        layer_linear_maps (`list[list[tuple[int, int]]]`): Each decoder layer's `nn.Linear` maps as (input width,
            output width): what the quantization step quantizes.
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
    kv_width: int = 0
    layer_linear_maps: list[list[tuple[int, int]]] = field(default_factory=list)

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


def layer_dependent_config(config: PretrainedConfig, adapter: DecoderAdapter, kept: Sequence[int]) -> PretrainedConfig:
    """A copy of `config` describing only the layers `kept` (surgery's rewrite of every layer-dependent field)."""
    config = copy.deepcopy(config)
    text = config.get_text_config(decoder=True)
    num_layers = getattr(text, adapter.layer_count_field)
    values = {name: copy.deepcopy(getattr(text, name)) for name in surgery.layer_dependent_fields(adapter, text, num_layers)}
    surgery.rewrite_fields(adapter, text, values, num_layers, kept)
    return config


def resolve_dtype(dtype: torch.dtype | str, config: PretrainedConfig) -> torch.dtype:
    """`dtype` as a `torch.dtype`: `"checkpoint"` (or `"auto"` as `resolve_dtype` returns it) is the config's."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in ("checkpoint", "auto"):
        saved = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
        return getattr(torch, saved) if isinstance(saved, str) else saved
    if dtype in ("float32", "bfloat16", "float16"):
        return getattr(torch, dtype)
    raise InvalidInputError(f"dtype={dtype!r}: expected float32, bfloat16, float16 or checkpoint.")


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
        kv_width=_kv_width(text),
        layer_linear_maps=[
            [(module.in_features, module.out_features) for module in layer.modules() if isinstance(module, nn.Linear)]
            for layer in layers
        ],
    )
    shape.layers = layer_costs(model, adapter, text, batch_size, seq_len)
    if heal_batch_size is not None and (heal_batch_size, heal_seq_len) != (batch_size, seq_len):
        shape.heal_layers = layer_costs(model, adapter, text, heal_batch_size, heal_seq_len)
    return shape


def _kv_width(text_config: PretrainedConfig) -> int:
    """One token's keys in one layer: key-value heads x head width (the hidden size where the config names neither)."""
    heads = getattr(text_config, "num_attention_heads", None) or 1
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
    return (getattr(text_config, "num_key_value_heads", None) or heads) * head_dim


def narrowed_config(config: PretrainedConfig, shape: ModelShape, bound: int | None = None) -> tuple[PretrainedConfig, int]:
    """The config of a model of the same family whose largest layer holds at most `bound` bytes of parameters: the
    attention heads (queries and keys-values alike, each as wide as before) and the MLP's widths divided by the
    smallest factor that gets there; `(config, 1)` where the largest layer is within `bound` already, or where the
    family's widths cannot be divided (its heads share no divisor that large).

    Args:
        config (`PretrainedConfig`): The model's config.
        shape ([`ModelShape`]): Its shape ([`describe_model`]).
        bound (`int`, *optional*): The most bytes of the narrowed layer's parameters (`None`: `MEASURED_LAYER_BYTES`).

    Returns:
        `tuple[PretrainedConfig, int]`: the config and the factor its widths are divided by.
    """
    bound = MEASURED_LAYER_BYTES if bound is None else bound
    largest = max(shape.layer_parameters) * shape.dtype_bytes
    if largest <= bound:
        return config, 1
    text = config.get_text_config(decoder=True)
    heads = getattr(text, "num_attention_heads", None)
    if not isinstance(heads, int) or not hasattr(text, "hidden_size"):
        return config, 1
    key_values = getattr(text, "num_key_value_heads", None) or heads
    wanted = math.ceil(math.sqrt(largest / bound))  # the parameters go with the square of the widths
    factor = next((f for f in range(wanted, heads + 1) if heads % f == 0 and key_values % f == 0), None)
    if factor is None:
        return config, 1
    narrowed = copy.deepcopy(config)
    text = narrowed.get_text_config(decoder=True)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    if getattr(text, "head_dim", None) is not None or text.hidden_size != heads * head_dim:
        text.head_dim = head_dim
    text.hidden_size = text.hidden_size // factor
    text.num_attention_heads = heads // factor
    if getattr(text, "num_key_value_heads", None):
        text.num_key_value_heads = key_values // factor
    for name in _WIDTHS:
        if isinstance(getattr(text, name, None), int):
            setattr(text, name, max(1, getattr(text, name) // factor))
    return narrowed, factor
