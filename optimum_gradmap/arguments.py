# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Command-line options generated from a config dataclass, the idea of transformers' `HfArgumentParser`:
one option per field, named after it, with the field's default, the help text in its metadata, and the
value type, choices and form that its type implies. `optimum-gradmap prune` gets every `GradMAPConfig`
field this way, so the config is the single source of their names, types, defaults and help.

The help comes in two lengths, the way `accelerate launch` and `vllm serve` show their many options: `--help` lists
the options a user sets, each with its short help (a field's `brief` metadata) and grouped by step
([`option_groups`]); `--help-all` lists every option with its whole help ([`finish_help`]). Each option is shown once,
hyphenated (`--pruning-ratio`); the underscore spelling (`--pruning_ratio`) stays accepted."""

from __future__ import annotations

import argparse
import copy
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import MISSING, fields
from typing import Any, Literal

from .retired import refused_value


def _value_parser(kinds: Sequence[Any]) -> Any:
    """The `type=` of an option whose value may be a number or one of some words (`reg_lambda`: a float or `auto`)."""
    words = [word for kind in kinds if typing.get_origin(kind) is Literal for word in typing.get_args(kind)]
    number = next(kind for kind in kinds if kind in (int, float))

    def parse(value: str) -> Any:
        return value if value in words else number(value)

    parse.__name__ = f"{number.__name__} or {' or '.join(words)}"  # what argparse names in its error message
    return parse


def _word_parser(name: str) -> Any:
    """The `type=` of an option whose value is one of some words: a retired word is refused with what retired it and
    what to use instead ([`~optimum_gradmap.retired.RETIRED_VALUES`]), before argparse checks the choices."""

    def parse(value: str) -> str:
        refusal = refused_value(name, value)
        if refusal:
            raise argparse.ArgumentTypeError(refusal)
        return value

    return parse


def add_config_arguments(
    parser: argparse.ArgumentParser,
    config_class: type,
    choices: dict[str, Sequence[str]] | None = None,
    only: Sequence[str] | None = None,
    groups: Mapping[str, argparse._ActionsContainer] | None = None,
) -> None:
    """Adds one option per field of a config dataclass, named after the field (`--field_name`, and
    `--field-name`), with the field's default and the help in its metadata; the option's value type,
    choices (a `Literal`), list form (`nargs="+"`) and `--x/--no-x` (a `bool`) come from the field's type.
    Fields with the metadata `group` form a mutually exclusive group (the config says when one is required); a
    field with the metadata `positional` is a positional argument.

    Args:
        parser (`argparse.ArgumentParser`): Where to add the options.
        config_class (`type`): The dataclass (`GradMAPConfig`).
        choices (`dict[str, Sequence[str]]`, *optional*): Choices of fields whose values are only known at
            run time (the registered importance metrics).
        only (`Sequence[str]`, *optional*): Add only these fields (the heal settings of `optimum-gradmap heal`).
        groups (`Mapping[str, argparse._ActionsContainer]`, *optional*): The help section of each field
            ([`option_groups`]); the others go to `parser`'s own.
    """
    hints = typing.get_type_hints(config_class)
    exclusive: dict[str, Any] = {}
    for setting in fields(config_class):
        if only is not None and setting.name not in only:
            continue
        annotation = hints[setting.name]
        is_union = typing.get_origin(annotation) is typing.Union or isinstance(annotation, types.UnionType)
        kinds = [kind for kind in (typing.get_args(annotation) if is_union else (annotation,)) if kind is not type(None)]
        default = None if setting.default is MISSING else setting.default
        options: dict[str, Any] = {"dest": setting.name, "default": default, "help": setting.metadata["help"].replace("%", "%%")}
        literals = [value for kind in kinds if typing.get_origin(kind) is Literal for value in typing.get_args(kind)]
        if kinds == [bool]:
            options["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(kinds[0]) is list:
            options.update(type=typing.get_args(kinds[0])[0], nargs="+", metavar="INDEX")
        elif literals and len(kinds) == 1:
            options.update(choices=literals, type=_word_parser(setting.name))
        elif literals:
            options["type"] = _value_parser(kinds)
        elif setting.name in (choices or {}):
            options["choices"] = list(choices[setting.name])
        else:
            options["type"] = kinds[0]
        names = dict.fromkeys([f"--{setting.name}", f"--{setting.name.replace('_', '-')}"])
        if setting.metadata.get("positional"):
            names = [options.pop("dest")]
            options.pop("default")
        container = (groups or {}).get(setting.name, parser)
        group = setting.metadata.get("group")
        if group and group not in exclusive:
            exclusive[group] = container.add_mutually_exclusive_group()
        action = (exclusive[group] if group else container).add_argument(*names, **options)
        action.brief = setting.metadata.get("brief", "").replace("%", "%%") or None


def config_from_arguments(args: argparse.Namespace, config_class: type) -> Any:
    """The config the options of [`add_config_arguments`] describe."""
    return config_class(**{setting.name: getattr(args, setting.name) for setting in fields(config_class)})


def option_groups(
    parser: argparse.ArgumentParser, sections: Iterable[tuple[str, str, Iterable[str]]]
) -> dict[str, argparse._ArgumentGroup]:
    """The help sections of a command's options: for each `(title, description, field names)`, in order, an argument
    group holding those fields that no earlier section holds. Returns field name -> its group, for
    [`add_config_arguments`]'s `groups`."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for title, description, names in sections:
        group = parser.add_argument_group(title, description)
        groups.update({name: group for name in names if name not in groups})
    return groups


def brief(action: argparse.Action, text: str | None = None) -> argparse.Action:
    """Sets the help `--help` shows for a hand-written option: a short `text`, or None for an option that only
    `--help-all` lists (fine control a first run does not need)."""
    action.brief = text
    return action


class OptionsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option once, in its hyphenated spelling (`--pruning_ratio` stays accepted, unshown), and a default
    only where there is one (not None, not False)."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        shown = [name for name in action.option_strings if "_" not in name or name.replace("_", "-") not in action.option_strings]
        if len(shown) < len(action.option_strings):
            action = copy.copy(action)
            action.option_strings = shown
        return super()._format_action_invocation(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False or isinstance(action, argparse._StoreConstAction):
            return action.help
        return super()._get_help_string(action)


def finish_help(parser: argparse.ArgumentParser, full: bool) -> None:
    """Gives a command's parser its two helps: `--help`, the options a user sets (those with a short help: a field's
    `brief`, or an option without a [`brief`]), each with that short help; `--help-all` (`full`, read from the
    command line before the parser is built), every option with its whole help. The usage line names what is
    required and `[options]`."""
    parser.formatter_class = OptionsHelpFormatter
    required = [
        action.metavar or action.dest.upper()
        if not action.option_strings
        else f"{action.option_strings[0]} {action.metavar or action.dest.upper()}"
        for action in parser._actions
        if action.required or not action.option_strings
    ]
    parser.usage = " ".join(["%(prog)s", *required, "[options]"])
    parser.add_argument("--help-all", action="help", help="show every option, with its whole help, and exit")
    if full:
        return
    for action in parser._actions:
        if hasattr(action, "brief"):
            action.help = action.brief or argparse.SUPPRESS
    if any(action.help == argparse.SUPPRESS for action in parser._actions):
        parser.epilog = "Every option, with the fine control of each step: --help-all."


def add_retired_arguments(parser: argparse.ArgumentParser, retired: Mapping[str, str]) -> None:
    """Options of retired settings (name -> the message that says what retired it and what to use instead), unshown:
    given on the command line, each is refused with its message rather than as an unknown option."""

    class Retired(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            parser.error(retired[self.dest])

    for name in retired:
        spellings = {f"--{name}", f"--{name.replace('_', '-')}", f"--no-{name}", f"--no-{name.replace('_', '-')}"}
        parser.add_argument(*sorted(spellings), dest=name, nargs="?", action=Retired, help=argparse.SUPPRESS)
