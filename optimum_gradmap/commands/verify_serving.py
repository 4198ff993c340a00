# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""`optimum-gradmap verify-serving`: serves a checkpoint with vLLM and compares it with transformers;
options named as the arguments of [`optimum_gradmap.serving.verify_serving`]."""

from __future__ import annotations

import argparse
import json
import os

from .common import InputError, add_logging_arguments, set_verbosity

HELP = "Serve a checkpoint with vLLM and check it computes what transformers computes"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `verify-serving`, named as the arguments of [`optimum_gradmap.serving.verify_serving`]."""
    from ..serving import DEFAULT_LOGPROB_TOLERANCE, VLLM_PYTHON_ENV

    parser.add_argument("checkpoint", help="a checkpoint folder (written by `optimum-gradmap prune`, or any other)")
    parser.add_argument(
        "--vllm-python",
        default=None,
        help=f"the Python of an environment with vLLM (None: ${VLLM_PYTHON_ENV}, else this Python if it has vLLM)",
    )
    parser.add_argument("--prompt", action="append", default=None, help="a prompt (repeat for several; None: four)")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="greedy tokens per prompt")
    parser.add_argument(
        "--logprob-tolerance",
        type=float,
        default=None,
        help=f"accepted log-probability difference in nats, for an unquantized checkpoint (default "
        f"{DEFAULT_LOGPROB_TOLERANCE:g}; a quantized one is held to a bound measured from bfloat16's own difference)",
    )
    parser.add_argument("--output", "-o", default=None, help="write the comparison as JSON to this file")
    add_logging_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """`optimum-gradmap verify-serving`: serves a checkpoint with vLLM and compares it with transformers.
    Exit code 0 when they match, 1 when they do not, 2 for bad input (a missing folder, no vLLM, an invalid checkpoint).
    A quantized (compressed-tensors) checkpoint is checked by
    [`~optimum_gradmap.quantize.serving.verify_quantized_serving`]: exit code 0 when vLLM agrees within its bound."""
    from ..checkpoint import InvalidCheckpointError
    from ..files import write_atomically
    from ..serving import DEFAULT_LOGPROB_TOLERANCE, verify_serving

    set_verbosity(args)
    if not os.path.isdir(args.checkpoint):
        raise InputError(f"{args.checkpoint} is not a folder: give a checkpoint folder.")
    quantized = _is_quantized(args.checkpoint)
    if quantized and args.logprob_tolerance is not None:
        raise InputError(
            f"{args.checkpoint} is quantized: it is checked against a bound measured from bfloat16's own difference, "
            "not a fixed tolerance. Leave --logprob-tolerance out (it applies to unquantized checkpoints)."
        )
    tolerance = args.logprob_tolerance if args.logprob_tolerance is not None else DEFAULT_LOGPROB_TOLERANCE
    try:
        if quantized:  # quantized kernels cannot match bit for bit: their agreement is measured
            from ..quantize.serving import verify_quantized_serving

            check = verify_quantized_serving(args.checkpoint, args.vllm_python, args.prompt, args.max_new_tokens)
            passed = check.agrees
        else:
            check = verify_serving(args.checkpoint, args.vllm_python, args.prompt, args.max_new_tokens, tolerance)
            passed = check.matched
    except InvalidCheckpointError as error:
        raise InputError(str(error)) from error
    print(check.summary())
    if args.output:
        write_atomically(args.output, json.dumps(check.to_dict(), indent=2))
    return 0 if passed else 1


def _is_quantized(checkpoint: str) -> bool:
    """Whether the checkpoint's config says compressed-tensors (a checkpoint `optimum-gradmap quantize` wrote)."""
    path = os.path.join(checkpoint, "config.json")
    if not os.path.isfile(path):
        return False
    with open(path, encoding="utf-8") as file:
        return (json.load(file).get("quantization_config") or {}).get("quant_method") == "compressed-tensors"
