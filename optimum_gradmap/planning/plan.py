# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""The plan: [`PruningPlan`] (what a run will do and cost) made of [`StagePlan`]s, printed as a table and given as
JSON-serialisable values; and the disk the output checkpoint takes beside its weights."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any

from .counts import ZERO, Count, Work, flops, plain
from .shape import ModelShape
from .text import bytes_text, count_text, flop_text, max_over, range_text, seconds_text, table
from .throughput import DeviceThroughput

# Files a checkpoint holds besides the weights and the tokenizer: config, generation config, gradmap_config.json,
# pruning_report.json, its pictures and the model card (measured on a saved SmolLM2-135M checkpoint: about 0.2 MB).
REPORT_BYTES = 300_000
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)


@dataclass
class StagePlan:
    """One stage of the run.

    Args:
        name (`str`): `"Stage 1"`, `"Stage 2"`, `"Heal"`, `"Evaluation"`.
        passes (`str`): What runs, in words.
        tokens (`int`): The tokens the stage reads (the calibration set, the heal text, ...).
        work ([`Work`]): What it computes.
        flops (`Count`): Its FLOPs.
        seconds (`Count`, *optional*): Its expected seconds on the device (none without a throughput).
        peak_bytes_in_memory (`Count`): Peak memory with every weight on the device (the weights included).
        peak_bytes_streamed (`Count`, *optional*): Peak device memory layer-streamed, the weights offloaded but those
            the device map keeps on the device (all of them without a device map), one layer's weights included;
            `None` where the stage cannot run offloaded.
        host_bytes (`float`): Host memory the stage holds beside the device (its part of the peak on a CPU).
    """

    name: str
    passes: str
    tokens: int
    work: Work
    flops: Count
    seconds: Count | None
    peak_bytes_in_memory: Count
    peak_bytes_streamed: Count | None
    host_bytes: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {item.name: plain(getattr(self, item.name)) for item in fields(self)}


def stage_plan(
    name: str,
    passes: str,
    tokens: int,
    work: Work,
    shape: ModelShape,
    throughput: DeviceThroughput | None,
    in_memory: float,
    streamed: float | None,
    host: float,
    heal: bool = False,
) -> StagePlan:
    """A [`StagePlan`] for `work` on a model of `shape`: its FLOPs, and its seconds where a throughput is given."""
    return StagePlan(
        name=name,
        passes=passes,
        tokens=tokens,
        work=work,
        flops=flops(work, shape, heal),
        seconds=throughput.seconds(work, shape, heal) if throughput is not None else None,
        peak_bytes_in_memory=Count.of(in_memory),
        peak_bytes_streamed=Count.of(streamed) if streamed is not None else None,
        host_bytes=host,
    )


@dataclass
class PruningPlan:
    """What a GradMAP run will do and cost, told before the run from the model's config alone: the layers to remove,
    the rounds and passes, the tokens and FLOPs of each stage, the peak memory in memory and layer-streamed, the disk
    the output needs and the expected seconds on the device. `print(plan)` shows it as a table; `to_dict()` gives it
    as JSON-serialisable values. Ranges (`low-high`) are where the run's own findings decide.

    Args:
        model (`str`): The model planned.
        model_type (`str`): Its family.
        dtype (`str`): The dtype it computes in.
        num_layers (`int`): Its decoder layers.
        num_parameters (`int`): Its parameters.
        weight_bytes (`int`): Its weights' bytes in `dtype`.
        largest_layer_bytes (`int`): The largest decoder layer's bytes (what layer streaming holds at once).
        num_layers_to_remove (`int`): K (the most a budget may remove).
        rounds (`Count`): Stage 1's rounds (a range with a budget: known only as Stage 1 goes).
        budget (`str`, *optional*): The budget or size target that decides K as Stage 1 goes.
        stage1 (`str`): How Stage 1 runs (metric, rounds, passes per round).
        stage2 (`str`): How Stage 2 runs.
        execution (`str`): How the gradient passes run: `"in_memory"` or `"layer_streamed"`.
        stages (`list[StagePlan]`): The stages.
        output_bytes (`Count`): The disk the output checkpoint takes (weights of the kept layers, tokenizer, report).
        throughput ([`DeviceThroughput`], *optional*): What the times are based on.
        notes (`list[str]`): What the plan assumes or cannot count.
    """

    model: str
    model_type: str
    dtype: str
    num_layers: int
    num_parameters: int
    weight_bytes: int
    largest_layer_bytes: int
    num_layers_to_remove: int
    rounds: Count
    budget: str | None
    stage1: str
    stage2: str
    execution: str
    stages: list[StagePlan]
    output_bytes: Count
    throughput: DeviceThroughput | None
    notes: list[str] = field(default_factory=list)

    @property
    def seconds(self) -> Count | None:
        """The whole run's expected seconds (`None` without a throughput)."""
        if any(stage.seconds is None for stage in self.stages):
            return None
        return sum((stage.seconds for stage in self.stages), ZERO)

    @property
    def peak_bytes(self) -> Count:
        """The run's peak memory, as it will run (`execution`)."""
        peaks = [
            stage.peak_bytes_streamed
            if self.execution == "layer_streamed" and stage.peak_bytes_streamed
            else stage.peak_bytes_in_memory
            for stage in self.stages
        ]
        return Count(max(peak.low for peak in peaks), max(peak.high for peak in peaks)) if peaks else ZERO

    def stage(self, name: str) -> StagePlan:
        """The stage called `name`."""
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(f"No stage {name!r} in this plan: {[stage.name for stage in self.stages]}.")

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON-serialisable values (a range as `{"low": ..., "high": ...}`)."""
        values = {item.name: plain(getattr(self, item.name)) for item in fields(self)}
        values["seconds"] = plain(self.seconds)
        values["peak_bytes"] = plain(self.peak_bytes)
        return values

    def __str__(self) -> str:
        lines = [
            f"GradMAP plan for {self.model} ({self.model_type}, {self.num_layers} layers, "
            f"{count_text(self.num_parameters)} parameters, {self.dtype}: {bytes_text(self.weight_bytes)})",
        ]
        if self.num_layers_to_remove:  # a quantization plan removes none
            removal = f"Remove {self.num_layers_to_remove} of {self.num_layers} layers"
            lines.append(f"{removal} ({self.budget})" if self.budget else removal)
        lines.append(f"Stage 1: {self.stage1}")
        if self.stage2:
            lines.append(f"Stage 2: {self.stage2}")
        lines.append(table(self._rows()))
        lines.append(f"Disk: the output checkpoint takes {range_text(self.output_bytes, bytes_text)}.")
        if self.throughput is not None:
            rates = self.throughput
            tera = lambda value: f"{value / 1e12:.3g}"  # noqa: E731
            lines.append(
                f"Throughput ({rates.source}): layer forward {tera(rates.forward_flops_per_second)}, gradient pass "
                f"{tera(rates.gradient_flops_per_second)}, with per-sample norms {tera(rates.per_sample_flops_per_second)}, "
                f"head {tera(rates.head_flops_per_second)} TFLOP/s."
            )
        lines += [f"Note: {note}" for note in self.notes]
        return "\n".join(lines)

    def _rows(self) -> list[list[str]]:
        """The table's header, a row per stage and the total."""
        rows = [["Stage", "Passes", "Tokens", "TFLOP", "Time", "Peak, in memory", "Peak, layer-streamed"]]
        for stage in self.stages:
            rows.append(
                [
                    stage.name,
                    stage.passes,
                    count_text(stage.tokens),
                    range_text(stage.flops / 1e12, flop_text),
                    range_text(stage.seconds, seconds_text) if stage.seconds is not None else "-",
                    range_text(stage.peak_bytes_in_memory, bytes_text),
                    range_text(stage.peak_bytes_streamed, bytes_text) if stage.peak_bytes_streamed is not None else "n/a",
                ]
            )
        total_seconds = self.seconds
        streamed = [stage.peak_bytes_streamed for stage in self.stages if stage.peak_bytes_streamed]
        rows.append(
            [
                "Total",
                f"gradient passes {self.execution.replace('_', '-')}",
                "",
                range_text(sum((stage.flops for stage in self.stages), ZERO) / 1e12, flop_text),
                range_text(total_seconds, seconds_text) if total_seconds is not None else "-",
                range_text(max_over(stage.peak_bytes_in_memory for stage in self.stages), bytes_text),
                range_text(max_over(streamed), bytes_text) if streamed else "n/a",
            ]
        )
        return rows


def described(shape: Any, dtype: Any) -> dict[str, Any]:
    """The [`PruningPlan`] fields a plan of one stage on a saved checkpoint takes from its shape (`ModelShape`)."""
    return dict(
        model_type=shape.model_type,
        dtype=str(dtype).replace("torch.", ""),
        num_layers=shape.num_layers,
        num_parameters=shape.num_parameters,
        weight_bytes=shape.weight_bytes,
        largest_layer_bytes=max(shape.layer_parameters) * shape.dtype_bytes,
    )


def tokenizer_bytes(model_or_path: Any) -> int | None:
    """The size of the tokenizer's files in a local model folder; `None` elsewhere."""
    if not isinstance(model_or_path, (str, os.PathLike)) or not os.path.isdir(model_or_path):
        return None
    return sum(
        os.path.getsize(os.path.join(model_or_path, name))
        for name in _TOKENIZER_FILES
        if os.path.isfile(os.path.join(model_or_path, name))
    )


def shard_bytes() -> int:
    """The checkpoint's shard size in bytes ([`optimum_gradmap.checkpoint.DEFAULT_MAX_SHARD_SIZE`])."""
    from transformers.utils.hub import convert_file_size_to_int

    from ..checkpoint import DEFAULT_MAX_SHARD_SIZE

    return convert_file_size_to_int(DEFAULT_MAX_SHARD_SIZE)
