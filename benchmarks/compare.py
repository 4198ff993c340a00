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
import itertools
import logging
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import records  # noqa: E402
from provenance import finish, provenance  # noqa: E402

from optimum_gradmap import GradMAPConfig, GradMAPPruner  # noqa: E402
from optimum_gradmap.assets import MODEL_ASSETS, load_model  # noqa: E402
from optimum_gradmap.configuration import PAPER_STAGE2  # noqa: E402
from optimum_gradmap.data import calibration_sha256  # noqa: E402
from optimum_gradmap.evaluation import PAPER_TASKS, evaluate  # noqa: E402
from optimum_gradmap.importance import IMPORTANCE_METRICS, importance_metric_names  # noqa: E402


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


def measure_held_out(model, tokenizer, label: str, max_eval_segments: int, task_limit: int) -> dict:
    """The comparison's evaluation protocol: perplexity on the first `max_eval_segments` held-out
    128-token segments of Wikipedia and of web text, and the seven zero-shot tasks with `task_limit`
    questions each (none with 0), offline; with the seconds it took."""
    started = time.perf_counter()
    evaluation = evaluate(
        model,
        tokenizer,
        ("offline:wikipedia", "offline:web_text"),
        segment_length=128,
        max_segments=max_eval_segments,
        tasks=PAPER_TASKS if task_limit > 0 else (),
        task_limit=task_limit or None,
        task_data="offline",
        model_name=label,
        progress_bar=False,
    ).to_dict()
    evaluation["seconds"] = time.perf_counter() - started
    return evaluation


def markdown(record: dict) -> str:
    """The comparison as a Markdown table."""
    rows = record["rows"]
    datasets = [entry["dataset"] for entry in rows[0]["evaluation"]["perplexities"]]
    header = ["method", "Stage 2", "removed layers", *[f"{name} ppl" for name in datasets], "zero-shot avg"]
    header += ["Stage 1 s", "Stage 2 s"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        evaluation = row["evaluation"]
        zero_shot = evaluation["zero_shot"]
        cells = [
            row["method"],
            "yes" if row["stage2"] else "no",
            " ".join(str(index) for index in row["removed_layers"]) or "-",
            *[f"{entry['perplexity']:.2f}" for entry in evaluation["perplexities"]],
            f"{zero_shot['average_acc']:.4f}" if zero_shot else "-",
            f"{row['stage1_seconds']:.1f}" if row["stage1_seconds"] is not None else "-",
            f"{row['stage2_seconds']:.1f}" if row["stage2_seconds"] is not None else "-",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", choices=sorted(MODEL_ASSETS), help="offline model asset")
    parser.add_argument("--ratio", type=float, default=0.25, help="pruning ratio (default 0.25)")
    parser.add_argument(
        "--metrics",
        nargs="+",
        default=importance_metric_names(),
        help="methods: metric names, or METRIC+topK for a verified shortlist of K (default: every metric)",
    )
    parser.add_argument("--task-limit", type=int, default=100, help="questions per zero-shot task (default 100; 0: no tasks)")
    parser.add_argument("--max-eval-segments", type=int, default=128, help="perplexity segments per dataset (default 128)")
    parser.add_argument("--num-samples", type=int, default=128, help="calibration sequences (default 128, as in the paper)")
    parser.add_argument("--output-dir", default=os.path.join(os.path.dirname(__file__), "results"))
    parser.add_argument("--resume", action="store_true", help="keep the methods already in the JSON, run the others")
    parser.add_argument(
        "--save-checkpoints", default=None, help="save each method's final checkpoint (with report) under this folder"
    )
    args = parser.parse_args()
    for method in args.metrics:
        parse_method(method)
    logging.basicConfig(format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("optimum_gradmap").setLevel(logging.INFO)  # one line per Stage 1 round

    dense, tokenizer = load_model(args.model)

    def measure(model, label):
        return measure_held_out(model, tokenizer, label, args.max_eval_segments, args.task_limit)

    command = (
        f"python benchmarks/compare.py --model {args.model} --ratio {args.ratio} --metrics {' '.join(args.metrics)} "
        f"--task-limit {args.task_limit} --max-eval-segments {args.max_eval_segments} --num-samples {args.num_samples}"
    )
    settings = {
        "model": args.model,
        "ratio": args.ratio,
        "task_limit": args.task_limit,
        "max_eval_segments": args.max_eval_segments,
        "num_samples": args.num_samples,
    }
    os.makedirs(args.output_dir, exist_ok=True)
    prefix = os.path.join(args.output_dir, f"compare-{args.model}-{args.ratio}")
    if args.resume and os.path.exists(f"{prefix}.json"):
        record = records.read(f"{prefix}.json")
        different = {key: (record["settings"][key], value) for key, value in settings.items() if record["settings"][key] != value}
        if different:
            raise SystemExit(f"--resume: settings differ from {prefix}.json (saved, asked): {different}")
        record["commands"].append(command + " --resume")
    else:
        record = {
            "commands": [command],
            "settings": settings,
            "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(), "torch": torch.__version__},
            "num_layers": dense.config.num_hidden_layers,
            "calibration": f"{args.num_samples} x 128 tokens of the calibration Wikipedia articles, seed 0, for every method",
            "rows": [],
        }

    def save() -> None:
        records.write(f"{prefix}.json", record)

    done = {row["method"] for row in record["rows"]}
    if "dense" not in done:
        dense_row = {"method": "dense", "stage2": False, "removed_layers": [], "stage1_seconds": None, "stage2_seconds": None}
        started = provenance()
        evaluation = measure(dense, "dense")
        record["rows"].append({**dense_row, "drift": {}, "evaluation": evaluation, "provenance": finish(started)})
        save()
    for metric in args.metrics:
        if metric in done:
            print(f"{metric}: already in {prefix}.json, kept", flush=True)
            continue
        started = provenance()  # both rows of the method: the Stage 2 row reports Stage 1's figures too
        model = copy.deepcopy(dense)
        importance, stage1_settings = parse_method(metric)
        config = GradMAPConfig(pruning_ratio=args.ratio, importance=importance, num_samples=args.num_samples, **stage1_settings)
        pruner = GradMAPPruner(config, tokenizer=tokenizer, progress_bar=False)
        stage1_checkpoint = f"{prefix}-{metric}-stage1.json"
        if not args.resume and os.path.exists(stage1_checkpoint):
            os.remove(stage1_checkpoint)  # a fresh comparison starts Stage 1 from scratch
        result = pruner.select_layers(model, "offline:wikipedia", stage1_checkpoint=stage1_checkpoint)
        calibration = calibration_sha256(result.calibration_ids)
        record.setdefault("calibration_sha256", calibration)
        assert record["calibration_sha256"] == calibration, "every method must see the same calibration set"
        stage1 = {
            "method": metric,
            "removed_layers": result.removed_layers,
            "stage1_seconds": result.timings["stage1"],
        }
        if "stage1_resumed" in result.timings:  # part of Stage 1 ran in an earlier invocation
            stage1["stage1_seconds_in_earlier_invocations"] = result.timings["stage1_resumed"]
        stage1_evaluation = measure(model, metric)
        stage1_origin = finish(started)
        pruner.compensate(result, **PAPER_STAGE2)  # the paper's Stage 2 for every row, whatever the defaults
        drift = {str(index): value for index, value in result.compensation.drift.items()}
        summary = result.to_dict()  # every round's scores and, with a shortlist, the loss without each verified layer
        rounds = [
            {"scores": scores, "verified": verified}
            for scores, verified in itertools.zip_longest(summary["scores"], summary["verified"], fillvalue={})
        ]
        record["rows"].append(
            {
                **stage1,
                "stage2": False,
                "stage2_seconds": None,
                "stage1_rounds": rounds,
                "drift": drift,
                "evaluation": stage1_evaluation,
                "provenance": stage1_origin,
            }
        )
        stage2_evaluation = measure(model, f"{metric} + Stage 2")
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
        save()
        os.remove(stage1_checkpoint)
        print(markdown(record).splitlines()[-2:], flush=True)
        if args.save_checkpoints:
            asset = MODEL_ASSETS[args.model]
            folder = os.path.join(args.save_checkpoints, f"{args.model}-{metric}-{args.ratio}")
            pruner.save_pretrained(folder, base_model=asset.hub_id, license=asset.license)
        del model

    times = {row["method"]: row["stage1_seconds"] for row in record["rows"] if row["stage1_seconds"] is not None}
    if "gradmap" in times and "sleb" in times:
        record["sleb_over_gradmap_stage1_time"] = times["sleb"] / times["gradmap"]
    record["plots"] = plot(record, prefix)
    save()
    print(markdown(record))
    if "sleb_over_gradmap_stage1_time" in record:
        print(f"Stage 1 time, SLEB / GradMAP: {record['sleb_over_gradmap_stage1_time']:.2f}x")
    print(f"saved {prefix}.json and the plots")


if __name__ == "__main__":
    main()
