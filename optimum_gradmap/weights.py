# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""How the linear maps the library reads and changes store their weights. The one place that knows:

- `nn.Linear`: weight `(d_out, d_in)`, y = W x + b;
- transformers' `Conv1D` (GPT-2): the same map with its weight stored transposed, `(d_in, d_out)`;
- a 3-D expert weight (fused mixture-of-experts layers): `(experts, d_out, d_in)`, expert e maps
  x to W_e x.

and where a weight offloaded by Accelerate really is (the module holds a "meta" placeholder, its hook
a map to the values on CPU or disk): [`materialized`] puts the values in place for a block and
writes what the block changed back where they live.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D
from transformers.utils import logging

logger = logging.get_logger(__name__)


def is_linear_map(module: nn.Module) -> bool:
    """Whether `module` is a linear map y = W x + b over its input's last dimension (`nn.Linear` or `Conv1D`)."""
    return isinstance(module, (nn.Linear, Conv1D))


def linear_map_tensors(target: nn.Module | torch.Tensor) -> list[torch.Tensor]:
    """The tensors that hold a linear map: weight and bias of a module, or a 3-D expert weight itself."""
    if is_linear_map(target):
        return [target.weight] + ([target.bias] if target.bias is not None else [])
    if isinstance(target, torch.Tensor) and target.dim() == 3:
        return [target]
    raise TypeError(f"{type(target).__name__} is not a linear map this library knows (nn.Linear, Conv1D, 3-D expert weight).")


# `fold_into` computes this many float64 elements of the new weight at a time (a block of its rows or columns), not
# a float64 copy of the whole weight.
FOLD_BLOCK_ELEMENTS = 2**22


@torch.no_grad()
def fold_into(target: nn.Module | nn.Parameter, matrix: torch.Tensor) -> None:
    """Replaces the linear map y = W x + b by y = M (W x + b) in place, on its device and in its
    dtype (computed in float64): Stage 2's fold of W' (Eq. 15).

    - `nn.Linear` (weight `(d, k)`): W <- M W and b <- M b;
    - `Conv1D` (weight stored transposed, `(k, d)`): W <- W M^T and b <- M b;
    - a 3-D expert weight `(experts, d, k)`: every expert's W_e <- M W_e.

    Args:
        target (`nn.Module` or `nn.Parameter`): The linear map.
        matrix (`torch.Tensor` of shape `(d, d)`): M.
    """
    if isinstance(target, Conv1D):
        weight, bias = target.weight, target.bias
        blocks = [weight]  # (k, d): W M^T, a block of rows at a time
    elif isinstance(target, nn.Linear):
        weight, bias = target.weight, target.bias
        blocks = [weight.T]  # (d, k): M W, a block of columns (rows of W^T) at a time
    elif isinstance(target, torch.Tensor) and target.dim() == 3:
        weight, bias = target, None
        blocks = [expert.T for expert in weight]
    else:
        raise TypeError(f"Cannot fold a compensation matrix into {type(target).__name__}.")
    transposed = matrix.to(weight.device, torch.float64).T
    step = max(1, FOLD_BLOCK_ELEMENTS // matrix.shape[0])
    for rows in blocks:  # each block of rows of (W^T or W): rows <- rows M^T, in float64, written back in place
        for start in range(0, rows.shape[0], step):
            block = rows[start : start + step]
            block.copy_((block.double() @ transposed).to(weight.dtype))
    if bias is not None:
        bias.copy_((matrix.to(bias.device, torch.float64) @ bias.double()).to(bias.dtype))


def _offload_hooks(module: nn.Module) -> list[Any]:
    """The Accelerate hooks of `module` itself that keep its weights offloaded."""
    hook = getattr(module, "_hf_hook", None)
    hooks = list(getattr(hook, "hooks", [hook])) if hook is not None else []  # SequentialHook holds several
    return [hook for hook in hooks if getattr(hook, "offload", False) and getattr(hook, "weights_map", None) is not None]


def _store_offloaded(weights_map: Any, name: str, value: torch.Tensor) -> None:
    """Writes `value` where the offloaded weight `name` of a hook's `weights_map` lives: the CPU
    state dict, or a new file in the offload folder (never the model's own checkpoint files)."""
    from accelerate.utils import OffloadedWeightsLoader, offload_weight

    dataset, key = _resolve_offloaded(weights_map, name)
    if not isinstance(dataset, OffloadedWeightsLoader):
        dataset[key] = value
    elif key in dataset.state_dict or dataset.save_folder is None:
        dataset.state_dict[key] = value
    else:
        os.makedirs(dataset.save_folder, exist_ok=True)
        offload_weight(value, key, dataset.save_folder, index=dataset.index)


def _resolve_offloaded(weights_map: Any, name: str) -> tuple[Any, str]:
    """The dataset that really holds the offloaded weight `name` of a hook's `weights_map`, and its key there."""
    from accelerate.utils import PrefixedDataset

    dataset, key = weights_map, name
    while isinstance(dataset, PrefixedDataset):
        dataset, key = dataset.dataset, dataset.prefix + key
    return dataset, key


def _offloaded_rows(weights_map: Any, name: str, start: int, stop: int) -> torch.Tensor:
    import numpy as np
    from accelerate.utils import OffloadedWeightsLoader
    from safetensors import safe_open

    dataset, key = _resolve_offloaded(weights_map, name)
    if not isinstance(dataset, OffloadedWeightsLoader) or key in dataset.state_dict:
        return (dataset.state_dict[key] if isinstance(dataset, OffloadedWeightsLoader) else dataset[key])[start:stop]
    info = dataset.index[key]
    if info.get("safetensors_file") is not None:
        with safe_open(info["safetensors_file"], framework="pt", device="cpu") as file:
            rows = file.get_slice(info.get("weight_name", key))[start:stop]
        return rows.to(getattr(torch, info["dtype"])) if "dtype" in info else rows
    stored_dtype = {"bfloat16": "int16"}.get(info["dtype"], info["dtype"])
    array = np.memmap(os.path.join(dataset.save_folder, f"{key}.dat"), dtype=stored_dtype, shape=tuple(info["shape"]), mode="r")
    rows = torch.tensor(array[start:stop])
    return rows.view(torch.bfloat16) if info["dtype"] == "bfloat16" else rows


@contextmanager
def rows_only(module: nn.Module, start: int, stop: int) -> Iterator[None]:
    """Makes the offloaded `module` (a linear map or an embedding, weight `(rows, d)`) hold rows
    `start:stop` of its weight (and of its bias) for the block, read without the rest: calling it then
    computes those outputs only (e.g. a slice of the vocabulary's logits). The placeholders are put back
    on exit. For a module whose weights are not offloaded, slices of them.

    Args:
        module (`nn.Module`): The module.
        start, stop (`int`): The rows.
    """
    hooks = _offload_hooks(module)
    names = [name for name, parameter in module.named_parameters(recurse=False) if parameter.dim() >= 1]
    originals = {name: module._parameters[name] for name in names}
    try:
        for hook in hooks:
            hook.offload = False
        for name in names:
            rows = _offloaded_rows(hooks[0].weights_map, name, start, stop) if hooks else originals[name][start:stop]
            device = hooks[0].execution_device if hooks else originals[name].device
            module._parameters[name] = nn.Parameter(rows.to(device), requires_grad=False)
        yield
    finally:
        module._parameters.update(originals)  # the placeholders (or the weights) as they were
        for hook in hooks:
            hook.offload = True


def is_offloaded_module(module: nn.Module) -> bool:
    """Whether Accelerate keeps `module`'s own weights offloaded (on CPU or disk, loaded per forward pass)."""
    return bool(_offload_hooks(module))


def execution_device(module: nn.Module) -> torch.device:
    """Where `module` computes: its offload hook's execution device where Accelerate offloaded its own weights, else
    the device of its first parameter (the CPU for a module without one)."""
    hooks = _offload_hooks(module)
    if hooks:
        return torch.device(hooks[0].execution_device)
    return next((parameter.device for parameter in module.parameters()), torch.device("cpu"))


def stored_state_dict(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """`model.state_dict()`'s items one at a time, each weight Accelerate offloaded read from where it lives (the CPU
    state dict or the disk) in place of its "meta" placeholder: one offloaded tensor in memory at a time.

    Args:
        model (`nn.Module`): A model, dispatched by Accelerate or not.

    Returns:
        An iterator over `(name, tensor)` in the state dict's order.
    """
    for name, tensor in model.state_dict().items():
        if tensor.device.type == "meta":
            module_name, _, leaf = name.rpartition(".")
            hooks = _offload_hooks(model.get_submodule(module_name))
            if hooks:
                tensor = hooks[0].weights_map[leaf]
        yield name, tensor


@contextmanager
def materialized(module: nn.Module, device: str | torch.device | None = None, write_back: bool = False) -> Iterator[None]:
    """Makes the weights of `module` (and its submodules) real tensors for the block, where Accelerate
    offloaded them to CPU or disk: forward passes inside the block use them as they are (the hooks stop
    loading and dropping them), and on exit every weight changed in place is written back to where it
    lives (the CPU state dict, or the offload folder for weights on disk, never the model's own files)
    and the placeholders are put back. Does nothing for weights that are not offloaded.

    Args:
        module (`nn.Module`): A module of a model dispatched by Accelerate (or any module).
        device (`str` or `torch.device`, *optional*): Where to put the weights; defaults to each hook's
            execution device.
        write_back (`bool`, defaults to `False`): Write every weight back on exit, changed or not: for
            changes made through `.data` (PEFT's LoRA merge), which a tensor's version counter does not see.
    """
    from accelerate.utils import set_module_tensor_to_device

    loaded: list[tuple[nn.Module, Any, str, int]] = []
    hooks = [(submodule, hook) for submodule in module.modules() for hook in _offload_hooks(submodule)]
    try:
        for submodule, hook in hooks:
            hook.offload = False  # forward passes in the block keep the weights put here
            for name, _ in submodule.named_parameters(recurse=False):
                target = hook.execution_device if device is None else device
                set_module_tensor_to_device(submodule, name, target, value=hook.weights_map[name])
                loaded.append((submodule, hook, name, getattr(submodule, name)._version))
        yield
    finally:
        for submodule, hook, name, version in loaded:
            value = getattr(submodule, name)
            if write_back or value._version != version:
                _store_offloaded(hook.weights_map, name, value.detach().to("cpu"))
            set_module_tensor_to_device(submodule, name, "meta")
        for _, hook in hooks:
            hook.offload = True


@contextmanager
def _parameter_in_memory(layer: nn.Module, name: str) -> Iterator[torch.Tensor]:
    """The parameter `name` of `layer`, [`materialized`] for the block: its own module alone where Accelerate's hooks
    sit on that module (one weight in memory, not the layer's), else the whole layer."""
    module_name, _, attribute = name.rpartition(".")
    owner = layer.get_submodule(module_name)
    with materialized(owner):
        parameter = owner.get_parameter(attribute)
        if parameter.device.type != "meta":
            yield parameter
            return
    with materialized(layer):
        yield layer.get_parameter(name)


class WeightBackup:
    """Copies of some parameters of some layers, to put them back exactly (Stage 2's rollback and
    re-runs), offloaded or not.

    Args:
        layers (`Sequence[nn.Module]`): The layers that hold them.
        tensors_of (`Callable`): Maps a layer (its weights [`materialized`]) to the parameters of it to
            back up; they are copied now, to CPU.
    """

    def __init__(self, layers: Sequence[nn.Module], tensors_of: Callable[[nn.Module], list[torch.Tensor]]):
        self._copies: list[tuple[nn.Module, list[tuple[str, torch.Tensor]]]] = []
        for layer in layers:
            with materialized(layer):
                names = {id(parameter): name for name, parameter in layer.named_parameters()}
                saved = [(names[id(tensor)], tensor.detach().to("cpu", copy=True)) for tensor in tensors_of(layer)]
            self._copies.append((layer, saved))

    @torch.no_grad()
    def restore(self) -> None:
        """Writes the saved values back into the parameters (offloaded, each one's module is brought into memory
        alone, not the whole layer)."""
        for layer, saved in self._copies:
            for name, value in saved:
                with _parameter_in_memory(layer, name) as parameter:
                    parameter.copy_(value)

    def current(self) -> WeightBackup:
        """A backup of the same parameters with the values they hold now."""
        backup = WeightBackup([], lambda layer: [])
        for layer, saved in self._copies:
            values = []
            for name, _ in saved:
                with _parameter_in_memory(layer, name) as parameter:
                    values.append((name, parameter.detach().to("cpu", copy=True)))
            backup._copies.append((layer, values))
        return backup


@contextmanager
def restored(backups: Sequence[WeightBackup]) -> Iterator[None]:
    """Inside the block, the parameters hold the values of `backups` (restored from the last to the first, so that
    the oldest backup's values win where two hold the same parameter); after it, exactly the values they held before
    it, even when the block raises. With the backups of every fold made since a snapshot, this gives the snapshot's
    weights back for a while (the dense model, as a teacher).

    Args:
        backups (`Sequence[WeightBackup]`): In the order they were taken.
    """
    now = [backup.current() for backup in backups]
    try:
        for backup in reversed(backups):
            backup.restore()
        yield
    finally:
        for backup in now:
            backup.restore()


class ModelBackup:
    """Everything an in-place change of a whole model may touch, to put the model back exactly after a change that
    failed part-way (llm-compressor's quantization adds parameters, buffers, hooks and attributes to the modules it
    quantizes, may replace modules, and rounds their weights): every module's children, parameters, buffers, hooks and
    attributes as they are now, and a copy on the CPU of the values of every parameter and buffer in memory. It costs
    as many host bytes as those values ([`ModelBackup.bytes_needed`]); a weight offloaded by Accelerate (on the "meta"
    device) is not copied.

    Args:
        model (`nn.Module`): The model.
    """

    def __init__(self, model: nn.Module):
        self._modules = [(module, _module_state(module)) for module in model.modules()]
        tensors = {id(tensor): tensor for module, _ in self._modules for tensor in _tensors(module)}  # tied ones once
        self._values = [(tensor, tensor.detach().to("cpu", copy=True)) for tensor in tensors.values()]

    @staticmethod
    def bytes_needed(model: nn.Module) -> int:
        """The host bytes a backup of `model` takes: its parameters and buffers in memory."""
        tensors = [*model.parameters(), *model.buffers()]
        return sum(tensor.numel() * tensor.element_size() for tensor in tensors if tensor.device.type != "meta")

    @torch.no_grad()
    def restore(self) -> None:
        """Puts every module's children, parameters, buffers, hooks and attributes back, then their values."""
        for module, state in self._modules:
            module.__dict__.clear()
            module.__dict__.update(_module_state(state))
        for tensor, value in self._values:
            if tensor.shape == value.shape and tensor.dtype == value.dtype:
                tensor.copy_(value)
            else:  # replaced in place by another shape or dtype
                tensor.data = value.to(tensor.device)


def _tensors(module: nn.Module) -> list[torch.Tensor]:
    """A module's own parameters and buffers in memory (not its children's, not on the "meta" device)."""
    tensors = [*module._parameters.values(), *module._buffers.values()]
    return [tensor for tensor in tensors if tensor is not None and tensor.device.type != "meta"]


def _module_state(module_or_state: nn.Module | dict[str, Any]) -> dict[str, Any]:
    """A copy of a module's attributes (or of such a copy), each dictionary among them (children, parameters, buffers,
    hooks) copied too, so that what is added to the module later does not reach the copy."""
    state = vars(module_or_state) if isinstance(module_or_state, nn.Module) else module_or_state
    return {name: (value.copy() if isinstance(value, dict) else value) for name, value in state.items()}


def available_host_bytes() -> int | None:
    """The host memory available now (Linux's `MemAvailable`), or `None` where `/proc/meminfo` cannot tell."""
    try:
        with open("/proc/meminfo") as file:
            for line in file:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


# The elements of a weight summed at a time by `weights_digest` (32 MB in float64).
DIGEST_CHUNK = 1 << 22


def weights_digest(model: nn.Module) -> str:
    """A cheap fingerprint of every weight of `model`: the SHA-256 of their float64 sums and sums of squares, each
    accumulated over chunks of `DIGEST_CHUNK` elements in a fixed order (deterministic), so that no temporary is
    larger than a chunk in float64 (a whole 8B model's embedding would take 8 GB)."""
    sums = []
    with torch.no_grad():
        for _, tensor in stored_state_dict(model):  # an offloaded weight read from where it lives, one at a time
            flat = tensor.detach().reshape(-1)
            total = torch.zeros(2, dtype=torch.float64, device=flat.device)
            for start in range(0, flat.numel(), DIGEST_CHUNK):
                chunk = flat[start : start + DIGEST_CHUNK].double()
                total[0] += chunk.sum()
                total[1] += chunk.square().sum()
            sums.append(total.cpu())
    return hashlib.sha256(torch.stack(sums).numpy().tobytes() if sums else b"").hexdigest()
