"""The command line's own `prune`, monitored: the run `optimum-gradmap prune ... --dry-run` plans, and
nothing more (no `--evaluate`, no reload check), for the plan-against-run rows of SmolLM2-135M and
Qwen2.5-Coder-0.5B (benchmarks/plan_accuracy.py). It runs

    optimum-gradmap prune offline:MODEL --pruning-ratio R --dtype float32 --dataset offline:wikipedia --output TMP

in a child process (the command line's entry point, `optimum_gradmap.cli.main`) and samples its memory every 0.5 s
as benchmarks/scale.py does (`run_monitored`: `/proc/PID/status`'s RssAnon and RssFile, `VmHWM` read when it ends,
`/proc/PID/io`), with the seconds of the whole run and each stage's seconds from the output's `pruning_report.json`.
`--dtype float32` is the command line's default, written out: the plans of these rows are float32.
`--dataset offline:wikipedia` is the main job's calibration data (the default, `wikipedia`, needs the Hub); the
rest is the command line's defaults (128 x 128 tokens, batches of 8, the closed-form Stage 2) unless given after `--`.

    python benchmarks/cli_prune_memory.py --model smollm2-135m --resume
    python benchmarks/cli_prune_memory.py --model qwen2.5-coder-0.5b --resume -- --num-samples 32

Writes benchmarks/results/cli_prune_memory.json, one row per command (its `key`: the arguments after `prune`, the
temporary `--output` left out; `--resume` skips a command measured already). The pruned checkpoint is deleted.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

RECORD = os.path.join(ROOT, "benchmarks", "results", "cli_prune_memory.json")

# The child: the command line's entry point, stopping itself at exit (SIGSTOP) so that `run_monitored` reads its final
# peak and disk reads before it goes (the parent continues it).
CHILD = (
    "import atexit, os, signal, sys; atexit.register(lambda: os.kill(os.getpid(), signal.SIGSTOP)); "
    "from optimum_gradmap import cli; sys.exit(cli.main(sys.argv[1:]) or 0)"
)


def prune_key(model: str, ratio: float, dtype: str, extra: list[str], dataset: str = "offline:wikipedia") -> list[str]:
    """The arguments after `prune`, the `--output` left out: the row's key, and what plan_accuracy.py names."""
    return [f"offline:{model}", "--pruning-ratio", str(ratio), "--dtype", dtype, "--dataset", dataset, *extra]


def shown_command(key: list[str]) -> str:
    """The command line the row measured, as a person would type it."""
    return shlex.join(["optimum-gradmap", "prune", *key, "--output", "TMP"])


def printed_tail(text: str, lines: int = 40) -> list[str]:
    """The last `lines` lines the run printed, progress bars left out."""
    kept = [line.rstrip() for line in text.replace("\r", "\n").splitlines()]
    return [line for line in kept if line and "it/s]" not in line and "s/it]" not in line][-lines:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="an offline model asset, e.g. smollm2-135m, qwen2.5-coder-0.5b")
    parser.add_argument("--ratio", type=float, default=0.25)
    parser.add_argument("--dtype", default="float32", help="float32: what the plans of these rows assume")
    parser.add_argument("--dataset", default="offline:wikipedia", help="calibration data (the main job's)")
    parser.add_argument("--work", default=None, help="folder for the temporary output (default: the system's)")
    parser.add_argument("--resume", action="store_true", help="skip a command measured already")
    parser.add_argument("extra", nargs="*", help="more options for `prune` (after --)")
    args = parser.parse_args()

    import records
    from main_job_memory import float32_weight_bytes
    from provenance import finish, provenance, wait_until_quiet
    from scale import folder_bytes, run_monitored

    rows = records.read(RECORD) if os.path.exists(RECORD) else []
    key = prune_key(args.model, args.ratio, args.dtype, args.extra, args.dataset)
    if args.resume and any(row["key"] == key and row["exit_code"] == 0 for row in rows):
        print(f"{shown_command(key)}: measured already ({RECORD})")
        return
    row = {"key": key, "command": shown_command(key), "weight_bytes_float32": float32_weight_bytes(args.model)}
    with tempfile.TemporaryDirectory(prefix="cli-prune-", dir=args.work) as folder:
        output = os.path.join(folder, "pruned")
        log = os.path.join(folder, "prune.log")
        command = [sys.executable, "-c", CHILD, "prune", *key, "--output", output]
        wait_until_quiet()
        row["provenance"] = provenance()
        code, seconds, memory = run_monitored(command, log)
        row["provenance"] = finish(row["provenance"])
        row.update(exit_code=code, seconds=round(seconds, 1), memory=memory)
        if code == 0:
            with open(os.path.join(output, "pruning_report.json")) as file:
                report = json.load(file)
            row["removed_layers"] = report.get("removed_layers")
            row["timings"] = report.get("timings")
            row["output_bytes"] = folder_bytes(output)
        with open(log, encoding="utf-8", errors="replace") as file:
            row["printed"] = printed_tail(file.read())
    rows = [existing for existing in rows if existing["key"] != key] + [row]
    os.makedirs(os.path.dirname(RECORD), exist_ok=True)
    records.write(RECORD, rows)
    shown = {name: value for name, value in row.items() if name not in ("provenance", "printed", "memory")}
    shown["memory"] = {name: value for name, value in memory.items() if name != "timeline"}
    print(json.dumps(shown, indent=1))
    if code != 0:
        print("\n".join(row["printed"][-16:]))
        sys.exit(code)


if __name__ == "__main__":
    main()
