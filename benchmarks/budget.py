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

import copy
import os
import shutil
import tempfile

from common import RESULTS, log_rounds, parser, perplexities, resumed
from provenance import finish, provenance
from records import write

from optimum_gradmap import GradMAPConfig, GradMAPPruner
from optimum_gradmap.assets import MODEL_ASSETS, load_model
from optimum_gradmap.data import calibration_sha256
from optimum_gradmap.report import CURVE_PICTURE, build_report, write_pictures


def main() -> None:
    arguments = parser(__doc__)
    arguments.add_argument("--model", default="smollm2-135m", choices=sorted(MODEL_ASSETS))
    arguments.add_argument("--importance", default="gradmap")
    arguments.add_argument("--budgets", nargs="+", type=float, default=[0.1, 0.5, 1.0])
    arguments.add_argument("--num-samples", type=int, default=32)
    arguments.add_argument("--max-eval-segments", type=int, default=128)
    arguments.add_argument("--picture", default=None, help="where to copy the largest budget's curve picture")
    arguments.add_argument("--output-dir", default=RESULTS)
    arguments.add_argument("--resume", action="store_true")
    args = arguments.parse_args()
    log_rounds()

    settings = {"model": args.model, "importance": args.importance, "num_samples": args.num_samples}
    os.makedirs(args.output_dir, exist_ok=True)
    path = os.path.join(args.output_dir, f"budget-{args.model}-{args.importance}-{args.num_samples}.json")
    record = resumed(path, args.resume, {"settings": settings, "rows": []}, settings)

    dense, tokenizer = load_model(args.model)
    if "dense_perplexity" not in record:
        record["dense_perplexity"] = perplexities(dense, tokenizer, args.max_eval_segments)
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
                "perplexity": perplexities(model, tokenizer, args.max_eval_segments),
                "provenance": origin,
            }
        )
        write(path, record)
        print(f"+{budget:.0%}: removed {result.removed_layers}, {record['rows'][-1]['perplexity']}", flush=True)
        if args.picture and budget == max(args.budgets):
            with tempfile.TemporaryDirectory() as folder:
                if CURVE_PICTURE in write_pictures(report, folder):
                    os.makedirs(os.path.dirname(os.path.abspath(args.picture)), exist_ok=True)
                    shutil.copyfile(os.path.join(folder, CURVE_PICTURE), args.picture)
        del model


if __name__ == "__main__":
    main()
