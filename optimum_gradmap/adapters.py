# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Architecture adapters: how each model family exposes its decoder layers and what must change in its config.

Everything the pruning algorithm needs to know about a model family lives here, behind
[`DecoderAdapter`]. The algorithm itself (importance scoring, compensation, orchestration) never
looks at `model_type`.

Adding a family means adding one small adapter and registering it:

```python
from optimum_gradmap.adapters import DecoderAdapter, register_adapter


@register_adapter("my_model")
class MyModelAdapter(DecoderAdapter):
    layers_path = "model.decoder.layers"
    down_projection_paths = ("mlp.fc2",)
```
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel


class UnsupportedArchitectureError(ValueError):
    """Raised when a model's family has no registered adapter."""


@dataclass
class LayerSnapshot:
    """The decoder stack of a model as it was before any layer was removed.

    Surgery is always expressed as "keep these original layers", so the dense model can be restored
    exactly (Stage 2 compares the pruned model against it) and repeated surgery never compounds.

    Args:
        layers (`list[nn.Module]`):
            The original decoder layers, indexed by their original position.
        config_values (`dict[str, Any]`):
            Deep copies of the original values of every config field that surgery rewrites.
        device_map (`dict[str, Any]`, *optional*):
            The model's `hf_device_map` (accelerate dispatch), naming layers by original index.
    """

    layers: list[nn.Module]
    config_values: dict[str, Any] = field(default_factory=dict)
    device_map: dict[str, Any] | None = None

    @property
    def num_layers(self) -> int:
        return len(self.layers)


def _has_submodule(root: nn.Module, path: str) -> bool:
    module = root
    for name in path.split("."):
        if not hasattr(module, name):
            return False
        module = getattr(module, name)
    return True


def _get_submodule(root: nn.Module, path: str) -> nn.Module:
    module = root
    for name in path.split("."):
        if not hasattr(module, name):
            raise AttributeError(f"{type(root).__name__} has no submodule `{path}` (missing `{name}`).")
        module = getattr(module, name)
    return module


class DecoderAdapter:
    """Describes one family of decoder-only causal LMs to the pruner.

    The defaults describe the Llama layout (`model.layers`, `mlp.down_proj`, `num_hidden_layers`),
    which most families share; a family overrides only what differs.

    Attributes:
        layers_path (`str`):
            Dotted path from the `*ForCausalLM` model to its `nn.ModuleList` of decoder layers.
        layer_count_field (`str`):
            Name of the config field that holds the number of decoder layers.
        mlp_path (`str`):
            Dotted path, inside one decoder layer, of the MLP: the module whose output Y Stage 2
            multiplies by W'.
        mlp_output_norm_path (`str`, *optional*):
            Dotted path of a norm applied to the MLP output before the residual add (Gemma2/3's and
            OLMo2's `post_feedforward_layernorm`). Stage 2 then fits W' with this norm in the loop.
        down_projection_paths (`tuple[str, ...]`):
            Candidate dotted paths, inside one decoder layer, of the last linear maps of the MLP (an
            `nn.Linear`, a transformers `Conv1D`, or a 3D expert weight of shape (experts, d, k)). The
            MLP output is linear in their outputs, so Stage 2 folds W' into each of those present.
        per_sample_units (`tuple[str, ...]`):
            Dotted paths of modules that Stage 1 scores as a whole (their parameters' per-sample
            gradients computed together), for blocks that regroup tokens across samples, such as
            mixture-of-experts blocks.
        layer_index_attributes (`tuple[str, ...]`):
            Attribute names that modules inside a layer use to know their position (the attention's
            `layer_idx`, used to address the KV cache). Every module of a kept layer that has one
            is renumbered.
        threshold_config_fields (`tuple[str, ...]`):
            Integer config fields meaning "layers with an index below this value behave one way,
            the others another way" (Qwen2's `max_window_layers`). Surgery rewrites them to the
            number of kept layers that were below the threshold, so the split is preserved.
        index_config_fields (`tuple[str, ...]`):
            Other config fields that depend on layer indices (lists of indices, periods); the
            adapter's [`~DecoderAdapter.update_config`] rewrites them.
    """

    model_types: tuple[str, ...] = ()
    layers_path: str = "model.layers"
    layer_count_field: str = "num_hidden_layers"
    mlp_path: str = "mlp"
    mlp_output_norm_path: str | None = None
    down_projection_paths: tuple[str, ...] = ("mlp.down_proj",)
    per_sample_units: tuple[str, ...] = ()
    layer_index_attributes: tuple[str, ...] = ("layer_idx",)
    threshold_config_fields: tuple[str, ...] = ()
    index_config_fields: tuple[str, ...] = ()

    # ----------------------------------------------------------------------------------------- access
    def get_layers(self, model: nn.Module) -> nn.ModuleList:
        """Returns the model's decoder layers."""
        layers = _get_submodule(model, self.layers_path)
        if not isinstance(layers, nn.ModuleList):
            raise TypeError(f"`{self.layers_path}` of {type(model).__name__} is a {type(layers).__name__}, not a ModuleList.")
        return layers

    def num_layers(self, model: nn.Module) -> int:
        """Returns the number of decoder layers the model currently runs."""
        return len(self.get_layers(model))

    def get_mlp(self, layer: nn.Module) -> nn.Module:
        """Returns the MLP of `layer`, whose output Y Stage 2 multiplies by W'."""
        return _get_submodule(layer, self.mlp_path)

    def get_mlp_output_norm(self, layer: nn.Module) -> nn.Module | None:
        """Returns the norm applied to the MLP output before the residual add, if the family has one."""
        return _get_submodule(layer, self.mlp_output_norm_path) if self.mlp_output_norm_path else None

    def get_down_projections(self, layer: nn.Module) -> list[nn.Module | nn.Parameter]:
        """Returns the last linear maps of `layer`'s MLP, into which Stage 2 folds W'."""
        found = [_get_submodule(layer, path) for path in self.down_projection_paths if _has_submodule(layer, path)]
        if not found:
            raise AttributeError(f"{type(layer).__name__} has none of the down projections {self.down_projection_paths}.")
        return found

    def get_per_sample_units(self, layer: nn.Module) -> list[nn.Module]:
        """Returns the modules of `layer` that Stage 1 scores as a whole."""
        return [_get_submodule(layer, path) for path in self.per_sample_units if _has_submodule(layer, path)]

    def get_decoder(self, model: PreTrainedModel) -> nn.Module:
        """Returns the part of the model that maps `inputs_embeds` to the final hidden states (the
        input of the language-model head)."""
        return model.base_model

    def compute_logits(self, model: PreTrainedModel, hidden_states: torch.Tensor) -> torch.Tensor:
        """Maps final hidden states to logits, as the model's own forward does: the output embedding,
        then `final_logit_softcapping` where the config sets it (Gemma2). Stage 1 applies it to a few
        tokens at a time, so the logits of a whole batch never exist at once."""
        logits = model.get_output_embeddings()(hidden_states)
        softcap = getattr(self.get_text_config(model), "final_logit_softcapping", None)
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        return logits

    def check_supported(self, model: PreTrainedModel, compensation: bool) -> None:
        """Raises [`UnsupportedArchitectureError`] for configurations of the family that cannot be
        pruned (or compensated) correctly. Called before the model is changed."""

    def get_text_config(self, model: PreTrainedModel) -> PretrainedConfig:
        """Returns the config that describes the decoder stack."""
        return model.config.get_text_config(decoder=True)

    # ---------------------------------------------------------------------------------------- surgery
    def per_layer_config_fields(self, config: PretrainedConfig, num_layers: int) -> list[str]:
        """Names the config fields that hold one entry per layer.

        One general rule: every list or tuple field whose length equals the layer count
        (`layer_types`, per-layer head counts, ...). Families with index-based fields extend
        this through `threshold_config_fields` or by overriding [`~DecoderAdapter.update_config`].
        """
        return [
            name
            for name, value in vars(config).items()
            if isinstance(value, (list, tuple))
            and len(value) == num_layers
            and not name.startswith("_")
            and name not in self.index_config_fields
        ]

    def snapshot(self, model: PreTrainedModel) -> LayerSnapshot:
        """Records the decoder stack and every config field that surgery will rewrite."""
        config = self.get_text_config(model)
        layers = list(self.get_layers(model))
        fields = [
            self.layer_count_field,
            *self.threshold_config_fields,
            *self.index_config_fields,
            *self.per_layer_config_fields(config, len(layers)),
        ]
        values = {name: copy.deepcopy(getattr(config, name)) for name in fields if hasattr(config, name)}
        device_map = copy.deepcopy(getattr(model, "hf_device_map", None))
        return LayerSnapshot(layers=layers, config_values=values, device_map=device_map)

    def keep_layers(self, model: PreTrainedModel, snapshot: LayerSnapshot, kept: Sequence[int]) -> None:
        """Makes `model` run exactly the original layers `kept`, in that order.

        Rebuilds the layer list from `snapshot`, renumbers every layer-index attribute, and rewrites
        the config so that it describes the new stack: the saved `config.json` then rebuilds this
        exact model.

        Args:
            model (`PreTrainedModel`): The model to change, in place.
            snapshot (`LayerSnapshot`): The dense stack, from [`~DecoderAdapter.snapshot`].
            kept (`Sequence[int]`): Original indices of the layers to keep, strictly increasing.
        """
        kept = list(kept)
        if not kept:
            raise ValueError("At least one decoder layer must be kept.")
        if sorted(set(kept)) != kept or kept[0] < 0 or kept[-1] >= snapshot.num_layers:
            raise ValueError(f"Kept layers must be strictly increasing indices in [0, {snapshot.num_layers}), got {kept}.")

        layers = self.get_layers(model)
        new_layers = nn.ModuleList([snapshot.layers[index] for index in kept])
        parent_path, _, attribute = self.layers_path.rpartition(".")
        parent = _get_submodule(model, parent_path) if parent_path else model
        setattr(parent, attribute, new_layers)
        del layers

        for new_index, layer in enumerate(new_layers):
            for module in layer.modules():
                for attribute_name in self.layer_index_attributes:
                    if isinstance(getattr(module, attribute_name, None), int):
                        setattr(module, attribute_name, new_index)

        self.update_config(self.get_text_config(model), snapshot, kept)
        if snapshot.device_map is not None:
            model.hf_device_map = self._renumber_device_map(snapshot.device_map, kept)

    def restore(self, model: PreTrainedModel, snapshot: LayerSnapshot) -> None:
        """Puts back every layer of `snapshot` and the exact config values it recorded."""
        self.keep_layers(model, snapshot, list(range(snapshot.num_layers)))
        config = self.get_text_config(model)
        for name, value in snapshot.config_values.items():
            setattr(config, name, copy.deepcopy(value))

    def update_config(self, config: PretrainedConfig, snapshot: LayerSnapshot, kept: Sequence[int]) -> None:
        """Rewrites the layer-dependent config fields for the kept layers."""
        original_count = snapshot.num_layers
        for name, value in snapshot.config_values.items():
            if name == self.layer_count_field:
                setattr(config, name, len(kept))
            elif name in self.threshold_config_fields:
                if isinstance(value, int):
                    setattr(config, name, sum(1 for index in kept if index < value))
            elif isinstance(value, (list, tuple)) and len(value) == original_count:
                sliced = [copy.deepcopy(value[index]) for index in kept]
                setattr(config, name, type(value)(sliced) if isinstance(value, tuple) else sliced)

    def _renumber_device_map(self, device_map: dict[str, Any], kept: Sequence[int]) -> dict[str, Any]:
        prefix = self.layers_path + "."
        new_position = {original: new for new, original in enumerate(kept)}
        renumbered: dict[str, Any] = {}
        for name, device in device_map.items():
            if name.startswith(prefix):
                index, _, rest = name[len(prefix) :].partition(".")
                if index.isdigit():
                    if int(index) not in new_position:
                        continue
                    name = prefix + str(new_position[int(index)]) + ("." + rest if rest else "")
            renumbered[name] = device
        return renumbered


_ADAPTERS: dict[str, type[DecoderAdapter]] = {}


def register_adapter(*model_types: str):
    """Class decorator that registers an adapter for one or more `config.model_type` values."""

    def decorator(cls: type[DecoderAdapter]) -> type[DecoderAdapter]:
        cls.model_types = tuple(model_types)
        for model_type in model_types:
            _ADAPTERS[model_type] = cls
        return cls

    return decorator


def supported_model_types() -> list[str]:
    """Returns the `model_type` values that have an adapter."""
    return sorted(_ADAPTERS)


def adapter_for_model_type(model_type: str) -> DecoderAdapter | None:
    """Returns the adapter registered for `model_type`, or `None`."""
    return _ADAPTERS[model_type]() if model_type in _ADAPTERS else None


def get_adapter(model: PreTrainedModel) -> DecoderAdapter:
    """Returns the adapter for `model`'s family.

    Raises:
        UnsupportedArchitectureError: if the family has no adapter. The model is not touched.
    """
    config = getattr(model, "config", None)
    model_type = getattr(config.get_text_config(decoder=True), "model_type", None) if config is not None else None
    if model_type not in _ADAPTERS:
        raise UnsupportedArchitectureError(
            f"GradMAP has no adapter for model type {model_type!r} ({type(model).__name__}). "
            f"Supported model types: {', '.join(supported_model_types())}. "
            "To add a family, subclass `optimum_gradmap.adapters.DecoderAdapter` and register it with "
            '`@register_adapter("<model_type>")` (see docs/adapters.md).'
        )
    return _ADAPTERS[model_type]()


@register_adapter("llama", "mistral", "phi3")
class LlamaAdapter(DecoderAdapter):
    """Llama, Mistral and Phi-3 (fused `gate_up_proj`, same `mlp.down_proj`): the default layout."""


@register_adapter("qwen2", "qwen3")
class Qwen2Adapter(DecoderAdapter):
    """Qwen2 (q/k/v biases) and Qwen3 (q/k norms): the Llama layout plus the `max_window_layers` threshold."""

    threshold_config_fields = ("max_window_layers",)


@register_adapter("gemma2", "gemma3_text", "olmo2")
class PostNormAdapter(DecoderAdapter):
    """Gemma2, Gemma3 and OLMo2: a norm (`post_feedforward_layernorm`) follows the MLP."""

    mlp_output_norm_path = "post_feedforward_layernorm"


@register_adapter("opt")
class OPTAdapter(DecoderAdapter):
    """OPT: layers under `model.decoder`, the MLP is `fc1` -> activation -> `fc2` (with bias) inline."""

    layers_path = "model.decoder.layers"
    mlp_path = "fc2"
    down_projection_paths = ("fc2",)

    def check_supported(self, model: PreTrainedModel, compensation: bool) -> None:
        if compensation and not self.get_text_config(model).do_layer_norm_before:
            raise UnsupportedArchitectureError(
                "This OPT model normalises after the residual add (do_layer_norm_before=False, as OPT-350m), "
                "so a map folded into fc2 does not act on the layer output linearly. Prune it with "
                "compensation=False."
            )


@register_adapter("gpt2")
class GPT2Adapter(DecoderAdapter):
    """GPT-2: layers in `transformer.h`, `n_layer`, Conv1D weights stored transposed."""

    layers_path = "transformer.h"
    layer_count_field = "n_layer"
    down_projection_paths = ("mlp.c_proj",)

    def check_supported(self, model: PreTrainedModel, compensation: bool) -> None:
        if getattr(self.get_text_config(model), "scale_attn_by_inverse_layer_idx", False):
            raise UnsupportedArchitectureError(
                "This GPT-2 model scales attention by 1/(layer index + 1) (scale_attn_by_inverse_layer_idx=True): "
                "a layer's computation depends on its position, so no checkpoint of the pruned stack would "
                "reproduce it."
            )


@register_adapter("gpt_neox")
class GPTNeoXAdapter(DecoderAdapter):
    """GPT-NeoX / Pythia: layers in `gpt_neox.layers`, MLP output `mlp.dense_4h_to_h` (parallel residual or not)."""

    layers_path = "gpt_neox.layers"
    down_projection_paths = ("mlp.dense_4h_to_h",)


@register_adapter("mixtral")
class MixtralAdapter(DecoderAdapter):
    """Mixtral: every MLP is a mixture of experts with fused 3D expert weights. W' is folded into every
    expert's down projection (it commutes with the routing-weighted sum)."""

    down_projection_paths = ("mlp.experts.down_proj",)
    per_sample_units = ("mlp",)


@register_adapter("qwen2_moe", "qwen3_moe")
class QwenMoeAdapter(Qwen2Adapter):
    """Qwen2-MoE and Qwen3-MoE: sparse layers (experts, plus a gated shared expert in Qwen2-MoE) and
    dense layers chosen by `mlp_only_layers` and `decoder_sparse_step`."""

    down_projection_paths = ("mlp.experts.down_proj", "mlp.shared_expert.down_proj", "mlp.down_proj")
    per_sample_units = ("mlp",)
    index_config_fields = ("mlp_only_layers", "decoder_sparse_step")

    def update_config(self, config: PretrainedConfig, snapshot: LayerSnapshot, kept: Sequence[int]) -> None:
        super().update_config(config, snapshot, kept)
        mlp_only = set(snapshot.config_values.get("mlp_only_layers") or [])
        step = snapshot.config_values.get("decoder_sparse_step") or 1
        sparse = [index not in mlp_only and config.num_experts > 0 and (index + 1) % step == 0 for index in kept]
        # step 1 plus an explicit list of dense layers describes any pattern exactly
        config.decoder_sparse_step = 1
        config.mlp_only_layers = [position for position, is_sparse in enumerate(sparse) if not is_sparse]


def remove_layers(model: PreTrainedModel, layer_indices: Sequence[int]) -> list[int]:
    """Removes the given decoder layers from `model` in place and fixes its config.

    Args:
        model (`PreTrainedModel`): A model of a supported family.
        layer_indices (`Sequence[int]`): Current indices of the layers to remove.

    Returns:
        `list[int]`: The indices of the layers that remain, in order.
    """
    adapter = get_adapter(model)
    snapshot = adapter.snapshot(model)
    removed = set(int(index) for index in layer_indices)
    if any(index < 0 or index >= snapshot.num_layers for index in removed):
        raise ValueError(f"Layer indices must lie in [0, {snapshot.num_layers}), got {sorted(removed)}.")
    kept = [index for index in range(snapshot.num_layers) if index not in removed]
    adapter.keep_layers(model, snapshot, kept)
    return kept
