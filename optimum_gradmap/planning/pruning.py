# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""[`Planner`]: the plan of a pruning run, stage by stage, each step of the pipeline adding its own
([`~optimum_gradmap.pipeline.plan_pruning`], [`GradMAPPruner.plan`], `prune --dry-run`)."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from typing import Any

import torch
from transformers import PretrainedConfig, PreTrainedModel

from ..adapters import get_adapter
from ..configuration import GradMAPConfig
from ..errors import InvalidInputError
from ..heal import HealSettings
from ..heal.cost import AUTO_REFERENCE_STEPS, AUTO_TIME_SHARE, changed_parameters, heal_memory
from .counts import Count, Work
from .heal import heal_work
from .placement import (
    ASSUMED_OFFLOAD_BYTES_PER_SECOND,
    allocator_overhead,
    offloaded_shares,
    process_bytes,
    transfer_seconds,
    weights_kept_on_device,
)
from .plan import REPORT_BYTES, PruningPlan, StagePlan, shard_bytes, stage_plan, tokenizer_bytes
from .quantization import passes_text, quantization_memory, quantization_work, stored_layer_bytes
from .shape import ModelShape, describe_model, load_model_config, resolve_dtype
from .stage1 import Stage1Outline, logits_bytes, stage1, stage1_memory
from .stage2 import layouts, stage2, stage2_memory
from .text import budget_text, bytes_text, stage1_passes, stage1_text, stage2_passes, stage2_text
from .throughput import DeviceThroughput


def _check_removal(config: GradMAPConfig, model_config: PretrainedConfig) -> None:
    """Refuses a config that removes no layer, or all of them."""
    adapter = get_adapter(model_config)
    num_layers = getattr(model_config.get_text_config(decoder=True), adapter.layer_count_field)
    num_to_remove = config.num_layers_to_remove(num_layers)
    if num_to_remove < 1 or num_to_remove >= num_layers:
        raise InvalidInputError(
            f"The config removes {num_to_remove} of the model's {num_layers} decoder layers: at least one must go and one "
            "must remain."
        )


class Planner:
    """The plan of one run, stage by stage: each step of the pipeline adds its stage in the order the run makes them
    ([`plan_stage1`], [`plan_stage2`], [`plan_heal`], [`plan_quantization`], [`plan_evaluation`], [`plan_save`]), over
    one model's shape and placement, and [`finish`] gives the [`PruningPlan`]. [`Planner.for_model`] builds one as
    [`~optimum_gradmap.pipeline.plan_pruning`] takes its arguments."""

    def __init__(self, model_config: PretrainedConfig, config: GradMAPConfig, dtype: torch.dtype, name: str):
        self.config, self.model_config, self.dtype = config, model_config, dtype
        self.adapter = get_adapter(model_config)
        self.heal = bool(config.heal_tokens)
        heal_shape = (config.heal_batch_size, config.heal_seq_len) if self.heal else (None, None)
        self.shape = describe_model(model_config, dtype, config.batch_size, config.seq_len, *heal_shape, name)
        self.notes: list[str] = []
        self.stages: list[StagePlan] = []
        self.throughput: DeviceThroughput | None = None
        # what the run is told (`for_model`), and what the stages planned so far leave for the next ones
        self.model_or_path: Any = model_config
        self.removed_layers: Sequence[int] | None = None
        self.validation, self.evaluation_tokens, self.tokenizer_size = False, 0, None
        self.outline1: Stage1Outline | None = None
        self.removable = self.num_kept = Count.of(0)
        self.stage2_line = ""

    def place(
        self,
        device: str | torch.device | None,
        execution: str | None,
        device_map: str | dict[str, Any] | None,
        max_memory: dict[int | str, str] | None,
    ) -> None:
        """Where the model runs: the device, the layers offloaded by `device_map` and `max_memory`, and whether the
        gradient passes run layer-streamed (`execution`, else the config's: `"auto"` streams an offloaded model)."""
        self.device = torch.device(device if device is not None else "cpu")
        self.shares = offloaded_shares(self.shape, self.model_config, device_map, max_memory)
        mode = execution or self.config.execution
        self.streamed = mode == "layer_streamed" or (mode == "auto" and bool(self.shares))
        self.on_cpu = self.device.type == "cpu"
        # on the CPU the process itself counts: the interpreter and its libraries, read before the throughput's measurement
        self.process = process_bytes() if self.on_cpu else 0
        self.placement = (device_map, max_memory)

    def measure(self, throughput: DeviceThroughput | None, measure: bool, host_allocator_overhead: float | None) -> None:
        """The device's rates: `throughput`, else measured where `measure` is on; what stays on the device; and what
        the host's allocator adds to a pass's tensors on a CPU device."""
        config, shape = self.config, self.shape
        if throughput is None and measure:
            throughput = DeviceThroughput.measure(self.model_config, self.dtype, self.device, config.batch_size, config.seq_len)
        self.throughput = throughput
        self.weights, self.largest = shape.weight_bytes, max(shape.layer_parameters) * shape.dtype_bytes
        # layer-streamed, the device holds the weights the device map keeps there (none without one) and one layer at a time
        kept_on_device = weights_kept_on_device(shape, self.model_config, *self.placement, self.device) if self.shares else None
        self.resident = self.largest + (kept_on_device if kept_on_device is not None else 0)
        self.overhead = allocator_overhead(self.device, host_allocator_overhead)

    def stage(
        self,
        name: str,
        passes: str,
        tokens: int,
        work: Work,
        beside_weights: float,
        streamed_peak: float | None,
        host: float = 0.0,
        heal: bool = False,
    ) -> StagePlan:
        """A stage's plan: `beside_weights` bytes held beside the weights in memory, `streamed_peak` layer-streamed,
        `host` on the host beside the device (none by default)."""
        in_memory = self.weights + self.overhead * beside_weights + self.process
        streamed_peak = streamed_peak + self.process if streamed_peak is not None else None
        plan = stage_plan(name, passes, tokens, work, self.shape, self.throughput, in_memory, streamed_peak, host, heal)
        if plan.seconds is not None and self.shares:  # offloaded layers come to the device once per call: per batch
            config = self.config
            batch_tokens = config.heal_batch_size * config.heal_seq_len if heal else config.batch_size * config.seq_len
            plan.seconds = plan.seconds + transfer_seconds(work, self.shape, batch_tokens, self.shares)
        return plan

    @classmethod
    def for_model(
        cls,
        model_or_path: PreTrainedModel | PretrainedConfig | str | os.PathLike,
        config: GradMAPConfig,
        dtype: torch.dtype | str = torch.float32,
        device: str | torch.device | None = None,
        throughput: DeviceThroughput | None = None,
        execution: str | None = None,
        device_map: str | dict[str, Any] | None = None,
        max_memory: dict[int | str, str] | None = None,
        removed_layers: Sequence[int] | None = None,
        validation: bool = False,
        evaluation_tokens: int = 0,
        tokenizer_bytes: int | None = None,
        measure: bool = True,
        name: str | None = None,
        host_allocator_overhead: float | None = None,
    ) -> Planner:
        """A planner for a run of `config` on a model, its throughput measured where none is given.

        Args:
            model_or_path (`PreTrainedModel`, `PretrainedConfig`, `str` or `os.PathLike`): The model, its config, a
                local folder or a Hub id (only `config.json` is read).
            config ([`GradMAPConfig`]): The run.
            dtype (`torch.dtype` or `str`, defaults to `torch.float32`): The dtype the model computes in
                (`"checkpoint"`: the one its config names).
            device (`str` or `torch.device`, *optional*): Where it computes (defaults to the CPU).
            throughput ([`DeviceThroughput`], *optional*): The device's rates; measured on `device` when not given
                and `measure` is on.
            execution (`str`, *optional*): `"in_memory"` or `"layer_streamed"`; defaults to what `config.execution`
                chooses (`"auto"`: layer-streamed where `device_map` offloads layers).
            device_map (`str` or `dict`, *optional*), max_memory (`dict`, *optional*): As `from_pretrained` takes them:
                where Accelerate would offload layers, inferred on the meta model.
            removed_layers (`Sequence[int]`, *optional*): The layers Stage 1 will remove, when known (a Stage 1
                checkpoint, an earlier run): Stage 2's counts then are exact.
            validation (`bool`, defaults to `False`): Stage 2 checks its compensation on validation text.
            evaluation_tokens (`int`, defaults to 0): Tokens of `prune --evaluate`'s perplexity (dense and pruned).
            tokenizer_bytes (`int`, *optional*): The tokenizer's files; read from a local folder when not given.
            measure (`bool`, defaults to `True`): Measure the throughput when none is given (else no time is told).
            name (`str`, *optional*): The model's name in the plan; defaults to `model_or_path`.
            host_allocator_overhead (`float`, *optional*): On a CPU device, the resident bytes one byte of a pass's
                tensors takes: an assumption about the C allocator, which keeps freed blocks. `None`:
                [`HOST_ALLOCATOR_OVERHEAD`] (1.48, measured with glibc's malloc on one machine); 1.0 for an allocator
                that returns freed memory.

        Returns:
            [`Planner`].
        """
        model_config = load_model_config(model_or_path)
        if name is None:
            name = os.fspath(model_or_path) if isinstance(model_or_path, (str, os.PathLike)) else model_config._name_or_path
        _check_removal(config, model_config)
        if config.layers_to_prune is not None:
            removed_layers = list(config.layers_to_prune)
        planner = cls(model_config, config, resolve_dtype(dtype, model_config), name)
        planner.place(device, execution, device_map, max_memory)
        planner.measure(throughput, measure, host_allocator_overhead)
        planner.model_or_path, planner.removed_layers, planner.validation = model_or_path, removed_layers, validation
        planner.evaluation_tokens, planner.tokenizer_size = evaluation_tokens, tokenizer_bytes
        return planner

    def finish(self) -> PruningPlan:
        """The plan of the stages added so far (Stage 1's first), with what it assumes in its notes."""
        config, shape, outline1 = self.config, self.shape, self.outline1
        self.closing_notes()
        return PruningPlan(
            model=shape.name,
            model_type=shape.model_type,
            dtype=str(self.dtype).replace("torch.", ""),
            num_layers=shape.num_layers,
            num_parameters=shape.num_parameters,
            weight_bytes=self.weights,
            largest_layer_bytes=self.largest,
            num_layers_to_remove=outline1.num_to_remove,
            rounds=outline1.rounds,
            budget=budget_text(config, outline1),
            stage1=stage1_text(outline1, config),
            stage2=self.stage2_line,
            execution="layer_streamed" if self.streamed else "in_memory",
            stages=self.stages,
            output_bytes=self.output_bytes,
            throughput=self.throughput,
            notes=self.notes,
        )

    def plan_stage1(self) -> None:
        """Stage 1's stage (none with `layers_to_prune`), its outline and how many layers it may remove."""
        config, shape, removed_layers = self.config, self.shape, self.removed_layers
        work, outline, notes = stage1(config, shape, self.streamed)
        self.notes += notes
        if config.layers_to_prune is None:
            memory = stage1_memory(config, shape, outline)
            tokens = config.num_samples * config.seq_len
            passes = stage1_passes(outline)
            self.stages.append(
                self.stage("Stage 1", passes, tokens, work, memory["in_memory"], self.resident + memory["streamed"])
            )
        if removed_layers is not None:
            removable = Count.of(len(removed_layers))
        else:
            removable = Count(1 if config.has_budget else outline.num_to_remove, outline.num_to_remove)
        self.outline1, self.removable = outline, removable
        self.num_kept = Count(shape.num_layers - removable.high, shape.num_layers - removable.low)

    def plan_stage2(self) -> None:
        """Stage 2's stage, its outline in words and the most layers it may compensate."""
        config, num_layers, protected = self.config, self.shape.num_layers, set(self.outline1.protected)
        if self.removed_layers is not None:
            removals = [sorted(self.removed_layers)]
        else:  # the layouts Stage 1 may leave
            counts = sorted({int(self.removable.low), int(self.removable.high)})
            removals = [removed for count in counts for removed in layouts(num_layers, count, protected)]
        work, outline = stage2(config, self.shape, self.adapter, removals, self.validation)
        memory = stage2_memory(config, self.shape, outline)
        beside = memory["device"] + (memory["host"] if self.on_cpu else 0.0)
        tokens = config.num_samples * config.seq_len
        passes = stage2_passes(outline)
        self.stages.append(self.stage("Stage 2", passes, tokens, work, beside, self.resident + beside, memory["host"]))
        self.stage2_line = stage2_text(outline, config)

    def plan_heal(self) -> None:
        """The heal's stage (an `auto` budget sized to Stage 1's planned time first)."""
        settings, shape = HealSettings.from_config(self.config), self.shape
        num_kept = int(self.num_kept.high)
        if settings.heal_tokens == "auto":
            settings = self.auto_heal_settings(settings, num_kept)
        work, counts = heal_work(settings, shape, num_kept, shape.num_layers, self.streamed)
        memory = heal_memory(settings, shape, num_kept, counts)
        host = memory["host"] if self.on_cpu else 0.0
        tokens = (counts.train_sequences + counts.validation_sequences) * settings.heal_seq_len
        passes = f"{counts.steps} steps, {counts.checks} checks"
        streamed = self.resident + memory["streamed"] + host
        plan = self.stage("Heal", passes, tokens, work, memory["device"] + host, streamed, memory["host"], heal=True)
        if self.config.quantization:  # the copy that undoes the heal if the quantization fails (few large blocks)
            copy = changed_parameters(settings, shape, num_kept) * shape.dtype_bytes
            plan.host_bytes += copy
            if self.on_cpu:
                plan.peak_bytes_in_memory = plan.peak_bytes_in_memory + copy
                plan.peak_bytes_streamed = plan.peak_bytes_streamed + copy
        self.stages.append(plan)

    def auto_heal_settings(self, settings: HealSettings, num_kept: int) -> HealSettings:
        """`heal_tokens="auto"`: as many tokens as fit in Stage 1's planned time. The heal's time is a fixed part (the
        held-out sequences' teacher pass, the first check) and a part per step: two budgets give both."""
        shape = self.shape
        batch_tokens = settings.heal_batch_size * settings.heal_seq_len

        def heal_seconds(steps: int) -> Count | None:
            budget = dataclasses.replace(settings, heal_tokens=steps * batch_tokens)
            work, _ = heal_work(budget, shape, num_kept, shape.num_layers, self.streamed)
            return self.stage("Heal", "", 0, work, 0.0, None, 0.0, heal=True).seconds

        first, second = heal_seconds(AUTO_REFERENCE_STEPS), heal_seconds(2 * AUTO_REFERENCE_STEPS)
        stage1_plan = next((done.seconds for done in self.stages if done.name == "Stage 1"), None)
        if first is None or second is None or stage1_plan is None:
            self.notes.append("heal_tokens='auto': planned at a reference budget (no Stage 1 time to size it by).")
            settings = dataclasses.replace(settings, heal_tokens=AUTO_REFERENCE_STEPS * batch_tokens)
        else:
            per_step = (second.high - first.high) / AUTO_REFERENCE_STEPS
            fixed = first.high - per_step * AUTO_REFERENCE_STEPS
            steps = max(1, math.floor((AUTO_TIME_SHARE * stage1_plan.high - fixed) / per_step))
            settings = dataclasses.replace(settings, heal_tokens=steps * batch_tokens)
            self.notes.append(
                f"heal_tokens='auto': about {settings.heal_tokens:,} tokens, Stage 1's planned time (the run measures its own)."
            )
        return settings

    def plan_quantization(self) -> None:
        """The quantization step, after the heal: llm-compressor over the kept layers, on as many calibration sequences
        as Stage 1 reads ([`optimum_gradmap.planning.quantization`]), with the copy of the pruned model on the host that
        undoes it if it fails ([`~optimum_gradmap.pipeline.Quantize`])."""
        config, shape, num_kept = self.config, self.shape, self.num_kept
        scheme, tokens = config.quantization, config.num_samples * config.seq_len
        work = quantization_work(shape, scheme, num_kept, tokens)
        beside = quantization_memory(shape, scheme, config.num_samples, config.seq_len)
        passes = passes_text(scheme, config.num_samples, config.seq_len)
        used = tokens if work.layer_forward.high else 0
        plan = self.stage("Quantize", passes, used, work, beside, self.resident + beside)
        # the copy that undoes it: the pruned weights, a few large blocks (no allocator overhead measured)
        plan.host_bytes = copy = _kept_bytes(shape, self.removable, self.outline1.protected, None).high
        if self.on_cpu:
            plan.peak_bytes_in_memory = plan.peak_bytes_in_memory + copy
            plan.peak_bytes_streamed = plan.peak_bytes_streamed + copy
        self.stages.append(plan)

    def plan_evaluation(self) -> None:
        """Perplexity of the dense and of the pruned model over the evaluation tokens (`prune --evaluate`), if any."""
        shape, num_kept, tokens = self.shape, self.num_kept, self.evaluation_tokens
        if not tokens:
            return
        logits = logits_bytes(shape, self.config.batch_size, self.config.seq_len)
        work = Work(layer_forward=(num_kept + shape.num_layers) * tokens, head_forward=Count.of(2 * tokens))
        self.stages.append(self.stage("Evaluation", "dense and pruned perplexity", tokens, work, logits, self.resident + logits))

    def plan_save(self) -> None:
        """Saving: the output's bytes on disk (the kept layers' weights, as the quantization stores them where it runs,
        the tokenizer and the report); an offloaded model is written a shard at a time, each shard's weights read
        into memory first."""
        config, shape = self.config, self.shape
        tokenizer_size = self.tokenizer_size
        if tokenizer_size is None:
            tokenizer_size = tokenizer_bytes(self.model_or_path)
            if tokenizer_size is None:
                self.notes.append("Disk: the tokenizer's files are not counted (no local folder to read their size from).")
        output_bytes = _kept_bytes(shape, self.removable, self.outline1.protected, config.quantization)
        self.output_bytes = output_bytes = output_bytes + (tokenizer_size or 0) + REPORT_BYTES
        shard = min(shard_bytes(), output_bytes.high)
        save = self.stage("Save", "the checkpoint, shard by shard", 0, Work(), 0.0, self.resident + shard)
        disk = ASSUMED_OFFLOAD_BYTES_PER_SECOND["disk"]
        save.seconds = Count.of(output_bytes.high / disk) if self.throughput is not None else None
        self.stages.append(save)

    def closing_notes(self) -> None:
        """What the plan assumes: the process's own memory, the allocator, the offload bandwidths, estimated layers."""
        if self.process:
            self.notes.append(
                f"Peaks include this process's own resident memory ({bytes_text(self.process)}: Python, torch, transformers)."
            )
        if self.on_cpu:
            self.notes.append(
                f"In memory, what the passes hold beside the weights is counted {self.overhead:g}x: the C allocator "
                "keeps freed blocks (MALLOC_MMAP_THRESHOLD_=131072 returns them, at a cost in time)."
            )
        if self.shares:
            places = ", ".join(f"{share:.0%} of the layers on {place}" for place, share in self.shares.items())
            bandwidths = ", ".join(f"{place} {ASSUMED_OFFLOAD_BYTES_PER_SECOND[place] / 1e9:g} GB/s" for place in self.shares)
            self.notes.append(
                f"Offloaded ({places}): the times include bringing their weights to the device at an assumed {bandwidths}."
            )
        if any(not layer.measured for layer in self.shape.layers):
            self.notes.append(
                "Some layers cannot run on the meta device: their FLOPs and activations are estimated from their parameters."
            )
        self.notes.append(
            "Activations are measured on the math attention path (its T^2 scores kept): flash attention keeps less."
        )


def _kept_bytes(shape: ModelShape, removable: Count, protected: list[int], quantization: str | None) -> Count:
    """The output's weight bytes after removing `removable` of the non-protected layers (the largest ones, or the
    smallest): in the model's dtype, or with the layers' linear maps stored as `quantization` stores them."""
    layer_bytes = [parameters * shape.dtype_bytes for parameters in shape.layer_parameters]
    if quantization:
        layer_bytes = stored_layer_bytes(shape, quantization)
    sizes = sorted(size for index, size in enumerate(layer_bytes) if index not in protected)
    total = (shape.num_parameters - sum(shape.layer_parameters)) * shape.dtype_bytes + sum(layer_bytes)
    low = total - sum(sizes[len(sizes) - int(removable.high) :])
    high = total - sum(sizes[: int(removable.low)])
    return Count(low, high)
