# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""`optimum-gradmap heal`: the heal stage ([`optimum_gradmap.heal`]) on a checkpoint pruned earlier, with the dense
model as teacher; writes a healed standard checkpoint, its report extended with what the heal did. The heal options
are the `heal_*` fields of `GradMAPConfig`, generated from it."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
from typing import Any

from ..arguments import add_config_arguments, config_from_arguments
from ..loading import ModelLoading
from .common import InputError, add_logging_arguments, command_line, set_verbosity

HELP = "Heal a pruned checkpoint: distil the dense model back into it (the heal stage) and save a standard checkpoint"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `heal`: the checkpoint and its loading, the teacher, the heal settings, the output."""
    from ..configuration import GradMAPConfig
    from ..heal import HEAL_SETTINGS

    add_config_arguments(parser, ModelLoading)
    parser.add_argument("--teacher", required=True, metavar="MODEL", help="the dense model the checkpoint was pruned from")
    add_config_arguments(parser, GradMAPConfig, only=HEAL_SETTINGS)
    parser.add_argument("--output", "-o", required=True, help="folder for the healed checkpoint, report and model card")
    parser.add_argument("--overwrite", action="store_true", help="replace the contents of an existing non-empty --output")
    parser.add_argument(
        "--heal-checkpoint",
        metavar="FILE",
        default=None,
        help="save the heal's state at every held-out check and resume from it when it exists (None: a hidden file "
        "beside --output, removed once the checkpoint is saved)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print what the heal would do and cost (its tokens, steps, FLOPs, peak memory and time on this device) and "
        "exit, without loading a weight",
    )
    add_logging_arguments(parser)


def default_heal_checkpoint(output: str) -> str:
    """Where `heal` (and `prune` with a heal budget) keeps the heal's state when no file is given: a hidden file
    beside the output folder, deleted when the checkpoint is saved."""
    target = os.path.abspath(output)
    return os.path.join(os.path.dirname(target), f".{os.path.basename(target)}.heal.pt")


def run(args: argparse.Namespace) -> int:
    """`optimum-gradmap heal`: heals a pruned checkpoint and saves it with its report."""
    import gc

    import torch
    from transformers import AutoConfig

    from .. import distributed
    from ..checkpoint import check_output_location, save_checkpoint
    from ..configuration import GradMAPConfig
    from ..data import check_dataset_name, describe_calibration_data
    from ..heal import HEAL_SETTINGS, check_heal_checkpoint, check_heal_settings, heal_as_configured, heal_sequences
    from ..report import environment, load_report, reproduction

    progress = set_verbosity(args)
    loading = config_from_arguments(args, ModelLoading)
    path = loading.resolve().path
    report = load_report(path)
    config = GradMAPConfig.from_pretrained(path)
    config = dataclasses.replace(config, **{name: getattr(args, name) for name in HEAL_SETTINGS})
    if not config.heal_tokens:
        raise InputError("Give the heal a budget: --heal-tokens N (e.g. 200000).")
    if report.get("heal"):
        raise InputError(
            f"{loading.model} was healed already: heal the pruned checkpoint it came from, or the dense model's pruning "
            "again, rather than on top of an earlier heal."
        )
    if not os.path.exists(config.heal_dataset):
        check_dataset_name(config.heal_dataset, "calibration")
    teacher_loading = dataclasses.replace(loading, model=args.teacher, revision=None)
    teacher_path = teacher_loading.resolve().path
    keep_safe = tuple(folder for folder in (path, teacher_path) if os.path.isdir(folder))
    check_output_location(args.output, args.overwrite, keep_safe=keep_safe)
    checkpoint = args.heal_checkpoint or default_heal_checkpoint(args.output)
    check_heal_checkpoint(checkpoint)  # before anything loads, not at the first held-out check
    _check_teacher(AutoConfig.from_pretrained(teacher_path), AutoConfig.from_pretrained(path), report, args.teacher)
    if args.dry_run:  # the plan from the two configs alone: no weight is loaded
        return _dry_run(loading, path, teacher_path, config, args.model)
    distributed.init_from_environment()
    model, tokenizer = loading.load(path)
    compensated = (report.get("compensation") or {}).get("compensated_layers", [])
    check_heal_settings(model, config, compensated)
    train_ids, validation_ids = heal_sequences(None, tokenizer, config)

    @contextlib.contextmanager
    def teacher():  # loaded for its pass only: the heal keeps no reference to it, so it is freed before training
        dense, _ = teacher_loading.load(teacher_path, with_tokenizer=False)
        try:
            yield dense
        finally:
            del dense
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    healed = heal_as_configured(
        model,
        teacher,
        train_ids,
        validation_ids,
        config,
        report["kept_layers"],
        report["original_num_layers"],
        compensated,
        describe_calibration_data(None, config.heal_dataset, config.text_column),
        checkpoint,
        progress and distributed.is_main_process(),
    )
    made = reproduction(command_line(args), step="heal", earlier=report.get("reproduce"))  # after the pruning's run
    report = {**report, "gradmap_config": config.to_dict(), "reproduce": made, "heal": healed.to_dict()}
    report["environment"] = environment(model)  # this run's
    report["timings"] = {**report.get("timings", {}), "heal": healed.seconds}
    save_checkpoint(args.output, model, tokenizer, config, report, overwrite=args.overwrite)
    if not distributed.is_main_process():
        return 0
    print(healed.summary())
    finish_heal_checkpoint(checkpoint, healed.interrupted, explicit=args.heal_checkpoint is not None)
    print(f"Saved the healed checkpoint, pruning_report.json and model card to {os.path.abspath(args.output)}")
    return 0


def _dry_run(loading: ModelLoading, path: str, teacher_path: str, config: Any, name: str) -> int:
    """`heal --dry-run`: prints the heal's plan ([`optimum_gradmap.planning.plan_heal`]) and returns 0."""
    from ..planning import plan_heal
    from ..precision import compute_device, resolve_dtype

    device = compute_device(loading.device, loading.device_map)
    dtype = resolve_dtype(loading.dtype, device)
    placement = {"device_map": loading.device_map, "max_memory": loading.max_memory_per_device()}
    plan = plan_heal(path, teacher_path, config, dtype=dtype, device=device, **placement)
    plan.model = name
    print(plan)
    return 0


def finish_heal_checkpoint(checkpoint: str, interrupted: bool, explicit: bool) -> None:
    """After a saved heal: the default checkpoint file is removed (its work is in the checkpoint folder), unless the
    heal was interrupted, when it stays so that the same command (with `--overwrite`) resumes from it."""
    if not os.path.isfile(checkpoint):
        return
    if interrupted:
        print(f"The heal's state is kept in {checkpoint}: the same command with --overwrite resumes from it.")
    elif not explicit:
        os.remove(checkpoint)


def _check_teacher(teacher: Any, pruned: Any, report: dict[str, Any], name: str) -> None:
    """Refuses a teacher that cannot be the dense model the checkpoint was pruned from, before anything loads."""
    from ..adapters import get_adapter

    adapter = get_adapter(teacher)
    teacher_text, pruned_text = teacher.get_text_config(decoder=True), pruned.get_text_config(decoder=True)
    layers = getattr(teacher_text, adapter.layer_count_field, None)
    differences = [
        f"{field} {getattr(teacher_text, field, None)} against {getattr(pruned_text, field, None)}"
        for field in ("model_type", "hidden_size", "vocab_size")
        if getattr(teacher_text, field, None) != getattr(pruned_text, field, None)
    ]
    if layers != report["original_num_layers"]:
        differences.insert(
            0, f"{layers} decoder layers, and the checkpoint was pruned from a model of {report['original_num_layers']}"
        )
    if differences:
        raise InputError(f"--teacher {name} is not the dense model this checkpoint was pruned from: {'; '.join(differences)}.")
