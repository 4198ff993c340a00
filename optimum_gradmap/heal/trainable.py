# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""What the heal trains (`heal_trainable`): LoRA's adapters on the kept layers' linear maps, injected through PEFT, or
the model's own parameters (norms, the kept layers), found and refused before anything changes
([`choose_trainable`]); their setup, their merge into plain weights, and the rollback that puts the model back as it
came ([`Trainable`])."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.pytorch_utils import Conv1D

from ..adapters import DecoderAdapter, get_adapter, get_submodule
from ..errors import InvalidInputError
from ..weights import WeightBackup, execution_device, is_offloaded_module, materialized

# The name of the heal stage's LoRA adapter (in its parameters' names).
LORA_ADAPTER = "heal"


def _linear_names(model: nn.Module, layers: Sequence[nn.Module]) -> list[str]:
    """The full names of the linear maps (`nn.Linear`, GPT-2's `Conv1D`) inside `layers`: LoRA's targets. (The experts
    of transformers' MoE blocks are 3-D parameters, not maps: LoRA leaves them and adapts the attention.)"""
    wanted = {id(module) for layer in layers for module in layer.modules() if isinstance(module, (nn.Linear, Conv1D))}
    return [name for name, module in model.named_modules() if id(module) in wanted]


def _is_norm(module: nn.Module) -> bool:
    return "norm" in type(module).__name__.lower()


def _norm_parameters(model: nn.Module, kept_layers: Sequence[nn.Module], adapter: DecoderAdapter) -> list[nn.Parameter]:
    """The weights of every normalisation inside the kept layers and of those beside the layer list (the final norm,
    whatever its name: `norm`, `ln_f`, `final_layer_norm`)."""
    holder = get_submodule(model, adapter.layers_path.rpartition(".")[0])
    modules = [module for layer in kept_layers for module in layer.modules() if _is_norm(module)]
    modules += [module for module in holder.children() if _is_norm(module)]
    return [parameter for module in modules for parameter in module.parameters(recurse=False)]


@dataclass
class TrainableChoice:
    """What `heal_trainable` names in a model, found without changing it: LoRA's target maps, or the parameters."""

    lora_targets: list[str]
    parameters: list[nn.Parameter]


def choose_trainable(model: PreTrainedModel, adapter: DecoderAdapter, trainable: str) -> TrainableChoice:
    """What to train (`heal_trainable`) in the pruned `model`, refused (before anything runs)
    where the model has nothing of that kind.

    Raises:
        InvalidInputError: nothing to train, a model that carries PEFT adapters already, or full weights in a dtype
            AdamW cannot update finely (bfloat16, float16).
    """
    check_no_peft_adapters(model)
    layers = list(adapter.get_layers(model))
    if trainable == "lora":
        choice = TrainableChoice(_linear_names(model, layers), [])
    elif trainable == "norms":
        choice = TrainableChoice([], _norm_parameters(model, layers, adapter))
    else:  # "all"
        choice = TrainableChoice([], [parameter for layer in layers for parameter in layer.parameters()])
        choice.parameters += _norm_parameters(model, [], adapter)
    if not choice.lora_targets and not choice.parameters:
        raise InvalidInputError(f"heal_trainable={trainable!r} finds nothing to train in this model: choose another.")
    offloaded = {
        id(parameter)
        for module in model.modules()
        if is_offloaded_module(module)
        for parameter in module.parameters(recurse=False)
    }
    if any(id(parameter) in offloaded for parameter in choice.parameters):
        raise InvalidInputError(offloaded_refusal(trainable))
    low_precision = sorted({str(p.dtype) for p in choice.parameters if p.dtype in (torch.bfloat16, torch.float16)})
    if low_precision:
        raise InvalidInputError(
            f"heal_trainable={trainable!r} would train {', '.join(low_precision)} weights in place, where AdamW's small "
            "steps round away: load the model in float32 (`--dtype float32`), or heal with heal_trainable='lora' (its "
            "adapters are float32 whatever the model's dtype)."
        )
    return choice


def offloaded_refusal(trainable: str) -> str:
    """The refusal of training the model's own weights (any `heal_trainable` but `lora`) where some are offloaded."""
    return (
        f"heal_trainable={trainable!r} trains the model's own weights, and Accelerate offloaded some of them to the CPU "
        "or disk, where no gradient can accumulate (each forward pass brings a new copy): heal an offloaded model with "
        "heal_trainable='lora' (its adapters live in memory and merge into the weights where they live), or load the "
        "model on devices that hold it."
    )


def check_no_peft_adapters(model: nn.Module) -> None:
    """Refuses a model that carries PEFT adapters: the heal stage adds its own and merges them."""
    if hasattr(model, "peft_config"):
        raise InvalidInputError(
            "The model carries PEFT adapters already: merge them first (`merge_and_unload`), then heal the plain model."
        )


class Trainable:
    """The parameters the heal stage trains (LoRA's adapters, injected here, or the model's own) and how they end as
    plain weights.

    Args:
        model (`PreTrainedModel`): The model.
        choice ([`TrainableChoice`]): From [`choose_trainable`].
        lora_rank (`int`): The adapters' rank.
        seed (`int`): LoRA's initialisation seed (the same on every process).
    """

    def __init__(self, model: PreTrainedModel, choice: TrainableChoice, lora_rank: int, seed: int = 0):
        self.model, self.lora, self.lora_layers = model, None, []
        if choice.lora_targets:
            try:
                self._inject_lora(choice.lora_targets, lora_rank, seed)
            except BaseException:  # PEFT failed part-way: no wrapper, adapter or PEFT config stays on the model
                self._unwrap()
                if hasattr(self.model, "peft_config"):
                    del self.model.peft_config
                raise
            marker = f".{LORA_ADAPTER}."
            self.parameters = [parameter for name, parameter in model.named_parameters() if "lora_" in name and marker in name]
        else:
            self.parameters = list(choice.parameters)
        for parameter in self.parameters:
            parameter.requires_grad_(True)

    def _inject_lora(self, targets: list[str], lora_rank: int, seed: int) -> None:
        """Wraps the maps `targets` with LoRA adapters of rank `lora_rank` through PEFT, initialised with `seed`."""
        from peft import LoraConfig
        from peft.tuners.lora import LoraLayer, LoraModel

        lora_config = LoraConfig(
            r=lora_rank,
            lora_alpha=2 * lora_rank,
            lora_dropout=0.0,
            target_modules=targets,
            bias="none",
            fan_in_fan_out=all(isinstance(self.model.get_submodule(name), Conv1D) for name in targets),  # GPT-2
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.lora = LoraModel(self.model, lora_config, LORA_ADAPTER)
            # the wrapped layers, kept to take a merge back even after the wrappers are gone
            self.lora_layers = [module for module in self.model.modules() if isinstance(module, LoraLayer)]
            # PEFT puts the adapters where the base layer's weight is, in its dtype: on the "meta" device, without
            # values, for a weight Accelerate offloaded. They are drawn again as PEFT draws them (A as nn.Linear's
            # default, B zero), in float32 whatever the model's dtype (AdamW's steps and the merged update keep
            # their bits), on the CPU with `seed`, then put where the base layer computes.
            torch.manual_seed(seed)
            for layer in self.lora_layers:
                adapters = (layer.lora_A[LORA_ADAPTER], layer.lora_B[LORA_ADAPTER])
                for linear in adapters:
                    linear.weight = nn.Parameter(torch.empty(linear.weight.shape, dtype=torch.float32))
                layer.reset_lora_parameters(LORA_ADAPTER, True)
                for linear in adapters:
                    linear.to(execution_device(layer.get_base_layer()))

    def num_parameters(self) -> int:
        """How many parameters are trained."""
        return sum(parameter.numel() for parameter in self.parameters)

    def state(self) -> list[torch.Tensor]:
        """Copies of the trained parameters, on the CPU."""
        return [parameter.detach().to("cpu", copy=True) for parameter in self.parameters]

    @torch.no_grad()
    def load(self, state: Sequence[torch.Tensor]) -> None:
        """Writes `state` ([`state`]'s output) into the trained parameters."""
        for parameter, value in zip(self.parameters, state, strict=True):
            parameter.copy_(value)

    def finish(self, merge: bool) -> None:
        """Removes the LoRA adapters, merged into the weights (`merge`) or dropped; nothing to do for the others. The
        merge comes first, layer by layer, and the unwrapping after it, so that [`restore`] can take back a merge an
        error cut short. A weight Accelerate offloaded is merged one map at a time and written where it lives (the CPU
        copy, or the offload folder for a weight on disk, never the model's own files: [`materialized`]). The trained
        parameters' gradients are dropped (for the model's own weights, a weight-sized tensor each)."""
        for parameter in self.parameters:
            parameter.grad = None
        if self.lora is not None:
            if merge:
                for layer in self.lora_layers:
                    with materialized(layer.get_base_layer(), write_back=True):  # PEFT merges through `.data`
                        layer.merge(adapter_names=[LORA_ADAPTER])
            self._unwrap()
            if hasattr(self.model, "peft_config"):
                del self.model.peft_config

    def _unwrap(self) -> None:
        """Puts each wrapped map's base layer back in its place: what PEFT's `unload` does, without its `onload_layer`,
        which would keep an offloaded layer's weights in memory as its hook's new weights map."""
        from peft.tuners.lora import LoraLayer

        wrapped = [(name, module) for name, module in self.model.named_modules() if isinstance(module, LoraLayer)]
        for name, module in wrapped:
            parent, _, child = name.rpartition(".")
            setattr(self.model.get_submodule(parent), child, module.get_base_layer())

    def restore(self, start_state: Sequence[torch.Tensor]) -> None:
        """Puts the model back as it came, after an error at any point (a merge cut short included): the update of
        the layers merged already is subtracted back (exact up to rounding), `start_state` is loaded, and LoRA's
        wrappers are removed.

        Args:
            start_state (`Sequence[torch.Tensor]`): [`state`] before training.
        """
        for layer in self.lora_layers:
            if layer.merged:
                with materialized(layer.get_base_layer(), write_back=True):
                    layer.unmerge()
        self.load(start_state)
        self.finish(merge=False)


def changed_parameters(model: PreTrainedModel, trainable: str) -> dict[str, nn.Parameter]:
    """Every parameter a heal of `trainable` changes, by its name in `model`: the trained parameters, or for LoRA the
    weights of the maps its adapters merge into.

    Args:
        model (`PreTrainedModel`): The pruned model, before the heal.
        trainable (`str`): `heal_trainable`.

    Returns:
        `dict[str, nn.Parameter]`.
    """
    choice = choose_trainable(model, get_adapter(model), trainable)
    changed = [model.get_submodule(name).weight for name in choice.lora_targets] + list(choice.parameters)
    wanted = {id(parameter) for parameter in changed}
    return {name: parameter for name, parameter in model.named_parameters() if id(parameter) in wanted}


def heal_backup(model: PreTrainedModel, trainable: str) -> WeightBackup:
    """A copy, on the CPU, of every parameter a heal of `trainable` changes ([`changed_parameters`]): what puts the
    model back as the heal found it when a later step fails. It costs as many bytes as those parameters."""
    wanted = {id(parameter) for parameter in changed_parameters(model, trainable).values()}
    owners = [module for module in model.modules() if any(id(p) in wanted for p in module.parameters(recurse=False))]
    return WeightBackup(owners, lambda module: [p for p in module.parameters(recurse=False) if id(p) in wanted])
