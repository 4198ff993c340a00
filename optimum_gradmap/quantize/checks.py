# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""What the quantization step refuses, before any work: llm-compressor missing, a scheme this machine cannot run, a
model that is quantized already or was loaded from a GGUF file, calibration text too short."""

from __future__ import annotations

import importlib.util
import platform

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from ..errors import InvalidInputError
from .schemes import SCHEMES, QuantizationScheme

INSTALL_HINT = "pip install 'optimum-gradmap[quantize]'"
# CPUs whose vLLM builds run INT8 W8A8 and INT4 W4A16 compressed-tensors checkpoints.
CPU_MACHINES = ("x86_64", "amd64")


def scheme_named(name: str) -> QuantizationScheme:
    """The scheme of `GradMAPConfig.quantization` called `name`.

    Raises:
        InvalidInputError: an unknown name (the message lists the schemes).
    """
    if name not in SCHEMES:
        raise InvalidInputError(f"Unknown quantization scheme {name!r}: choose one of {', '.join(SCHEMES)}.")
    return SCHEMES[name]


def require_llmcompressor() -> None:
    """Refuses when llm-compressor (the vLLM project's quantization library) is not installed, or is installed but
    cannot be imported (a broken install, a version that does not fit this transformers): checked by importing it,
    so that a run that cannot quantize fails before any work.

    Raises:
        InvalidInputError: it is missing or broken; the message says how to install it.
    """
    if importlib.util.find_spec("llmcompressor") is None:
        raise InvalidInputError(
            f"Quantization needs llm-compressor, which is not installed: `{INSTALL_HINT}` installs the version this "
            "library is tested with (it brings compressed-tensors, which transformers and vLLM load the checkpoint with)."
        )
    try:
        from llmcompressor import oneshot  # noqa: F401
    except Exception as error:  # an import error, or whatever a mismatched dependency raises on import
        raise InvalidInputError(
            f"llm-compressor is installed but cannot be imported ({type(error).__name__}: {error}): `{INSTALL_HINT}` "
            "installs the version this library is tested with, with the dependencies it needs."
        ) from error


def hardware_problem(scheme: QuantizationScheme) -> str | None:
    """Why this machine cannot run `scheme`'s checkpoint, or `None` when it can.

    FP8 needs an NVIDIA GPU of compute capability 8.9 or newer (Ada, Hopper and later: vLLM's FP8 kernels); INT8 W8A8
    and INT4 W4A16 run on any CUDA GPU vLLM supports and on x86-64 CPUs (vLLM's CPU build).
    """
    capabilities = [torch.cuda.get_device_capability(index) for index in range(torch.cuda.device_count())]
    if scheme.cuda_capability is not None:
        if any(capability >= scheme.cuda_capability for capability in capabilities):
            return None
        found = f"its GPUs are of compute capability {sorted(set(capabilities))}" if capabilities else "it has no CUDA GPU"
        needed = ".".join(map(str, scheme.cuda_capability))
        return (
            f"`{scheme.name}` needs an NVIDIA GPU of compute capability {needed} or newer to run, and {found}. "
            "Quantize on the machine that will serve the model, or choose `w8a8` or `w4a16`, which CPUs run."
        )
    if capabilities or platform.machine().lower() in CPU_MACHINES:
        return None
    return (
        f"`{scheme.name}` runs on CUDA GPUs and x86-64 CPUs; this machine is {platform.machine()} without a CUDA GPU. "
        "Quantize on the machine that will serve the model."
    )


def check_quantization(
    model_config: PretrainedConfig, scheme_name: str, calibration_ids: torch.LongTensor | None = None
) -> QuantizationScheme:
    """Everything the quantization step refuses, checked before any work; the model is not touched.

    Args:
        model_config (`PretrainedConfig`): The config of the model to quantize (read before its weights load).
        scheme_name (`str`): `GradMAPConfig.quantization`.
        calibration_ids (`torch.LongTensor`, *optional*): The calibration sequences, when they are known already.

    Returns:
        [`QuantizationScheme`]: The scheme.

    Raises:
        InvalidInputError: in this order, an unknown scheme, a scheme this machine cannot run, a model quantized
            already (a GGUF file's included), calibration sequences a calibrated scheme cannot use, or llm-compressor
            missing.
    """
    scheme = scheme_named(scheme_name)
    problem = hardware_problem(scheme)
    if problem is not None:
        raise InvalidInputError(problem)
    quantization = getattr(model_config, "quantization_config", None)
    if quantization is not None:
        method = (
            quantization.get("quant_method") if isinstance(quantization, dict) else getattr(quantization, "quant_method", None)
        )
        method = getattr(method, "value", method)
        if method == "gguf":
            raise InvalidInputError(
                "This model was loaded from a GGUF file: its weights were dequantized from another format and transformers "
                "cannot save it back. Convert it to a plain checkpoint first (`optimum_gradmap.assets.get_model_path` "
                "does this for the offline models), then quantize that."
            )
        raise InvalidInputError(
            f"This model is quantized already ({method}): quantizing it again would round rounded weights. Start from "
            "the full-precision checkpoint."
        )
    if scheme.calibrated and calibration_ids is not None and (calibration_ids.ndim != 2 or calibration_ids.shape[1] < 2):
        raise InvalidInputError(
            f"`{scheme.name}` calibrates on token sequences of shape (num_samples, seq_len >= 2), got "
            f"{tuple(calibration_ids.shape)}."
        )
    require_llmcompressor()
    return scheme


def check_linear_maps(model: PreTrainedModel, scheme: QuantizationScheme, ignored: list[str]) -> int | None:
    """Chooses the weight group of a scheme that has them (`w4a16`: 128 input columns a scale, else 64, else 32) and
    refuses a model whose linear maps none of them divides.

    Args:
        model (`PreTrainedModel`): The model to quantize.
        scheme ([`QuantizationScheme`]): The scheme.
        ignored (`list[str]`): The maps left in full precision.

    Returns:
        `int` or `None`: The group size, `None` for a scheme without weight groups.

    Raises:
        InvalidInputError: naming the maps that no group size divides.
    """
    if not scheme.group_sizes:
        return None
    maps = {
        name: module.in_features
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name not in ignored
    }
    group_size = scheme.group_size_for(list(maps.values()))
    if group_size is not None:
        return group_size
    smallest = scheme.group_sizes[-1]
    misfits = [f"{name} ({width})" for name, width in maps.items() if width % smallest]
    shown = ", ".join(misfits[:4]) + (f" and {len(misfits) - 4} more" if len(misfits) > 4 else "")
    sizes = ", ".join(map(str, scheme.group_sizes))
    raise InvalidInputError(
        f"`{scheme.name}` quantizes weights in groups of {sizes} input columns, and none of these divides the input "
        f"widths of these linear maps: {shown}. Choose `w8a8` (one scale per output channel)."
    )
