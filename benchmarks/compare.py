"""Layer-pruning methods side by side: every importance metric, with and without GradMAP's Stage 2,
on the same model, ratio and calibration set (the paper's: 128 random sequences of 128 tokens of
the calibration Wikipedia articles).

For each metric: Stage 1 on a fresh copy of the dense model, evaluation, the paper's Stage 2 on that
pruned model (`PAPER_STAGE2`: largest-drift layer, lambda 1e-3; benchmarks/stage2.py compares the other
Stage 2 variants on the same layers), evaluation again. Each row reports the removed layers, held-out perplexities (Wikipedia and
web text, 128-token protocol), the zero-shot average (stated sample limit) and the time of each
stage. Also plots which layers each method removed and the per-layer drift (Eq. 10) after Stage 1.

    python benchmarks/compare.py --model smollm2-135m --ratio 0.25
    python benchmarks/compare.py --model smollm2-135m --ratio 0.25 --metrics gradmap block_influence --task-limit 50
    python benchmarks/compare.py --model smollm2-135m --ratio 0.25 --metrics gradmap_bound+top4 --resume

A method is a metric name, optionally with a verified shortlist: `METRIC+topK` runs the metric with
`verify_top_k=K` (`METRIC+topK+halving` also sets `verify_halving=True`); `+each_round` adds
`compensate_each_round=True` (Prune&Comp's fit between removals, with the default Stage 2 settings; the
"Stage 2" rows then add the paper's fit on top).

Writes benchmarks/results/compare-<model>-<ratio>.json and compare-<model>-<ratio>-{layers,drift}.png.
With `--resume`, methods already in that JSON are kept (the dense row too) and only the others run,
so a long comparison can be split over several invocations; the settings must match, and the
calibration set is checked to be the same one (by its SHA-256). Stage 1 saves its progress after
every round in compare-<model>-<ratio>-<metric>-stage1.json (deleted once the method's rows are
written); `--resume` goes on from there, so a stopped iterative run (SLEB) loses at most one round.
Every row carries its provenance (`benchmarks/provenance.py`).
"""

from __future__ import annotations

import argparse
import copy
import os

import records
from common import CALIBRATION, RESULTS, commanded_record, comparison_settings, held_out, log_rounds, parser
from provenance import finish, provenance

from optimum_gradmap import GradMAPConfig, GradMAPPruner
from optimum_gradmap.assets import MODEL_ASSETS, load_model
from optimum_gradmap.configuration import PAPER_STAGE2
from optimum_gradmap.data import calibration_sha256
from optimum_gradmap.importance import IMPORTANCE_METRICS, importance_metric_names


def parse_method(method: str) -> tuple[str, dict]:
    """A method name -> its metric and the Stage 1 settings it changes: `"gradmap_bound+top4"` ->
    `("gradmap_bound", {"verify_top_k": 4})`, `"gradmap+each_round"` -> `("gradmap", {"compensate_each_round": True})`,
    `"gradmap_bound+top8+halving"` -> `("gradmap_bound", {"verify_top_k": 8, "verify_halving": True})`."""
    metric, *changes = method.split("+")
    settings: dict = {}
    for change in changes:
        if change.startswith("top") and change[3:].isdigit():
            settings["verify_top_k"] = int(change[3:])
        elif change == "each_round":
            settings["compensate_each_round"] = True
        elif change == "halving":
            settings["verify_halving"] = True
        else:
            metric = None
    halving_alone = "verify_halving" in settings and "verify_top_k" not in settings
    if metric not in IMPORTANCE_METRICS or len(settings) != len(changes) or halving_alone:
        raise argparse.ArgumentTypeError(
            f"{method!r}: give a metric ({', '.join(importance_metric_names())}), then optionally +topK, +halving, +each_round"
        )
    return metric, settings


def removes_one_per_round(method: str) -> bool:
    """Whether the removal order means something (re-scored, or verified, after each removal)."""
    metric, settings = parse_method(method)
    return IMPORTANCE_METRICS[metric].iterative or "verify_top_k" in settings


def plot(record: dict, prefix: str) -> list[str]:
    """Which layers each method removed, and the per-layer drift after its Stage 1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    num_layers = record["num_layers"]
    pruned = [row for row in record["rows"] if row["method"] != "dense" and not row["stage2"]]
    figure, axis = plt.subplots(figsize=(max(6, num_layers * 0.3), 0.5 * len(pruned) + 1.2))
    for position, row in enumerate(pruned):
        for order, index in enumerate(row["removed_layers"]):
            axis.scatter(index, position, s=120, color="tab:red", marker="s")
            if removes_one_per_round(row["method"]):  # re-scored or verified after each removal: the order means something
                axis.annotate(str(order + 1), (index, position), ha="center", va="center", fontsize=7, color="white")
    axis.set_yticks(range(len(pruned)), [row["method"] for row in pruned])
    axis.set_xticks(range(num_layers))
    axis.set_xlim(-0.5, num_layers - 0.5)
    axis.set_xlabel("layer index (dense model)")
    axis.set_title(
        f"Layers removed from {record['settings']['model']} at {record['settings']['ratio']:.0%}\n"
        "(numbers: removal order, for the iterative methods)",
        fontsize=10,
    )
    axis.grid(axis="x", alpha=0.3)
    figure.tight_layout()
    layers_path = f"{prefix}-layers.png"
    figure.savefig(layers_path, dpi=120)
    plt.close(figure)

    figure, axis = plt.subplots(figsize=(8, 4))
    for row in pruned:
        drift = {int(index): value for index, value in row["drift"].items() if value > 0}
        if drift:
            indices = sorted(drift)
            axis.plot(indices, [drift[index] for index in indices], marker="o", markersize=3, label=row["method"])
    axis.set_xlabel("kept layer index (dense model)")
    axis.set_ylabel("mean drift ||mean H - mean H'|| (Eq. 10)")
    axis.set_yscale("log")
    axis.set_title(
        f"Drift of each kept layer after Stage 1, {record['settings']['model']} at {record['settings']['ratio']:.0%}\n"
        "(layers before the first removed one do not drift and are not drawn)",
        fontsize=10,
    )
    axis.legend(fontsize=8)
    figure.tight_layout()
    drift_path = f"{prefix}-drift.png"
    figure.savefig(drift_path, dpi=120)
    plt.close(figure)
    return [layers_path, drift_path]


def arguments() -> argparse.ArgumentParser:
    arguments = parser(__doc__)
    arguments.add_argument("--model", default="smollm2-135m", choices=sorted(MODEL_ASSETS), help="offline model asset")
    arguments.add_argument("--ratio", type=float, default=0.25, help="pruning ratio (default 0.25)")
    methods = "methods: metric names, or METRIC+topK for a verified shortlist of K (default: every metric)"
    arguments.add_argument("--metrics", nargs="+", default=importance_metric_names(), help=methods)
    arguments.add_argument("--task-limit", type=int, default=100, help="questions per zero-shot task (default 100; 0: no tasks)")
    arguments.add_argument("--max-eval-segments", type=int, default=128, help="perplexity segments per dataset (default 128)")
    arguments.add_argument("--num-samples", type=int, default=128, help="calibration sequences (default 128, as in the paper)")
    arguments.add_argument("--output-dir", default=RESULTS)
    arguments.add_argument("--resume", action="store_true", help="keep the methods already in the JSON, run the others")
    return arguments


def start_record(args: argparse.Namespace, prefix: str, num_layers: int) -> dict:
    """A new record, or with `--resume` the record at `prefix`.json (the same settings), this command added."""
    command = (
        f"python benchmarks/compare.py --model {args.model} --ratio {args.ratio} --metrics {' '.join(args.metrics)} "
        f"--task-limit {args.task_limit} --max-eval-segments {args.max_eval_segments} --num-samples {args.num_samples}"
    )
    fields = {
        "num_layers": num_layers,
        "calibration": f"{args.num_samples} x 128 tokens of the calibration Wikipedia articles, seed 0, for every method",
    }
    return commanded_record(f"{prefix}.json", args.resume, command, comparison_settings(args), fields)


def method_rows(args: argparse.Namespace, record: dict, prefix: str, dense, tokenizer, metric: str) -> None:
    """The two rows of one method: Stage 1 on a fresh copy of the dense model, evaluated, then the paper's Stage 2 on
    it, evaluated again."""
    started = provenance()  # both rows of the method: the Stage 2 row reports Stage 1's figures too
    model = copy.deepcopy(dense)
    importance, stage1_settings = parse_method(metric)
    config = GradMAPConfig(pruning_ratio=args.ratio, importance=importance, num_samples=args.num_samples, **stage1_settings)
    pruner = GradMAPPruner(config, tokenizer=tokenizer, progress_bar=False)
    stage1_checkpoint = f"{prefix}-{metric}-stage1.json"
    if not args.resume and os.path.exists(stage1_checkpoint):
        os.remove(stage1_checkpoint)  # a fresh comparison starts Stage 1 from scratch
    result = pruner.select_layers(model, CALIBRATION, stage1_checkpoint=stage1_checkpoint)
    calibration = calibration_sha256(result.calibration_ids)
    record.setdefault("calibration_sha256", calibration)
    assert record["calibration_sha256"] == calibration, "every method must see the same calibration set"
    stage1 = {"method": metric, "removed_layers": result.removed_layers, "stage1_seconds": result.timings["stage1"]}
    if "stage1_resumed" in result.timings:  # part of Stage 1 ran in an earlier invocation
        stage1["stage1_seconds_in_earlier_invocations"] = result.timings["stage1_resumed"]
    stage1_evaluation = held_out(model, tokenizer, metric, args.max_eval_segments, args.task_limit)
    stage1_origin = finish(started)
    pruner.compensate(result, **PAPER_STAGE2)  # the paper's Stage 2 for every row, whatever the defaults
    drift = {str(index): value for index, value in result.compensation.drift.items()}
    record["rows"].append(
        {
            **stage1,
            "stage2": False,
            "stage2_seconds": None,
            "drift": drift,
            "evaluation": stage1_evaluation,
            "provenance": stage1_origin,
        }
    )
    stage2_evaluation = held_out(model, tokenizer, f"{metric} + Stage 2", args.max_eval_segments, args.task_limit)
    record["rows"].append(
        {
            **stage1,
            "stage2": True,
            "stage2_seconds": result.timings["stage2"],
            "compensated_layers": result.compensated_layers,
            "drift": drift,
            "evaluation": stage2_evaluation,
            "provenance": finish(started),
        }
    )
    os.remove(stage1_checkpoint)


def main() -> None:
    args = arguments().parse_args()
    for method in args.metrics:
        parse_method(method)
    log_rounds()
    dense, tokenizer = load_model(args.model)
    os.makedirs(args.output_dir, exist_ok=True)
    prefix = os.path.join(args.output_dir, f"compare-{args.model}-{args.ratio}")
    record = start_record(args, prefix, dense.config.num_hidden_layers)
    done = {row["method"] for row in record["rows"]}
    if "dense" not in done:
        dense_row = {"method": "dense", "stage2": False, "removed_layers": [], "stage1_seconds": None, "stage2_seconds": None}
        started = provenance()
        evaluation = held_out(dense, tokenizer, "dense", args.max_eval_segments, args.task_limit)
        record["rows"].append({**dense_row, "drift": {}, "evaluation": evaluation, "provenance": finish(started)})
        records.write(f"{prefix}.json", record)
    for metric in args.metrics:
        if metric in done:
            print(f"{metric}: already in {prefix}.json, kept", flush=True)
            continue
        method_rows(args, record, prefix, dense, tokenizer, metric)
        records.write(f"{prefix}.json", record)
        for row in record["rows"][-2:]:
            print(f"{metric}, Stage 2 {row['stage2']}: removed {row['removed_layers']}, {row['evaluation']['perplexities']}")
    record["plots"] = plot(record, prefix)
    records.write(f"{prefix}.json", record)
    print(f"saved {prefix}.json and the plots")


if __name__ == "__main__":
    main()
