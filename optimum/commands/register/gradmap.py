# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Registers `optimum-cli gradmap {prune,evaluate,compare,inspect,verify-serving}` with Optimum's command line.

Optimum imports every module of the `optimum.commands.register` namespace package (PEP 420: no
`__init__.py`) and registers its `REGISTER_COMMANDS`. The commands, their help texts and their
options are those of the `optimum-gradmap` console script (`optimum_gradmap.cli.COMMANDS`).
"""

import sys

from optimum.commands.base import BaseOptimumCLICommand, CommandInfo

from optimum_gradmap.cli import COMMANDS, DESCRIPTION, add_command_arguments, run


def _leaf_command(name: str) -> type:
    """An Optimum command class for the `optimum-gradmap` subcommand `name`."""

    class GradMAPSubcommand(BaseOptimumCLICommand):
        COMMAND = CommandInfo(name=name, help=COMMANDS[name][0])

        @staticmethod
        def parse_args(parser):
            parser.description = COMMANDS[name][0]
            add_command_arguments(parser, name, sys.argv[1:])

        def run(self):
            self.args.run = COMMANDS[name][2]
            sys.exit(run(self.args, prog=f"optimum-cli gradmap {name}"))

    GradMAPSubcommand.__name__ = f"GradMAP{name.capitalize()}Command"
    return GradMAPSubcommand


class GradMAPCommand(BaseOptimumCLICommand):
    COMMAND = CommandInfo(name="gradmap", help=DESCRIPTION)
    SUBCOMMANDS = tuple(
        CommandInfo(name=name, help=help_text, subcommand_class=_leaf_command(name))
        for name, (help_text, _, _) in COMMANDS.items()
    )


REGISTER_COMMANDS = [GradMAPCommand]
