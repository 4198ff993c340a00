"""Stage 2 variants side by side (the paper's Table 4 on our models): for every selection method already
measured by benchmarks/compare.py, the same removed layers, compensated by each Stage 2 variant, with the
same calibration set and evaluation protocol as compare.py.

    python benchmarks/stage2.py --model smollm2-135m --ratio 0.25 --variants paper auto span_end+auto
    python benchmarks/stage2.py --model smollm2-135m --ratio 0.25 --variants auto --methods gradmap sleb --resume

The Stage 1 rows (no Stage 2), and the paper's Stage 2 rows unless `paper` is asked for, are copied from
compare-<model>-<ratio>.json, which must exist with the same
settings; its calibration SHA-256 is checked against the one rebuilt here. Variants:

- `paper`: the paper's Stage 2 (largest-drift layer, full d x d W', closed form, lambda 1e-3);
- changes to it, joined by `+` (e.g. `span_end+auto+mixed`): `auto`, lambda by cross-validation
  (`reg_lambda="auto"`), identity when nothing beats it; `span_end`, the layer before each removed run,
  fitted to the run's dense end; `mixed`, fitted on Wikipedia and web text in equal parts
  (`offline:wikipedia+offline:web_text`; Stage 1's layers stay compare.py's).

Writes benchmarks/results/stage2-<model>-<ratio>.json; with `--resume`, rows already there are kept.
Every row measured here carries its provenance (`benchmarks/provenance.py`); a copied row, `copied_from`.
"""

from __future__ import annotations

import argparse
import copy
import os

import records
from common import CALIBRATION, RESULTS, commanded_record, comparison_settings, held_out, log_rounds, parser
from provenance import finish, mark_copy, provenance
from rendering.stage2 import copied_from

from optimum_gradmap import GradMAPConfig, GradMAPPruner
from optimum_gradmap.assets import MODEL_ASSETS, load_model
from optimum_gradmap.configuration import PAPER_STAGE2
from optimum_gradmap.data import calibration_sha256

# A variant is "paper" or "+"-joined changes to it (e.g. "span_end+auto+mixed"); "mixed": Stage 2 fitted on
# Wikipedia and web text in equal parts (the web pages' calibration half), the same number of sequences.
CHANGES = {"auto": {"reg_lambda": "auto"}, "span_end": {"compensation_target": "span_end"}, "mixed": {}}
MIXED_CALIBRATION = "offline:wikipedia+offline:web_text"


def parse_variant(name: str) -> tuple[dict, str]:
    """The Stage 2 settings of a variant (the paper's, `PAPER_STAGE2`, with the changes applied, whatever the
    library's defaults are), and the calibration text Stage 2 fits on."""
    changes = [] if name == "paper" else name.split("+")
    unknown = [change for change in changes if change not in CHANGES]
    if unknown or len(set(changes)) != len(changes):
        raise SystemExit(f"unknown variant {name!r}: 'paper' or '+'-joined changes from {list(CHANGES)}")
    overrides = {**PAPER_STAGE2, **{key: value for change in changes for key, value in CHANGES[change].items()}}
    return overrides, MIXED_CALIBRATION if "mixed" in changes else CALIBRATION


def arguments() -> argparse.ArgumentParser:
    arguments = parser(__doc__)
    arguments.add_argument("--model", default="smollm2-135m", choices=sorted(MODEL_ASSETS), help="offline model asset")
    arguments.add_argument("--ratio", type=float, default=0.25, help="pruning ratio of the compare.py run (default 0.25)")
    arguments.add_argument("--variants", nargs="+", default=["paper", "auto", "span_end+auto"], help="Stage 2 variants")
    arguments.add_argument("--methods", nargs="+", default=None, help="selection methods (default: every one in compare)")
    arguments.add_argument("--task-limit", type=int, default=50, help="questions per zero-shot task (default 50; 0: none)")
    arguments.add_argument("--max-eval-segments", type=int, default=128, help="perplexity segments per dataset (default 128)")
    arguments.add_argument("--num-samples", type=int, default=128, help="calibration sequences (default 128)")
    arguments.add_argument("--output-dir", default=RESULTS)
    arguments.add_argument("--compare-dir", default=RESULTS)
    arguments.add_argument("--resume", action="store_true", help="keep the rows already in the JSON, run the others")
    return arguments


def start_record(args: argparse.Namespace, compare: dict, methods: list[str], prefix: str) -> dict:
    """A new record, or with `--resume` the record at `prefix`.json (the same settings), this command added."""
    settings = comparison_settings(args)
    same_text = {key: value for key, value in settings.items() if key != "task_limit"}
    if {key: compare["settings"][key] for key in same_text} != same_text:
        raise SystemExit(f"compare.py ran with other settings: {compare['settings']}, asked {settings}")
    command = (
        f"python benchmarks/stage2.py --model {args.model} --ratio {args.ratio} --variants {' '.join(args.variants)} "
        f"--methods {' '.join(methods)} --task-limit {args.task_limit} --max-eval-segments {args.max_eval_segments} "
        f"--num-samples {args.num_samples}"
    )
    fields = {"calibration_sha256": compare["calibration_sha256"], "stage1_rows_from": f"compare-{args.model}-{args.ratio}.json"}
    return commanded_record(f"{prefix}.json", args.resume, command, settings, fields)


def copy_compare_rows(args: argparse.Namespace, record: dict, compare: dict, methods: list[str]) -> None:
    """The Stage 1 rows (no Stage 2) of compare.py's record, and its paper's Stage 2 rows unless `paper` is asked for
    (the same protocol), each marked as a copy; with another question limit, the zero-shot figures are left out."""
    same_tasks = compare["settings"]["task_limit"] == args.task_limit
    stage1_rows = {row["method"]: row for row in compare["rows"] if not row["stage2"]}
    paper_rows = {row["method"]: row for row in compare["rows"] if row["stage2"]}
    done = {(row["method"], row["variant"]) for row in record["rows"]}
    for method in ["dense", *methods]:
        if (method, "none") not in done:
            stage1 = stage1_rows[method]
            evaluation = dict(stage1["evaluation"])
            if not same_tasks:  # another question limit: its zero-shot figures do not compare
                evaluation["zero_shot"] = None
            row = {"method": method, "variant": "none", "removed_layers": stage1["removed_layers"], "evaluation": evaluation}
            record["rows"].append(mark_copy(row, f"COPY of compare-{args.model}-{args.ratio}.json ({method}, Stage 1 only)"))
        if method in paper_rows and (method, "paper") not in done and "paper" not in args.variants and same_tasks:
            paper = paper_rows[method]  # the paper's Stage 2 as compare.py measured it, same protocol
            record["rows"].append(
                {
                    "method": method,
                    "variant": "paper",
                    "removed_layers": paper["removed_layers"],
                    "compensated_layers": paper.get("compensated_layers", []),
                    "stage2_seconds": paper["stage2_seconds"],
                    "evaluation": paper["evaluation"],
                    "copied_from": f"COPY of compare-{args.model}-{args.ratio}.json ({method}, the paper's Stage 2)",
                }
            )


def copy_twins(record: dict, method: str, removed: list[int], todo: list[str]) -> list[str]:
    """Copies, for each variant of `todo`, a measured row of another method with the same removed layers (the same
    pruned model); returns the variants left to measure."""
    left = []
    for variant in todo:
        twin = next(
            (
                row
                for row in record["rows"]
                if row["variant"] == variant
                and copied_from(row, record) is None
                and row["method"] != method
                and sorted(row["removed_layers"]) == sorted(removed)
            ),
            None,
        )
        if twin is None:
            left.append(variant)
            continue
        copy_of = f"COPY of the {twin['method']} row (same removed layers, same model)"
        record["rows"].append(mark_copy({**twin, "method": method, "removed_layers": removed}, copy_of))
    return left


def variant_row(args, method: str, removed: list[int], variant: str, pruner, result, model, tokenizer) -> dict:
    """One Stage 2 variant fitted on the Stage 1 model of `result`, evaluated."""
    overrides, _ = parse_variant(variant)
    started = provenance()
    pruner.compensate(result, **overrides)
    evaluation = held_out(model, tokenizer, f"{method} + Stage 2 {variant}", args.max_eval_segments, args.task_limit)
    return {
        "method": method,
        "variant": variant,
        "removed_layers": removed,
        "compensated_layers": result.compensated_layers,
        "compensation_targets": {str(k): v for k, v in result.compensation.targets.items()},
        "compensation_lambda": {str(k): v for k, v in result.compensation.reg_lambda.items()},
        "uncompensated_layers": {str(k): v for k, v in result.compensation.skipped_layers.items()},
        "compensation_validation": result.compensation.validation,
        "stage2_seconds": result.timings["stage2"],
        "evaluation": evaluation,
        "provenance": finish(started),
    }


def main() -> None:
    args = arguments().parse_args()
    for name in args.variants:
        parse_variant(name)
    log_rounds()
    compare = records.read(os.path.join(args.compare_dir, f"compare-{args.model}-{args.ratio}.json"))
    stage1_rows = {row["method"]: row for row in compare["rows"] if not row["stage2"]}
    methods = args.methods or [method for method in stage1_rows if method != "dense"]
    os.makedirs(args.output_dir, exist_ok=True)
    path = os.path.join(args.output_dir, f"stage2-{args.model}-{args.ratio}.json")
    record = start_record(args, compare, methods, path[: -len(".json")])
    dense, tokenizer = load_model(args.model)
    done = {(row["method"], row["variant"]) for row in record["rows"]}
    copy_compare_rows(args, record, compare, methods)
    records.write(path, record)
    for method in methods:
        removed = stage1_rows[method]["removed_layers"]
        todo = copy_twins(record, method, removed, [variant for variant in args.variants if (method, variant) not in done])
        records.write(path, record)
        by_calibration: dict[str, list[str]] = {}  # one Stage 1 replay per calibration text
        for variant in todo:
            by_calibration.setdefault(parse_variant(variant)[1], []).append(variant)
        for text, variants in by_calibration.items():
            model = copy.deepcopy(dense)
            config = GradMAPConfig(layers_to_prune=removed, num_samples=args.num_samples)
            pruner = GradMAPPruner(config, tokenizer=tokenizer, progress_bar=False)
            result = pruner.select_layers(model, text)
            if text == CALIBRATION and calibration_sha256(result.calibration_ids) != compare["calibration_sha256"]:
                raise SystemExit("the calibration set differs from the one compare.py used")
            for variant in variants:
                row = variant_row(args, method, removed, variant, pruner, result, model, tokenizer)
                record["rows"].append(row)
                records.write(path, record)
                print(f"{method} + {variant}: {row['evaluation']['perplexities']}", flush=True)
            del model, pruner, result
    print(f"saved {path}")


if __name__ == "__main__":
    main()
