# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""The quantization schemes of the quantization step: each one a llm-compressor recipe, what it needs to calibrate,
and the hardware that runs its checkpoint.

The recipes are llm-compressor's own for each scheme (its `examples/quantization_w8a8_int8`,
`quantization_w4a16` and `quantization_w8a8_fp8`): this module chooses them, llm-compressor does the work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..settings import StepSettings


@dataclass(frozen=True)
class QuantizationSettings(StepSettings):
    """The quantization step's settings: the fields of [`~optimum_gradmap.GradMAPConfig`] it reads, under the same
    names, frozen; `QuantizationSettings.from_config(config)` takes them from a config.

    Args:
        quantization (`str`): The scheme (`"w8a8"`, `"w4a16"`, `"fp8"`).
        quantization_dataset (`str`, *optional*): Its calibration text; `None`: Stage 1's calibration sequences.
    """

    quantization: str
    quantization_dataset: str | None = None


@dataclass(frozen=True)
class QuantizationScheme:
    """One scheme of `GradMAPConfig.quantization`.

    Args:
        name (`str`): The setting's value (`"w8a8"`, `"w4a16"`, `"fp8"`).
        description (`str`): What it stores, in words (the model card's); `{group_size}` stands for the weight group.
        preset (`str`): llm-compressor's preset scheme (`"W8A8"`, `"W4A16"`, `"FP8_DYNAMIC"`).
        algorithm (`str`): How the weights are rounded: `"SmoothQuant + GPTQ"`, `"GPTQ"` or `"round to nearest"`.
        calibrated (`bool`): Whether the recipe reads calibration text (FP8's dynamic scales need none).
        cuda_capability (`tuple[int, int]`, *optional*): The least NVIDIA compute capability whose kernels run it
            (vLLM's), `None` where CPUs run it too.
        group_sizes (`tuple[int, ...]`): For a scheme with weight groups, the input columns that may share a weight
            scale, preferred first: the first that divides every quantized linear map's input width is used (the
            preset's 128 where it divides; vLLM's CPU kernels take any even group, its GPU kernels 32, 64 and 128).
    """

    name: str
    description: str
    preset: str
    algorithm: str
    calibrated: bool
    cuda_capability: tuple[int, int] | None = None
    group_sizes: tuple[int, ...] = ()

    def group_size_for(self, widths: list[int]) -> int | None:
        """The weight group this scheme uses on linear maps of input `widths`: the first of `group_sizes` that divides
        them all; `None` for a scheme without groups or when none divides."""
        return next((size for size in self.group_sizes if all(width % size == 0 for width in widths)), None)

    def describe(self, group_size: int | None = None) -> str:
        """What a checkpoint of this scheme stores, in words, with its weight group."""
        return self.description.format(group_size=group_size)

    def recipe(self, ignore: list[str], group_size: int | None = None) -> list[Any]:
        """The llm-compressor modifiers of this scheme, every linear map quantized except `ignore`.

        Args:
            ignore (`list[str]`): Module names left in full precision (the output embedding).
            group_size (`int`, *optional*): The weight group, where it is not the preset's (`group_size_for`).

        Returns:
            `list`: llm-compressor modifiers, in the order they run.
        """
        from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

        quantization: dict[str, Any] = {"scheme": self.preset}
        if group_size is not None and group_size != self.group_sizes[0]:
            from compressed_tensors.quantization import preset_name_to_scheme

            scheme = preset_name_to_scheme(self.preset, ["Linear"])
            scheme.weights = scheme.weights.model_copy(update={"group_size": group_size})
            quantization = {"config_groups": {"group_0": scheme}}

        if self.algorithm == "round to nearest":
            return [QuantizationModifier(targets="Linear", ignore=ignore, **quantization)]
        modifiers: list[Any] = []
        if self.algorithm.startswith("SmoothQuant"):
            from llmcompressor.modifiers.transform import SmoothQuantModifier

            # 0.8: llm-compressor's INT8 example; moves activation outliers into the weights before GPTQ
            modifiers.append(SmoothQuantModifier(smoothing_strength=0.8))
        modifiers.append(GPTQModifier(targets="Linear", ignore=ignore, **quantization))
        return modifiers


SCHEMES: dict[str, QuantizationScheme] = {
    "w8a8": QuantizationScheme(
        "w8a8",
        "INT8 weights (one scale per output channel) and INT8 activations (one dynamic scale per token)",
        "W8A8",
        "SmoothQuant + GPTQ",
        calibrated=True,
    ),
    "w4a16": QuantizationScheme(
        "w4a16",
        "INT4 weights (one scale per group of {group_size} input columns), activations in the model's dtype",
        "W4A16",
        "GPTQ",
        calibrated=True,
        group_sizes=(128, 64, 32),
    ),
    "fp8": QuantizationScheme(
        "fp8",
        "FP8 E4M3 weights (one scale per output channel) and activations (one dynamic scale per token)",
        "FP8_DYNAMIC",
        "round to nearest",
        calibrated=False,
        cuda_capability=(8, 9),
    ),
}
