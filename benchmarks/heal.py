"""Heal (issue 56): what distilling the dense model back into the pruned one brings, judged by fidelity to the dense
model (flips, KL) as well as accuracy and perplexity, on one model, ratio and selection of removed layers.

    python benchmarks/heal.py --model smollm2-135m --ratio 0.25 --selection gradmap --variants dense stage1 default
    python benchmarks/heal.py --model smollm2-135m --ratio 0.25 --variants lora@150000 --resume
    python benchmarks/heal.py --model smollm2-135m --ratio 0.25 --variants lora@40000 norms@40000 all@40000 \
        --no-tasks --label trainables --resume   # the trainable choices on held-out KL and perplexity alone
    python benchmarks/heal.py --ratio 0.4 --variants dense stage1 default lora@196608 \
        --dense-from heal-smollm2-135m-0.25-gradmap-screening --resume   # the dense row copied, marked as a copy

A variant is `dense`, `stage1` (Stage 1 alone), `default` (Stage 1 and the default Stage 2), or a heal after them:
`TRAINABLE@TOKENS` (`heal_trainable` and `heal_tokens`), optionally `+lr=VALUE` (`heal_lr`), `+rank=R`
(`heal_lora_rank`) and `+topk=K` (the teacher's K most likely tokens the loss keeps apart,
`optimum_gradmap.distillation.TOP_K`, 64 by default; the tail beyond them is one outcome). Two kinds of rows measure
how flips follow the KL divergence when the damage is small (where the flips come from when a goal on them
is missed): `dense@bf16` (the dense model with every weight rounded to bfloat16, computing in float32: a model
almost equal to the dense one) and `stage1@K` (Stage 1 alone with only the first K of the removed layers, in the
order they were removed). The removed layers are
those benchmarks/compare.py recorded for `--selection` (as in benchmarks/accuracy.py). Calibration: 128 x 128 tokens
of offline Wikipedia (the benchmarks' set, its SHA-256 in the record). The heal text is the calibration parts of the
offline web pages and of offline Wikipedia (`offline:web_text+offline:wikipedia`, about 146k + 409k SmolLM2 tokens;
the held-out perplexities use the other web pages and other articles), cut into non-overlapping 128-token windows,
32 of them held out to choose the state kept, none trained on twice. The 128 calibration windows lie in that
Wikipedia text: at most 16k of its 555k tokens (3%) are also calibration tokens.

Each row: held-out perplexity on the first `--max-segments` 128-token segments of held-out Wikipedia and of the
other half of the web pages, the next-token KL divergence from the dense model on the same segments (mean per
token, standard error over segments), the seven zero-shot tasks offline under `--protocol` (`screening`: 400
questions per task; `standard`: whole validation splits, HellaSwag and BoolQ subsets) with every question's choice,
the flips against the dense row (right/wrong changed, chosen answer changed; with and without BoolQ), and the paired
accuracy against `stage1` and `default`; for a heal row, what was trained, its seconds, and its held-out KL curve.
Stage 1 and the default Stage 2 run once per invocation, and every heal row starts from their weights with the dense
model, loaded beside them, as its teacher (as `optimum-gradmap heal --teacher` does; the pruner's own teacher, the
pruned model with its layers put back and its folds undone, gives the same targets: tests/test_heal.py). Every row
carries its provenance (benchmarks/provenance.py). Writes
benchmarks/results/heal-<model>-<ratio>-<selection>-<protocol>[-<label>].{json,md}; with `--resume`, rows already
there are kept.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import time
from dataclasses import asdict

import torch
from accuracy import CALIBRATION, RESULTS, layers_of
from provenance import finish, provenance

from optimum_gradmap import GradMAPConfig, GradMAPPruner, distillation
from optimum_gradmap.assets import load_model
from optimum_gradmap.data import calibration_sha256, prepare_calibration_data
from optimum_gradmap.evaluation import (
    PAPER_TASKS,
    SCREENING_SUBSETS,
    STANDARD_SUBSETS,
    QuestionRecord,
    TaskResult,
    ZeroShotResult,
    compare_zero_shot,
    evaluate,
    flips,
)
from optimum_gradmap.heal import heal_as_configured, heal_sequences

PROTOCOLS = {"standard": STANDARD_SUBSETS, "screening": SCREENING_SUBSETS}
HEAL_TEXT = "offline:web_text+offline:wikipedia"
PERPLEXITY_DATASETS = ("offline:wikipedia", "offline:web_text")
# Stage 1's seconds for GradMAP's layers in float32, on this machine type, quiet: the unit of the heal budgets.
# SmolLM2-135M 25%: the main job (benchmarks/results/main_job-smollm2-135m.json); Qwen2.5-Coder-0.5B 25%: the
# float32 row of benchmarks/results/dtype-qwen2.5-coder-0.5b-0.25.json.
STAGE1_SECONDS = {("smollm2-135m", 0.25): 476.3, ("qwen2.5-coder-0.5b", 0.25): 1306.7}


def parse_variant(name: str) -> dict | None:
    """`None` for `dense`, `stage1`, `default` and the rows without a heal (`dense@bf16`, `stage1@K`); else the heal
    settings of `TRAINABLE@TOKENS[+lr=VALUE]`."""
    if name in ("dense", "stage1", "default", "dense@bf16") or partial_stage1(name) is not None:
        return None
    head, *options = name.split("+")
    trainable, _, tokens = head.partition("@")
    if not tokens.isdigit():
        raise SystemExit(f"unknown variant {name!r}: dense, stage1, default, or TRAINABLE@TOKENS[+lr=VALUE]")
    settings = {"heal_trainable": trainable, "heal_tokens": int(tokens), "heal_dataset": HEAL_TEXT}
    for option in options:
        key, _, value = option.partition("=")
        if key == "lr":
            settings["heal_lr"] = float(value)
        elif key == "topk" and value.isdigit():
            settings["top_k"] = int(value)
        elif key == "rank" and value.isdigit():
            settings["heal_lora_rank"] = int(value)
        else:
            raise SystemExit(f"unknown option {option!r} in {name!r}: lr=VALUE, topk=K or rank=R")
    return settings


@contextlib.contextmanager
def teacher_top_k(top_k: int | None):
    """Within the block, the heal's loss keeps the teacher's `top_k` most likely tokens apart (the library's
    `TOP_K`, a module constant, otherwise)."""
    default = distillation.TOP_K
    distillation.TOP_K = top_k or default
    try:
        yield
    finally:
        distillation.TOP_K = default


def partial_stage1(name: str) -> int | None:
    """K of a `stage1@K` variant, else `None`."""
    head, _, count = name.partition("@")
    return int(count) if head == "stage1" and count.isdigit() else None


def compact(zero_shot: ZeroShotResult) -> dict[str, dict]:
    """Every question's id, right/wrong and choice, per task: enough to pair two rows and count flips."""
    return {
        task.task: {
            "doc_ids": [q.doc_id for q in task.questions],
            "acc": "".join(str(q.acc) for q in task.questions),
            "choice": [q.choice for q in task.questions],
        }
        for task in zero_shot.tasks
    }


def expand(answers: dict[str, dict], skip: tuple[str, ...] = ()) -> ZeroShotResult:
    tasks = []
    for task, kept in answers.items():
        if task in skip:
            continue
        questions = [
            QuestionRecord(i, [], choice, None, 0, int(a)) for i, a, choice in zip(kept["doc_ids"], kept["acc"], kept["choice"])
        ]
        tasks.append(
            TaskResult(
                task, "validation", "", len(questions), sum(q.acc for q in questions) / len(questions), questions=questions
            )
        )
    return ZeroShotResult(tasks=tasks)


def markdown(record: dict) -> str:
    lines = [
        f"# Heal: {record['model']}, {record['ratio']:g}, layers of {record['selection']} ({record['protocol']} protocol)",
        "",
        f"Removed layers {record['removed_layers']} ({record['layers_from']}); calibration {record['calibration']} "
        f"{record['calibration_sha256'][:12]}; heal text {HEAL_TEXT}. KL: next-token KL divergence from the dense model "
        "on the held-out segments (nats per token, +/- SE over segments). Flips: share of questions whose right/wrong "
        "differs from the dense model's (BoolQ left out; in brackets with it), answer changes: whose chosen answer "
        "differs. Paired: pooled accuracy change against Stage 1 alone and against Stage 1 + default Stage 2, points "
        "+/- SE.",
        "",
        "| row | Wikipedia ppl | web ppl | KL Wikipedia | KL web | flips | answer changes | accuracy | vs Stage 1 | "
        "vs Stage 1 + 2 | heal seconds | heal tokens | quiet | commit |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in record["rows"]:
        evaluation = row["evaluation"]
        ppl = [f"{entry['perplexity']:.2f}" for entry in evaluation["perplexities"]]
        kl = [
            f"{entry['kl_to_reference']:.4f} +/- {entry['kl_stderr']:.4f}" if entry.get("kl_to_reference") is not None else "-"
            for entry in evaluation["perplexities"]
        ]
        fidelity = row.get("flips_without_boolq")
        flips_cell = changes_cell = "-"
        if fidelity:
            flips_cell = f"{100 * fidelity['flips']:.1f}% ({100 * row['flips']['flips']:.1f}%)"
            changes_cell = f"{100 * fidelity['answer_changes']:.1f}%"
        accuracy = f"{row['pooled_acc']:.4f}" if row.get("pooled_acc") is not None else "-"
        paired = [
            f"{100 * row[key]['difference']:+.2f} +/- {100 * row[key]['stderr']:.2f}" if row.get(key) else "-"
            for key in ("against_stage1", "against_default")
        ]
        heal = row.get("heal") or {}
        heal_seconds = f"{heal['seconds']:.0f}" if heal else "-"
        heal_tokens = f"{heal['trained_tokens']:,}" if heal else "-"
        quiet = "yes" if row["provenance"]["quiet"] else "no"
        lines.append(
            f"| {row['variant']} | {ppl[0]} | {ppl[1]} | {kl[0]} | {kl[1]} | {flips_cell} | {changes_cell} | {accuracy} | "
            f"{paired[0]} | {paired[1]} | {heal_seconds} | {heal_tokens} | {quiet} | {row['provenance']['commit'][:8]} |"
        )
    return "\n".join(lines) + "\n"


def copied_dense_row(source: str, record: dict, max_segments: int) -> dict:
    """The `dense` row of another record of the same model and protocol, its provenance marked as a copy: the dense
    model's evaluation does not depend on the ratio or the selection."""
    with open(os.path.join(RESULTS, source + ".json"), encoding="utf-8") as file:
        other = json.load(file)
    other.setdefault("device", "cpu")  # records from before `--device` ran on the CPU
    for key in ("model", "protocol", "subsets", "calibration_sha256", "device"):
        if other.get(key) != record.get(key):
            raise SystemExit(f"--dense-from {source}: its {key} ({other.get(key)!r}) is not this run's ({record.get(key)!r})")
    row = json.loads(json.dumps(next(row for row in other["rows"] if row["variant"] == "dense")))
    segments = {entry["num_segments"] for entry in row["evaluation"]["perplexities"]}
    if segments != {max_segments}:
        raise SystemExit(f"--dense-from {source}: its perplexities use {segments} segments, this run {max_segments}")
    row["provenance"]["copied_from"] = f"benchmarks/results/{source}.json (the same model, questions and segments)"
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--ratio", type=float, default=0.25)
    parser.add_argument("--selection", default="gradmap")
    parser.add_argument("--variants", nargs="+", default=["dense", "stage1", "default"])
    parser.add_argument("--protocol", choices=list(PROTOCOLS), default="screening")
    parser.add_argument("--no-tasks", action="store_true", help="perplexities and KL only")
    parser.add_argument("--max-segments", type=int, default=128)
    parser.add_argument("--num-samples", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--label", default=None)
    parser.add_argument(
        "--dense-from",
        default=None,
        help="take the `dense` row from this record of benchmarks/results (same model and protocol), marked as a copy, "
        "instead of evaluating the dense model again",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="where the models run (e.g. cuda); a record from another device than cpu goes to its own file, '-<device>'",
    )
    parser.add_argument(
        "--time-stage1",
        action="store_true",
        help="also time GradMAP's own Stage 1 (the selection, float32) at this ratio on this device, once per record: "
        "the unit of the heal budgets there",
    )
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.manual_seed(0)

    removed, layers_from = layers_of(args.model, args.ratio, args.selection)
    suffix = ("-notasks" if args.no_tasks else "") + ("" if args.device == "cpu" else f"-{args.device}")
    name = f"heal-{args.model}-{args.ratio:g}-{args.selection}-{args.protocol}{suffix}" + (f"-{args.label}" if args.label else "")
    path = os.path.join(RESULTS, name + ".json")
    record = {
        "model": args.model,
        "ratio": args.ratio,
        "selection": args.selection,
        "protocol": args.protocol,
        "subsets": PROTOCOLS[args.protocol],
        "removed_layers": removed,
        "layers_from": layers_from,
        "calibration": f"{CALIBRATION}, {args.num_samples} x 128",
        "heal_text": HEAL_TEXT,
        "stage1_seconds_reference": STAGE1_SECONDS.get((args.model, args.ratio)) if args.device == "cpu" else None,
        "device": args.device,
        "rows": [],
    }
    if args.resume and os.path.exists(path):
        with open(path, encoding="utf-8") as file:
            record = json.load(file)
    done = {row["variant"] for row in record["rows"]}

    def save() -> None:
        with open(path, "w", encoding="utf-8") as file:
            json.dump(record, file, indent=1)
        with open(path[: -len(".json")] + ".md", "w", encoding="utf-8") as file:
            file.write(markdown(record))

    def load() -> torch.nn.Module:
        model, _ = load_model(args.model)
        return model.to(args.device)

    dense_model, tokenizer = load_model(args.model)
    dense_model.to(args.device)
    calibration = prepare_calibration_data(CALIBRATION, tokenizer, args.num_samples, 128, 0, CALIBRATION)
    record["calibration_sha256"] = calibration_sha256(calibration)
    if args.time_stage1 and "stage1_on_device" not in record:
        started = provenance()
        config = GradMAPConfig(pruning_ratio=args.ratio, num_samples=args.num_samples, seq_len=128, compensation=False)
        result = GradMAPPruner(config, tokenizer=tokenizer, progress_bar=False).select_layers(load(), calibration)
        record["stage1_on_device"] = {
            "seconds": result.timings["stage1"],
            "removed_layers": result.removed_layers,
            "same_layers_as_cpu": sorted(result.removed_layers) == sorted(layers_of(args.model, args.ratio, "gradmap")[0]),
            "provenance": finish(started),
        }
        save()
        print(f"GradMAP's Stage 1 on {args.device}: {record['stage1_on_device']}", flush=True)
    rows = {row["variant"]: row for row in record["rows"]}
    compensated = stage2 = stage2_state = None
    for variant in args.variants:
        if variant in done:
            print(f"{variant}: already measured, kept")
            continue
        heal_settings = parse_variant(variant)
        started = provenance()
        row: dict = {"variant": variant}
        if variant == "dense" and args.dense_from:
            row = copied_dense_row(args.dense_from, record, args.max_segments)
            record["rows"].append(row)
            rows[variant] = row
            save()
            print(f"dense: copied from {args.dense_from}", flush=True)
            continue
        if variant == "dense":
            model = dense_model
        elif variant == "dense@bf16":
            model = load()
            with torch.no_grad():
                for tensor in model.state_dict().values():
                    tensor.copy_(tensor.to(torch.bfloat16))
        elif variant == "stage1" or partial_stage1(variant) is not None:
            model = load()
            layers = removed if variant == "stage1" else removed[: partial_stage1(variant)]
            config = GradMAPConfig(layers_to_prune=layers, num_samples=args.num_samples, compensation=False)
            result = GradMAPPruner(config, model, tokenizer).prune(model, calibration)
            row["timings"] = result.timings
        else:
            if compensated is None:  # Stage 1 and the default Stage 2, once for every row that starts from them
                compensated = load()
                config = GradMAPConfig(layers_to_prune=removed, num_samples=args.num_samples)
                stage2 = GradMAPPruner(config, compensated, tokenizer).prune(compensated, calibration)
                stage2_state = {name: tensor.clone() for name, tensor in compensated.state_dict().items()}
            compensated.load_state_dict(stage2_state)
            model = compensated
            row["timings"] = dict(stage2.timings)
            row["compensated_layers"] = stage2.compensated_layers
            if heal_settings is not None:  # the heal on Stage 1 + 2, the dense model as teacher
                top_k = heal_settings.pop("top_k", None)
                heal_config = dataclasses.replace(stage2.config, **heal_settings)
                train_ids, validation_ids = heal_sequences(None, tokenizer, heal_config)
                with teacher_top_k(top_k):
                    healed = heal_as_configured(
                        model,
                        lambda: contextlib.nullcontext(dense_model),
                        train_ids,
                        validation_ids,
                        heal_config,
                        stage2.kept_layers,
                        stage2.original_num_layers,
                        stage2.compensated_layers,
                        HEAL_TEXT,
                    )
                row["heal"] = healed.to_dict()
                row["heal"]["teacher_top_k"] = top_k or distillation.TOP_K
                row["timings"]["heal"] = healed.seconds
        tick = time.perf_counter()
        evaluation = evaluate(
            model,
            tokenizer,
            PERPLEXITY_DATASETS,
            segment_length=128,
            max_segments=args.max_segments,
            tasks=() if args.no_tasks else PAPER_TASKS,
            task_subsets=PROTOCOLS[args.protocol],
            task_data="offline",
            batch_size=args.batch_size,
            model_name=variant,
            progress_bar=False,
            reference_model=None if variant == "dense" else dense_model,
            reference_model_name="dense",
        )
        row["evaluation_seconds"] = time.perf_counter() - tick
        summary = evaluation.to_dict()
        summary.pop("flips", None)
        if evaluation.zero_shot is not None:
            summary["zero_shot"]["answers"] = compact(evaluation.zero_shot)
            row["pooled_acc"] = evaluation.zero_shot.pooled_acc
        row["evaluation"] = summary
        print(evaluation.summary(), flush=True)
        if evaluation.zero_shot is not None and "dense" in rows and variant != "dense":
            dense_answers = rows["dense"]["evaluation"]["zero_shot"]["answers"]
            mine = summary["zero_shot"]["answers"]
            row["flips"] = asdict(flips(expand(mine), expand(dense_answers)).pooled)
            row["flips_without_boolq"] = asdict(flips(expand(mine, ("boolq",)), expand(dense_answers, ("boolq",))).pooled)
            for key, other in (("against_stage1", "stage1"), ("against_default", "default")):
                if other in rows and other != variant:
                    comparison = compare_zero_shot(
                        expand(rows[other]["evaluation"]["zero_shot"]["answers"]), expand(mine), names=(other, variant, "dense")
                    )
                    row[key] = asdict(comparison.pooled)
                    row[key + "_without_boolq"] = asdict(
                        compare_zero_shot(
                            expand(rows[other]["evaluation"]["zero_shot"]["answers"], ("boolq",)),
                            expand(mine, ("boolq",)),
                        ).pooled
                    )
        row["provenance"] = finish(started)
        record["rows"].append(row)
        rows[variant] = row
        save()
        print(f"{variant}: saved to {path}", flush=True)
    print(markdown(record))


if __name__ == "__main__":
    main()
