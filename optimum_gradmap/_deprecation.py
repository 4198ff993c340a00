# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Names kept working for one release after they moved or were replaced, with a `FutureWarning`."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any


def warn_deprecated(old: str, new: str, stacklevel: int = 3) -> None:
    """Warns that `old` goes in the next release and says what to use instead."""
    warnings.warn(
        f"`{old}` is deprecated and will be removed in the next release: use {new}.", FutureWarning, stacklevel=stacklevel
    )


def deprecated_module_attributes(
    module: str,
    moved: Mapping[str, str] | None = None,
    replaced: Mapping[str, tuple[str, Callable[[], Any]]] | None = None,
) -> Callable[[str], Any]:
    """A module-level `__getattr__` for a module's former names.

    Args:
        module (`str`): The module's name.
        moved (`Mapping[str, str]`, *optional*): Name -> the module that holds it now.
        replaced (`Mapping[str, tuple[str, Callable]]`, *optional*): Name -> (what to use instead, a
            function that returns the value the name still gives).
    """
    moved, replaced = moved or {}, replaced or {}

    def __getattr__(name: str) -> Any:
        if name in moved:
            warn_deprecated(f"{module}.{name}", f"`{moved[name]}.{name}`")
            return getattr(importlib.import_module(moved[name]), name)
        if name in replaced:
            instead, value = replaced[name]
            warn_deprecated(f"{module}.{name}", instead)
            return value()
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
