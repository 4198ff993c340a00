# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Layer-stack surgery: which of the original decoder layers a model runs, with a config that says so.

Surgery is always expressed as "keep these original layers" from a [`LayerSnapshot`] of the stack,
so the dense model can be restored exactly (Stage 2 compares the pruned model against it) and
repeated surgery never compounds. The snapshot holds the model and its family's adapter, resolved
once. Keeping a set of layers:

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
dense.keep([0, 1, 3, 5])  # the model now runs 4 layers
with dense.temporarily(range(dense.num_layers)):
    ...  # the dense model, for this block only
dense.restore()  # the dense model again, exact config values included
```
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from .adapters import DecoderAdapter, get_adapter, get_submodule
from .errors import InvalidInputError
from .weights import WeightBackup, restored


@dataclass
class LayerSnapshot:
    """A model's decoder stack as it was when the snapshot was taken, and the surgery on it.

    Args:
        model (`PreTrainedModel`): The model whose stack this is; surgery changes it in place.
        adapter (`DecoderAdapter`): Its family's adapter.
        layers (`list[nn.Module]`):
            The decoder layers, indexed by their position at snapshot time ("original indices").
        config_values (`dict[str, Any]`):
            Deep copies of the values of every config field that surgery rewrites.
        device_map (`dict[str, Any]`, *optional*):
            The model's `hf_device_map` (accelerate dispatch), naming layers by original index.
    """

    model: PreTrainedModel = field(repr=False, compare=False)
    adapter: DecoderAdapter = field(repr=False, compare=False)
    layers: list[nn.Module] = field(repr=False)
    config_values: dict[str, Any] = field(default_factory=dict)
    device_map: dict[str, Any] | None = None

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def kept_layers(self) -> list[int]:
        """The original indices of the layers the model runs now.

        Raises:
            ValueError: if the model runs a layer that is not in the snapshot.
        """
        position = {id(layer): index for index, layer in enumerate(self.layers)}
        current = list(self.adapter.get_layers(self.model))
        if any(id(layer) not in position for layer in current):
            raise InvalidInputError(
                "The model runs a layer that is not in the snapshot: take the snapshot before changing the stack."
            )
        return [position[id(layer)] for layer in current]

    def keep(self, kept: Iterable[int]) -> None:
        """Makes the model run exactly the original layers `kept`, in that order, with a config that says so.

        Args:
            kept (`Iterable[int]`): Original indices of the layers to keep, strictly increasing.
        """
        kept = list(kept)
        if not kept:
            raise InvalidInputError("At least one decoder layer must be kept.")
        if sorted(set(kept)) != kept or kept[0] < 0 or kept[-1] >= self.num_layers:
            raise InvalidInputError(f"Kept layers must be strictly increasing indices in [0, {self.num_layers}), got {kept}.")
        adapter = self.adapter
        parent_path, _, attribute = adapter.layers_path.rpartition(".")
        setattr(get_submodule(self.model, parent_path), attribute, nn.ModuleList([self.layers[index] for index in kept]))
        for new_index, layer in enumerate(adapter.get_layers(self.model)):
            for module in layer.modules():
                for attribute_name in adapter.layer_index_attributes:
                    if isinstance(getattr(module, attribute_name, None), int):
                        setattr(module, attribute_name, new_index)
        rewrite_fields(adapter, adapter.get_text_config(self.model), self.config_values, self.num_layers, kept)
        if self.device_map is not None:
            self.model.hf_device_map = _renumber_device_map(adapter, self.device_map, kept)

    def restore(self) -> None:
        """Puts back every layer of the snapshot and the exact config values it recorded."""
        self.keep(range(self.num_layers))
        _set_config_values(self.adapter.get_text_config(self.model), self.config_values)

    @contextmanager
    def temporarily(self, kept: Iterable[int]) -> Iterator[None]:
        """Runs the original layers `kept` inside the block, then puts back the stack and the exact
        config values the model had before it (even when the block raises)."""
        previous = self.kept_layers()
        config = self.adapter.get_text_config(self.model)
        previous_values = {name: copy.deepcopy(getattr(config, name)) for name in self.config_values if hasattr(config, name)}
        previous_device_map = getattr(self.model, "hf_device_map", None)
        try:
            self.keep(kept)
            yield
        finally:
            self.keep(previous)
            _set_config_values(config, previous_values)
            if previous_device_map is not None:
                self.model.hf_device_map = previous_device_map

    @contextmanager
    def dense_model(self, fold_backups: Sequence[WeightBackup] = ()) -> Iterator[PreTrainedModel]:
        """The dense model, for the block: every layer of the snapshot runs, and the weights that folds changed since
        the snapshot hold their values from before the folds; the stack, the config and the weights are put back after
        the block (even when it raises). A teacher for distillation without a second copy of the model.

        Args:
            fold_backups (`Sequence[WeightBackup]`): The backups of every fold made since the snapshot, in the order they
                were taken (the fits between Stage 1's removals, then Stage 2's).

        Yields:
            `PreTrainedModel`: The model, dense inside the block.
        """
        with self.temporarily(range(self.num_layers)), restored(fold_backups):
            yield self.model

    @contextmanager
    def replaying(self, position: int, hidden_states: Any, as_tuple: bool) -> Iterator[None]:
        """Inside the block the model runs, in place of the kept layers up to original index `position` (included),
        one stand-in ([`ReplayedHiddenStates`]) that returns `hidden_states`, then the kept layers after `position`:
        a pass that starts from what those layers received, recorded earlier, instead of computing it again. The
        embeddings, masks and position embeddings are the model's own; the stack and config are restored on exit.

        Args:
            position (`int`): The original index of a kept layer: the last one the stand-in replaces.
            hidden_states (`torch.Tensor` of shape `(batch, seq_len, hidden)`): What the layers after `position`
                receive (the output of layer `position`, or, to drop it, its input).
            as_tuple (`bool`): Whether the model's layers return a tuple (the stand-in returns what they return).
        """
        kept = self.kept_layers()
        if position not in kept:
            raise InvalidInputError(f"Layer {position} is not kept (kept: {kept}): there is nothing to replay in its place.")
        with self.temporarily(kept[kept.index(position) :]):
            self.replace(0, ReplayedHiddenStates(hidden_states, as_tuple))
            yield

    @contextmanager
    def starting_at(self, first: int, input_ids: Any, hidden_states: Any, as_tuple: bool) -> Iterator[None]:
        """Inside the block, the model's passes over sequences among `input_ids` start at kept layer `first` (an
        original index): one stand-in ([`ReplayedSequences`]) in place of the kept layers before it returns, for each
        sequence of a pass, the hidden states `first` received on it earlier (`hidden_states`, one row per row of
        `input_ids`). Token ids decide what those layers compute, so this is exact while they are unchanged: Stage 2
        fits layers in forward order, and every pass of a fit starts at the layer fitted before it. Where `first` is
        the first kept layer, the block runs the model as it is. The stack and config are restored on exit.

        Args:
            first (`int`): The original index of a kept layer.
            input_ids (`torch.LongTensor` of shape `(num_sequences, seq_len)`): The sequences recorded.
            hidden_states (`torch.Tensor` of shape `(num_sequences, seq_len, hidden)`): What `first` received on each.
            as_tuple (`bool`): Whether the model's layers return a tuple.
        """
        kept = self.kept_layers()
        if first not in kept:
            raise InvalidInputError(f"Layer {first} is not kept (kept: {kept}): no pass can start there.")
        position = kept.index(first)
        if position == 0:
            yield
            return
        stand_in = ReplayedSequences(input_ids, hidden_states, as_tuple)
        handle = self.model.get_input_embeddings().register_forward_pre_hook(stand_in.read_ids, with_kwargs=True)
        try:
            with self.temporarily(kept[position - 1 :]):
                self.replace(0, stand_in)
                yield
        finally:
            handle.remove()

    def replace(self, position: int, module: nn.Module) -> nn.Module:
        """Puts `module` at `position` of the model's layer list (no renumbering, no config change) and
        returns the layer it replaces. For stand-ins during a pass (SLEB replays recorded hidden states)."""
        layers = self.adapter.get_layers(self.model)
        replaced = layers[position]
        layers[position] = module
        return replaced


class ReplayedHiddenStates(nn.Module):
    """Stands in for the first layers of a model during a pass ([`LayerSnapshot.replaying`]): returns the hidden states
    they produced earlier, whatever it is called with."""

    def __init__(self, hidden_states: Any, as_tuple: bool):
        super().__init__()
        self.hidden_states = hidden_states
        self.as_tuple = as_tuple

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return (self.hidden_states,) if self.as_tuple else self.hidden_states


class ReplayedSequences(nn.Module):
    """Stands in for the first layers of a model ([`LayerSnapshot.starting_at`]): returns, for each sequence of the
    current pass (its token ids, read when the input embeddings run), the hidden states those layers produced for it
    earlier. A sequence that was not recorded is an error, never a silent guess."""

    def __init__(self, input_ids: Any, hidden_states: Any, as_tuple: bool):
        super().__init__()
        self.rows = {_sequence_key(sequence): row for row, sequence in enumerate(input_ids)}
        self.hidden_states = hidden_states
        self.as_tuple = as_tuple
        self.current_ids: Any = None

    def read_ids(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.current_ids = args[0] if args else kwargs.get("input")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        try:
            rows = [self.rows[_sequence_key(sequence)] for sequence in self.current_ids]
        except (KeyError, TypeError) as error:
            raise RuntimeError("A pass started from recorded hidden states ran on a sequence that was not recorded.") from error
        hidden_states = self.hidden_states[rows]
        return (hidden_states,) if self.as_tuple else hidden_states


def _sequence_key(sequence: Any) -> bytes:
    return sequence.detach().cpu().numpy().tobytes()


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
    return LayerSnapshot(model=model, adapter=adapter, layers=layers, config_values=values, device_map=device_map)


def remove_layers(model: PreTrainedModel, layer_indices: Sequence[int]) -> list[int]:
    """Removes the given decoder layers from `model` in place and fixes its config.

    Args:
        model (`PreTrainedModel`): A model of a supported family.
        layer_indices (`Sequence[int]`): Current indices of the layers to remove.

    Returns:
        `list[int]`: The indices of the layers that remain, in order.
    """
    stack = snapshot(model)
    removed = {int(index) for index in layer_indices}
    if any(index < 0 or index >= stack.num_layers for index in removed):
        raise InvalidInputError(f"Layer indices must lie in [0, {stack.num_layers}), got {sorted(removed)}.")
    kept = [index for index in range(stack.num_layers) if index not in removed]
    stack.keep(kept)
    return kept


def rewrite_fields(
    adapter: DecoderAdapter, config: PretrainedConfig, dense_values: dict[str, Any], num_layers: int, kept: Sequence[int]
) -> None:
    """Rewrites the layer-dependent config fields for the kept layers: count, thresholds, per-layer lists,
    then the adapter's index fields.

    Args:
        adapter (`DecoderAdapter`): The family's adapter.
        config (`PretrainedConfig`): The text config, changed in place.
        dense_values (`dict[str, Any]`): The dense model's value of every layer-dependent field
            ([`LayerSnapshot.config_values`]).
        num_layers (`int`): The dense model's layer count.
        kept (`Sequence[int]`): Original indices of the kept layers.
    """
    for name, value in dense_values.items():
        if name == adapter.layer_count_field:
            setattr(config, name, len(kept))
        elif name in adapter.threshold_config_fields:
            if isinstance(value, int):
                setattr(config, name, sum(1 for index in kept if index < value))
        elif name in adapter.index_config_fields:
            continue
        elif isinstance(value, (list, tuple)) and len(value) == num_layers:
            sliced = [copy.deepcopy(value[index]) for index in kept]
            setattr(config, name, type(value)(sliced) if isinstance(value, tuple) else sliced)
    for name, value in adapter.rewrite_index_fields(config, dense_values, kept).items():
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
