# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""`optimum-gradmap inspect`: prints a checkpoint's pruning report."""

from __future__ import annotations

import argparse
import json

HELP = "Print the pruning report of a checkpoint"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `inspect`."""
    parser.add_argument("checkpoint", help="a folder written by `optimum-gradmap prune` (or GradMAPPruner.save_pretrained)")
    parser.add_argument("--json", action="store_true", help="print the whole pruning_report.json")


def run(args: argparse.Namespace) -> int:
    """`optimum-gradmap inspect`: prints a checkpoint's pruning report."""
    from ..report import format_report, load_report

    report = load_report(args.checkpoint)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0
