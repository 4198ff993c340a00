# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""`optimum-gradmap compare`: two models' zero-shot answers compared question by question, from the JSON
files `optimum-gradmap evaluate --output` writes (with their `.questions.jsonl` records): per task and
pooled, each accuracy, the paired difference with its standard error, McNemar's exact test, and with
`--reference` (the dense model's evaluation) the retained accuracy and the two models' flips against it (the share of
questions whose right/wrong differs from the reference's; Dutta et al., "Accuracy is Not All You Need", NeurIPS
2024), compared the same way."""

from __future__ import annotations

import argparse
import json
import os

from .common import InputError, add_logging_arguments, set_verbosity

HELP = "Compare two models' zero-shot answers question by question (paired difference, McNemar, retained share, flips)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `compare`."""
    parser.add_argument("model_a", metavar="A", help="evaluation JSON of the first model (`evaluate --output`)")
    parser.add_argument("model_b", metavar="B", help="evaluation JSON of the second model, on the same questions")
    parser.add_argument(
        "--reference",
        default=None,
        help="evaluation JSON of the dense model: retained accuracy against it, and each model's flips against its answers",
    )
    parser.add_argument("--output", "-o", default=None, help="write the comparison as JSON to this file")
    add_logging_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Prints the comparison of B against A (and writes it as JSON with `--output`)."""
    from ..evaluation import EvaluationResult, compare_zero_shot
    from ..files import write_atomically

    set_verbosity(args)
    results = []
    for path in (args.model_a, args.model_b, args.reference):
        if path is None:
            results.append(None)
            continue
        if not os.path.isfile(path):
            raise InputError(f"{path}: no such file: give the JSON written by `optimum-gradmap evaluate --output`.")
        result = EvaluationResult.from_json(path)
        if result.zero_shot is None:
            raise InputError(f"{path} has no zero-shot results: evaluate the model with --tasks.")
        results.append(result)
    names = [result.model if result is not None else None for result in results]
    comparison = compare_zero_shot(*(result.zero_shot if result else None for result in results), names=names)
    print(comparison.summary())
    if args.output:
        write_atomically(args.output, json.dumps(comparison.to_dict(), indent=2))
    return 0
