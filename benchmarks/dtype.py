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

import argparse
import logging
import os

import records
import torch
from accuracy import CALIBRATION, RESULTS
from provenance import finish, provenance, wait_until_quiet

from optimum_gradmap import GradMAPConfig, GradMAPPruner, load_evaluation_segments, perplexity
from optimum_gradmap.assets import load_model
from optimum_gradmap.data import calibration_sha256, prepare_calibration_data

EVALUATION = ("offline:wikipedia", "offline:web_text")


def markdown(record: dict) -> str:
    """The rows, then each bfloat16 row against the float32 row: same layers, perplexity ratio, time ratios."""
    lines = [
        f"# float32 and bfloat16: {record['model']}, {record.get('num_layers_to_prune') or record['ratio']}",
        "",
        f"GradMAP's Stage 1 and the default Stage 2 from weights loaded in each dtype; calibration {record['num_samples']} "
        f"x 128 tokens of Wikipedia, {record['calibration_sha256'][:12]}; perplexity on the first {record['max_segments']} "
        "held-out 128-token segments, computed in float32 (the pruned weights cast up) and in the row's own dtype.",
        "",
        "| dtype | removed layers | fitted layers (lambda) | Stage 1 s | Stage 2 s | Wikipedia ppl (fp32 / own) | "
        "web text ppl (fp32 / own) | quiet | date |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in record["rows"]:
        fitted = ", ".join(f"{layer} ({value:.2g})" for layer, value in row["compensation_lambda"].items()) or "none"
        ppl = {name: f"{row['perplexity_float32'][name]:.3f} / {row['perplexity_own_dtype'][name]:.3f}" for name in EVALUATION}
        quiet = "yes" if row["provenance"]["quiet"] else "no"
        lines.append(
            f"| {row['dtype']} | {row['removed_layers']} | {fitted} | {row['stage1_seconds']:.1f} | {row['stage2_seconds']:.1f} "
            f"| {ppl[EVALUATION[0]]} | {ppl[EVALUATION[1]]} | {quiet} | {row['provenance']['date']} |"
        )
    rows = {row["dtype"]: row for row in record["rows"]}
    if "float32" in rows and "bfloat16" in rows:
        full, half = rows["float32"], rows["bfloat16"]
        lines += ["", "| bfloat16 against float32 | value |", "|---|---|"]
        lines.append(f"| same removed layers | {'yes' if full['removed_layers'] == half['removed_layers'] else 'no'} |")
        for name in EVALUATION:
            change = half["perplexity_float32"][name] / full["perplexity_float32"][name] - 1
            lines.append(f"| {name} perplexity after both stages (float32 evaluation) | {change:+.2%} |")
        for stage in ("stage1", "stage2"):
            lines.append(f"| {stage} time ratio | {half[f'{stage}_seconds'] / full[f'{stage}_seconds']:.2f} |")
        both_quiet = full["provenance"]["quiet"] and half["provenance"]["quiet"]
        lines.append(f"| both rows quiet (time ratios comparable) | {'yes' if both_quiet else 'no'} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--ratio", type=float, default=0.25)
    parser.add_argument("--num-layers-to-prune", type=int, default=None, help="K instead of --ratio (the file is named -k<K>)")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--num-samples", type=int, default=128)
    parser.add_argument("--max-segments", type=int, default=128)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    logging.getLogger("optimum_gradmap").setLevel(logging.WARNING)

    size = f"k{args.num_layers_to_prune}" if args.num_layers_to_prune else f"{args.ratio:g}"
    suffix = f"-{args.num_samples}x128" if args.num_samples != 128 else ""
    path = os.path.join(RESULTS, f"dtype-{args.model}-{size}{suffix}")
    record = {
        "model": args.model,
        "ratio": args.ratio,
        "num_layers_to_prune": args.num_layers_to_prune,
        "num_samples": args.num_samples,
        "max_segments": args.max_segments,
    }
    record["rows"] = []
    if args.resume and os.path.isfile(path + ".json"):
        record = records.read(path + ".json")
    for dtype in args.dtypes:
        if any(row["dtype"] == dtype for row in record["rows"]):
            continue
        wait_until_quiet()
        started = provenance()
        model, tokenizer = load_model(args.model, dtype=getattr(torch, dtype))
        calibration = prepare_calibration_data(CALIBRATION, tokenizer, args.num_samples, 128, 0, CALIBRATION)
        record["calibration_sha256"] = calibration_sha256(calibration)
        size = {"num_layers_to_prune": args.num_layers_to_prune} if args.num_layers_to_prune else {"pruning_ratio": args.ratio}
        config = GradMAPConfig(**size, num_samples=args.num_samples, seq_len=128, dataset=CALIBRATION)
        pruner = GradMAPPruner(config, tokenizer=tokenizer, progress_bar=False)
        result = pruner.select_layers(model, calibration)
        pruner.compensate(result)
        compensation = result.compensation
        segments = {name: load_evaluation_segments(name, tokenizer, 128, args.max_segments) for name in EVALUATION}
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
        records.write(path + ".json", record)
        print(
            f"{dtype}: removed {row['removed_layers']}, Stage 1 {row['stage1_seconds']:.1f} s, Stage 2 "
            f"{row['stage2_seconds']:.1f} s, perplexity {full}",
            flush=True,
        )
    print(markdown(record))


if __name__ == "__main__":
    main()
