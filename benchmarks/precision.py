"""The main job with the default passes (`--precision auto`: bfloat16 where the hardware computes it natively, each
near tie recomputed in float32) against float32 passes throughout (`--precision float32`): the README's main job
(examples/main_job/prune_smollm2.py, its defaults: GradMAP's Stage 1, the default Stage 2, 128 x 128 calibration
tokens, float32 weights), run whole under `/usr/bin/time -v`, one row per setting, one after the other: the removed
layers, the fitted layers and their lambdas, each stage's seconds, the decisions checked and recomputed (and their
seconds), the held-out Wikipedia perplexities the job prints (evaluated in float32), its wall time and peak memory.

    python benchmarks/precision.py --model smollm2-135m --ratio 0.25 --resume
    python benchmarks/precision.py --model smollm2-135m --ratio 0.4 --precisions auto --resume
    python benchmarks/precision.py --model qwen2.5-coder-0.5b --ratio 0.25 --precisions auto --resume

`--precisions` run in the order given. Writes benchmarks/results/precision-<model>-<ratio>.json; with `--resume`,
rows already there are kept. Every row carries its provenance (`benchmarks/provenance.py`): compare the seconds of
rows that are both quiet.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

import records
from common import RESULTS, parser, resumed
from provenance import finish, provenance, wait_until_quiet

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAIN_JOB = os.path.join("examples", "main_job", "prune_smollm2.py")
PERPLEXITY = re.compile(r"^  (dense|stage 1 only|stage 1 \+ 2)\s+([0-9.]+)", re.MULTILINE)


def run_main_job(model: str, ratio: float, setting: str, output: str) -> dict:
    """The main job's figures: what it printed, its report, and `/usr/bin/time -v`'s wall time and peak memory."""
    command = [sys.executable, MAIN_JOB, "--model", model, "--ratio", str(ratio), "--precision", setting, "--output", output]
    done = subprocess.run(["/usr/bin/time", "-v", *command], cwd=ROOT, capture_output=True, text=True, check=True)
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", done.stderr).group(1)
    seconds = sum(float(part) * 60**power for power, part in enumerate(reversed(wall.split(":"))))
    peak = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr).group(1))
    with open(os.path.join(output, "pruning_report.json"), encoding="utf-8") as file:
        report = json.load(file)
    compensation = report["compensation"]
    return {
        "command": " ".join(["python", *command[1:-2]]),
        "removed_layers": report["removed_layers"],
        "compensated_layers": compensation["compensated_layers"],
        "compensation_lambda": compensation["reg_lambda"],
        "skipped_layers": compensation["skipped_layers"],
        "stage1_seconds": report["timings"]["stage1"],
        "stage2_seconds": report["timings"]["stage2"],
        "passes": report["precision"],
        "wikipedia_perplexity": {name: float(value) for name, value in PERPLEXITY.findall(done.stdout)},
        "wall_seconds": seconds,
        "peak_rss_kib": peak,
        "output": "\n".join(line for line in done.stdout[-3000:].splitlines() if not line.startswith("checkpoint:")),
    }


def main() -> None:
    arguments = parser(__doc__)
    arguments.add_argument("--model", default="smollm2-135m")
    arguments.add_argument("--ratio", type=float, default=0.25)
    arguments.add_argument("--precisions", nargs="+", default=["auto", "float32"], choices=["auto", "float32"])
    arguments.add_argument("--resume", action="store_true")
    arguments.add_argument(
        "--no-wait", action="store_true", help="start without waiting for a quiet machine (for layers, not times)"
    )
    args = arguments.parse_args()

    path = os.path.join(RESULTS, f"precision-{args.model}-{args.ratio:g}.json")
    record = resumed(path, args.resume, {"model": args.model, "ratio": args.ratio, "rows": []})
    for setting in args.precisions:
        if any(row["precision"] == setting for row in record["rows"]):
            continue
        if not args.no_wait:
            wait_until_quiet()
        started = provenance()
        with tempfile.TemporaryDirectory() as output:
            row = {"precision": setting, **run_main_job(args.model, args.ratio, setting, output)}
        row["provenance"] = finish(started)
        record["rows"].append(row)
        records.write(path, record)
        passes = row["passes"]
        print(
            f"{setting}: removed {row['removed_layers']}, fitted {row['compensation_lambda']}, Stage 1 "
            f"{row['stage1_seconds']:.1f} s, Stage 2 {row['stage2_seconds']:.1f} s, wall {row['wall_seconds']:.0f} s, "
            f"{passes['decisions']} decisions, {len(passes['recomputed'])} recomputed "
            f"({passes['recompute_seconds']:.1f} s), Wikipedia perplexity {row['wikipedia_perplexity']}",
            flush=True,
        )


if __name__ == "__main__":
    main()
