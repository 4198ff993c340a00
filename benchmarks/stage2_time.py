"""Stage 2's seconds, variant against variant, in one process on the same removed layers: what a change to the
default Stage 2 costs in time, measured so that the figures can be compared (same machine, same minute, same
calibration set; the rows alternate between the variants so that a change in the machine's load falls on all).

    python benchmarks/stage2_time.py --model smollm2-135m --ratio 0.25 --selection gradmap \
        --variants previous_default default --repeats 2

The removed layers are those of `--selection` in compare-<model>-<ratio>.json (as in benchmarks/accuracy.py);
the variants are accuracy.py's (`default`, `paper`, `previous_default`, or changes joined by `+`). Nothing is
evaluated: each row is one Stage 2 run (`GradMAPPruner.compensate`) and its seconds, the layers it fitted and
their lambdas, then the fold is undone. Writes benchmarks/results/stage2_time-<model>-<ratio>-<selection>.{json,md};
with `--resume`, rows already there are kept; `--label NAME` appends `-NAME` to the file's name. Each row waits (at
most 5 minutes) for a 1-minute load below 1 before it starts. Every row carries its provenance
(`benchmarks/provenance.py`): compare only rows whose `quiet` is true.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics

import torch
from accuracy import CALIBRATION, RESULTS, add_layer_arguments, layers_of, variant_settings
from provenance import finish, provenance, wait_until_quiet

from optimum_gradmap import GradMAPConfig, GradMAPPruner
from optimum_gradmap.assets import load_model
from optimum_gradmap.data import calibration_sha256, prepare_calibration_data


def markdown(record: dict) -> str:
    """The rows, then each variant's median seconds over its quiet rows."""
    lines = [
        f"# Stage 2 seconds: {record['model']}, {record['ratio']:g}, layers of {record['selection']}",
        "",
        f"Removed layers {record['removed_layers']} ({record['layers_from']}); calibration "
        f"{record['num_samples']} x 128 tokens, {record['calibration_sha256'][:12]}. Every row is one Stage 2 run in the "
        "same process; `quiet`: nothing else used more than 10% of a CPU and the 1-minute load was below 1 when the row "
        "started.",
        "",
        "| variant | repeat | Stage 2 seconds | fitted layers (lambda) | left alone | quiet | date |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in record["rows"]:
        fitted = ", ".join(f"{layer} ({reg_lambda:.2g})" for layer, reg_lambda in row["compensation_lambda"].items())
        alone = ", ".join(row["skipped_layers"]) or "none"
        quiet = "yes" if row["provenance"]["quiet"] else "no"
        lines.append(
            f"| {row['variant']} | {row['repeat']} | {row['stage2_seconds']:.1f} | {fitted} | {alone} | {quiet} | "
            f"{row['provenance']['date']} |"
        )
    lines += ["", "| variant | median Stage 2 seconds, quiet rows | quiet rows |", "|---|---|---|"]
    for variant in dict.fromkeys(row["variant"] for row in record["rows"]):
        quiet = [row["stage2_seconds"] for row in record["rows"] if row["variant"] == variant and row["provenance"]["quiet"]]
        median = f"{statistics.median(quiet):.1f}" if quiet else "no quiet row"
        lines.append(f"| {variant} | {median} | {len(quiet)} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_layer_arguments(parser)
    parser.add_argument("--variants", nargs="+", default=["previous_default", "default"])
    parser.add_argument("--repeats", type=int, default=1, help="runs of each variant, alternating (default 1)")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--label", default=None, help="suffix of the result file's name, to keep earlier records apart")
    args = parser.parse_args()
    logging.getLogger("optimum_gradmap").setLevel(logging.WARNING)
    torch.manual_seed(0)
    settings = {variant: variant_settings(variant) for variant in args.variants}  # refuses an unknown one first
    if any(value is None for value in settings.values()):
        parser.error("every variant must run a Stage 2 (`stage1` has none to time)")

    path = os.path.join(RESULTS, f"stage2_time-{args.model}-{args.ratio:g}-{args.selection}")
    if args.label:
        path += f"-{args.label}"
    layers, layers_from = layers_of(args.model, args.ratio, args.selection)
    record = {"model": args.model, "ratio": args.ratio, "selection": args.selection, "num_samples": args.num_samples, "rows": []}
    if args.resume and os.path.isfile(path + ".json"):
        with open(path + ".json", encoding="utf-8") as file:
            record = json.load(file)
        if record["num_samples"] != args.num_samples:
            parser.error(f"{path}.json was measured with --num-samples {record['num_samples']}: resume with that, or start anew")
    record.update(removed_layers=layers, layers_from=layers_from)

    model, tokenizer = load_model(args.model)
    calibration = prepare_calibration_data(CALIBRATION, tokenizer, args.num_samples, 128, 0, CALIBRATION)
    record["calibration_sha256"] = calibration_sha256(calibration)
    config = GradMAPConfig(layers_to_prune=layers, num_samples=args.num_samples, seq_len=128, dataset=CALIBRATION)
    pruner = GradMAPPruner(config, tokenizer=tokenizer, progress_bar=False)
    result = pruner.select_layers(model, calibration)
    done = {(row["variant"], row["repeat"]) for row in record["rows"]}
    for repeat in range(1, args.repeats + 1):
        for variant in args.variants:
            if (variant, repeat) in done:
                continue
            wait_until_quiet()
            started = provenance()
            pruner.compensate(result, **settings[variant])
            compensation = result.compensation
            row = {
                "variant": variant,
                "repeat": repeat,
                "stage2_settings": settings[variant],
                "stage2_seconds": compensation.seconds,
                "compensation_lambda": {str(k): v for k, v in compensation.reg_lambda.items()},
                "skipped_layers": {str(k): v for k, v in compensation.skipped_layers.items()},
                "stage2_calibration_sha256": compensation.calibration_sha256,
                "provenance": finish(started),
            }
            compensation.undo()
            result.compensation = None
            record["rows"].append(row)
            with open(path + ".json", "w", encoding="utf-8") as file:
                json.dump(record, file, indent=1)
            with open(path + ".md", "w", encoding="utf-8") as file:
                file.write(markdown(record))
            print(f"{variant} (repeat {repeat}): Stage 2 {compensation.seconds:.1f} s", flush=True)
    print(markdown(record))


if __name__ == "__main__":
    main()
