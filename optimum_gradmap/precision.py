# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Which dtype the model computes in: `dtype="auto"` ([`resolve_dtype`]) is bfloat16 where the hardware computes it
natively ([`has_native_bfloat16`]: CUDA GPUs of compute capability 8.0 or more, CPUs with AVX512-BF16 or AMX) and
float32 elsewhere. The CLI's `--dtype` and `GradMAPPruner.from_pretrained(..., dtype=...)` take it.

What a bfloat16 model computes in bfloat16: the forward and backward passes of its layers and head (the weights
are stored in bfloat16, which halves their memory). What stays in float32 or float64 whatever the model's dtype,
because rounding there would change a decision or a figure rather than the model:

- **Stage 1's scores**: each per-sample squared gradient norm is summed in float32 from the (bfloat16) gradients, and
  the scores accumulate over samples in float64 (`optimum_gradmap.importance.gradient`); the losses behind them
  (next-token cross-entropy, SLEB's removal losses) are computed from float32 logits.
- **Stage 2's sufficient statistics and solves**: the MLP outputs, residual streams and dense targets are cast to
  float64 before A = sum y y^T, C = sum r y^T and sum ||r||^2 are accumulated; W' is solved in float64 and folded into
  the down projection in float64 before the result is rounded once to the weights' dtype
  (`optimum_gradmap.compensation`); the dense hidden states recorded for the fits are kept in float32.
- **Losses, perplexity and KL**: the cross-entropy (and any divergence) is computed from logits cast to float32 and
  summed in float64 (`optimum_gradmap.objectives.summed_next_token_loss`).

The logits themselves come out of a bfloat16 head in bfloat16: a bfloat16 model's perplexity is that model's, not
the float32 model's (docs/benchmarks/stage1-cost.md measures both on the same checkpoints).
"""

from __future__ import annotations

import torch

from .errors import InvalidInputError

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16", "checkpoint")


def has_native_bfloat16(device: str | torch.device | None = None) -> bool:
    """Whether `device` computes bfloat16 natively: a CUDA GPU of compute capability 8.0 (Ampere) or more, or a CPU
    with AVX512-BF16 or AMX-BF16 instructions (as `torch.cpu.get_capabilities` reports them). Other devices (MPS,
    older GPUs and CPUs, where bfloat16 is emulated and slower than float32) answer `False`.

    Args:
        device (`str` or `torch.device`, *optional*): Defaults to the CPU.
    """
    device = torch.device(device if device is not None else "cpu")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return False
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.get_device_capability(index) >= (8, 0)
    if device.type == "cpu":
        get_capabilities = getattr(torch.cpu, "get_capabilities", None)
        capabilities = get_capabilities() if get_capabilities is not None else {}
        return bool(capabilities.get("avx512_bf16") or capabilities.get("amx_bf16"))
    return False


def compute_device(device: str | torch.device | None = None, device_map: object = None) -> torch.device:
    """Where a model loaded with `device` or `device_map` computes, for [`resolve_dtype`]: `device`; with a
    `device_map` and a CUDA GPU, the GPU; else the CPU."""
    if device is not None:
        return torch.device(device)
    return torch.device("cuda" if device_map is not None and torch.cuda.is_available() else "cpu")


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device | None = None) -> torch.dtype | str:
    """The dtype to load a model in for `dtype`:

    - `"auto"`: bfloat16 where `device` computes it natively ([`has_native_bfloat16`]), float32 elsewhere;
    - `"float32"`, `"bfloat16"`, `"float16"` (or a `torch.dtype`): that dtype;
    - `"checkpoint"`: the dtype the checkpoint was saved in (what transformers' own `dtype="auto"` loads), returned
      as the string `"auto"` for `from_pretrained`.

    Args:
        dtype (`str` or `torch.dtype`): One of `DTYPE_CHOICES`, or a floating `torch.dtype`.
        device (`str` or `torch.device`, *optional*): Where the model will compute (defaults to the CPU); for a
            `device_map`, the first GPU if there is one.

    Returns:
        `torch.dtype`, or `"auto"` for `"checkpoint"`.

    Raises:
        InvalidInputError: for another name.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if has_native_bfloat16(device) else torch.float32
    if dtype == "checkpoint":
        return "auto"
    if dtype in ("float32", "bfloat16", "float16"):
        return getattr(torch, dtype)
    raise InvalidInputError(
        f"dtype={dtype!r}: expected one of {', '.join(DTYPE_CHOICES)} ('auto': bfloat16 where the hardware computes it "
        "natively, float32 elsewhere; 'checkpoint': the dtype the checkpoint was saved in)."
    )


def uses_bfloat16_autocast(requested: bool, model: torch.nn.Module) -> bool:
    """The heal's autocast rule (`heal_autocast`): bfloat16 autocast where it was asked for, the device that takes the
    model's inputs computes bfloat16 natively ([`has_native_bfloat16`]), and the model is float32.

    Args:
        requested (`bool`): Whether autocast was asked for.
        model (`torch.nn.Module`): The model the passes run.

    Returns:
        `bool`.
    """
    from .passes import input_device

    return bool(requested) and has_native_bfloat16(input_device(model)) and model.dtype == torch.float32
