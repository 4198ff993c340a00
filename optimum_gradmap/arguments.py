# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Command-line options generated from a config dataclass, the idea of transformers' `HfArgumentParser`:
one option per field, named after it, with the field's default, the help text in its metadata, and the
value type, choices and form that its type implies. `optimum-gradmap prune` gets every `GradMAPConfig`
field this way, so the config is the single source of their names, types, defaults and help."""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Sequence
from dataclasses import MISSING, fields
from typing import Any, Literal


def _value_parser(kinds: Sequence[Any]) -> Any:
    """The `type=` of an option whose value may be a number or one of some words (`reg_lambda`: a float or `auto`)."""
    words = [word for kind in kinds if typing.get_origin(kind) is Literal for word in typing.get_args(kind)]
    number = next(kind for kind in kinds if kind in (int, float))

    def parse(value: str) -> Any:
        return value if value in words else number(value)

    parse.__name__ = f"{number.__name__} or {' or '.join(words)}"  # what argparse names in its error message
    return parse


def add_config_arguments(
    parser: argparse.ArgumentParser,
    config_class: type,
    choices: dict[str, Sequence[str]] | None = None,
    only: Sequence[str] | None = None,
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
    """
    hints = typing.get_type_hints(config_class)
    groups: dict[str, Any] = {}
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
            options["choices"] = literals
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
        group = setting.metadata.get("group")
        if group and group not in groups:
            groups[group] = parser.add_mutually_exclusive_group()
        (groups[group] if group else parser).add_argument(*names, **options)


def config_from_arguments(args: argparse.Namespace, config_class: type) -> Any:
    """The config the options of [`add_config_arguments`] describe."""
    return config_class(**{setting.name: getattr(args, setting.name) for setting in fields(config_class)})
