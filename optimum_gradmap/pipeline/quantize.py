# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""The quantization step, last ([`Quantize`]): llm-compressor quantizes the pruned (and healed) model in place to a
compressed-tensors checkpoint ([`optimum_gradmap.quantize`]). Everything it refuses is checked before Stage 1, and
what the settings alone decide (the scheme on this machine, llm-compressor importable) before any weight is read."""

from __future__ import annotations

import dataclasses

from transformers.utils import logging

from ..configuration import GradMAPConfig
from ..errors import InvalidInputError
from ..quantize import (
    QuantizationSettings,
    check_linear_maps,
    check_quantization,
    hardware_problem,
    head_names,
    quantize_model,
    require_llmcompressor,
    scheme_named,
)
from ..weights import ModelBackup, available_host_bytes
from .run import Run, Step

logger = logging.get_logger(__name__)


@dataclasses.dataclass(frozen=True)
class Quantize(Step):
    """Quantization: the model's linear maps (all but the output embedding) quantized in place by llm-compressor,
    calibrated on `quantization_dataset` or Stage 1's calibration sequences.

    Its undo puts back the unquantized model from a copy taken before llm-compressor runs (every module's structure and
    weights, as many host bytes as the model's weights). Where that copy does not fit in the host memory available, the
    check says so and the step runs without it: a failure inside llm-compressor then leaves the model partly quantized,
    and the error says so.

    Args:
        settings ([`~optimum_gradmap.quantize.QuantizationSettings`]): The scheme and its calibration text.
    """

    name = "Quantize"
    summary = "optional, last: llm-compressor's quantization, a checkpoint vLLM serves"
    settings: QuantizationSettings

    @classmethod
    def from_config(cls, config: GradMAPConfig) -> Quantize:
        return cls(QuantizationSettings.from_config(config))

    def check_settings(self) -> None:
        """What the settings alone decide, before any weight is read: the scheme runs on this machine, and
        llm-compressor imports."""
        problem = hardware_problem(scheme_named(self.settings.quantization))
        if problem is not None:
            raise InvalidInputError(problem)
        require_llmcompressor()

    def check(self, run: Run) -> None:
        """The model (its linear maps' widths for the scheme's weight groups, not quantized already), the tokenizer
        llm-compressor needs beside calibration data, the calibration sequences of `quantization_dataset` (kept in
        `run.quantization_ids`), and whether the host memory holds the copy that undoes the step."""
        scheme_name, model = self.settings.quantization, run.model
        scheme = scheme_named(scheme_name)
        check_linear_maps(model, scheme, head_names(model))  # Stage 1 removes layers, not widths
        check_quantization(model.config, scheme_name)
        if scheme.calibrated:
            run.require_tokenizer(f"`{scheme_name}` calibrates with llm-compressor, which needs the model's tokenizer")
        dataset = self.settings.quantization_dataset
        if scheme.calibrated and dataset is not None:
            run.quantization_ids, run.quantization_source = run.read(dataset), dataset
        needed, available = ModelBackup.bytes_needed(model), available_host_bytes()
        run.quantization_undoable = available is None or needed <= available
        if not run.quantization_undoable:
            logger.warning(
                f"The quantization step cannot keep a copy of the model to undo it ({needed / 2**30:.1f} GiB, "
                f"{available / 2**30:.1f} GiB available): if llm-compressor fails part-way, the model is left partly "
                "quantized."
            )

    def plan(self, planner) -> None:
        planner.plan_quantization()

    def run(self, run: Run) -> None:
        """Quantizes `run.result`'s model; `result.quantization` and `.timings["quantization"]` say what it did."""
        result = run.result
        ids, source = run.quantization_ids, run.quantization_source
        if ids is None:
            ids, source = result.calibration_ids, f"Stage 1's calibration sequences ({result.calibration_source})"
        run.quantization_backup = ModelBackup(result.model) if run.quantization_undoable else None
        try:
            result.quantization = quantize_model(result.model, self.settings.quantization, ids, run.tokenizer, source)
        except BaseException as error:
            if run.quantization_backup is None:
                raise InvalidInputError(
                    f"The quantization failed part-way ({type(error).__name__}: {error}), and the model, too large to copy "
                    "into the host memory available, is left partly quantized: load it again."
                ) from error
            raise
        result.timings["quantization"] = result.quantization.seconds

    def undo(self, run: Run) -> None:
        """Puts back the unquantized model from the copy taken before the quantization."""
        if run.quantization_backup is not None:
            run.quantization_backup.restore()
            run.quantization_backup = None
        if run.result is not None:
            run.result.quantization = None
            run.result.timings.pop("quantization", None)
