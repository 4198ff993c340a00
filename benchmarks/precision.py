"""The default passes (`precision="auto"`: bfloat16 where the hardware computes it natively, each near tie
recomputed in float32) against float32 passes throughout (`precision="float32"`): for one model and ratio, GradMAP's
two stages with the library's defaults from float32 weights, each from a fresh load of the model, in one process:
the removed layers, the fitted layers and their lambdas, each stage's seconds, how many decisions were checked and
recomputed (and their seconds), and the held-out perplexity after both stages (evaluated in float32).

    python benchmarks/precision.py --model smollm2-135m --ratio 0.25 --resume
    python benchmarks/precision.py --model smollm2-135m --ratio 0.4 --precisions auto --resume
    python benchmarks/precision.py --model qwen2.5-coder-0.5b --ratio 0.25 --precisions auto --resume

`--precisions` run in the order given, one row each. Writes benchmarks/results/precision-<model>-<ratio>.json; with
`--resume`, rows already there are kept. Every row carries its provenance (`benchmarks/provenance.py`): compare the
seconds of rows that are both quiet.
"""

from __future__ import annotations

import logging
import os

import records
from common import CALIBRATION, HELD_OUT, RESULTS, calibration, parser, resumed
from provenance import finish, provenance, wait_until_quiet

from optimum_gradmap import GradMAPConfig, GradMAPPruner, load_evaluation_segments, perplexity
from optimum_gradmap.assets import load_model
from optimum_gradmap.data import calibration_sha256


def main() -> None:
    arguments = parser(__doc__)
    arguments.add_argument("--model", default="smollm2-135m")
    arguments.add_argument("--ratio", type=float, default=0.25)
    arguments.add_argument("--precisions", nargs="+", default=["auto", "float32"], choices=["auto", "float32"])
    arguments.add_argument("--num-samples", type=int, default=128)
    arguments.add_argument("--max-segments", type=int, default=128)
    arguments.add_argument("--resume", action="store_true")
    args = arguments.parse_args()
    logging.getLogger("optimum_gradmap").setLevel(logging.WARNING)

    path = os.path.join(RESULTS, f"precision-{args.model}-{args.ratio:g}.json")
    new = {"model": args.model, "ratio": args.ratio, "num_samples": args.num_samples, "max_segments": args.max_segments}
    record = resumed(path, args.resume, {**new, "rows": []})
    for setting in args.precisions:
        if any(row["precision"] == setting for row in record["rows"]):
            continue
        wait_until_quiet()
        started = provenance()
        model, tokenizer = load_model(args.model)
        ids = calibration(tokenizer, args.num_samples)
        record["calibration_sha256"] = calibration_sha256(ids)
        config = GradMAPConfig(
            pruning_ratio=args.ratio, num_samples=args.num_samples, seq_len=128, dataset=CALIBRATION, precision=setting
        )
        pruner = GradMAPPruner(config, tokenizer=tokenizer, progress_bar=False)
        result = pruner.select_layers(model, ids)
        pruner.compensate(result)
        compensation = result.compensation
        segments = {name: load_evaluation_segments(name, tokenizer, 128, args.max_segments) for name in HELD_OUT}
        row = {
            "precision": setting,
            "removed_layers": result.removed_layers,
            "compensated_layers": result.compensated_layers,
            "compensation_lambda": {str(k): v for k, v in compensation.reg_lambda.items()},
            "skipped_layers": {str(k): v for k, v in compensation.skipped_layers.items()},
            "stage1_seconds": result.timings["stage1"],
            "stage2_seconds": result.timings["stage2"],
            "passes": result.precision,
            "perplexity": {name: perplexity(model, ids, progress_bar=False) for name, ids in segments.items()},
            "provenance": finish(started),
        }
        record["rows"].append(row)
        records.write(path, record)
        passes = row["passes"]
        print(
            f"{setting}: removed {row['removed_layers']}, fitted {row['compensation_lambda']}, Stage 1 "
            f"{row['stage1_seconds']:.1f} s, Stage 2 {row['stage2_seconds']:.1f} s, {passes['decisions']} decisions, "
            f"{len(passes['recomputed'])} recomputed ({passes['recompute_seconds']:.1f} s), perplexity {row['perplexity']}",
            flush=True,
        )


if __name__ == "__main__":
    main()
