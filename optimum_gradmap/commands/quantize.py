# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""`optimum-gradmap quantize`: the quantization step ([`optimum_gradmap.quantize`]) on a checkpoint pruned (or healed)
earlier; writes a compressed-tensors checkpoint that vLLM serves, its report extended with what the quantization did.

By default it calibrates on the checkpoint's own calibration set: its `gradmap_config.json` names the dataset, the
count, the length and the seed, and the sequences read again are checked against the SHA-256 in its report. The
report's evaluation described the unquantized weights: it moves to `evaluation_before_quantization`.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from ..arguments import add_config_arguments, config_from_arguments, option_groups
from ..loading import ModelLoading
from .common import MODEL_SECTION, InputError, add_logging_arguments, command_line, set_verbosity

HELP = "Quantize a pruned or healed checkpoint with LLM Compressor, for vLLM to serve"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `quantize`: the checkpoint and its loading, the scheme, the calibration text, the output."""
    from ..quantize import SCHEMES

    groups = option_groups(parser, [MODEL_SECTION])
    add_config_arguments(parser, ModelLoading, groups=groups)
    scheme = parser.add_argument_group("Quantize", "the scheme, and the text it calibrates on")
    scheme.add_argument(
        "--scheme",
        required=True,
        choices=list(SCHEMES),
        help="w8a8: INT8 weights and per-token INT8 activations (SmoothQuant + GPTQ; CPUs and GPUs); w4a16: INT4 weights "
        "in groups of 128 input columns, or 64 or 32 where 128 does not divide the model's widths (GPTQ; CPUs and "
        "GPUs); fp8: FP8 weights and activations (no calibration; NVIDIA GPUs of "
        "compute capability 8.9 or newer)",
    )
    scheme.add_argument(
        "--dataset",
        default=None,
        help="calibration text (any name prune's --dataset takes). Default: the checkpoint's own calibration set "
        "(dataset, count, length and seed from its gradmap_config.json), checked against the SHA-256 in its report",
    )
    scheme.add_argument("--num-samples", type=int, default=None, help="calibration sequences (default: the checkpoint's)")
    scheme.add_argument("--seq-len", type=int, default=None, help="tokens per calibration sequence (default: the checkpoint's)")
    output = parser.add_argument_group("output")
    output.add_argument("--output", "-o", required=True, help="folder for the quantized checkpoint, report and model card")
    output.add_argument("--overwrite", action="store_true", help="replace the contents of an existing non-empty --output")
    output.add_argument(
        "--dry-run",
        action="store_true",
        help="print the plan (time, peak memory, the quantized checkpoint's size on disk) from the config alone and exit",
    )
    add_logging_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """`optimum-gradmap quantize`: quantizes a saved checkpoint and saves it with its report."""
    import dataclasses

    from ..checkpoint import save_checkpoint
    from ..quantize import quantize_model, scheme_named

    set_verbosity(args)
    loading, path, report, config = _checked_input(args)
    if args.dry_run:
        return _dry_run(loading, path, config, args)
    model, tokenizer = loading.load(path)
    ids, source = _calibration(args, config, report, model, tokenizer) if scheme_named(args.scheme).calibrated else (None, None)
    quantized = quantize_model(model, args.scheme, ids, tokenizer, source)
    config = dataclasses.replace(config, quantization=args.scheme, quantization_dataset=args.dataset)
    report = _quantized_report(report, quantized, model, args, config)
    save_checkpoint(args.output, model, tokenizer, config, report, overwrite=args.overwrite)
    print(
        f"Quantized to {args.scheme} ({quantized.algorithm}) in {quantized.seconds:.1f} s"
        + (f" on {quantized.num_samples} x {quantized.seq_len} tokens of {source}" if quantized.num_samples else "")
    )
    print(f"Saved the quantized checkpoint, pruning_report.json and model card to {os.path.abspath(args.output)}")
    return 0


def _checked_input(args: argparse.Namespace) -> tuple[ModelLoading, str, dict[str, Any], Any]:
    """Everything `quantize` checks before a weight loads: the checkpoint, its report and config, the scheme against
    this machine and llm-compressor (the pipeline's quantization step's own check), the model's linear maps against the
    scheme's weight groups (from its config), the calibration text's name and counts, the output folder."""
    import torch
    from transformers import AutoConfig

    from ..checkpoint import check_output_location
    from ..configuration import GradMAPConfig
    from ..data import check_dataset_name, given_directly
    from ..pipeline import Quantize
    from ..planning import empty_model
    from ..quantize import QuantizationSettings, check_linear_maps, check_quantization, head_names, scheme_named
    from ..report import load_report

    loading = config_from_arguments(args, ModelLoading)
    path = loading.resolve().path
    for option, value, least in (("--num-samples", args.num_samples, 1), ("--seq-len", args.seq_len, 2)):
        if value is not None and value < least:
            raise InputError(f"{option} must be at least {least}, got {value}.")
    report = load_report(path)
    if report.get("quantization"):
        raise InputError(
            f"{loading.model} is quantized already ({report['quantization']['scheme']}): quantize the checkpoint it came from."
        )
    Quantize(QuantizationSettings(args.scheme, args.dataset)).check_settings()
    model_config = AutoConfig.from_pretrained(path)
    check_quantization(model_config, args.scheme)
    scheme = scheme_named(args.scheme)
    if scheme.calibrated and args.dataset is not None:
        check_dataset_name(args.dataset, "calibration")
    if scheme.calibrated and args.dataset is None and given_directly(report.get("calibration_source")):
        raise InputError(
            f"{loading.model} was calibrated on data given directly ({report['calibration_source']}), which no name reads "
            f"again: `{args.scheme}` calibrates on text, so give it with --dataset (e.g. --dataset offline:wikipedia)."
        )
    meta = empty_model(model_config, torch.float32)  # the linear maps' widths, from the config alone
    check_linear_maps(meta, scheme, head_names(meta))
    check_output_location(args.output, args.overwrite, keep_safe=(path,) if os.path.isdir(path) else ())
    return loading, path, report, GradMAPConfig.from_pretrained(path)


def _dry_run(loading: ModelLoading, path: str, config: Any, args: argparse.Namespace) -> int:
    """`quantize --dry-run`: prints the quantization's plan ([`optimum_gradmap.planning.plan_quantization`])."""
    from ..planning import plan_quantization
    from ..precision import compute_device, resolve_dtype

    device = compute_device(loading.device, loading.device_map)
    num_samples, seq_len = args.num_samples or config.num_samples, args.seq_len or config.seq_len
    plan = plan_quantization(path, args.scheme, num_samples, seq_len, resolve_dtype(loading.dtype, device), device)
    plan.model = loading.model
    print(plan)
    return 0


def _calibration(args: argparse.Namespace, config: Any, report: dict[str, Any], model: Any, tokenizer: Any) -> tuple[Any, str]:
    """The calibration sequences and their description: `--dataset`, or the checkpoint's own calibration set, whose
    SHA-256 is compared with its report's."""
    from transformers.utils import logging

    from ..data import calibration_sha256, check_token_ids, prepare_calibration_data

    dataset = args.dataset or config.dataset
    num_samples, seq_len = args.num_samples or config.num_samples, args.seq_len or config.seq_len
    ids = prepare_calibration_data(dataset, tokenizer, num_samples, seq_len, config.seed, config.dataset, config.text_column)
    check_token_ids(ids, model)
    if args.dataset is not None or (num_samples, seq_len) != (config.num_samples, config.seq_len):
        return ids, dataset
    if calibration_sha256(ids) == report.get("calibration_sha256"):
        return ids, f"{dataset}, Stage 1's calibration sequences (the same SHA-256)"
    logging.get_logger(__name__).warning(
        f"The checkpoint's calibration set read again ({dataset}, seed {config.seed}) differs from the one its report "
        f"records ({report.get('calibration_source')}, SHA-256 {str(report.get('calibration_sha256'))[:12]}): "
        "quantizing on the sequences read now."
    )
    return ids, dataset


def _quantized_report(
    report: dict[str, Any], quantized: Any, model: Any, args: argparse.Namespace, config: Any
) -> dict[str, Any]:
    """The quantized checkpoint's report: what the quantization did, its config (with the quantization's settings) and
    how to make it again; the evaluation measured on the unquantized weights kept, labelled, under
    `evaluation_before_quantization` (the model card shows it so)."""
    from ..report import environment, reproduction

    made = reproduction(command_line(args), step="quantize", earlier=report.get("reproduce"))
    before = {key: report.get(key) for key in ("evaluation", "zero_shot_against_dense", "flips_against_dense")}
    report = {**report, "reproduce": made, "quantization": quantized.to_dict(), "environment": environment(model)}
    report["gradmap_config"] = config.to_dict()
    report["steps"] = [*(report.get("steps") or []), "Quantize"]
    report["evaluation_before_quantization"] = before
    report["evaluation"] = report["zero_shot_against_dense"] = report["flips_against_dense"] = None
    report["timings"] = {**report.get("timings", {}), "quantization": quantized.seconds}
    return report
