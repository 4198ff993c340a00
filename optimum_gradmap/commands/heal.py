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

from ..arguments import add_config_arguments, config_from_arguments
from ..loading import ModelLoading
from .common import InputError, add_logging_arguments, set_verbosity

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
    add_logging_arguments(parser)


def default_heal_checkpoint(output: str) -> str:
    """Where `heal` (and `prune` with a heal budget) keeps the heal's state when no file is given: a hidden file
    beside the output folder, deleted when the checkpoint is saved."""
    target = os.path.abspath(output)
    return os.path.join(os.path.dirname(target), f".{os.path.basename(target)}.heal.pt")


def run(args: argparse.Namespace) -> int:
    """`optimum-gradmap heal`: heals a pruned checkpoint and saves it with its report."""
    from transformers import AutoConfig

    from .. import distributed
    from ..adapters import get_adapter
    from ..checkpoint import check_output_location, save_checkpoint
    from ..configuration import GradMAPConfig
    from ..data import check_dataset_name, describe_calibration_data
    from ..heal import HEAL_SETTINGS, check_heal_settings, heal, heal_sequences
    from ..report import load_report

    progress = set_verbosity(args)
    loading = config_from_arguments(args, ModelLoading)
    report = load_report(loading.model)
    config = GradMAPConfig.from_pretrained(loading.model)
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
    check_output_location(args.output, args.overwrite, keep_safe=(loading.model,))
    teacher_loading = dataclasses.replace(loading, model=args.teacher)
    resolved_teacher = teacher_loading.resolve()
    teacher_config = AutoConfig.from_pretrained(resolved_teacher.path, revision=args.revision)
    adapter = get_adapter(teacher_config)
    teacher_layers = getattr(teacher_config.get_text_config(decoder=True), adapter.layer_count_field, None)
    if teacher_layers != report["original_num_layers"]:
        raise InputError(
            f"--teacher {args.teacher} has {teacher_layers} decoder layers, and {loading.model} was pruned from a model of "
            f"{report['original_num_layers']}: give the dense model it was pruned from."
        )
    distributed.init_from_environment()
    model, tokenizer = loading.load(loading.resolve().path)
    teacher, _ = teacher_loading.load(resolved_teacher.path, with_tokenizer=False)
    check_heal_settings(model, config)
    if config.heal_trainable == "down_projections" and not (report.get("compensation") or {}).get("compensated_layers"):
        raise InputError("--heal-trainable down_projections: Stage 2 compensated no layer of this checkpoint.")
    train_ids, validation_ids = heal_sequences(None, tokenizer, config)
    checkpoint = args.heal_checkpoint or default_heal_checkpoint(args.output)
    healed = heal(
        model,
        adapter,
        lambda: contextlib.nullcontext(teacher),
        train_ids,
        validation_ids,
        trainable=config.heal_trainable,
        learning_rate=config.heal_lr,
        batch_size=config.heal_batch_size,
        check_every=config.heal_check_every,
        lora_rank=config.heal_lora_rank,
        autocast=config.heal_autocast,
        kept=report["kept_layers"],
        num_layers=report["original_num_layers"],
        compensated=(report.get("compensation") or {}).get("compensated_layers", []),
        dataset=describe_calibration_data(None, config.heal_dataset, config.text_column),
        checkpoint=checkpoint,
        progress_bar=progress and distributed.is_main_process(),
    )
    report = {**report, "gradmap_config": config.to_dict(), "heal": healed.to_dict()}
    report["timings"] = {**report.get("timings", {}), "heal": healed.seconds}
    save_checkpoint(args.output, model, tokenizer, config, report, overwrite=args.overwrite)
    if not distributed.is_main_process():
        return 0
    if args.heal_checkpoint is None and os.path.isfile(checkpoint):
        os.remove(checkpoint)  # the default one: its work is in the checkpoint now
    stopped = " (interrupted: the best state so far was kept)" if healed.interrupted else ""
    print(
        f"Healed {config.heal_trainable} ({healed.num_trainable_parameters:,} parameters) on {healed.trained_tokens:,} "
        f"tokens of {healed.dataset}{stopped}: held-out KL from the dense model {healed.start_kl:.4f} -> "
        f"{healed.best_kl:.4f} in {healed.seconds:.0f} s."
    )
    print(f"Saved the healed checkpoint, pruning_report.json and model card to {os.path.abspath(args.output)}")
    return 0
