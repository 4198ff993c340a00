# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Writing files so that an interruption never leaves half of one."""

from __future__ import annotations

import os
import tempfile


def current_umask() -> int:
    """The process's umask (Python has no getter: it is set and put back at once, through the most private
    mask, so that a file another thread creates meanwhile is never more open than it would have been)."""
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode `open()` gives a new file under the current umask (0o644 with the usual 022): the one
    temporary files (0600 from `tempfile`) are given before they are renamed into place."""
    return 0o666 & ~current_umask()


def folder_mode() -> int:
    """The mode `os.makedirs` gives a new folder under the current umask (0o755 with the usual 022): the one
    temporary folders (0700 from `tempfile.mkdtemp`) are given before they are renamed into place."""
    return 0o777 & ~current_umask()


def write_atomically(path: str | os.PathLike, text: str) -> str:
    """Writes `text` to `path` through a temporary file beside it, renamed into place once complete: a
    reader sees the old file or the new one, never a part of it, and a failure leaves the old file. The file
    has the mode the umask gives any new file ([`file_mode`]), not the temporary file's 0600.

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
        os.chmod(temporary, file_mode())
        with open(temporary, "w", encoding="utf-8") as file:
            file.write(text)
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise
    return path
