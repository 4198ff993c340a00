"""Heal: what distilling the dense model back into the pruned one brings, judged by fidelity to the dense
model (flips, KL) as well as accuracy and perplexity, on one model, ratio and selection of removed layers.

    python benchmarks/heal.py --model smollm2-135m --ratio 0.25 --selection gradmap --variants dense stage1 default
    python benchmarks/heal.py --model smollm2-135m --ratio 0.25 --variants lora@150000 --resume
    python benchmarks/heal.py --model smollm2-135m --ratio 0.25 --variants lora@40000 norms@40000 all@40000 \
        --no-tasks --label trainables --resume   # the trainable choices on held-out KL and perplexity alone
    python benchmarks/heal.py --ratio 0.4 --variants dense stage1 default lora@196608 \
        --dense-from heal-smollm2-135m-0.25-gradmap-screening --resume   # the dense row copied, marked as a copy
    python benchmarks/heal.py --pair A B   # two rows of the record compared per question, nothing measured

A variant is `dense`, `stage1` (Stage 1 alone), `default` (Stage 1 and the default Stage 2), or a heal after them:
`TRAINABLE@TOKENS` (`heal_trainable`, `heal_tokens`), optionally `+lr=VALUE` (`heal_lr`), `+rank=R`
(`heal_lora_rank`), `+topk=K` (`optimum_gradmap.distillation.TOP_K`, the teacher's most likely tokens the loss keeps
apart), `+text=generated` (the dense model's own text, generated afresh for the row and timed) or `+text=mix` (it and
the corpus in equal parts), `+temp=T` (`heal_temperature`), `+loss=NAME`
(`heal_loss`) and `+from=stage1` (the heal on Stage 1 alone). A budget `FACTORx` in place of TOKENS (`lora@1.5x`) is
`heal_tokens="auto"` for FACTOR times Stage 1's quiet time on this machine (`STAGE1_SECONDS`). The removed layers
are those benchmarks/compare.py recorded for `--selection`; calibration, 128 x 128 tokens of offline Wikipedia (its
SHA-256 in the record). The heal text is the calibration parts of the offline web pages and of offline Wikipedia
(`offline:web_text+offline:wikipedia`; the held-out perplexities use the other pages and articles), in
non-overlapping 128-token windows, 32 held out to choose the state kept.

Each row: held-out perplexity on the first `--max-segments` 128-token segments of held-out Wikipedia and web text,
the next-token KL divergence from the dense model there, the seven zero-shot tasks offline under `--protocol`
(`screening`: 400 questions per task; `standard`: whole validation splits, HellaSwag and BoolQ subsets) with every
question's answer, the flips against the dense row (with and without BoolQ; on the confident questions, whose dense
margin is above their task's median: `confident_flips`), the answers' drift, BoolQ's "yes" share, and the paired
accuracy against `stage1` and `default`; for a heal row, what was trained and its seconds. Stage 1 and the default
Stage 2 run once per invocation; every heal row starts from their weights with the dense model as its teacher (as
`optimum-gradmap heal --teacher` does). Every row carries its provenance (benchmarks/provenance.py). Writes
benchmarks/results/heal-<model>-<ratio>-<selection>-<protocol>[-<label>].json; with `--resume`, rows already there
are kept, except the variants of `--redo VARIANT ...`, measured again in their old rows' place. The flips are counted
again at every save (`--recount-only`: only that); a dense row recorded without margins is measured again with
`--variants dense --redo dense --resume`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import os
import tempfile
import time
from dataclasses import asdict

import records
import torch
from common import CALIBRATION, HELD_OUT, RESULTS, calibration, expand, layers_of, parser
from provenance import finish, provenance

from optimum_gradmap import GradMAPConfig, GradMAPPruner, distillation
from optimum_gradmap.assets import load_model
from optimum_gradmap.data import calibration_sha256
from optimum_gradmap.errors import InvalidInputError
from optimum_gradmap.evaluation import (
    PAPER_TASKS,
    SCREENING_SUBSETS,
    STANDARD_SUBSETS,
    ZeroShotResult,
    answer_shares,
    compare_zero_shot,
    evaluate,
    flips,
    question_margin,
)
from optimum_gradmap.heal import HEAL_LOSS_CHOICES, HealSettings, PrunedLayout, heal_stage

PROTOCOLS = {"standard": STANDARD_SUBSETS, "screening": SCREENING_SUBSETS}
HEAL_TEXT = "offline:web_text+offline:wikipedia"
# `+text=NAME`: the dense model's own text alone, or in equal parts with the corpus text.
HEAL_TEXTS = {"corpus": HEAL_TEXT, "generated": "generated", "mix": f"generated+{HEAL_TEXT}"}
# Stage 1's seconds for GradMAP's layers in float32, on this machine type, quiet: the unit of the heal budgets.
# SmolLM2-135M 25%: the main job (benchmarks/results/main_job-smollm2-135m.json); Qwen2.5-Coder-0.5B 25%: the
# float32 row of benchmarks/results/dtype-qwen2.5-coder-0.5b-0.25.json; SmolLM2-135M 40%: GradMAP's row of
# benchmarks/results/compare-smollm2-135m-0.4.json.
STAGE1_SECONDS = {
    ("smollm2-135m", 0.25): 476.3,
    ("smollm2-135m", 0.4): 910.1,
    ("qwen2.5-coder-0.5b", 0.25): 1306.7,
}
MISSING_MARGINS = (
    "Confident flips: not counted, the dense row was measured without its questions' margins: "
    "measure it again with `--variants dense --redo dense --resume` (the other rows are kept and counted against it)."
)


def parse_variant(name: str) -> dict | None:
    """`None` for `dense`, `stage1` and `default`; else the heal settings of `TRAINABLE@BUDGET[+OPTION=VALUE...]`
    (see the module docstring)."""
    if name in ("dense", "stage1", "default"):
        return None
    head, *options = name.split("+")
    trainable, _, budget = head.partition("@")
    times = budget[:-1] if budget.endswith("x") else None
    if not (budget.isdigit() or (times and times.replace(".", "", 1).isdigit())):
        raise SystemExit(f"unknown variant {name!r}: dense, stage1, default, or TRAINABLE@TOKENS or TRAINABLE@FACTORx")
    settings = {"heal_trainable": trainable, "heal_dataset": HEAL_TEXT}
    if times:  # heal_tokens="auto" for FACTOR x Stage 1's quiet time (STAGE1_SECONDS)
        settings.update(heal_tokens="auto", stage1_factor=float(times))
    else:
        settings["heal_tokens"] = int(budget)
    for option in options:
        key, _, value = option.partition("=")
        if key == "lr":
            settings["heal_lr"] = float(value)
        elif key == "topk" and value.isdigit():
            settings["top_k"] = int(value)
        elif key == "rank" and value.isdigit():
            settings["heal_lora_rank"] = int(value)
        elif key == "text" and value in HEAL_TEXTS:
            settings["heal_dataset"] = HEAL_TEXTS[value]
        elif key == "temp":
            settings["heal_temperature"] = float(value)
        elif key == "loss" and value in HEAL_LOSS_CHOICES:
            settings["heal_loss"] = value
        elif key == "from" and value in ("stage1", "default"):
            settings["start"] = value
        else:
            raise SystemExit(
                f"unknown option {option!r} in {name!r}: lr=VALUE, topk=K, rank=R, text={'|'.join(HEAL_TEXTS)}, "
                f"temp=T, loss={'|'.join(HEAL_LOSS_CHOICES)} or from=stage1"
            )
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


def compact(zero_shot: ZeroShotResult) -> dict[str, dict]:
    """Every question's id, right/wrong, choice, margin (its log-likelihood of the chosen answer minus the next
    best, 4 decimals; `None` without two log-likelihoods) and every answer's log-likelihood (4 decimals), per task:
    enough to pair two rows, count flips, split them by the dense row's margins and measure the answers' drift."""
    return {
        task.task: {
            "doc_ids": [q.doc_id for q in task.questions],
            "acc": "".join(str(q.acc) for q in task.questions),
            "choice": [q.choice for q in task.questions],
            "margin": [None if (margin := question_margin(q)) is None else round(margin, 4) for q in task.questions],
            "loglikelihoods": [[round(value, 4) for value in q.loglikelihoods] for q in task.questions],
        }
        for task in zero_shot.tasks
    }


def answer_drift(answers: dict[str, dict], dense_answers: dict[str, dict], skip: tuple[str, ...] = ()) -> float | None:
    """How far the model's answer log-likelihoods moved from the dense model's, relative to each other: per question,
    the root mean square over its answers of the difference of the two models' centred log-likelihoods (each less its
    mean over the question's answers: what decides the choice, and a flip, is their differences), averaged over the
    questions both rows scored (nats). `None` where either row lacks the log-likelihoods (rows before this column)."""
    drifts: list[float] = []
    for task, kept in answers.items():
        dense_kept = dense_answers.get(task) or {}
        if task in skip or "loglikelihoods" not in kept or "loglikelihoods" not in dense_kept:
            continue
        dense_by_id = dict(zip(dense_kept["doc_ids"], dense_kept["loglikelihoods"]))
        for doc_id, values in zip(kept["doc_ids"], kept["loglikelihoods"]):
            reference = dense_by_id.get(doc_id)
            if reference is None or len(reference) != len(values) or len(values) < 2:
                continue
            mine, theirs = sum(values) / len(values), sum(reference) / len(reference)
            squares = [((a - mine) - (b - theirs)) ** 2 for a, b in zip(values, reference)]
            drifts.append(math.sqrt(sum(squares) / len(squares)))
    return sum(drifts) / len(drifts) if drifts else None


def answers_of(row: dict) -> dict | None:
    """The compact answers a row keeps, or `None` for a row without tasks."""
    return ((row.get("evaluation") or {}).get("zero_shot") or {}).get("answers")


def has_margins(row: dict) -> bool:
    """Whether the row's answers keep every question's margin (rows recorded before the margins do not)."""
    answers = answers_of(row)
    return bool(answers) and all(None not in kept.get("margin", [None]) for kept in answers.values())


def boolq_yes(answers: dict) -> float | None:
    """The share of BoolQ questions answered "yes" (lm-eval's answers are `["no", "yes"]`); `None` without BoolQ."""
    if "boolq" not in answers:
        return None
    return answer_shares(expand({"boolq": answers["boolq"]}), "boolq").get(1, 0.0)


def count_fidelity(row: dict, dense: dict) -> None:
    """The row's flips against the dense row, with BoolQ and without, from both rows' answers, and where the dense row
    keeps its margins, the flips on the confident questions (dense margin above its task's median): by `flips`."""
    mine, dense_answers = answers_of(row), answers_of(dense)
    for suffix, skip in (("", ()), ("_without_boolq", ("boolq",))):
        drift = answer_drift(mine, dense_answers, skip)
        if drift is not None:
            row["answer_drift" + suffix] = drift
        found = flips(expand(mine, skip), expand(dense_answers, skip))
        row["flips" + suffix] = asdict(found.pooled)
        if found.confident is not None:
            row["confident_flips" + suffix] = asdict(found.confident)


def recount(record: dict) -> None:
    """Counts again, from the answers the rows keep, every row's flips against the dense row (with the confident
    flips where the dense row keeps its margins) and its BoolQ "yes" share: rows measured
    before these columns get them, and every row follows a dense row measured again (`--redo dense`)."""
    dense = next((row for row in record["rows"] if row["variant"] == "dense"), None)
    for row in record["rows"]:
        answers = answers_of(row)
        if not answers:
            continue
        row["boolq_yes"] = boolq_yes(answers)
        if row["variant"] != "dense" and dense is not None and answers_of(dense):
            try:
                count_fidelity(row, dense)
            except InvalidInputError as error:  # other questions than the dense row's: its counts are left as they were
                print(f"{row['variant']}: flips not counted again: {error}", flush=True)


def write(record: dict, path: str) -> None:
    """Counts the record's flips again ([`recount`]) and writes it to `path`: the rows' answers kept packed, every
    question's margin and log-likelihoods only for the dense row (what the other rows are counted against; their own
    drift is counted before they are dropped)."""
    recount(record)
    kept = json.loads(json.dumps(record))
    for row in kept["rows"]:
        if row["variant"] != "dense":
            for answers in (answers_of(row) or {}).values():
                answers.pop("margin", None)
                answers.pop("loglikelihoods", None)
    records.write(path, kept)


def copied_dense_row(source: str, record: dict, max_segments: int) -> dict:
    """The `dense` row of another record of the same model and protocol, its provenance marked as a copy: the dense
    model's evaluation does not depend on the ratio or the selection."""
    other = records.read(os.path.join(RESULTS, source + ".json"))
    for earlier in (other, record):
        earlier.setdefault("device", "cpu")  # records from before `--device` ran on the CPU
    for key in ("model", "protocol", "subsets", "calibration_sha256", "device"):
        if other.get(key) != record.get(key):
            raise SystemExit(f"--dense-from {source}: its {key} ({other.get(key)!r}) is not this run's ({record.get(key)!r})")
    row = json.loads(json.dumps(next(row for row in other["rows"] if row["variant"] == "dense")))
    segments = {entry["num_segments"] for entry in row["evaluation"]["perplexities"]}
    if segments != {max_segments}:
        raise SystemExit(f"--dense-from {source}: its perplexities use {segments} segments, this run {max_segments}")
    row["provenance"]["copied_from"] = f"benchmarks/results/{source}.json (the same model, questions and segments)"
    return row


def print_pair(record: dict, variant_a: str, variant_b: str) -> None:
    """Prints `variant_b` against `variant_a`, paired per question ([`compare_zero_shot`] with the dense row as the
    reference): the accuracy difference, the flips' difference and that of the flips on the confident questions, each
    with its standard error and McNemar's p-value, with BoolQ and without."""
    rows = {row["variant"]: row for row in record["rows"]}
    missing = [name for name in ("dense", variant_a, variant_b) if name not in rows or not answers_of(rows[name])]
    if missing:
        raise SystemExit(f"--pair: no answers kept for {missing} in this record.")
    for label, skip in (("all tasks", ()), ("without BoolQ", ("boolq",))):
        comparison = compare_zero_shot(
            *(expand(answers_of(rows[name]), skip) for name in (variant_a, variant_b, "dense")),
            names=(variant_a, variant_b, "dense"),
        )
        print(f"{variant_b} - {variant_a}, {label}:")
        entries = [("accuracy", comparison.pooled), ("flips", comparison.pooled_flips)]
        entries += [("confident flips", comparison.confident_flips)] if comparison.confident_flips is not None else []
        for name, paired in entries:
            print(
                f"  {name}: {100 * paired.difference:+.2f} +/- {100 * paired.stderr:.2f} points, McNemar p = "
                f"{paired.p_value:.3f} ({paired.num_questions} questions)"
            )


def arguments() -> argparse.ArgumentParser:
    arguments = parser(__doc__)
    arguments.add_argument("--model", default="smollm2-135m")
    arguments.add_argument("--ratio", type=float, default=0.25)
    arguments.add_argument("--selection", default="gradmap")
    arguments.add_argument("--variants", nargs="+", default=["dense", "stage1", "default"])
    arguments.add_argument("--protocol", choices=list(PROTOCOLS), default="screening")
    arguments.add_argument("--no-tasks", action="store_true", help="perplexities and KL only")
    arguments.add_argument("--max-segments", type=int, default=128)
    arguments.add_argument("--num-samples", type=int, default=128)
    arguments.add_argument("--batch-size", type=int, default=8)
    arguments.add_argument("--label", default=None)
    arguments.add_argument("--dense-from", help="copy the `dense` row from this record (same model and protocol)")
    arguments.add_argument("--device", default="cpu", help="where the models run (a device but cpu: '-<device>' records)")
    arguments.add_argument("--time-stage1", action="store_true", help="time GradMAP's own Stage 1 on this device, once")
    arguments.add_argument("--resume", action="store_true")
    arguments.add_argument("--redo", nargs="+", default=[], metavar="VARIANT", help="with --resume, measure these again")
    arguments.add_argument("--recount-only", action="store_true", help="measure nothing: count the flips again")
    arguments.add_argument("--pair", nargs=2, metavar=("A", "B"), help="measure nothing: B against A, per question")
    return arguments


def new_record(args: argparse.Namespace, removed: list[int], layers_from: str) -> dict:
    return {
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


class HealRun:
    """One invocation's models: the dense model (every row's teacher, loaded once), the calibration set, and the pruned
    models the rows start from, Stage 1 and the default Stage 2 (or Stage 1 alone), each made once and put back to
    its weights for every row."""

    def __init__(self, args: argparse.Namespace, removed: list[int]):
        self.args, self.removed = args, removed
        self.dense, self.tokenizer = load_model(args.model)
        self.dense.to(args.device)
        self.calibration = calibration(self.tokenizer, args.num_samples)
        self.starts: dict[str, tuple] = {}  # "default" or "stage1" -> (its model, its result, its weights)

    def load(self) -> torch.nn.Module:
        model, _ = load_model(self.args.model)
        return model.to(self.args.device)

    def prune(self, layers: list[int], model: torch.nn.Module, compensation: bool = True):
        """`model` pruned in place: `layers` removed, then the default Stage 2 unless `compensation` is false."""
        config = GradMAPConfig(layers_to_prune=layers, num_samples=self.args.num_samples, compensation=compensation)
        return GradMAPPruner(config, model, self.tokenizer).prune(model, self.calibration)

    def time_stage1(self, record: dict) -> None:
        """GradMAP's own Stage 1 at this ratio on this device (`--time-stage1`), once per record."""
        args, started = self.args, provenance()
        config = GradMAPConfig(pruning_ratio=args.ratio, num_samples=args.num_samples, seq_len=128, compensation=False)
        result = GradMAPPruner(config, tokenizer=self.tokenizer, progress_bar=False).select_layers(self.load(), self.calibration)
        record["stage1_on_device"] = {
            "seconds": result.timings["stage1"],
            "removed_layers": result.removed_layers,
            "same_layers_as_cpu": sorted(result.removed_layers) == sorted(layers_of(args.model, args.ratio, "gradmap")[0]),
            "provenance": finish(started),
        }
        print(f"GradMAP's Stage 1 on {args.device}: {record['stage1_on_device']}", flush=True)

    def start(self, kind: str):
        """The model and result of Stage 1 + the default Stage 2 (`default`) or of Stage 1 alone (`stage1`), made the
        first time (Stage 1 + 2 always first) and put back to their weights every time."""
        if "default" not in self.starts:
            model = self.load()
            result = self.prune(self.removed, model)
            self.starts["default"] = (model, result, {name: tensor.clone() for name, tensor in model.state_dict().items()})
        if kind not in self.starts:
            result = GradMAPPruner(
                GradMAPConfig(layers_to_prune=self.removed, num_samples=self.args.num_samples, compensation=False),
                tokenizer=self.tokenizer,
            ).prune(self.load(), self.calibration)
            self.starts[kind] = (
                result.model,
                result,
                {name: tensor.clone() for name, tensor in result.model.state_dict().items()},
            )
        model, result, state = self.starts[kind]
        model.load_state_dict(state)
        return model, result

    def model_of(self, variant: str, row: dict) -> torch.nn.Module:
        """The model a row evaluates, healed where the variant says so; its timings and what it trained in `row`."""
        if variant == "dense":
            return self.dense
        if variant == "stage1":
            model = self.load()
            row["timings"] = self.prune(self.removed, model, compensation=False).timings
            return model
        settings = parse_variant(variant)
        model, start = self.start("default")
        row["timings"], row["compensated_layers"] = dict(start.timings), start.compensated_layers
        if settings is not None and settings.get("start") == "stage1":  # the heal on Stage 1 alone
            model, start = self.start("stage1")
            row["timings"], row["compensated_layers"] = dict(start.timings), []
        if settings is not None:
            self.heal(model, start, settings, row)
        return model

    def heal(self, model: torch.nn.Module, start, settings: dict, row: dict) -> None:
        """The heal of `model` (Stage 1 + 2, or Stage 1 alone) from `start`'s result, the dense model as teacher."""
        top_k, factor = settings.pop("top_k", None), settings.pop("stage1_factor", None)
        settings.pop("start", None)
        stage1_seconds = factor * STAGE1_SECONDS[(self.args.model, self.args.ratio)] if factor else None
        config = dataclasses.replace(start.config, **settings)
        with teacher_top_k(top_k), tempfile.TemporaryDirectory() as scratch:  # the text generated afresh, timed
            healed = heal_stage(
                model,
                lambda: contextlib.nullcontext(self.dense),
                HealSettings.from_config(config),
                self.tokenizer,
                PrunedLayout(start.kept_layers, start.original_num_layers, start.compensated_layers),
                stage1_seconds=stage1_seconds,
                text_cache=os.path.join(scratch, "text.pt"),
                prompt_data=CALIBRATION,
            )
        row["heal"] = healed.to_dict()
        row["heal"]["stage1_factor"] = factor
        row["heal"]["teacher_top_k"] = top_k or distillation.TOP_K
        row["timings"]["heal"] = healed.seconds

    def evaluate(self, variant: str, model: torch.nn.Module, row: dict, rows: dict[str, dict]) -> None:
        """The row's held-out perplexities and KL, its tasks with every answer, and its paired accuracy against the
        `stage1` and `default` rows."""
        args, tick = self.args, time.perf_counter()
        evaluation = evaluate(
            model,
            self.tokenizer,
            HELD_OUT,
            segment_length=128,
            max_segments=args.max_segments,
            tasks=() if args.no_tasks else PAPER_TASKS,
            task_subsets=PROTOCOLS[args.protocol],
            task_data="offline",
            batch_size=args.batch_size,
            model_name=variant,
            progress_bar=False,
            reference_model=None if variant == "dense" else self.dense,
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
        if evaluation.zero_shot is None or "dense" not in rows or variant == "dense":
            return
        mine = summary["zero_shot"]["answers"]
        count_fidelity(row, rows["dense"])
        for key, other in (("against_stage1", "stage1"), ("against_default", "default")):
            if other in rows and other != variant:
                theirs = rows[other]["evaluation"]["zero_shot"]["answers"]
                row[key] = asdict(compare_zero_shot(expand(theirs), expand(mine), names=(other, variant, "dense")).pooled)
                row[key + "_without_boolq"] = asdict(
                    compare_zero_shot(expand(theirs, ("boolq",)), expand(mine, ("boolq",))).pooled
                )


def put(record: dict, row: dict) -> None:
    """Adds the row to the record, in place of the row of the same variant (`--redo`)."""
    index = next((i for i, old in enumerate(record["rows"]) if old["variant"] == row["variant"]), None)
    if index is None:
        record["rows"].append(row)
    else:
        record["rows"][index] = row


def main() -> None:
    args = arguments().parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.manual_seed(0)
    removed, layers_from = layers_of(args.model, args.ratio, args.selection)
    suffix = ("-notasks" if args.no_tasks else "") + ("" if args.device == "cpu" else f"-{args.device}")
    name = f"heal-{args.model}-{args.ratio:g}-{args.selection}-{args.protocol}{suffix}" + (f"-{args.label}" if args.label else "")
    path = os.path.join(RESULTS, name + ".json")
    if args.recount_only:
        write(records.read(path), path)
        print(f"counted again, nothing measured: {path}", flush=True)
        return
    if args.pair:
        print_pair(records.read(path), *args.pair)
        return
    record = records.read(path) if args.resume and os.path.exists(path) else new_record(args, removed, layers_from)
    done = {row["variant"] for row in record["rows"]} - set(args.redo)
    variants = [*args.variants, *(variant for variant in args.redo if variant not in args.variants)]
    variants.sort(key=lambda variant: variant != "dense")  # the dense row first: the others' flips count against it
    old_dense = next((row for row in record["rows"] if row["variant"] == "dense"), None)
    if old_dense is not None and "dense" in done and answers_of(old_dense) and not has_margins(old_dense):
        print(MISSING_MARGINS, flush=True)
    run = HealRun(args, removed)
    record["calibration_sha256"] = calibration_sha256(run.calibration)
    if args.time_stage1 and "stage1_on_device" not in record:
        run.time_stage1(record)
        write(record, path)
    for variant in variants:
        if variant in done:
            print(f"{variant}: already measured, kept")
            continue
        if variant == "dense" and args.dense_from:
            put(record, copied_dense_row(args.dense_from, record, args.max_segments))
            write(record, path)
            print(f"dense: copied from {args.dense_from}", flush=True)
            continue
        started, row = provenance(), {"variant": variant}
        model = run.model_of(variant, row)
        run.evaluate(variant, model, row, {row["variant"]: row for row in record["rows"]})
        row["provenance"] = finish(started)
        put(record, row)
        write(record, path)
        print(f"{variant}: saved to {path}", flush=True)


if __name__ == "__main__":
    main()
