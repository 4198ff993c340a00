# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Layer-stack surgery: which of the original decoder layers a model runs, with a config that says so.

Surgery is always expressed as "keep these original layers" from a [`LayerSnapshot`] of the stack,
so the dense model can be restored exactly (Stage 2 compares the pruned model against it) and
repeated surgery never compounds. Keeping a set of layers:

- rebuilds the layer `nn.ModuleList` from the snapshot;
- renumbers every layer-index attribute (`layer_idx`, which addresses the KV cache);
- rewrites every layer-dependent config field, as the family's adapter declares them: the layer
  count, per-layer lists (sliced), thresholds such as `max_window_layers` (recounted) and other
  index fields (the adapter's `rewrite_index_fields`), so that the saved `config.json` rebuilds
  exactly the pruned model;
- renumbers the accelerate device map, if the model has one.

```python
from optimum_gradmap import surgery

dense = surgery.snapshot(model)
surgery.keep(model, dense, [0, 1, 3, 5])  # the model now runs 4 layers
with surgery.temporarily(model, dense, range(dense.num_layers)):
    ...  # the dense model, for this block only
surgery.restore(model, dense)  # the dense model again, exact config values included
```
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from .adapters import DecoderAdapter, get_adapter, get_submodule


@dataclass
class LayerSnapshot:
    """A model's decoder stack as it was when the snapshot was taken.

    Args:
        layers (`list[nn.Module]`):
            The decoder layers, indexed by their position at snapshot time ("original indices").
        config_values (`dict[str, Any]`):
            Deep copies of the values of every config field that surgery rewrites.
        device_map (`dict[str, Any]`, *optional*):
            The model's `hf_device_map` (accelerate dispatch), naming layers by original index.
    """

    layers: list[nn.Module]
    config_values: dict[str, Any] = field(default_factory=dict)
    device_map: dict[str, Any] | None = None

    @property
    def num_layers(self) -> int:
        return len(self.layers)


def layer_dependent_fields(adapter: DecoderAdapter, config: PretrainedConfig, num_layers: int) -> list[str]:
    """Every config field whose value depends on the layer stack, for a config of `num_layers` layers:
    the layer count, thresholds, index fields and per-layer lists, as `adapter` declares them."""
    names = [
        adapter.layer_count_field,
        *adapter.threshold_config_fields,
        *adapter.index_config_fields,
        *adapter.per_layer_config_fields(config, num_layers),
    ]
    return [name for name in dict.fromkeys(names) if hasattr(config, name)]


def snapshot(model: PreTrainedModel, adapter: DecoderAdapter | None = None) -> LayerSnapshot:
    """Records the model's decoder stack and every config field that surgery will rewrite.

    Args:
        model (`PreTrainedModel`): A model of a supported family.
        adapter (`DecoderAdapter`, *optional*): Its adapter; looked up when not given.
    """
    adapter = adapter or get_adapter(model)
    config = adapter.get_text_config(model)
    layers = list(adapter.get_layers(model))
    values = {name: copy.deepcopy(getattr(config, name)) for name in layer_dependent_fields(adapter, config, len(layers))}
    device_map = copy.deepcopy(getattr(model, "hf_device_map", None))
    return LayerSnapshot(layers=layers, config_values=values, device_map=device_map)


def kept_layers(model: PreTrainedModel, snapshot: LayerSnapshot, adapter: DecoderAdapter | None = None) -> list[int]:
    """The original indices of the layers `model` runs now.

    Raises:
        ValueError: if the model runs a layer that is not in `snapshot`.
    """
    adapter = adapter or get_adapter(model)
    position = {id(layer): index for index, layer in enumerate(snapshot.layers)}
    current = list(adapter.get_layers(model))
    if any(id(layer) not in position for layer in current):
        raise ValueError("The model runs a layer that is not in the snapshot: take the snapshot before changing the stack.")
    return [position[id(layer)] for layer in current]


def keep(model: PreTrainedModel, snapshot: LayerSnapshot, kept: Iterable[int], adapter: DecoderAdapter | None = None) -> None:
    """Makes `model` run exactly the original layers `kept`, in that order, with a config that says so.

    Args:
        model (`PreTrainedModel`): The model to change, in place.
        snapshot (`LayerSnapshot`): The stack the indices refer to, from [`snapshot`].
        kept (`Iterable[int]`): Original indices of the layers to keep, strictly increasing.
        adapter (`DecoderAdapter`, *optional*): The model's adapter; looked up when not given.
    """
    adapter = adapter or get_adapter(model)
    kept = list(kept)
    if not kept:
        raise ValueError("At least one decoder layer must be kept.")
    if sorted(set(kept)) != kept or kept[0] < 0 or kept[-1] >= snapshot.num_layers:
        raise ValueError(f"Kept layers must be strictly increasing indices in [0, {snapshot.num_layers}), got {kept}.")

    parent_path, _, attribute = adapter.layers_path.rpartition(".")
    setattr(get_submodule(model, parent_path), attribute, nn.ModuleList([snapshot.layers[index] for index in kept]))
    for new_index, layer in enumerate(adapter.get_layers(model)):
        for module in layer.modules():
            for attribute_name in adapter.layer_index_attributes:
                if isinstance(getattr(module, attribute_name, None), int):
                    setattr(module, attribute_name, new_index)

    rewrite_config(adapter, adapter.get_text_config(model), snapshot, kept)
    if snapshot.device_map is not None:
        model.hf_device_map = _renumber_device_map(adapter, snapshot.device_map, kept)


def restore(model: PreTrainedModel, snapshot: LayerSnapshot, adapter: DecoderAdapter | None = None) -> None:
    """Puts back every layer of `snapshot` and the exact config values it recorded."""
    adapter = adapter or get_adapter(model)
    keep(model, snapshot, range(snapshot.num_layers), adapter)
    _set_config_values(adapter.get_text_config(model), snapshot.config_values)


@contextmanager
def temporarily(
    model: PreTrainedModel, snapshot: LayerSnapshot, kept: Iterable[int], adapter: DecoderAdapter | None = None
) -> Iterator[None]:
    """Runs the original layers `kept` inside the block, then puts back the stack and the exact
    config values the model had before it (even when the block raises)."""
    adapter = adapter or get_adapter(model)
    previous = kept_layers(model, snapshot, adapter)
    config = adapter.get_text_config(model)
    previous_values = {name: copy.deepcopy(getattr(config, name)) for name in snapshot.config_values if hasattr(config, name)}
    previous_device_map = getattr(model, "hf_device_map", None)
    try:
        keep(model, snapshot, kept, adapter)
        yield
    finally:
        keep(model, snapshot, previous, adapter)
        _set_config_values(config, previous_values)
        if previous_device_map is not None:
            model.hf_device_map = previous_device_map


def replace(model: PreTrainedModel, position: int, module: nn.Module, adapter: DecoderAdapter | None = None) -> nn.Module:
    """Puts `module` at `position` of the layer list (no renumbering, no config change) and returns
    the layer it replaces. For stand-ins during a pass (SLEB replays recorded hidden states)."""
    adapter = adapter or get_adapter(model)
    layers = adapter.get_layers(model)
    replaced = layers[position]
    layers[position] = module
    return replaced


def remove_layers(model: PreTrainedModel, layer_indices: Sequence[int]) -> list[int]:
    """Removes the given decoder layers from `model` in place and fixes its config.

    Args:
        model (`PreTrainedModel`): A model of a supported family.
        layer_indices (`Sequence[int]`): Current indices of the layers to remove.

    Returns:
        `list[int]`: The indices of the layers that remain, in order.
    """
    adapter = get_adapter(model)
    stack = snapshot(model, adapter)
    removed = {int(index) for index in layer_indices}
    if any(index < 0 or index >= stack.num_layers for index in removed):
        raise ValueError(f"Layer indices must lie in [0, {stack.num_layers}), got {sorted(removed)}.")
    kept = [index for index in range(stack.num_layers) if index not in removed]
    keep(model, stack, kept, adapter)
    return kept


def rewrite_config(adapter: DecoderAdapter, config: PretrainedConfig, snapshot: LayerSnapshot, kept: Sequence[int]) -> None:
    """Rewrites the layer-dependent config fields recorded in `snapshot` for the kept layers."""
    if type(adapter).update_config is not DecoderAdapter.update_config:  # an adapter written for the old API
        warnings.warn(
            f"{type(adapter).__name__} overrides the deprecated `update_config`: override `rewrite_index_fields` instead.",
            FutureWarning,
            stacklevel=2,
        )
        type(adapter).update_config(adapter, config, snapshot, kept)
    else:
        rewrite_fields(adapter, config, snapshot, kept)


def rewrite_fields(adapter: DecoderAdapter, config: PretrainedConfig, snapshot: LayerSnapshot, kept: Sequence[int]) -> None:
    """The rewriting [`rewrite_config`] does: count, thresholds, per-layer lists, then the adapter's index fields."""
    for name, value in snapshot.config_values.items():
        if name == adapter.layer_count_field:
            setattr(config, name, len(kept))
        elif name in adapter.threshold_config_fields:
            if isinstance(value, int):
                setattr(config, name, sum(1 for index in kept if index < value))
        elif name in adapter.index_config_fields:
            continue
        elif isinstance(value, (list, tuple)) and len(value) == snapshot.num_layers:
            sliced = [copy.deepcopy(value[index]) for index in kept]
            setattr(config, name, type(value)(sliced) if isinstance(value, tuple) else sliced)
    for name, value in adapter.rewrite_index_fields(config, snapshot.config_values, kept).items():
        setattr(config, name, value)


def _set_config_values(config: PretrainedConfig, values: dict[str, Any]) -> None:
    for name, value in values.items():
        setattr(config, name, copy.deepcopy(value))


def _renumber_device_map(adapter: DecoderAdapter, device_map: dict[str, Any], kept: Sequence[int]) -> dict[str, Any]:
    prefix = adapter.layers_path + "."
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
