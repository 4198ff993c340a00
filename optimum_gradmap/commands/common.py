# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""What every command shares: the error for bad command-line input, the `-q` / `-v` options, the help sections of
the options, and how the library's messages are printed."""

from __future__ import annotations

import argparse
import logging as std_logging
import os
import shlex
import sys
import typing
from collections.abc import Mapping, Sequence
from dataclasses import fields

from transformers.utils import logging

from ..errors import InvalidInputError
from ..loading import ModelLoading

LIBRARY_LOGGER = "optimum_gradmap"


class InputError(InvalidInputError):
    """Bad command-line input: exit code 2."""


def command_line(args: argparse.Namespace) -> str:
    """The command as it was typed, quoted for a shell (`shlex.join`): `optimum-gradmap prune ...` (the arguments
    `optimum_gradmap.cli.main` parsed), or, run another way (`optimum-cli gradmap prune ...`), the process's own."""
    return shlex.join(getattr(args, "command_line", None) or [os.path.basename(sys.argv[0]), *sys.argv[1:]])


# ------------------------------------------------------------------------------------------ parsers

# The help sections of the options that are not one step's settings: (title, what it is about, the config fields).
MODEL_SECTION = (
    "the model and where it runs",
    "which model, on which device and in which dtype, and how its passes compute",
    [*(item.name for item in fields(ModelLoading)), "precision", "execution", "batch_size"],
)
DATA_SECTION = (
    "data",
    "the calibration text that Stage 1 scores the layers on and Stage 2 fits on",
    ["dataset", "text_column", "num_samples", "seq_len", "seed"],
)


def step_sections(steps: Sequence[type], first: Mapping[type, Sequence[str]] | None = None) -> list[tuple[str, str, list[str]]]:
    """One help section per step of the pipeline (`optimum_gradmap.pipeline`), titled by its name and summary and
    holding the config fields its settings read (`first`: fields of a step shown before those).

    Args:
        steps (`Sequence[type]`): Step classes, each with a `settings` field (a [`StepSettings`] subclass).
        first (`Mapping[type, Sequence[str]]`, *optional*): Fields shown in a step's section that its settings do not
            hold (Stage 2's on/off switch).
    """
    sections = []
    for step in steps:
        settings = typing.get_type_hints(step)["settings"]
        names = [*(first or {}).get(step, []), *(item.name for item in fields(settings))]
        sections.append((step.name, step.summary, names))
    return sections


def add_logging_arguments(parser: argparse.ArgumentParser) -> None:
    verbosity = parser.add_mutually_exclusive_group()
    verbosity.add_argument("-q", "--quiet", action="store_true", help="print only errors and the final summary")
    verbosity.add_argument("-v", "--verbose", action="store_true", help="also print INFO/DEBUG messages and tracebacks")


class _StdoutHandler(std_logging.StreamHandler):
    """Prints the library's messages to whatever `sys.stdout` is at the time (it may be replaced, e.g. by tests)."""

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, value) -> None:
        pass


def set_verbosity(args: argparse.Namespace) -> bool:
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
    library_logger.setLevel(std_logging.DEBUG if getattr(args, "verbose", False) else std_logging.INFO)
    logging.set_verbosity_debug() if getattr(args, "verbose", False) else logging.set_verbosity_warning()
    logging.enable_progress_bar()
    return True
