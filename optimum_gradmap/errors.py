# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""The library's error for bad input."""


class InvalidInputError(ValueError):
    """Input the library cannot work with (a setting, a model, data, a name or a file), raised before
    anything is changed, with a message that says what was wrong and how to fix it. The command line
    exits with code 2 for it (and for `UnsupportedArchitectureError`, the adapters' own); any other error is
    a failure while running (code 1)."""
