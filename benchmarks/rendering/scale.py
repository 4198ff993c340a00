"""Scale (docs/benchmarks/scale.md): real architectures' shapes with random weights, pruned from disk
(benchmarks/scale.py). Time, memory, disk and correctness only: random weights say nothing of quality."""

from __future__ import annotations

import glob
import json
import os

from .common import RESULTS, Context, Table

FLOAT32_BYTES = 4


def scale_records() -> list[tuple[str, dict]]:
    """Every row of every `scale-*.json` record, with its record's name, in name order."""
    rows = []
    for path in sorted(glob.glob(os.path.join(RESULTS, "scale-*.json"))):
        source = os.path.basename(path)[: -len(".json")]
        with open(path, encoding="utf-8") as file:
            rows += [(source, row) for row in json.load(file)]
    return rows


def gib(value: float) -> str:
    return f"{value:,.2f}"


def _parameters(row: dict) -> int:
    """The model's parameter count, from its weight bytes on disk (the safetensors files' tensors, in the record's dtype)."""
    bytes_per_parameter = {"float32": 4, "bfloat16": 2, "float16": 2}[row["dtype"]]
    return row["weight_bytes_on_disk"] // bytes_per_parameter


def prune_from_disk(context: Context) -> str:
    """`optimum-gradmap prune` on a model larger than this machine's memory, its weights on disk: seconds per Stage 1
    round and for Stage 2, peak resident memory (over the float32 weight bytes, the issue's yardstick), what was read
    from disk and written, and whether the checkpoint reloaded to the same logits."""
    table = Table(
        "scale",
        [
            "model (random weights)",
            "weights on disk",
            "calibration",
            "s per Stage 1 round (first, last)",
            "Stage 1 s",
            "Stage 2 s",
            "peak resident GiB (/ fp32 weights)",
            "of which mapped files",
            "read from disk GiB",
            "output GiB",
            "reloaded: logits",
        ],
    )
    for source, row in scale_records():
        if row.get("exit_code") != 0:
            continue
        memory = row["memory"]
        rounds = row["round_seconds"]
        float32_gib = _parameters(row) * FLOAT32_BYTES / 2**30
        reload = row.get("reload", {})
        logits = "equal" if reload.get("equal") else f"max diff {reload.get('max_abs_difference', float('nan')):.2e}"
        table.add(
            [
                f"{row['model']} ({_parameters(row) / 1e9:.2f} B)",
                f"{gib(row['weight_bytes_on_disk'] / 2**30)} GiB {row['dtype']}, `--max-memory {row['key']['max_memory']}`",
                f"{row['key']['num_samples']} x {row['key']['seq_len']}, {row['key']['ratio']:.0%}",
                f"{rounds[0]:,.0f}, {rounds[-1]:,.0f}",
                f"{row['timings']['stage1']:,.0f}",
                f"{row['timings'].get('stage2', 0):,.0f}",
                f"**{gib(memory['peak_resident_gib'])}** ({memory['peak_resident_gib'] / float32_gib:.3f})",
                gib(memory["peak_file_mapped_gib"]),
                gib(memory["read_bytes_gib"]),
                gib(row["output_bytes"] / 2**30),
                logits,
            ],
            row["provenance"],
            source,
        )
    return table.markdown()


TABLES = {
    "scale-prune": prune_from_disk,
}


def main_job_memory(context: Context) -> str:
    """The README's main job run as a child process: its peak resident memory (VmHWM), its own (anonymous) memory at
    its peak, over the model's float32 weight bytes, with what it removed and its perplexities."""
    from .common import load

    table = Table(
        "main-job-memory", ["main job options", "seconds", "peak resident GiB", "peak anonymous GiB", "/ weight bytes", "result"]
    )
    for row in load("main_job_memory"):
        if row["exit_code"] != 0:
            continue
        memory = row["memory"]
        weights_gib = row["weight_bytes_float32"] / 2**30
        printed = row["printed"]
        removed = next((line.split(": ", 1)[1] for line in printed if line.startswith("removed layers")), "?")
        final = next((line.split()[-13] for line in printed if "(the checkpoint reloaded" in line), None)
        table.add(
            [
                " ".join(row["options"]) or "(as the README runs it)",
                f"{row['seconds']:,.0f}",
                f"**{gib(memory['peak_resident_gib'])}**",
                gib(memory["peak_anonymous_gib"]),
                f"{memory['peak_resident_gib'] / weights_gib:.1f}x",
                f"removed {removed}" + (f"; final perplexity {final}" if final else ""),
            ],
            row["provenance"],
            "main_job_memory",
        )
    return table.markdown()


TABLES["main-job-memory"] = main_job_memory


def _stage_seconds_printed(printed: list[str]) -> dict[str, float]:
    """Stage 1's and Stage 2's seconds from the main job's printed line `stage 1: X s   stage 2 (...): Y s`."""
    import re

    for line in printed:
        match = re.match(r"stage 1: ([\d.]+) s\s+stage 2 \([^)]*\): ([\d.]+) s", line)
        if match:
            return {"Stage 1": float(match.group(1)), "Stage 2": float(match.group(2))}
    return {}


def _measured(spec_source: str, key) -> tuple[dict[str, float], float, dict, str] | None:
    """A planned run's measured stage seconds, peak resident bytes, provenance and record."""
    from .common import load

    for row in load(spec_source):
        if spec_source == "main_job_memory" and row["options"] == key and row["exit_code"] == 0:
            return (
                _stage_seconds_printed(row["printed"]),
                row["memory"]["peak_resident_gib"] * 2**30,
                row["provenance"],
                spec_source,
            )
        if spec_source.startswith("scale-") and row.get("key") == key and row.get("exit_code") == 0:
            seconds = {"Stage 1": row["timings"]["stage1"], "Stage 2": row["timings"].get("stage2", 0.0)}
            return seconds, row["memory"]["peak_resident_gib"] * 2**30, row["provenance"], spec_source
    return None


def _range(value) -> tuple[float, float]:
    return (value["low"], value["high"]) if isinstance(value, dict) else (value, value)


def plan_against_run(context: Context) -> str:
    """The plan `--dry-run` prints (benchmarks/plan_accuracy.py) beside the run it planned: each stage's seconds (a
    range where the run's own findings decide, its middle compared) and the peak resident memory."""
    from .common import load

    table = Table(
        "plan",
        ["run", "stage", "planned", "measured", "measured / planned (middle)", "goal"],
    )
    for planned in load("plan_accuracy"):
        measured = _measured(*planned["measured"])
        if measured is None:
            continue
        seconds, peak, provenance, source = measured
        plan = planned["plan"]
        for stage in plan["stages"]:
            if stage["name"] not in seconds:
                continue
            low, high = _range(stage["seconds"])
            middle = (low + high) / 2
            ratio = seconds[stage["name"]] / middle
            planned_text = f"{low:,.0f} s" if low == high else f"{low:,.0f} to {high:,.0f} s"
            table.add(
                [
                    planned["row"],
                    stage["name"],
                    planned_text,
                    f"{seconds[stage['name']]:,.0f} s",
                    f"{ratio:.2f}",
                    "met" if abs(ratio - 1) <= 0.3 else "**not met** (30%)",
                ],
                planned["provenance"],
                "plan_accuracy",
                more=[(3, provenance, source)],
            )
        low, high = _range(plan["peak_bytes"])
        middle = (low + high) / 2
        ratio = peak / middle
        table.add(
            [
                planned["row"],
                "peak resident memory",
                f"{low / 2**30:,.2f} GiB" if low == high else f"{low / 2**30:,.2f} to {high / 2**30:,.2f} GiB",
                f"{peak / 2**30:,.2f} GiB",
                f"{ratio:.2f}",
                "met" if abs(ratio - 1) <= 0.2 else "**not met** (20%)",
            ],
            planned["provenance"],
            "plan_accuracy",
            more=[(3, provenance, source)],
        )
    return table.markdown()


TABLES["plan-against-run"] = plan_against_run
