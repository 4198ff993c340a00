"""Accuracy you can trust: for one model, ratio and selection of removed layers, the Stage 1 model and each Stage 2
variant, evaluated on the same questions, and compared with the Stage 1 model question by question.

    python benchmarks/accuracy.py --model smollm2-135m --ratio 0.25 --selection gradmap --variants stage1 default paper
    python benchmarks/accuracy.py --model smollm2-135m --ratio 0.25 --selection sleb --variants stage1 default --resume
    python benchmarks/accuracy.py --protocol screening --pair previous_default mixed   # two saved variants, paired
    python benchmarks/accuracy.py --model qwen2.5-coder-0.5b --variants --resume   # the dense model's row only

The removed layers of a selection are those benchmarks/compare.py recorded for its method (`quality` -> the
`quality` preset's, `fast` -> `relative_magnitude`), stated with the file they came from; every figure here is
measured again. Each row: held-out perplexity on the first `--max-segments` 128-token segments of Wikipedia and of
web text, the seven zero-shot tasks offline (whole validation splits; HellaSwag and BoolQ: `STANDARD_SUBSETS`),
every question's answer, and, for a Stage 2 variant, its paired difference against the Stage 1 model and the dense
model (per task and pooled, standard errors, McNemar's test). Every row carries its provenance.

A variant is `stage1`; `default`, the library's default Stage 2 when the row is measured; `paper` (`PAPER_STAGE2`);
`previous_default` (`PREVIOUS_DEFAULT_STAGE2`); or changes to the previous default joined by `+` (`CHANGES`); `mixed`
fits Stage 2 on Wikipedia and web text in equal parts (`compensation_dataset`).

Writes benchmarks/results/accuracy-<model>-<ratio>.json (`-screening` with `--protocol screening`: 400 questions per
task; `-cuda` with `--device cuda`); with `--resume`, rows already there are kept. A row is saved as it goes (each
task as it ends, under `in_progress`): a run stopped halfway resumes at the row's next task with `--resume`, on the
same weights only (their SHA-256), and the row keeps each part's provenance (`parts`).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import logging
import os
import time

import records
import torch
from common import CALIBRATION, RESULTS, SELECTIONS, calibration, expand, layers_of, parser, resumed
from provenance import finish, provenance

from optimum_gradmap import GradMAPConfig, GradMAPPruner
from optimum_gradmap.assets import MODEL_ASSETS, load_model
from optimum_gradmap.configuration import PAPER_STAGE2, PRESETS, PREVIOUS_DEFAULT_STAGE2, QUALITY_SELECTION
from optimum_gradmap.data import calibration_sha256
from optimum_gradmap.evaluation import (
    PAPER_TASKS,
    SCREENING_SUBSETS,
    STANDARD_SUBSETS,
    EvaluationResult,
    PerplexityResult,
    ZeroShotResult,
    compare_zero_shot,
    evaluate,
    zero_shot_accuracy,
)

# the presets' layer selections, as benchmarks/common.py's SELECTIONS names them
assert QUALITY_SELECTION == {"importance": "gradmap_bound_token", "verify_top_k": 8, "verify_halving": True}
assert PRESETS["fast"] == {"importance": "relative_magnitude"}
# A variant is "stage1" (no Stage 2), "default" (GradMAPConfig's defaults today), "paper", "previous_default", or
# changes to the previous default joined by "+", so that a name keeps what it measured when the default changes.
NAMED_VARIANTS: dict[str, dict] = {"default": {}, "paper": PAPER_STAGE2, "previous_default": PREVIOUS_DEFAULT_STAGE2}
CHANGES: dict[str, dict] = {
    "no_outliers": {"outlier_tokens": "exclude"},
    "next_token": {"compensation_selection": "next_token_loss"},
    "mixed": {"compensation_dataset": "offline:wikipedia+offline:web_text"},  # the web pages' calibration half
}
PROTOCOLS = {"standard": STANDARD_SUBSETS, "screening": SCREENING_SUBSETS}


def variant_settings(name: str) -> dict | None:
    """The Stage 2 settings of a variant (`None`: Stage 1 only; `{}`: the library's defaults)."""
    if name == "stage1":
        return None
    if name in NAMED_VARIANTS:
        return dict(NAMED_VARIANTS[name])
    changes = name.split("+")
    if any(change not in CHANGES for change in changes):
        raise SystemExit(
            f"unknown variant {name!r}: stage1, {', '.join(NAMED_VARIANTS)}, or '+'-joined changes from {list(CHANGES)}"
        )
    return {**PREVIOUS_DEFAULT_STAGE2, **{key: value for change in changes for key, value in CHANGES[change].items()}}


def rows_by_key(record: dict) -> dict[tuple[str, str], dict]:
    """`record`'s rows by (selection, variant)."""
    return {(row["selection"], row["variant"]): row for row in record["rows"]}


def selections_in(record: dict) -> list[str]:
    """The selections `record` has rows for, in the order they were first measured."""
    return list(dict.fromkeys(row["selection"] for row in record["rows"]))


def same_layers_as(record: dict, model: str, ratio: float, selection: str, layers: list[int]) -> str | None:
    """The selection already in `record` whose removed layers are `selection`'s (in any order), if any: the same
    pruned model, measured once under that selection's name."""
    for other in selections_in(record):
        if other not in (selection, "dense") and sorted(layers_of(model, ratio, other)[0]) == sorted(layers):
            return other
    return None


def compact_answers(zero_shot: ZeroShotResult) -> dict[str, dict]:
    """Every question's right (1) / wrong (0), per task, with the questions' ids: enough to pair two rows."""
    return {
        task.task: {"doc_ids": [q.doc_id for q in task.questions], "acc": "".join(str(q.acc) for q in task.questions)}
        for task in zero_shot.tasks
    }


def model_sha256(model) -> str:
    """SHA-256 of every weight of `model`: the same model (pruned and compensated the same way) when a row resumes."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def measure(model, tokenizer, label: str, max_segments: int, batch_size: int, subsets: dict, progress: dict, save) -> dict:
    """The row's evaluation: the two perplexities, then the seven tasks one at a time, each kept in `progress` and
    saved (`save()`) as it ends, so that a row stopped halfway resumes at its next task (`--resume`). Each task is
    scored the same way alone as beside the others (`ZeroShotResult.merge`); `seconds` sums the parts'."""
    if "perplexities" not in progress:
        started = time.perf_counter()
        result = evaluate(
            model,
            tokenizer,
            ("offline:wikipedia", "offline:web_text"),
            segment_length=128,
            max_segments=max_segments,
            batch_size=batch_size,
            model_name=label,
            progress_bar=False,
        )
        progress["perplexities"] = result.to_dict()["perplexities"]
        progress["perplexity_seconds"] = time.perf_counter() - started
        save()
    tasks = progress.setdefault("tasks", {})
    for task in PAPER_TASKS:
        if task in tasks:
            continue
        zero_shot = zero_shot_accuracy(
            model, tokenizer, [task], task_data="offline", batch_size=batch_size, progress_bar=False, subsets=subsets
        )
        tasks[task] = {"summary": zero_shot.to_dict(), "answers": compact_answers(zero_shot)[task]}
        print(f"{label}: {task} acc {zero_shot.tasks[0].acc:.4f} ({zero_shot.seconds:.0f} s), saved", flush=True)
        save()
    parts = []
    for task in PAPER_TASKS:
        part = ZeroShotResult.from_dict(tasks[task]["summary"])
        part.tasks[0].questions = expand({task: tasks[task]["answers"]}).tasks[0].questions
        parts.append(part)
    zero_shot = ZeroShotResult.merge(parts)
    result = EvaluationResult(
        model=label, perplexities=[PerplexityResult(**entry) for entry in progress["perplexities"]], zero_shot=zero_shot
    )
    summary = result.to_dict()
    summary["zero_shot"]["answers"] = compact_answers(zero_shot)
    summary["seconds"] = progress["perplexity_seconds"] + zero_shot.seconds
    print(result.summary(), flush=True)
    return summary


def measure_row(
    record: dict, selection: str, variant: str, model, settings: dict, measure_model, save, started: dict
) -> tuple[dict, dict]:
    """Measures one row with `measure_model(progress, save)` (`started`: its `provenance()`, taken before the model was
    made, Stage 2 included), resuming what `record["in_progress"]` kept of this row when that was measured on the
    same weights (`model_sha256`) with the same `settings` (segments, batch size, lm-eval version); returns its
    evaluation and provenance. A row measured in parts (stopped and resumed) has each part's provenance in `parts`:
    its own commit, date and load are the last part's, its `seconds` the parts' sum, and it is quiet only if every
    part was. (Stage 2 runs again on a resume: where it is not bit for bit repeatable, as on some GPUs, the row
    starts over.)"""
    key, fingerprint = f"{selection} + {variant}", model_sha256(model)
    in_progress = record.setdefault("in_progress", {})
    progress = in_progress.get(key)
    if progress is not None and (progress["model_sha256"], progress["settings"]) != (fingerprint, settings):
        print(f"the saved part of {key} was measured on other weights or settings ({progress['settings']}): started over")
        progress = None
    if progress is None:
        progress = in_progress[key] = {"model_sha256": fingerprint, "settings": settings, "parts": []}
    progress["parts"].append(finish(started))

    def save_part() -> None:
        progress["parts"][-1] = finish(started)
        save()

    evaluation = measure_model(progress, save_part)
    parts = progress["parts"]
    parts[-1] = finish(started)
    row_provenance = dict(parts[-1])
    if len(parts) > 1:
        row_provenance.update(
            parts=parts, seconds=sum(part["seconds"] for part in parts), quiet=all(part["quiet"] for part in parts)
        )
    del in_progress[key]
    if not in_progress:
        del record["in_progress"]
    return evaluation, row_provenance


def paired(row: dict, against: dict, dense: dict | None) -> dict:
    comparison = compare_zero_shot(
        expand(against["evaluation"]["zero_shot"]["answers"]),
        expand(row["evaluation"]["zero_shot"]["answers"]),
        reference=expand(dense["evaluation"]["zero_shot"]["answers"]) if dense else None,
        names=(against["label"], row["label"], "dense"),
    )
    print(comparison.summary(), flush=True)
    return comparison.to_dict()


def print_pairs(record: dict, a: str, b: str) -> None:
    """Variant `b` against variant `a` on the same questions, for every selection that has both: pooled paired
    change (points), its standard error and McNemar's p, with and without BoolQ."""
    rows = rows_by_key(record)
    for selection in selections_in(record):
        if (selection, a) not in rows or (selection, b) not in rows:
            continue
        answers = [rows[(selection, variant)]["evaluation"]["zero_shot"]["answers"] for variant in (a, b)]
        for label, skip in (("all tasks", ()), ("without BoolQ", ("boolq",))):
            kept = [{task: v for task, v in side.items() if task not in skip} for side in answers]
            pooled = compare_zero_shot(expand(kept[0]), expand(kept[1])).pooled
            print(
                f"{selection}: {b} - {a}, {label} ({pooled.num_questions} questions): "
                f"{100 * pooled.difference:+.2f} ± {100 * pooled.stderr:.2f} points, p = {pooled.p_value:.3g}"
            )


def add_layer_arguments(arguments: argparse.ArgumentParser) -> None:
    """The arguments that name a pruned model's layers (`--model`, `--ratio`, `--selection`: see `common.layers_of`)
    and its calibration set (`--num-samples` sequences of 128 tokens of `CALIBRATION`)."""
    arguments.add_argument("--model", default="smollm2-135m", choices=sorted(MODEL_ASSETS))
    arguments.add_argument("--ratio", type=float, default=0.25)
    arguments.add_argument("--selection", default="gradmap", choices=sorted(SELECTIONS))
    arguments.add_argument("--num-samples", type=int, default=128)


def arguments() -> argparse.ArgumentParser:
    arguments = parser(__doc__)
    add_layer_arguments(arguments)
    variants = "stage1, default, paper, or changes; none: the dense model's row only"
    arguments.add_argument("--variants", nargs="*", default=["stage1", "default", "paper"], help=variants)
    arguments.add_argument("--protocol", default="standard", choices=list(PROTOCOLS), help="which zero-shot questions")
    arguments.add_argument("--max-segments", type=int, default=128)
    arguments.add_argument("--batch-size", type=int, default=8)
    device = "where the model runs (e.g. cuda); rows from another device than cpu go to their own file, '-<device>'"
    arguments.add_argument("--device", default="cpu", help=device)
    arguments.add_argument("--resume", action="store_true")
    pair = "measure nothing: print, for every selection in the record with both variants, B's paired change against A"
    arguments.add_argument("--pair", nargs=2, metavar=("A", "B"), help=pair)
    return arguments


def variant_row(record: dict, args: argparse.Namespace, pruner, result, variant: str, measure_model, save) -> dict:
    """The row of `variant` on the Stage 1 model of `result`: its Stage 2 fitted first (or undone, for `stage1`),
    then measured ([`measure_row`]) and paired against the Stage 1 row and the dense row."""
    started = provenance()
    layers, layers_from = layers_of(args.model, args.ratio, args.selection)
    row = {"selection": args.selection, "variant": variant, "label": f"{args.selection} + {variant}"}
    row.update(removed_layers=layers, layers_from=layers_from)
    settings = variant_settings(variant)
    if settings is not None:
        pruner.compensate(result, **settings)
        compensation = result.compensation
        row.update(
            compensated_layers=compensation.compensated_layers,
            compensation_lambda={str(k): v for k, v in compensation.reg_lambda.items()},
            skipped_layers={str(k): v for k, v in compensation.skipped_layers.items()},
            stage2_seconds=compensation.seconds,
            stage2_settings=settings,
            stage2_calibration_sha256=compensation.calibration_sha256,
        )
    elif result.compensation is not None:  # back to the Stage 1 model
        result.compensation.undo()
        result.compensation = None
    # the saved part of a row resumes with the same Stage 2 settings
    row["evaluation"], row_provenance = measure_row(
        record, args.selection, variant, result.model, settings, measure_model(row["label"]), save, started
    )
    rows = rows_by_key(record)
    dense, stage1 = rows[("dense", "dense")], rows.get((args.selection, "stage1"))
    if variant != "stage1" and stage1 is not None:
        row["against_stage1"] = paired(row, stage1, dense)
    row["against_dense"] = paired(row, dense, dense)
    row["provenance"] = row_provenance
    return row


def main() -> None:
    args = arguments().parse_args()
    logging.getLogger("optimum_gradmap").setLevel(logging.WARNING)
    torch.manual_seed(0)
    for variant in args.variants:
        variant_settings(variant)  # refuses an unknown one before anything runs
    suffix = ("" if args.protocol == "standard" else f"-{args.protocol}") + ("" if args.device == "cpu" else f"-{args.device}")
    path = os.path.join(RESULTS, f"accuracy-{args.model}-{args.ratio:g}{suffix}.json")
    subsets = PROTOCOLS[args.protocol]
    record = {"model": args.model, "ratio": args.ratio, "protocol": args.protocol, "subsets": subsets, "rows": []}
    record = resumed(path, args.resume or bool(args.pair), record)
    if args.pair:
        print_pairs(record, *args.pair)
        return

    def save() -> None:
        if record["rows"]:
            answers = record["rows"][0]["evaluation"]["zero_shot"]["answers"]
            record["questions"] = sum(len(kept["acc"]) for kept in answers.values())
        records.write(path, record)

    model, tokenizer = load_model(args.model)
    model.to(args.device)
    ids = calibration(tokenizer, args.num_samples)
    record["calibration_sha256"] = calibration_sha256(ids)

    def measure_model(label: str):
        return lambda progress, save_part: measure(
            model, tokenizer, label, args.max_segments, args.batch_size, subsets, progress, save_part
        )

    if ("dense", "dense") not in rows_by_key(record):
        settings = {
            "max_segments": args.max_segments,
            "batch_size": args.batch_size,
            "lm_eval": importlib.metadata.version("lm_eval"),
        }
        evaluation, row_provenance = measure_row(
            record, "dense", "dense", model, settings, measure_model("dense"), save, provenance()
        )
        row = {"selection": "dense", "variant": "dense", "label": "dense", "evaluation": evaluation, "provenance": row_provenance}
        record["rows"].append(row)
        save()
    if not args.variants:
        return
    layers, _ = layers_of(args.model, args.ratio, args.selection)
    twin = same_layers_as(record, args.model, args.ratio, args.selection, layers)
    if twin is not None:  # the same model: one set of rows, no copy
        record.setdefault("same_layers", {})[args.selection] = twin
        save()
        print(f"{args.selection}'s removed layers are {twin}'s ({sorted(layers)}): its rows are {twin}'s; nothing measured")
        return
    config = GradMAPConfig(layers_to_prune=layers, num_samples=args.num_samples, seq_len=128, dataset=CALIBRATION)
    pruner = GradMAPPruner(config, tokenizer=tokenizer, progress_bar=False)
    result = pruner.select_layers(model, ids)
    for variant in args.variants:
        if (args.selection, variant) not in rows_by_key(record):
            record["rows"].append(variant_row(record, args, pruner, result, variant, measure_model, save))
            save()


if __name__ == "__main__":
    main()
