# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""`optimum-gradmap heal`: the heal stage ([`optimum_gradmap.heal`]) on a checkpoint pruned earlier, with the dense
model as teacher; writes a healed standard checkpoint, its report extended with what the heal did. The heal options
are the `heal_*` fields of `GradMAPConfig`, generated from it.

The checkpoint's report and card describe the healed weights: the evaluation the pruning report holds is run again on
the healed model ([`healed_evaluation`]) and replaces it, and the figures measured before the heal are kept under
`evaluation_before_heal` (shown in the card as "after Stage 1 + 2" beside "after heal"). `--no-evaluate` skips that
evaluation: the card then labels the earlier figures "before heal"."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from ..arguments import add_config_arguments, add_retired_arguments, brief, config_from_arguments, option_groups
from ..loading import ModelLoading
from ..retired import RETIRED_SETTINGS, retired_setting_message
from .common import MODEL_SECTION, InputError, add_logging_arguments, command_line, set_verbosity, step_sections

HELP = "Heal a pruned checkpoint: distil the dense model back into it (the heal stage) and save a standard checkpoint"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `heal`: the checkpoint and its loading, the teacher, the heal settings, the output."""
    from ..configuration import GradMAPConfig
    from ..heal import HEAL_SETTINGS
    from ..pipeline import Heal

    groups = option_groups(parser, [MODEL_SECTION, *step_sections([Heal])])
    add_config_arguments(parser, ModelLoading, groups=groups)
    groups["model"].add_argument(
        "--teacher", required=True, metavar="MODEL", help="the dense model the checkpoint was pruned from"
    )
    add_config_arguments(parser, GradMAPConfig, only=HEAL_SETTINGS, groups=groups)
    retired = [name for name in RETIRED_SETTINGS if name.startswith("heal_")]
    add_retired_arguments(parser, {name: retired_setting_message(name) for name in retired})
    output = parser.add_argument_group("output", "where the healed checkpoint goes, and what is measured on it")
    output.add_argument("--output", "-o", required=True, help="folder for the healed checkpoint, report and model card")
    output.add_argument("--overwrite", action="store_true", help="replace the contents of an existing non-empty --output")
    brief(
        output.add_argument(
            "--heal-checkpoint",
            metavar="FILE",
            default=None,
            help="save the heal's state at every held-out check and resume from it when it exists (None: a hidden file "
            "beside --output, removed once the checkpoint is saved)",
        )
    )
    brief(
        output.add_argument(
            "--no-evaluate",
            dest="evaluate",
            action="store_false",
            help="do not evaluate the healed model. By default the evaluation in the checkpoint's report is run again on "
            "it (each perplexity on the same dataset and segments, with the KL divergence from --teacher where the report "
            "has one; zero-shot tasks are not run again) and its figures replace those measured before the heal, which "
            "the report keeps under evaluation_before_heal; with this option the card labels those 'before heal'",
        ),
        "skip the evaluation the checkpoint's report had, run again on the healed model by default",
    )
    output.add_argument(
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


def default_heal_text_cache(output: str) -> str:
    """Where `heal` and `prune` keep the dense model's own text (`--heal-dataset generated`): a hidden file beside the
    output folder, kept after the run, so that a rerun or a resume reads it instead of generating again (its
    fingerprint says when it no longer applies: [`~optimum_gradmap.heal.generation`])."""
    target = os.path.abspath(output)
    return os.path.join(os.path.dirname(target), f".{os.path.basename(target)}.heal-text.pt")


def run(args: argparse.Namespace) -> int:
    """`optimum-gradmap heal`: heals a pruned checkpoint and saves it with its report."""
    from .. import distributed
    from ..checkpoint import save_checkpoint
    from ..heal import HealSettings, PrunedLayout, changed_parameters, check_generation_prompts, check_heal_settings, heal_stage
    from ..heal.quantized import dequantized_loading, stored_quantization, stored_weights_writer

    progress = set_verbosity(args)
    loading, path, report, config, teacher_loading, teacher_path = _checked_heal_input(args)
    checkpoint = args.heal_checkpoint or default_heal_checkpoint(args.output)
    if args.dry_run:  # the plan from the two configs alone: no weight is loaded
        return _dry_run(loading, path, teacher_path, config, args.model)
    distributed.init_from_environment()
    quantized = stored_quantization(path) is not None  # healed on its dequantized weights, saved as stored
    model, tokenizer = loading.load(path, **(dequantized_loading() if quantized else {}))
    compensated = (report.get("compensation") or {}).get("compensated_layers", [])
    settings, layout = (
        HealSettings.from_config(config),
        PrunedLayout(report["kept_layers"], report["original_num_layers"], compensated),
    )
    check_heal_settings(model, settings, layout)
    trained = list(changed_parameters(model, settings.heal_trainable)) if quantized else []
    check_generation_prompts(settings)  # before the teacher loads
    teacher = _teacher(teacher_loading, teacher_path)
    stage1_seconds, stage1_basis = _stage1_seconds(report, config, teacher_path, model)
    shown = progress and distributed.is_main_process()
    healed = heal_stage(
        model,
        teacher,
        settings,
        tokenizer,
        layout,
        stage1_seconds=stage1_seconds,
        stage1_basis=stage1_basis,
        checkpoint=checkpoint,
        text_cache=default_heal_text_cache(args.output),
        progress_bar=shown,
    )
    evaluation = None
    if args.evaluate and not healed.interrupted:  # after Ctrl-C the best state is saved now; the resume evaluates
        name = os.path.basename(os.path.abspath(args.output))
        evaluation = healed_evaluation(report, model, tokenizer, teacher, args.teacher, name=name, progress_bar=shown)
    before = {key: report.get(key) for key in ("evaluation", "zero_shot_against_dense", "flips_against_dense")}
    report = _healed_report(report, config, healed, evaluation, model, args)
    writer = stored_weights_writer(path, model, trained) if quantized else None
    save_checkpoint(args.output, model, tokenizer, config, report, overwrite=args.overwrite, write_weights=writer)
    if not distributed.is_main_process():
        return 0
    _print_outcome(healed, evaluation, before, args)
    finish_heal_checkpoint(checkpoint, healed.interrupted, explicit=args.heal_checkpoint is not None)
    print(f"Saved the healed checkpoint, pruning_report.json and model card to {os.path.abspath(args.output)}")
    return 0


def _checked_heal_input(args: argparse.Namespace) -> tuple[ModelLoading, str, dict[str, Any], Any, ModelLoading, str]:
    """Everything `heal` checks before a weight loads: the checkpoint and its report, the heal settings and text, the
    output folder, the heal checkpoint's path and the teacher's config. Returns the checkpoint's loading, path,
    report and config (with this run's heal settings), and the teacher's loading and path."""
    from transformers import AutoConfig

    from ..checkpoint import check_output_location
    from ..configuration import GradMAPConfig
    from ..heal import HEAL_SETTINGS, check_heal_checkpoint, check_heal_dataset_name
    from ..heal.quantized import check_quantized_heal, stored_quantization
    from ..report import load_report

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
    check_heal_dataset_name(config.heal_dataset)
    quantization = stored_quantization(path)
    if quantization is not None:
        check_quantized_heal(quantization, config.heal_trainable, loading.model)
    teacher_loading = dataclasses.replace(loading, model=args.teacher, revision=None)
    teacher_path = teacher_loading.resolve().path
    keep_safe = tuple(folder for folder in (path, teacher_path) if os.path.isdir(folder))
    check_output_location(args.output, args.overwrite, keep_safe=keep_safe)
    check_heal_checkpoint(args.heal_checkpoint or default_heal_checkpoint(args.output))  # not at the first check
    _check_teacher(AutoConfig.from_pretrained(teacher_path), AutoConfig.from_pretrained(path), report, args.teacher)
    return loading, path, report, config, teacher_loading, teacher_path


def _teacher(loading: ModelLoading, path: str) -> Callable[[], AbstractContextManager[Any]]:
    """The dense model's context: loaded for its block only and freed by its cleanup (the heal and the evaluation keep
    no reference to it), so that training and saving do not hold it."""
    import gc

    import torch

    @contextlib.contextmanager
    def teacher():
        dense, _ = loading.load(path, with_tokenizer=False)
        try:
            yield dense
        finally:
            del dense
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    return teacher


def _stage1_seconds(report: dict[str, Any], config: Any, teacher_path: str, model: Any) -> tuple[float | None, str]:
    """Stage 1's time for `--heal-tokens auto`: the one the pruning run measured, or, where it scored nothing (its
    `layers_to_prune`, a cut), the plan's time for a Stage 1 that removes as many layers from the teacher
    ([`~optimum_gradmap.pipeline.heal.predicted_stage1_seconds`], the throughput measured on this device)."""
    measured = (report.get("timings") or {}).get("stage1")
    if config.heal_tokens != "auto" or config.layers_to_prune is None:
        return measured, "measured"
    from ..pipeline.heal import predicted_stage1_seconds

    return predicted_stage1_seconds(teacher_path, config, len(report["removed_layers"]), next(model.parameters())), "predicted"


def _healed_report(
    report: dict[str, Any], config: Any, healed: Any, evaluation: Any, model: Any, args: argparse.Namespace
) -> dict[str, Any]:
    """The healed checkpoint's report: every top-level figure describes the healed weights, and what the pruning run
    measured is kept, labelled (`evaluation_before_heal`)."""
    from ..report import environment, reproduction, stage_before_heal

    before = {key: report.get(key) for key in ("evaluation", "zero_shot_against_dense", "flips_against_dense")}
    made = reproduction(command_line(args), step="heal", earlier=report.get("reproduce"))  # after the pruning's run
    report = {**report, "gradmap_config": config.to_dict(), "reproduce": made, "heal": healed.to_dict()}
    if report.get("quantization"):  # quantized first: the heal trained what the quantized checkpoint stores as it is
        report["heal"]["after_quantization"] = True
    report["evaluation_before_heal"] = {"measured_after": stage_before_heal(report), **before}
    report["evaluation"] = evaluation.to_dict() if evaluation is not None else None
    report["zero_shot_against_dense"] = report["flips_against_dense"] = None  # zero-shot is not run again
    report["environment"] = environment(model)  # this run's
    report["timings"] = {**report.get("timings", {}), "heal": healed.seconds}
    report["steps"] = [*(report.get("steps") or []), "Heal"]
    return report


def _print_outcome(healed: Any, evaluation: Any, before: dict[str, Any], args: argparse.Namespace) -> None:
    """Prints what the heal did and the healed model's perplexities beside those measured before it."""
    print(healed.summary())
    earlier = {(e["dataset"], e["protocol"]): e for e in (before["evaluation"] or {}).get("perplexities", [])}
    for entry in evaluation.perplexities if evaluation is not None else ():
        line = f"{entry.dataset} perplexity after heal: {entry.perplexity:.3f}"
        if (entry.dataset, entry.protocol) in earlier:
            line += f" (before: {earlier[(entry.dataset, entry.protocol)]['perplexity']:.3f})"
        if entry.kl_to_reference is not None:
            line += f"; KL from {entry.reference}: {entry.kl_to_reference:.4f} nats/token"
        print(f"{line} ({entry.protocol}, {entry.num_segments} segments)")
    if args.evaluate and healed.interrupted and before["evaluation"]:
        print("The interrupted heal was not evaluated: the card labels the figures measured before it 'before heal'.")


def healed_evaluation(
    report: dict[str, Any],
    model: Any,
    tokenizer: Any,
    teacher: Callable[[], AbstractContextManager[Any]],
    teacher_name: str,
    name: str = "healed",
    progress_bar: bool = True,
) -> Any:
    """The pruning report's evaluation run again on the healed model, so that the healed checkpoint's report and card
    give its own figures: each perplexity on the same dataset with the same segment length and number of segments (the
    first segments of the same text: the same segments), and the next-token KL divergence from the dense model beside
    those the report measured one for. Zero-shot accuracy and flips are not run again (their cost is the pruning run's
    evaluation's, not a few passes): the report keeps them as measured before the heal.

    For the KL divergence the teacher is loaded again (`teacher()`, after the heal freed it) and scores each segment
    in the same pass as the healed model ([`optimum_gradmap.evaluation.perplexity_and_kl`]): memory holds both models,
    as it did during the heal's teacher pass, and no logits are kept. Computing the teacher's logits on the evaluation
    segments while the heal had it loaded would instead keep segments x tokens x vocabulary floats until the end of
    training (over 3 GB in float32 for 128 segments of 128 tokens over SmolLM2's 49,152-token vocabulary) to save one
    load. Without a KL in the report the teacher is not loaded.

    Args:
        report (`dict`): The pruned checkpoint's `pruning_report.json`.
        model (`PreTrainedModel`): The healed model.
        tokenizer (`PreTrainedTokenizerBase`): Its tokenizer (the checkpoint's).
        teacher (`Callable`): A context manager factory that loads the dense model and frees it on exit.
        teacher_name (`str`): The dense model's name, stored beside each KL divergence.
        name (`str`, defaults to `"healed"`): The healed model's name in the result.
        progress_bar (`bool`, defaults to `True`): Show progress bars.

    Returns:
        [`~optimum_gradmap.evaluation.EvaluationResult`], or `None` when the report has no perplexity to measure again.
    """
    from ..evaluation import EvaluationResult, evaluate

    entries = (report.get("evaluation") or {}).get("perplexities") or []
    if not entries:
        return None
    with_kl = any(entry.get("kl_to_reference") is not None for entry in entries)
    result = EvaluationResult(model=name)
    with teacher() if with_kl else contextlib.nullcontext() as dense:
        for entry in entries:  # one call each: the segment length and count are the entry's own
            measured = evaluate(
                model,
                tokenizer,
                perplexity_datasets=[entry["dataset"]],
                segment_length=entry["segment_length"],
                max_segments=entry["num_segments"],
                model_name=name,
                progress_bar=progress_bar,
                shared_by_processes=True,
                reference_model=dense if entry.get("kl_to_reference") is not None else None,
                reference_model_name=teacher_name,
            )
            result.perplexities += measured.perplexities
        del dense  # before the context's cleanup runs: the teacher is freed there, before the checkpoint is saved
    return result


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
