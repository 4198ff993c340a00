# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Registers `optimum-cli gradmap {prune,evaluate,inspect}` with Optimum's command line.

Optimum imports every module of the `optimum.commands.register` namespace package (PEP 420: no
`__init__.py`) and registers its `REGISTER_COMMANDS`. This module stays light: the library is
imported only when a command runs. The options are those of the `optimum-gradmap` console script.
"""

import sys

from optimum.commands.base import BaseOptimumCLICommand, CommandInfo


def _leaf_command(name: str) -> type:
    """An Optimum command class for the `optimum-gradmap` subcommand `name`."""

    class GradMAPSubcommand(BaseOptimumCLICommand):
        COMMAND = CommandInfo(name=name, help=f"optimum-gradmap {name}")

        @staticmethod
        def parse_args(parser):
            from optimum_gradmap.cli import COMMANDS

            parser.description = COMMANDS[name][0]
            COMMANDS[name][1](parser)

        def run(self):
            from optimum_gradmap.cli import COMMANDS, run

            self.args.run = COMMANDS[name][2]
            sys.exit(run(self.args, prog=f"optimum-cli gradmap {name}"))

    GradMAPSubcommand.__name__ = f"GradMAP{name.capitalize()}Command"
    return GradMAPSubcommand


class GradMAPCommand(BaseOptimumCLICommand):
    COMMAND = CommandInfo(name="gradmap", help="Layer pruning with GradMAP: prune, evaluate, inspect")
    SUBCOMMANDS = tuple(
        CommandInfo(name=name, help=help_text, subcommand_class=_leaf_command(name))
        for name, help_text in (
            ("prune", "Prune a model's decoder layers with GradMAP and save a standard checkpoint"),
            ("evaluate", "Measure perplexity, zero-shot accuracy and inference speed"),
            ("inspect", "Print the pruning report of a checkpoint"),
        )
    )


REGISTER_COMMANDS = [GradMAPCommand]
