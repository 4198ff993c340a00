# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Architecture adapters: how each model family exposes its decoder layers and which config fields
depend on them.

Everything the library needs to know about a model family lives here, as declarations on a
[`DecoderAdapter`]. The algorithm (importance scoring, compensation, orchestration) and the layer
surgery ([`optimum_gradmap.surgery`]) read them and never look at `model_type`.

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

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel


class UnsupportedArchitectureError(ValueError):
    """Raised when a model's family has no registered adapter, or a configuration of it cannot be pruned."""


def _has_submodule(root: nn.Module, path: str) -> bool:
    module = root
    for name in path.split("."):
        if not hasattr(module, name):
            return False
        module = getattr(module, name)
    return True


def get_submodule(root: nn.Module, path: str) -> nn.Module:
    """The module (or parameter) at dotted `path` under `root`; an empty path is `root` itself."""
    module = root
    for name in path.split(".") if path else ():
        if not hasattr(module, name):
            raise AttributeError(f"{type(root).__name__} has no submodule `{path}` (missing `{name}`).")
        module = getattr(module, name)
    return module


class DecoderAdapter:
    """Describes one family of decoder-only causal LMs.

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
        known_per_layer_config_fields (`tuple[str, ...]`):
            Config fields that hold one entry per layer whatever their length (`layer_types`). A list
            whose length equals the layer count is per-layer too, without being named here.
        threshold_config_fields (`tuple[str, ...]`):
            Integer config fields meaning "layers with an index below this value behave one way,
            the others another way" (Qwen2's `max_window_layers`). Surgery rewrites them to the
            number of kept layers that were below the threshold, so the split is preserved.
        index_config_fields (`tuple[str, ...]`):
            Other config fields that depend on layer indices (lists of indices, periods); the
            adapter's [`~DecoderAdapter.rewrite_index_fields`] says their values for the kept layers.
    """

    model_types: tuple[str, ...] = ()
    layers_path: str = "model.layers"
    layer_count_field: str = "num_hidden_layers"
    mlp_path: str = "mlp"
    mlp_output_norm_path: str | None = None
    down_projection_paths: tuple[str, ...] = ("mlp.down_proj",)
    per_sample_units: tuple[str, ...] = ()
    layer_index_attributes: tuple[str, ...] = ("layer_idx",)
    known_per_layer_config_fields: tuple[str, ...] = ("layer_types",)
    threshold_config_fields: tuple[str, ...] = ()
    index_config_fields: tuple[str, ...] = ()

    # ----------------------------------------------------------------------------------------- access
    def get_layers(self, model: nn.Module) -> nn.ModuleList:
        """Returns the model's decoder layers.

        Args:
            model (`nn.Module`): A model of the family.

        Returns:
            `nn.ModuleList`: The layers at `layers_path`, in forward order.
        """
        layers = get_submodule(model, self.layers_path)
        if not isinstance(layers, nn.ModuleList):
            raise TypeError(f"`{self.layers_path}` of {type(model).__name__} is a {type(layers).__name__}, not a ModuleList.")
        return layers

    def layers_at(self, model: nn.Module, indices: Sequence[int]) -> list[nn.Module]:
        """Returns the model's decoder layers at `indices` (positions in its stack, in the order given).

        Args:
            model (`nn.Module`): A model of the family.
            indices (`Sequence[int]`): Positions in [`get_layers`]'s list.

        Returns:
            `list[nn.Module]`
        """
        layers = self.get_layers(model)
        return [layers[index] for index in indices]

    def num_layers(self, model: nn.Module) -> int:
        """Returns the number of decoder layers the model currently runs.

        Args:
            model (`nn.Module`): A model of the family.

        Returns:
            `int`: The length of [`get_layers`].
        """
        return len(self.get_layers(model))

    def get_mlp(self, layer: nn.Module) -> nn.Module:
        """Returns the MLP of `layer`, whose output Y Stage 2 multiplies by W'.

        Args:
            layer (`nn.Module`): A decoder layer.

        Returns:
            `nn.Module`: The module at `mlp_path`.
        """
        return get_submodule(layer, self.mlp_path)

    def get_mlp_output_norm(self, layer: nn.Module) -> nn.Module | None:
        """Returns the norm applied to the MLP output before the residual add, if the family has one.

        Args:
            layer (`nn.Module`): A decoder layer.

        Returns:
            `nn.Module` or `None`: The module at `mlp_output_norm_path`; `None` where the MLP output reaches the
            residual stream directly.
        """
        return get_submodule(layer, self.mlp_output_norm_path) if self.mlp_output_norm_path else None

    def get_down_projections(self, layer: nn.Module) -> list[nn.Module | nn.Parameter]:
        """Returns the last linear maps of `layer`'s MLP, into which Stage 2 folds W'.

        Args:
            layer (`nn.Module`): A decoder layer.

        Returns:
            `list[nn.Module | nn.Parameter]`: Those of `down_projection_paths` the layer has (several for a
            mixture of experts: every expert's, and a shared expert's).
        """
        found = [get_submodule(layer, path) for path in self.down_projection_paths if _has_submodule(layer, path)]
        if not found:
            raise AttributeError(f"{type(layer).__name__} has none of the down projections {self.down_projection_paths}.")
        return found

    def get_per_sample_units(self, layer: nn.Module) -> list[nn.Module]:
        """Returns the modules of `layer` that Stage 1 scores as a whole.

        Args:
            layer (`nn.Module`): A decoder layer.

        Returns:
            `list[nn.Module]`: Those of `per_sample_units` the layer has.
        """
        return [get_submodule(layer, path) for path in self.per_sample_units if _has_submodule(layer, path)]

    def get_decoder(self, model: PreTrainedModel) -> nn.Module:
        """Returns the part of the model that maps `inputs_embeds` to the final hidden states (the
        input of the language-model head).

        Args:
            model (`PreTrainedModel`): A causal LM of the family.

        Returns:
            `nn.Module`: `model.base_model` by default.
        """
        return model.base_model

    def compute_logits(self, model: PreTrainedModel, hidden_states: torch.Tensor) -> torch.Tensor:
        """Maps final hidden states to logits, as the model's own forward does: the output embedding,
        then `final_logit_softcapping` where the config sets it (Gemma2). Stage 1 applies it to a few
        tokens at a time, so the logits of a whole batch never exist at once.

        Args:
            model (`PreTrainedModel`): A causal LM of the family.
            hidden_states (`torch.Tensor` of shape `(..., hidden_size)`): Final hidden states ([`final_hidden_states`]).

        Returns:
            `torch.Tensor` of shape `(..., vocab_size)`: The logits.
        """
        logits = model.get_output_embeddings()(hidden_states)
        softcap = getattr(self.get_text_config(model), "final_logit_softcapping", None)
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        return logits

    def final_hidden_states(self, model: PreTrainedModel, **inputs: Any) -> torch.Tensor:
        """Runs the decoder ([`get_decoder`]) on `inputs` (`input_ids` or `inputs_embeds`, masks, ...) and returns
        its final hidden states: with [`compute_logits`], the model's forward split at the head, so that a
        caller forms logits only where it needs them.

        Args:
            model (`PreTrainedModel`): A causal LM of the family.
            inputs: The decoder's keyword arguments.

        Returns:
            `torch.Tensor` of shape `(batch_size, sequence_length, hidden_size)`.
        """
        return self.get_decoder(model)(**inputs)[0]

    def check_supported(self, model: PreTrainedModel, compensation: bool) -> None:
        """Raises [`UnsupportedArchitectureError`] for configurations of the family that cannot be
        pruned (or compensated) correctly. Called before the model is changed.

        Args:
            model (`PreTrainedModel`): The model about to be pruned.
            compensation (`bool`): Whether Stage 2 (or `compensate_each_round`) will fold W' into it.
        """

    def get_text_config(self, model: PreTrainedModel) -> PretrainedConfig:
        """Returns the config that describes the decoder stack.

        Args:
            model (`PreTrainedModel`): A model of the family.

        Returns:
            `PretrainedConfig`: `model.config.get_text_config(decoder=True)` by default (the text config of a
            multimodal model).
        """
        return model.config.get_text_config(decoder=True)

    # ------------------------------------------------------------------------- layer-dependent config
    def per_layer_config_fields(self, config: PretrainedConfig, num_layers: int) -> list[str]:
        """Names the config fields that hold one entry per layer, for a config describing `num_layers`
        layers. Surgery slices them to the kept layers; [`validate_checkpoint`] checks their length.

        One general rule: every list or tuple field whose length equals the layer count (`layer_types`,
        per-layer head counts, ...), plus the `known_per_layer_config_fields` the config has as lists,
        whatever their length (a stale copy of the dense model's list is then caught).

        Args:
            config (`PretrainedConfig`): The text config.
            num_layers (`int`): The number of layers it describes.

        Returns:
            `list[str]`: The field names.
        """
        return [
            name
            for name, value in vars(config).items()
            if isinstance(value, (list, tuple))
            and (len(value) == num_layers or name in self.known_per_layer_config_fields)
            and not name.startswith("_")
            and name not in self.index_config_fields
        ]

    def rewrite_index_fields(
        self, config: PretrainedConfig, original_values: dict[str, Any], kept: Sequence[int]
    ) -> dict[str, Any]:
        """The values of `index_config_fields` that describe the kept layers.

        Args:
            config (`PretrainedConfig`): The text config, other fields already rewritten.
            original_values (`dict[str, Any]`): The dense model's values of every layer-dependent field.
            kept (`Sequence[int]`): Original indices of the kept layers.

        Returns:
            `dict[str, Any]`: Field name to new value; none by default.
        """
        return {}


_ADAPTERS: dict[str, type[DecoderAdapter]] = {}


def register_adapter(*model_types: str) -> Callable[[type[DecoderAdapter]], type[DecoderAdapter]]:
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


def get_adapter(model_or_config: PreTrainedModel | PretrainedConfig) -> DecoderAdapter:
    """Returns the adapter for a model's (or a config's) family. The only adapter lookup.

    Raises:
        UnsupportedArchitectureError: if the family has no adapter. Nothing is touched.
    """
    config = model_or_config if isinstance(model_or_config, PretrainedConfig) else getattr(model_or_config, "config", None)
    model_type = getattr(config.get_text_config(decoder=True), "model_type", None) if config is not None else None
    if model_type not in _ADAPTERS:
        raise UnsupportedArchitectureError(
            f"GradMAP has no adapter for model type {model_type!r} ({type(model_or_config).__name__}). "
            f"Supported model types: {', '.join(supported_model_types())}. "
            "To add a family, subclass `optimum_gradmap.adapters.DecoderAdapter` and register it with "
            '`@register_adapter("<model_type>")` (see docs/guides/new-family.md).'
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

    def rewrite_index_fields(
        self, config: PretrainedConfig, original_values: dict[str, Any], kept: Sequence[int]
    ) -> dict[str, Any]:
        mlp_only = set(original_values.get("mlp_only_layers") or [])
        step = original_values.get("decoder_sparse_step") or 1
        sparse = [index not in mlp_only and config.num_experts > 0 and (index + 1) % step == 0 for index in kept]
        # step 1 plus an explicit list of dense layers describes any pattern exactly
        return {
            "decoder_sparse_step": 1,
            "mlp_only_layers": [position for position, is_sparse in enumerate(sparse) if not is_sparse],
        }
