"""The main job's memory: runs the README's main job (`examples/main_job/prune_smollm2.py`) as a
child process and samples its memory every 0.5 s (`/proc/PID/status`: RssAnon, the process's own memory, and RssFile,
mapped files), with its peak resident memory (`VmHWM`) read when it ends, beside the weight bytes it prunes.

    python benchmarks/main_job_memory.py                 # the main job as the README runs it
    python benchmarks/main_job_memory.py -- --num-samples 32 --max-eval-segments 64   # options for the main job

Writes benchmarks/results/main_job_memory.json (one row per set of main-job options; `--resume` skips a finished one),
with the main job's printed output (its layers and perplexities: the same result as before a memory change) and the
memory timeline.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import records  # noqa: E402
from provenance import finish, provenance  # noqa: E402
from scale import run_monitored  # noqa: E402

RECORD = os.path.join(ROOT, "benchmarks", "results", "main_job_memory.json")


def float32_weight_bytes(asset: str = "smollm2-135m") -> int:
    """The offline model's parameters in float32 bytes, read from its safetensors headers (no weight is loaded)."""
    import glob

    from safetensors import safe_open

    sys.path.insert(0, ROOT)
    from optimum_gradmap.assets import get_model_path

    total = 0
    for path in glob.glob(os.path.join(get_model_path(asset), "*.safetensors")):
        with safe_open(path, framework="pt") as file:
            for name in file.keys():
                shape = file.get_slice(name).get_shape()
                count = 1
                for size in shape:
                    count *= size
                total += count
    return 4 * total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--resume", action="store_true", help="skip a set of options measured already")
    parser.add_argument("main_job_options", nargs="*", help="options for the main job (after --)")
    args = parser.parse_args()
    rows = records.read(RECORD) if os.path.exists(RECORD) else []
    options = args.main_job_options
    if args.resume and any(row["options"] == options and row["exit_code"] == 0 for row in rows):
        print(f"{options}: measured already ({RECORD})")
        return
    with tempfile.TemporaryDirectory() as folder:
        log = os.path.join(folder, "main_job.log")
        output = os.path.join(folder, "out")
        command = [sys.executable, os.path.join(ROOT, "examples", "main_job", "prune_smollm2.py"), "--output", output, *options]
        asset = options[options.index("--model") + 1] if "--model" in options else "smollm2-135m"
        row = {"options": options, "weight_bytes_float32": float32_weight_bytes(asset), "provenance": provenance()}
        code, seconds, memory = run_monitored(command, log)
        row["provenance"] = finish(row["provenance"])
        with open(log, encoding="utf-8", errors="replace") as file:
            printed = [line.rstrip() for line in file.read().replace("\r", "\n").splitlines()]
    row.update(exit_code=code, seconds=round(seconds, 1), memory=memory)
    row["printed"] = [line for line in printed if line and "it/s]" not in line and "s/it]" not in line][-40:]
    rows = [existing for existing in rows if existing["options"] != options] + [row]
    os.makedirs(os.path.dirname(RECORD), exist_ok=True)
    records.write(RECORD, rows)
    shown = {key: value for key, value in memory.items() if key != "timeline"}
    print(json.dumps({"exit_code": code, "seconds": round(seconds, 1), **shown}, indent=1))
    print("\n".join(row["printed"][-16:]))


if __name__ == "__main__":
    main()
