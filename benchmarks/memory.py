"""Memory and time of a whole run, in a child process whose memory is sampled every 0.5 s (`/proc/PID/status`:
RssAnon, the process's own memory, and RssFile, mapped files; `VmHWM`, its peak resident memory, and `/proc/PID/io`
read when it ends), beside the model's float32 weight bytes. Two runs, each with its own record:

- `prune`: the command line's own `optimum-gradmap prune offline:MODEL --pruning-ratio R --dtype float32 --dataset
  offline:wikipedia --output TMP` (its entry point, `optimum_gradmap.cli.main`), the run `prune --dry-run` plans and
  nothing more (no `--evaluate`, no reload check): the plan-against-run rows of benchmarks/plan_accuracy.py. `--dtype
  float32` is the command line's default, written out (the plans of these rows are float32); `--dataset
  offline:wikipedia` the main job's calibration data (the default, `wikipedia`, needs the Hub); the rest the command
  line's defaults (128 x 128 tokens, batches of 8, the closed-form Stage 2) unless given after `--`. Each stage's
  seconds come from the output's `pruning_report.json`; the pruned checkpoint is deleted. Writes
  benchmarks/results/cli_prune_memory.json, one row per command (its `key`: the arguments after `prune`, the temporary
  `--output` left out).
- `main-job`: the README's main job (`examples/main_job/prune_smollm2.py`), with its printed output (its layers and
  perplexities: the same result as before a memory change). Writes benchmarks/results/main_job_memory.json, one row
  per set of main-job options.

    python benchmarks/memory.py prune --model smollm2-135m --resume
    python benchmarks/memory.py prune --model qwen2.5-coder-0.5b --resume -- --num-samples 32
    python benchmarks/memory.py main-job --resume                  # the main job as the README runs it
    python benchmarks/memory.py main-job -- --num-samples 32 --max-eval-segments 64   # options for the main job

`--resume` skips a command measured already.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import tempfile

import records
from common import RESULTS, ROOT, folder_bytes, parser, printed_tail, replaced, run_monitored, shown, stop_at_exit
from provenance import finish, provenance, wait_until_quiet

PRUNE_RECORD = os.path.join(RESULTS, "cli_prune_memory.json")
MAIN_JOB_RECORD = os.path.join(RESULTS, "main_job_memory.json")


def cli_command(argv: list[str]) -> list[str]:
    """The command of a child that runs the command line's own entry point with `argv`, stopping itself at exit."""
    return [sys.executable, os.path.abspath(__file__), "_cli", *argv]


def prune_key(model: str, ratio: float, dtype: str, extra: list[str], dataset: str = "offline:wikipedia") -> list[str]:
    """The arguments after `prune`, the `--output` left out: the row's key, and what plan_accuracy.py names."""
    return [f"offline:{model}", "--pruning-ratio", str(ratio), "--dtype", dtype, "--dataset", dataset, *extra]


def shown_command(key: list[str]) -> str:
    """The command line the row measured, as a person would type it."""
    return shlex.join(["optimum-gradmap", "prune", *key, "--output", "TMP"])


def float32_weight_bytes(asset: str = "smollm2-135m") -> int:
    """The offline model's parameters in float32 bytes, read from its safetensors headers (no weight is loaded)."""
    import glob
    import math

    from safetensors import safe_open

    from optimum_gradmap.assets import get_model_path

    total = 0
    for path in glob.glob(os.path.join(get_model_path(asset), "*.safetensors")):
        with safe_open(path, framework="pt") as file:
            total += sum(math.prod(file.get_slice(name).get_shape()) for name in file.keys())
    return 4 * total


def measure_prune(args, folder: str) -> dict:
    """The `prune` row: the command line's run, its stages' seconds and output bytes."""
    key = prune_key(args.model, args.ratio, args.dtype, args.extra, args.dataset)
    row = {"key": key, "command": shown_command(key), "weight_bytes_float32": float32_weight_bytes(args.model)}
    output, log = os.path.join(folder, "pruned"), os.path.join(folder, "prune.log")
    wait_until_quiet()
    row["provenance"] = provenance()
    code, seconds, memory = run_monitored(cli_command(["prune", *key, "--output", output]), log)
    row["provenance"] = finish(row["provenance"])
    row.update(exit_code=code, seconds=round(seconds, 1), memory=memory)
    if code == 0:
        with open(os.path.join(output, "pruning_report.json")) as file:
            report = json.load(file)
        row.update(removed_layers=report.get("removed_layers"), timings=report.get("timings"))
        row["output_bytes"] = folder_bytes(output)
    row["printed"] = printed_tail(log)
    return row


def measure_main_job(args, folder: str) -> dict:
    """The `main-job` row: the main job's run and the last lines it printed."""
    options, log = args.extra, os.path.join(folder, "main_job.log")
    script = os.path.join(ROOT, "examples", "main_job", "prune_smollm2.py")
    asset = options[options.index("--model") + 1] if "--model" in options else "smollm2-135m"
    row = {"options": options, "weight_bytes_float32": float32_weight_bytes(asset), "provenance": provenance()}
    code, seconds, memory = run_monitored([sys.executable, script, "--output", os.path.join(folder, "out"), *options], log)
    row["provenance"] = finish(row["provenance"])
    row.update(exit_code=code, seconds=round(seconds, 1), memory=memory, printed=printed_tail(log))
    return row


def main() -> None:
    if sys.argv[1:2] == ["_cli"]:  # the child of `cli_command`
        stop_at_exit()
        from optimum_gradmap import cli

        sys.exit(cli.main(sys.argv[2:]) or 0)
    arguments = parser(__doc__)
    arguments.add_argument("run", choices=["prune", "main-job"])
    arguments.add_argument("--model", default="smollm2-135m", help="prune: an offline model asset, e.g. qwen2.5-coder-0.5b")
    arguments.add_argument("--ratio", type=float, default=0.25, help="prune: the pruning ratio")
    arguments.add_argument("--dtype", default="float32", help="prune: float32, what the plans of these rows assume")
    arguments.add_argument("--dataset", default="offline:wikipedia", help="prune: calibration data (the main job's)")
    arguments.add_argument("--work", default=None, help="folder for the temporary output (default: the system's)")
    arguments.add_argument("--resume", action="store_true", help="skip a command measured already")
    arguments.add_argument("extra", nargs="*", help="more options for `prune` or for the main job (after --)")
    args = arguments.parse_args()
    if args.run == "prune":
        path, field, key = PRUNE_RECORD, "key", prune_key(args.model, args.ratio, args.dtype, args.extra, args.dataset)
    else:
        path, field, key = MAIN_JOB_RECORD, "options", args.extra
    rows = records.read(path) if os.path.exists(path) else []
    if args.resume and any(row[field] == key and row["exit_code"] == 0 for row in rows):
        print(f"{key}: measured already ({path})")
        return
    with tempfile.TemporaryDirectory(prefix="memory-", dir=args.work) as folder:
        row = (measure_prune if args.run == "prune" else measure_main_job)(args, folder)
    records.write(path, replaced(rows, row, field))
    print(json.dumps(shown(row), indent=1))
    print("\n".join(row["printed"][-16:]))
    sys.exit(row["exit_code"])


if __name__ == "__main__":
    main()
