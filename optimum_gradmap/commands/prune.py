# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""`optimum-gradmap prune`: prunes a model, saves a standard checkpoint with its report and model card,
and uploads it if asked. Every `GradMAPConfig` field is an option under its own name, generated from the
config ([`optimum_gradmap.arguments`])."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import TYPE_CHECKING, Any

from transformers.utils import logging

from ..arguments import add_config_arguments, add_retired_arguments, brief, config_from_arguments, option_groups
from ..configuration import PRESETS, GradMAPConfig
from ..loading import ModelLoading
from ..retired import RETIRED_SETTINGS, retired_setting_message
from .common import (
    DATA_SECTION,
    MODEL_SECTION,
    InputError,
    add_logging_arguments,
    command_line,
    set_verbosity,
    step_sections,
)
from .heal import default_heal_checkpoint, default_heal_text_cache, finish_heal_checkpoint

if TYPE_CHECKING:
    from ..pipeline import Step

logger = logging.get_logger(__name__)

HELP = "Prune a model's decoder layers with GradMAP and save a standard checkpoint"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `prune`: every `GradMAPConfig` field, plus where to read and write, in one help section per
    step of the run (a step's section holds the fields its settings read)."""
    from ..pipeline import Compensate, Heal, Quantize, SelectLayers

    groups = option_groups(
        parser,
        [
            MODEL_SECTION,
            DATA_SECTION,
            *step_sections([SelectLayers, Compensate, Heal, Quantize], first={Compensate: ["compensation"]}),
        ],
    )
    described = "; ".join(
        f"{name}: {', '.join(f'{key}={value}' for key, value in settings.items())}" for name, settings in PRESETS.items()
    )
    brief(
        parser.add_argument(
            "--preset", choices=PRESETS, default=None, help=f"named settings, which the options below override: {described}"
        ),
        "named settings for every step, which the other options override: paper (GradMAP as published), quality, fast",
    )
    add_config_arguments(parser, ModelLoading, groups=groups)
    add_config_arguments(parser, GradMAPConfig, groups=groups)
    add_retired_arguments(parser, {name: retired_setting_message(name) for name in RETIRED_SETTINGS})
    brief(
        groups["importance"].add_argument(
            "--cut-from",
            metavar="CHECKPOINT",
            default=None,
            help="cut an earlier run at --num-layers-to-prune K without scoring again: remove the first K layers that "
            "CHECKPOINT's Stage 1 removed (its pruning_report.json; removal is nested, so they are the layers a run with "
            "K removes), then run Stage 2 for that K (no Stage 1 round runs: --max-loss-increase, "
            "--target-num-parameters and --loss-curve are refused)",
        )
    )
    brief(
        groups["compensation"].add_argument(
            "--validation-dataset",
            default=None,
            metavar="DATASET",
            help="keep Stage 2's compensation only if it lowers the perplexity on this dataset (read like --dataset; "
            "needs Stage 2: refused with --no-compensation)",
        )
    )
    _add_output_arguments(parser)
    add_logging_arguments(parser)


def _add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of the output and the Hub: where the checkpoint goes, what is measured on it, the dry run."""
    output = parser.add_argument_group("output and the Hub", "where the pruned checkpoint goes, and what is measured on it")
    output.add_argument("--output", "-o", required=True, help="folder for the pruned checkpoint, report and model card")
    output.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the contents of an existing non-empty --output folder (never the input model's)",
    )
    brief(
        output.add_argument(
            "--evaluate",
            nargs="*",
            metavar="DATASET",
            default=None,
            help="also measure perplexity on these datasets (none given: those of `evaluate`), of the dense model and of "
            "the model saved (after the heal when --heal-tokens is given: the card labels its figures 'after heal')",
        ),
        "also measure perplexity before and after on these datasets (none given: those of `evaluate`)",
    )
    brief(
        output.add_argument(
            "--max-segments", type=int, default=None, help="with --evaluate: only the first segments of each dataset (None: all)"
        )
    )
    output.add_argument("--push-to-hub", metavar="REPO", default=None, help="also upload the checkpoint to this Hub repository")
    output.add_argument("--private", action="store_true", help="create the Hub repository as private (with --push-to-hub)")
    brief(
        output.add_argument(
            "--dry-run",
            action="store_true",
            help="print what the run would do and cost (layers, rounds and passes, tokens, FLOPs, peak memory, disk, and "
            "the time on this device from a few seconds' measurement of its throughput) and exit, without loading a "
            "weight; the model and the calibration text are read as the run reads them, so that a run that cannot start "
            "fails here",
        ),
        "print what the run would do and cost (time, memory, disk) and exit, without loading a weight",
    )
    brief(
        output.add_argument(
            "--stage1-checkpoint",
            metavar="FILE",
            default=None,
            help="save Stage 1's progress to this JSON file after every round, and resume from it when it exists "
            "(None: a hidden file beside --output, removed once the checkpoint is saved, unless the heal was interrupted)",
        )
    )
    brief(
        output.add_argument(
            "--host-allocator-overhead",
            type=float,
            default=None,
            metavar="FACTOR",
            help="with --dry-run on a CPU device: the resident bytes one byte of a pass's tensors takes, an assumption "
            "about the C allocator (default 1.48, measured with glibc's malloc on one machine, docs/benchmarks/scale.md; "
            "1.0 for an allocator that returns freed memory, e.g. with MALLOC_MMAP_THRESHOLD_=131072)",
        )
    )


def default_stage1_checkpoint(output: str) -> str:
    """Where `prune` keeps Stage 1's progress when `--stage1-checkpoint` is not given: a hidden file beside
    the output folder, deleted when the checkpoint is saved (kept when the heal stage was interrupted: its resume
    replays Stage 1 from it), so that an interrupted run resumes by itself."""
    target = os.path.abspath(output)
    return os.path.join(os.path.dirname(target), f".{os.path.basename(target)}.stage1.json")


def _checked_prune_input(args: argparse.Namespace) -> tuple[GradMAPConfig, ModelLoading, list[Step]]:
    """Everything `prune` can check before any compute (options, datasets, calibration files, device, output
    folder, and what each step's settings alone decide: the quantization's extra and hardware, ...), so that bad input
    costs seconds, exits with code 2 and writes nothing. Returns the config, the loading and the run's steps."""
    from ..data import check_dataset_name
    from ..heal import check_heal_dataset_name
    from ..pipeline import Evaluate, Save, pruning_steps

    config = config_from_arguments(args, GradMAPConfig)
    if args.cut_from is not None:
        config = _cut(config, args.cut_from)
    if args.private and not args.push_to_hub:
        raise InputError("--private only applies with --push-to-hub REPO.")
    check_dataset_name(config.dataset, "calibration")
    if config.compensation_dataset is not None:
        check_dataset_name(config.compensation_dataset, "calibration")
    if config.heal_tokens:
        check_heal_dataset_name(config.heal_dataset)
    if args.validation_dataset is not None:
        check_dataset_name(args.validation_dataset, "calibration")
    loading = config_from_arguments(args, ModelLoading)
    loading.check_device()
    steps = pruning_steps(config)  # Stage 1, Stage 2, the heal, quantization: those the config asks for
    if args.evaluate is not None:
        steps.append(Evaluate(tuple(args.evaluate), args.max_segments, announce=True))
    keep_safe = (args.model,) if os.path.isdir(args.model) else ()
    steps.append(Save(args.output, args.overwrite, keep_safe))
    for step in steps:
        step.check_settings()
    return config, loading, steps


def _cut(config: GradMAPConfig, checkpoint: str) -> GradMAPConfig:
    """The config that removes the first `config.num_layers_to_prune` layers an earlier run removed.

    The cut runs no Stage 1 round: a budget, a parameter target or a loss curve would have nothing to decide or
    measure, so they are refused rather than ignored."""

    from ..report import load_report

    given = [
        option
        for option, value in (
            ("--max-loss-increase", config.max_loss_increase),
            ("--target-num-parameters", config.target_num_parameters),
            ("--loss-curve", config.loss_curve or None),
        )
        if value is not None
    ]
    if given:
        raise InputError(
            f"--cut-from cannot apply {', '.join(given)}: it replays the first K layers {checkpoint}'s Stage 1 removed, "
            "without Stage 1's rounds, so there is no removal to stop or loss to follow. Drop "
            f"{'it' if len(given) == 1 else 'them'} and choose K yourself: `optimum-gradmap inspect {checkpoint}` prints "
            "the calibration loss after each removal when that run followed it (--loss-curve or a budget), and its "
            "parameters; then give --num-layers-to-prune K."
        )
    report = load_report(checkpoint)
    if config.compensate_each_round or report["gradmap_config"].get("compensate_each_round"):
        raise InputError(
            "--cut-from replays the first K removals without Stage 1's fits: a run with --compensate-each-round (this "
            "one or the one it cuts) cannot be cut, its later fits depend on the layers removed after."
        )
    removed = report["removed_layers"]
    if config.num_layers_to_prune is None or not 1 <= config.num_layers_to_prune <= len(removed):
        raise InputError(
            f"--cut-from needs --num-layers-to-prune K, between 1 and the {len(removed)} layers {checkpoint} removed."
        )
    print(f"Cutting {checkpoint}'s run at {config.num_layers_to_prune}: removing layers {removed[: config.num_layers_to_prune]}")
    return dataclasses.replace(config, layers_to_prune=removed[: config.num_layers_to_prune], num_layers_to_prune=None)


def run(args: argparse.Namespace) -> int:
    """`optimum-gradmap prune`: prunes, saves checkpoint + report + model card, optionally uploads."""
    from .. import distributed
    from ..pipeline import Run, RunInputs, check_inputs_have_steps, run_steps

    progress = set_verbosity(args)
    config, loading, steps = _checked_prune_input(args)
    stage1_checkpoint = args.stage1_checkpoint
    if stage1_checkpoint is None and config.layers_to_prune is None:
        stage1_checkpoint = default_stage1_checkpoint(args.output)
    heal_checkpoint = default_heal_checkpoint(args.output) if config.heal_tokens else None
    inputs = RunInputs(
        validation_data=args.validation_dataset,
        stage1_checkpoint=stage1_checkpoint,
        heal_checkpoint=heal_checkpoint,
        heal_text_cache=default_heal_text_cache(args.output) if config.heal_tokens else None,
    )
    check_inputs_have_steps(config, inputs)
    resolved = loading.resolve()  # a model name that is no folder, no asset and not on the Hub: refused here
    if args.dry_run:
        return _dry_run(args, config, loading, resolved.path, steps)

    several = distributed.init_from_environment()  # under torchrun / accelerate launch: data parallel
    main_process = distributed.is_main_process()
    progress = progress and main_process
    if several and loading.device == "cuda":
        loading.device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}"  # one GPU per process
    card = {
        "base_model": resolved.base_model or args.model,
        "base_model_revision": args.revision,
        "license": resolved.license,
        "repo_id": args.push_to_hub,
        "command": command_line(args),
    }
    steps[-1] = dataclasses.replace(steps[-1], card=card)  # the save, with what the model card says of the run
    model, tokenizer = loading.load(resolved.path)
    run = Run(model, config, inputs, tokenizer, progress_bar=progress)
    try:
        run_steps(steps, run)  # the last one saves, by the main process; the others wait for it
    except KeyboardInterrupt:
        _print_interrupted(args, stage1_checkpoint)
        return 130
    if not main_process:
        return 0
    _finish(args, run.result, stage1_checkpoint, heal_checkpoint, run.dense_evaluation, run.evaluation)
    return 0


def _print_interrupted(args: argparse.Namespace, stage1_checkpoint: str | None) -> None:
    """After Ctrl-C: where Stage 1's finished rounds are, and the command that resumes from them."""
    saved = stage1_checkpoint is not None and os.path.isfile(stage1_checkpoint)
    print(
        f"\nInterrupted. Stage 1's finished rounds are saved in {stage1_checkpoint}; the same command resumes from "
        f"them:\n  {command_line(args)}"
        if saved
        else "\nInterrupted before any Stage 1 round finished: nothing was saved.",
        file=sys.stderr,
    )


def _finish(
    args: argparse.Namespace,
    result: Any,
    stage1_checkpoint: str | None,
    heal_checkpoint: str | None,
    dense_evaluation: Any,
    evaluation: Any,
) -> None:
    """After the save, on the main process: the default Stage 1 checkpoint removed (kept for an interrupted heal's
    resume), the result printed, and the upload."""
    from ..report import curve_lines

    heal_interrupted = result.heal is not None and result.heal.interrupted
    if stage1_checkpoint is not None and args.stage1_checkpoint is None and os.path.isfile(stage1_checkpoint):
        if heal_interrupted:  # the resume (the same command) replays Stage 1 from it, then the heal goes on
            print(f"Stage 1's rounds are kept in {stage1_checkpoint}, for the resume of the interrupted heal.")
        else:
            os.remove(stage1_checkpoint)  # the default one: its work is in the checkpoint now
    print(f"Removed layers {result.removed_layers} of {result.original_num_layers} (in removal order); kept {result.kept_layers}")
    for line in curve_lines(result.to_dict()):
        print(line)
    if result.stopped:
        print(f"Stage 1 stopped: {result.stopped}.")
    if result.compensated_layers:
        print(f"Compensated layer(s) {result.compensated_layers}.")
    if result.heal is not None:
        print(result.heal.summary())
        finish_heal_checkpoint(heal_checkpoint, result.heal.interrupted, explicit=False)
    dense = {(e.dataset, e.protocol): e.perplexity for e in (dense_evaluation.perplexities if dense_evaluation else [])}
    for e in evaluation.perplexities if evaluation else []:
        before = dense[(e.dataset, e.protocol)]
        print(f"{e.dataset} perplexity: {e.perplexity:.3f} (dense {before:.3f}) ({e.protocol}, {e.num_segments} segments)")
    print(f"Saved the checkpoint, pruning_report.json, pictures and model card to {os.path.abspath(args.output)}")
    if args.push_to_hub:
        from ..hub import upload_checkpoint

        # the folder just written is the upload: no second save
        commit_message = result.commit_message()
        url = upload_checkpoint(args.output, args.push_to_hub, private=args.private or None, commit_message=commit_message)
        print(f"Uploaded to {url}")


def _dry_run(args: argparse.Namespace, config: GradMAPConfig, loading: ModelLoading, path: str, steps: list[Step]) -> int:
    """`prune --dry-run`: reads the calibration text as the run would (a dataset that cannot be reached fails here,
    with the run's own error), prints the plan of the run's steps ([`optimum_gradmap.pipeline.plan_pruning`]) from the model's
    config alone, and returns 0 without loading a weight."""
    from ..pipeline import plan_pruning
    from ..precision import compute_device, resolve_dtype

    _read_calibration_text(args, config)
    device = compute_device(loading.device, loading.device_map)
    evaluation_tokens = 0
    if args.evaluate is not None and args.max_segments is not None:  # dense and pruned, 128-token segments
        evaluation_tokens = args.max_segments * 128 * len(args.evaluate or ("wikitext2", "c4"))
    plan = plan_pruning(
        path,
        config,
        dtype=resolve_dtype(loading.dtype, device),
        device=device,
        device_map=loading.device_map,
        max_memory=loading.max_memory_per_device(),
        validation=args.validation_dataset is not None,
        evaluation_tokens=evaluation_tokens,
        name=args.model,
        host_allocator_overhead=args.host_allocator_overhead,
        steps=steps,
    )
    if args.evaluate is not None and args.max_segments is None:
        plan.notes.append("--evaluate without --max-segments: the evaluation is not counted (its size is known once read).")
    print(plan)
    return 0


def _read_calibration_text(args: argparse.Namespace, config: GradMAPConfig) -> None:
    """Reads the text the run reads before Stage 1 (the calibration dataset, Stage 2's and the validation's where
    given) with the run's own loaders ([`optimum_gradmap.data.text_documents`]): a dataset the run could not reach, or
    a file it could not read, raises the error the run would raise."""
    from ..data import text_documents

    for data in (config.dataset, config.compensation_dataset, args.validation_dataset):
        if data is not None:
            text_documents(data, config.text_column)
