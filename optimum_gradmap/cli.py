# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""The `optimum-gradmap` command line (also `optimum-cli gradmap`): the commands of
[`optimum_gradmap.commands`] (`prune`, `evaluate`, `heal`, `quantize`, `compare`, `inspect`, `verify-serving`), their
parser, and what their errors become. Every `GradMAPConfig` field is a `prune` option under its own name
(`--pruning-ratio`, also accepted as `--pruning_ratio`), with the config's default and help. `--help` lists the
options a user sets, grouped by step; `--help-all` lists every option.

    optimum-gradmap prune offline:smollm2-135m --pruning-ratio 0.25 --dataset offline:wikipedia --output out/s

Exit codes: 0 on success, 2 for bad input (the message says what to fix; nothing was changed or written),
1 when something failed while running (a download, the Hub, memory). `-v` prints the traceback of any error.
"""

from __future__ import annotations

import argparse
import logging as std_logging
import sys
import traceback
from collections.abc import Sequence

from transformers.utils import logging

from .adapters import UnsupportedArchitectureError
from .arguments import finish_help
from .commands import COMMANDS
from .commands.common import LIBRARY_LOGGER
from .commands.prune import default_stage1_checkpoint
from .configuration import PRESETS
from .errors import InvalidInputError

PROG = "optimum-gradmap"
DESCRIPTION = f"Layer pruning of causal LMs with GradMAP: {', '.join(COMMANDS)}"
__all__ = [
    "COMMANDS",
    "DESCRIPTION",
    "add_command_arguments",
    "build_parser",
    "default_stage1_checkpoint",
    "main",
    "preset_in",
    "run",
]


def build_parser(prog: str = PROG, argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The `optimum-gradmap` argument parser with its subcommands (`COMMANDS`).

    Args:
        prog (`str`): The program name in messages.
        argv (`Sequence[str]`, *optional*): The arguments about to be parsed: a `--preset` among them sets the
            defaults of `prune`'s options ([`add_command_arguments`]).
    """
    parser = argparse.ArgumentParser(prog=prog, description=DESCRIPTION)
    subparsers = parser.add_subparsers(dest="command", metavar="{" + ",".join(COMMANDS) + "}")
    for name, (help_text, _, run) in COMMANDS.items():
        subparser = subparsers.add_parser(
            name, help=help_text, description=help_text, formatter_class=argparse.ArgumentDefaultsHelpFormatter
        )
        add_command_arguments(subparser, name, argv)
        subparser.set_defaults(run=run)
    return parser


def add_command_arguments(parser: argparse.ArgumentParser, name: str, argv: Sequence[str]) -> None:
    """Adds the options of the command `name` to `parser` (for the `optimum-gradmap` script and `optimum-cli
    gradmap` alike). The options of `prune` are named after the config fields, and a `--preset` in `argv` makes
    its settings their defaults, so that options given on the command line still override them (an unknown
    preset changes nothing here; `prune` refuses it)."""
    COMMANDS[name][1](parser)
    finish_help(parser, full="--help-all" in argv)
    if name == "prune":
        parser.set_defaults(**PRESETS.get(preset_in(argv), {}))


def preset_in(argv: Sequence[str]) -> str | None:
    """The value of `--preset` in `argv`, read before the full parse (it sets other options' defaults)."""
    reader = argparse.ArgumentParser(add_help=False)
    reader.add_argument("--preset")
    return reader.parse_known_args(argv)[0].preset


def run(args: argparse.Namespace, prog: str = PROG) -> int:
    """Runs a parsed command and turns errors into exit codes and messages: 2 for bad input
    ([`InvalidInputError`], an unsupported architecture, an output folder that cannot be written), 1 for any
    other error. With `-v`,
    the traceback is printed too. The logging settings the command makes (see `set_verbosity`) are undone
    when it returns, for callers that run it in-process."""
    library_logger = std_logging.getLogger(LIBRARY_LOGGER)
    saved = (library_logger.level, library_logger.propagate, list(library_logger.handlers), logging.get_verbosity())
    try:
        return args.run(args)
    except Exception as error:  # noqa: BLE001 - every error becomes a message and an exit code
        if getattr(args, "verbose", False):
            traceback.print_exc(file=sys.stderr)
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 2 if isinstance(error, (InvalidInputError, UnsupportedArchitectureError, FileExistsError, PermissionError)) else 1
    finally:
        library_logger.setLevel(saved[0])
        library_logger.propagate = saved[1]
        library_logger.handlers[:] = saved[2]
        logging.set_verbosity(saved[3])


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `optimum-gradmap` console script."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv=argv)
    args = parser.parse_args(argv)
    args.command_line = [PROG, *argv]
    if not getattr(args, "run", None):
        parser.print_help()
        return 2
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
