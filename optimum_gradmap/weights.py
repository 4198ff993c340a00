# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""How the linear maps the library reads and changes store their weights. The one place that knows:

- `nn.Linear`: weight `(d_out, d_in)`, y = W x + b;
- transformers' `Conv1D` (GPT-2): the same map with its weight stored transposed, `(d_in, d_out)`;
- a 3-D expert weight (fused mixture-of-experts layers): `(experts, d_out, d_in)`, expert e maps
  x to W_e x.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D


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
        new_weight = weight.double() @ matrix.to(weight.device, torch.float64).T
    elif isinstance(target, nn.Linear):
        weight, bias = target.weight, target.bias
        new_weight = matrix.to(weight.device, torch.float64) @ weight.double()
    elif isinstance(target, torch.Tensor) and target.dim() == 3:
        weight, bias = target, None
        new_weight = matrix.to(weight.device, torch.float64) @ weight.double()
    else:
        raise TypeError(f"Cannot fold a compensation matrix into {type(target).__name__}.")
    weight.copy_(new_weight.to(weight.dtype))
    if bias is not None:
        bias.copy_((matrix.to(bias.device, torch.float64) @ bias.double()).to(bias.dtype))


class WeightBackup:
    """Copies of some tensors, to put them back exactly (Stage 2's rollback and re-runs).

    Args:
        tensors (`list[torch.Tensor]`): The tensors to back up (copied now, on their own device).
    """

    def __init__(self, tensors: list[torch.Tensor]):
        self._copies = [(tensor, tensor.detach().clone()) for tensor in tensors]

    @torch.no_grad()
    def restore(self) -> None:
        """Writes the saved values back into the tensors."""
        for tensor, saved in self._copies:
            tensor.copy_(saved)
