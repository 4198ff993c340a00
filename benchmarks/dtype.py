"""What computing in bfloat16 changes: for one model and ratio, GradMAP's two stages run from weights loaded
in each dtype, on the same calibration set, in one process: the layers Stage 1 removes, the lambdas Stage 2 chooses,
each stage's seconds, and the held-out perplexity after both stages on Wikipedia and web text, measured in float32
(the pruned weights cast up, exactly) and in the dtype the model computed in.

    python benchmarks/dtype.py --model smollm2-135m --ratio 0.25 --dtypes float32 bfloat16 --resume
    python benchmarks/dtype.py --model qwen2.5-coder-0.5b --ratio 0.25 --resume
    python benchmarks/dtype.py --num-layers-to-prune 4 --num-samples 16   # the issue's first measurement's setting

Stage 1 is the library's default (GradMAP's gradient score), Stage 2 its default; `--dtypes` run in the order given,
one row each. Writes benchmarks/results/dtype-<model>-<ratio>.json; with `--resume`, rows already there are
kept. Every row carries its provenance (`benchmarks/provenance.py`): compare the seconds of rows that are both quiet.
"""

from __future__ import annotations

import logging
import os

import records
import torch
from common import CALIBRATION, HELD_OUT, RESULTS, calibration, parser, resumed
from provenance import finish, provenance, wait_until_quiet

from optimum_gradmap import GradMAPConfig, GradMAPPruner, load_evaluation_segments, perplexity
from optimum_gradmap.assets import load_model
from optimum_gradmap.data import calibration_sha256


def main() -> None:
    arguments = parser(__doc__)
    arguments.add_argument("--model", default="smollm2-135m")
    arguments.add_argument("--ratio", type=float, default=0.25)
    arguments.add_argument("--num-layers-to-prune", type=int, default=None, help="K instead of --ratio (the file is named -k<K>)")
    arguments.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16", "float16"])
    arguments.add_argument("--num-samples", type=int, default=128)
    arguments.add_argument("--max-segments", type=int, default=128)
    arguments.add_argument("--resume", action="store_true")
    args = arguments.parse_args()
    logging.getLogger("optimum_gradmap").setLevel(logging.WARNING)

    size = f"k{args.num_layers_to_prune}" if args.num_layers_to_prune else f"{args.ratio:g}"
    suffix = f"-{args.num_samples}x128" if args.num_samples != 128 else ""
    path = os.path.join(RESULTS, f"dtype-{args.model}-{size}{suffix}.json")
    record = {
        "model": args.model,
        "ratio": args.ratio,
        "num_layers_to_prune": args.num_layers_to_prune,
        "num_samples": args.num_samples,
        "max_segments": args.max_segments,
        "rows": [],
    }
    record = resumed(path, args.resume, record)
    for dtype in args.dtypes:
        if any(row["dtype"] == dtype for row in record["rows"]):
            continue
        wait_until_quiet()
        started = provenance()
        model, tokenizer = load_model(args.model, dtype=getattr(torch, dtype))
        ids = calibration(tokenizer, args.num_samples)
        record["calibration_sha256"] = calibration_sha256(ids)
        size = {"num_layers_to_prune": args.num_layers_to_prune} if args.num_layers_to_prune else {"pruning_ratio": args.ratio}
        config = GradMAPConfig(**size, num_samples=args.num_samples, seq_len=128, dataset=CALIBRATION)
        pruner = GradMAPPruner(config, tokenizer=tokenizer, progress_bar=False)
        result = pruner.select_layers(model, ids)
        pruner.compensate(result)
        compensation = result.compensation
        segments = {name: load_evaluation_segments(name, tokenizer, 128, args.max_segments) for name in HELD_OUT}
        own = {name: perplexity(model, ids, progress_bar=False) for name, ids in segments.items()}
        model.float()
        full = {name: perplexity(model, ids, progress_bar=False) for name, ids in segments.items()}
        row = {
            "dtype": dtype,
            "removed_layers": result.removed_layers,
            "stage1_seconds": result.timings["stage1"],
            "stage2_seconds": compensation.seconds,
            "compensation_lambda": {str(k): v for k, v in compensation.reg_lambda.items()},
            "skipped_layers": {str(k): v for k, v in compensation.skipped_layers.items()},
            "perplexity_own_dtype": own,
            "perplexity_float32": full,
            "provenance": finish(started),
        }
        record["rows"].append(row)
        records.write(path, record)
        print(
            f"{dtype}: removed {row['removed_layers']}, Stage 1 {row['stage1_seconds']:.1f} s, Stage 2 "
            f"{row['stage2_seconds']:.1f} s, perplexity {full}",
            flush=True,
        )


if __name__ == "__main__":
    main()
