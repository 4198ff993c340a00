"""Pruning to a calibration-loss budget: the K each budget chooses, and the curve.

For each budget (a fraction: 0.1 is +10% over the dense model's calibration loss), one run of Stage 1 with
`max_loss_increase` and no K, on a fresh copy of the dense model, Stage 2 off (the budget decides Stage 1).
Each row: the K chosen, the layers, the loss curve, the removal refused, Stage 1 seconds, the held-out
perplexity on Wikipedia and web text, and provenance. The largest budget's curve is drawn (the report's
`loss_curve.png`) into `--picture`.

    python benchmarks/budget.py --model smollm2-135m --budgets 0.1 0.5 1.0 --num-samples 32 \
        --picture docs/images/budget-curve-smollm2-135m.png --resume

Writes benchmarks/results/budget-<model>-<importance>-<num samples>.json after every row.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from provenance import finish, provenance  # noqa: E402
from records import write  # noqa: E402
from stage1_peers import held_out, load_record  # noqa: E402

from optimum_gradmap import GradMAPConfig, GradMAPPruner  # noqa: E402
from optimum_gradmap.assets import MODEL_ASSETS, load_model  # noqa: E402
from optimum_gradmap.data import calibration_sha256  # noqa: E402
from optimum_gradmap.report import CURVE_PICTURE, build_report, write_pictures  # noqa: E402


def markdown(record: dict) -> str:
    settings = record["settings"]
    lines = [
        f"{settings['model']}, importance {settings['importance']}, {settings['num_samples']} x 128 calibration "
        f"(sha256 {record.get('calibration_sha256', '?')[:12]}), Stage 1 only; dense calibration loss "
        f"{record.get('dense_loss', float('nan')):.4f}, held-out perplexity {record.get('dense_perplexity')}",
        "",
        "| budget | K chosen | removed layers | loss after | refused | Stage 1 s | Wikipedia ppl | web ppl | quiet |",
        "|---|---:|---|---:|---|---:|---:|---:|---|",
    ]
    for row in record["rows"]:
        dense = row["dense_loss"]
        last = row["loss_curve"][-1] if row["loss_curve"] else dense
        refused = f"layer {row['rejected']['layer']} ({row['rejected']['loss'] / dense - 1:+.1%})" if row["rejected"] else "-"
        ppl = row["perplexity"]
        lines.append(
            f"| +{100 * row['budget']:g}% | {len(row['removed_layers'])} | {row['removed_layers']} | {last:.4f} "
            f"({last / dense - 1:+.1%}) | {refused} | {row['stage1_seconds']:.0f} | {ppl['offline:wikipedia']:.3f} | "
            f"{ppl['offline:web_text']:.3f} | {row['provenance']['quiet']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", choices=sorted(MODEL_ASSETS))
    parser.add_argument("--importance", default="gradmap")
    parser.add_argument("--budgets", nargs="+", type=float, default=[0.1, 0.5, 1.0])
    parser.add_argument("--num-samples", type=int, default=32)
    parser.add_argument("--max-eval-segments", type=int, default=128)
    parser.add_argument("--picture", default=None, help="where to copy the largest budget's curve picture")
    parser.add_argument("--output-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("optimum_gradmap").setLevel(logging.INFO)

    settings = {"model": args.model, "importance": args.importance, "num_samples": args.num_samples}
    os.makedirs(args.output_dir, exist_ok=True)
    path = os.path.join(args.output_dir, f"budget-{args.model}-{args.importance}-{args.num_samples}")
    record = load_record(path, settings, args.resume)

    def save() -> None:
        write(f"{path}.json", record)

    dense, tokenizer = load_model(args.model)
    if "dense_perplexity" not in record:
        record["dense_perplexity"] = held_out(dense, tokenizer, args.max_eval_segments)
    done = {row["budget"] for row in record["rows"]}
    for budget in sorted(args.budgets):
        if budget in done:
            continue
        model = copy.deepcopy(dense)
        config = GradMAPConfig(
            importance=args.importance, max_loss_increase=budget, num_samples=args.num_samples, seq_len=128, compensation=False
        )
        started = provenance()
        pruner = GradMAPPruner(config, tokenizer=tokenizer, progress_bar=False)
        result = pruner.prune(model, "offline:wikipedia")
        origin = finish(started)
        calibration = calibration_sha256(result.calibration_ids)
        if record.setdefault("calibration_sha256", calibration) != calibration:
            raise SystemExit(f"+{budget:.0%}: another calibration set than the other rows'")
        record["dense_loss"] = result.dense_loss
        report = build_report(model, result.to_dict(), config)
        record["rows"].append(
            {
                "budget": budget,
                "removed_layers": result.removed_layers,
                "dense_loss": result.dense_loss,
                "loss_curve": result.loss_curve,
                "rejected": result.rejected,
                "stopped": result.stopped,
                "stage1_seconds": result.timings["stage1"],
                "perplexity": held_out(model, tokenizer, args.max_eval_segments),
                "provenance": origin,
            }
        )
        save()
        print(markdown(record).splitlines()[-1], flush=True)
        if args.picture and budget == max(args.budgets):
            with tempfile.TemporaryDirectory() as folder:
                if CURVE_PICTURE in write_pictures(report, folder):
                    os.makedirs(os.path.dirname(os.path.abspath(args.picture)), exist_ok=True)
                    shutil.copyfile(os.path.join(folder, CURVE_PICTURE), args.picture)
        del model
    print(markdown(record))


if __name__ == "__main__":
    main()
