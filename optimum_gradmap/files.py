# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Writing files so that an interruption never leaves half of one."""

from __future__ import annotations

import os
import tempfile


def write_atomically(path: str | os.PathLike, text: str) -> str:
    """Writes `text` to `path` through a temporary file beside it, renamed into place once complete: a
    reader sees the old file or the new one, never a part of it, and a failure leaves the old file.

    Args:
        path (`str` or `os.PathLike`): The file; its folder is created if needed.
        text (`str`): What to write (UTF-8).

    Returns:
        `str`: The path.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    prefix = f".{os.path.basename(path)}."
    with tempfile.NamedTemporaryFile("w", dir=directory, prefix=prefix, suffix=".tmp", delete=False, encoding="utf-8") as file:
        temporary = file.name
    try:
        with open(temporary, "w", encoding="utf-8") as file:
            file.write(text)
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise
    return path
