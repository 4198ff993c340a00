# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""The commands of `optimum-gradmap` (and `optimum-cli gradmap`), one module each: its help text (`HELP`),
its options (`add_arguments`) and what it does (`run`)."""

from . import compare, evaluate, heal, inspect, prune, quantize, verify_serving

# Command name -> (help text, options, run). The single source of both `optimum-gradmap` and `optimum-cli gradmap`.
COMMANDS = {
    "prune": (prune.HELP, prune.add_arguments, prune.run),
    "evaluate": (evaluate.HELP, evaluate.add_arguments, evaluate.run),
    "heal": (heal.HELP, heal.add_arguments, heal.run),
    "quantize": (quantize.HELP, quantize.add_arguments, quantize.run),
    "compare": (compare.HELP, compare.add_arguments, compare.run),
    "inspect": (inspect.HELP, inspect.add_arguments, inspect.run),
    "verify-serving": (verify_serving.HELP, verify_serving.add_arguments, verify_serving.run),
}
