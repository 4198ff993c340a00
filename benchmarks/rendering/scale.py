"""Scale (docs/benchmarks/scale.md): real architectures' shapes with random weights, pruned from disk
(benchmarks/scale.py). Time, memory, disk and correctness only: random weights say nothing of quality."""

from __future__ import annotations

import glob
import json
import math
import os
import re

from .charts import Panel, Point, scatter
from .common import RESULTS, Context, Table, load, paragraph

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
    round and for Stage 2, peak resident memory and the process's own (anonymous) part of it at its peak (each over
    the float32 weight bytes), what was read from disk and written, and whether the checkpoint reloaded to the same logits."""
    table = Table(
        "scale",
        (
            "model (random weights) | weights on disk | calibration | s per Stage 1 round (first, last) | "
            "Stage 1 s | Stage 2 s | peak resident GiB (/ fp32 weights) | of which mapped files | "
            "peak anonymous GiB (/ fp32 weights) | read from disk GiB | output GiB | reloaded: logits"
        ),
    )
    for source, row in scale_records():
        if row.get("exit_code") != 0 or "round_seconds" not in row:
            continue
        memory = row["memory"]
        rounds = row["round_seconds"]
        float32_gib = _parameters(row) * FLOAT32_BYTES / 2**30
        reload = row.get("reload", {})
        logits = "equal" if reload.get("equal") else f"max diff {reload.get('max_abs_difference', float('nan')):.2e}"
        key = row["key"]
        cells = [f"{row['model']} ({_parameters(row) / 1e9:.2f} B)" + (f", {key['label']}" if key.get("label") else "")]
        cells += [f"{gib(row['weight_bytes_on_disk'] / 2**30)} GiB {row['dtype']}, `--max-memory {key['max_memory']}`"]
        if rounds:
            cells += [f"{key['num_samples']} x {key['seq_len']}, {key['ratio']:.0%}", f"{rounds[0]:,.0f}, {rounds[-1]:,.0f}"]
            cells += [f"{row['timings']['stage1']:,.0f}"]
        else:  # the removed layers given (`--layers-to-prune`): no Stage 1 scoring
            given = len(row["removed_layers"])
            cells += [f"{key['num_samples']} x {key['seq_len']}, {given} layers given", "none: given", "0"]
        cells += [f"{row['timings'].get('stage2', 0):,.0f}"]
        cells += [f"**{gib(memory['peak_resident_gib'])}** ({memory['peak_resident_gib'] / float32_gib:.3f})"]
        cells += [gib(memory["peak_file_mapped_gib"])]
        cells += [f"{gib(memory['peak_anonymous_gib'])} ({memory['peak_anonymous_gib'] / float32_gib:.3f})"]
        cells += [gib(memory["read_bytes_gib"]), gib(row["output_bytes"] / 2**30)]
        table.add(cells + [logits], row["provenance"], source)
    return table.markdown()


def _pruned_rows() -> list[tuple[str, dict]]:
    return [(source, row) for source, row in scale_records() if row.get("exit_code") == 0 and "round_seconds" in row]


def _run_names() -> list[str]:
    """A short name per pruned run, numbered per model in the records' order (the full table below says what
    each run changed)."""
    names, seen = [], {}
    for _, row in _pruned_rows():
        key = row["model"]
        seen[key] = seen.get(key, 0) + 1
        names.append(f"{key} run {seen[key]}" + ("" if row["round_seconds"] else ", layers given"))
    return names


def opening_table(context: Context) -> str:
    """Each run pruned from disk: its peak resident memory, over the float32 weight bytes, its seconds, its reload."""
    table = Table("scale-opening", "run | peak resident GiB | / fp32 weights | Stage 1 + 2 s | reload")
    for (source, row), name in zip(_pruned_rows(), _run_names()):
        float32_gib = _parameters(row) * FLOAT32_BYTES / 2**30
        peak = row["memory"]["peak_resident_gib"]
        seconds = row["timings"].get("stage1", 0) + row["timings"].get("stage2", 0)
        reload = "equal" if row.get("reload", {}).get("equal") else "differ"
        cells = [name, gib(peak), f"{peak / float32_gib:.3f}", f"{seconds:,.0f}", reload]
        table.add(cells, row["provenance"], source)
    return table.markdown()


def opening_chart() -> tuple[str, str]:
    """Peak resident memory over the float32 weight bytes against Stage 1 + 2's seconds, per run pruned from disk."""
    points = []
    for (_, row), name in zip(_pruned_rows(), _run_names()):
        float32_gib = _parameters(row) * FLOAT32_BYTES / 2**30
        peak = row["memory"]["peak_resident_gib"]
        seconds = row["timings"].get("stage1", 0) + row["timings"].get("stage2", 0)
        label = f"{name}: peak {peak:.2f} GiB ({peak / float32_gib:.3f}x the fp32 weights), {seconds:,.0f} s"
        points.append(Point(seconds, peak / float32_gib, row["model"], row["dtype"], label))
    title = "Peak resident memory over the float32 weight bytes against the seconds of Stage 1 and 2, pruned from disk"
    panel = Panel("Memory against time (random weights)", "Stage 1 + 2 seconds", "peak memory / fp32 weights", points)
    return title, scatter([panel], title)


# The memory of the machine kind the records ran on (their provenance records its cores, not its memory).
MACHINE_MEMORY = "24 GB"


def largest_pruned() -> list[dict]:
    """The runs of the largest model pruned from disk, its layers found by Stage 1 (not given)."""
    scored = [row for _, row in _pruned_rows() if row["round_seconds"]]
    largest = max(_parameters(row) for row in scored)
    return [row for row in scored if _parameters(row) == largest]


def largest_machine() -> str:
    """The largest model's machine, as the answers say it: `2-core, 24 GB`."""
    cores = sorted({row["provenance"]["machine"]["cpu_count"] for row in largest_pruned()})
    return f"{'/'.join(map(str, cores))}-core, {MACHINE_MEMORY}"


def answer(context: Context) -> str:
    """The page's answer: the largest model pruned from disk, its peak resident memory over its float32 weight bytes
    (the next 0.05 above the largest), and whether it reloaded to the same logits."""
    rows = largest_pruned()
    peak = max(row["memory"]["peak_resident_gib"] / (_parameters(row) * FLOAT32_BYTES / 2**30) for row in rows)
    bound = (math.floor(peak / 0.05) + 1) * 0.05
    reload = "bit-equal logits" if all(row.get("reload", {}).get("equal") for row in rows) else "logits that differ"
    size = f"{_parameters(rows[0]) / 1e9:.0f}B"
    article = "An" if size.startswith("8") or size[:2] in ("11", "18") else "A"
    return paragraph(
        f"**{article} {size} model prunes from disk on this {largest_machine()} machine in under "
        f"{bound:.2f}x its float32 weight bytes, and reloads to {reload}.** Random weights: these figures measure time, "
        "memory and the machinery, never quality."
    )


CHARTS = {"scale-chart": opening_chart}

TABLES = {
    "scale-answer": answer,
    "scale-opening": opening_table,
    "scale-prune": prune_from_disk,
}


def main_job_memory(context: Context) -> str:
    """The README's main job run as a child process: its peak resident memory (VmHWM), its own (anonymous) memory at
    its peak, over the model's float32 weight bytes, with what it removed and its perplexities."""
    table = Table(
        "main-job-memory", "main job options | seconds | peak resident GiB | peak anonymous GiB | / weight bytes | result"
    )
    for row in load("main_job_memory"):
        if row["exit_code"] != 0:
            continue
        memory = row["memory"]
        weights_gib = row["weight_bytes_float32"] / 2**30
        printed = row["printed"]
        removed = next((line.split(": ", 1)[1] for line in printed if line.startswith("removed layers")), "?")
        final = next(
            (line.split("(the checkpoint reloaded")[0].split()[-1] for line in printed if "(the checkpoint reloaded" in line),
            None,
        )
        options = " ".join(row["options"]) or "(as the README runs it)"
        cells = [options + (" (again, the reload check holding one copy)" if row.get("rerun_of") else "")]
        cells += [f"{row['seconds']:,.0f}", f"**{gib(memory['peak_resident_gib'])}**", gib(memory["peak_anonymous_gib"])]
        cells += [f"{memory['peak_resident_gib'] / weights_gib:.1f}x"]
        cells += [f"removed {removed}" + (f"; final perplexity {final}" if final else "")]
        table.add(cells, row["provenance"], "main_job_memory")
    return table.markdown()


TABLES["main-job-memory"] = main_job_memory


def _stage_seconds_printed(printed: list[str]) -> dict[str, float]:
    """Stage 1's and Stage 2's seconds from the main job's printed line `stage 1: X s   stage 2 (...): Y s`."""
    for line in printed:
        match = re.match(r"stage 1: ([\d.]+) s\s+stage 2 \([^)]*\): ([\d.]+) s", line)
        if match:
            return {"Stage 1": float(match.group(1)), "Stage 2": float(match.group(2))}
    return {}


# what each measurement record ran: the plan-against-run table's `run` cell says which run a row compares with
MEASURED_RUNS = {
    "cli_prune_memory": "`optimum-gradmap prune`",
    "main_job_memory": "main job (evaluation and reload included)",
    "scale-": "`optimum-gradmap prune`, from disk",
}


def measured_run(source: str) -> str:
    """What the record `source` ran (`MEASURED_RUNS`; the `scale-*` records share one entry)."""
    return MEASURED_RUNS["scale-" if source.startswith("scale-") else source]


def _measured(spec_source: str, key) -> tuple[dict[str, float], float, dict, str] | None:
    """A planned run's measured stage seconds, peak resident bytes, provenance and record. A row of
    `cli_prune_memory` adds the command line it ran to its provenance's note (its footnote shows it)."""
    if not os.path.exists(os.path.join(RESULTS, spec_source + ".json")):
        return None  # not measured yet
    for row in load(spec_source):
        if spec_source == "cli_prune_memory" and row["key"] == key and row["exit_code"] == 0:
            seconds = {"Stage 1": row["timings"]["stage1"], "Stage 2": row["timings"].get("stage2", 0.0)}
            note = "; ".join(part for part in (f"ran `{row['command']}`", row["provenance"].get("note")) if part)
            return seconds, row["memory"]["peak_resident_gib"] * 2**30, {**row["provenance"], "note": note}, spec_source
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


def _range(value) -> tuple[float, float, float]:
    """A planned figure's (low, high, typical): the plan's likely value where it gives one, else the middle."""
    if not isinstance(value, dict):
        return value, value, value
    return value["low"], value["high"], value.get("likely", (value["low"] + value["high"]) / 2)


def _summed(ranges: list[tuple[float, float, float]]) -> tuple[float, float, float]:
    """The (low, high, typical) of stages run one after the other."""
    return tuple(sum(part[index] for part in ranges) for index in range(3))


def _planned_text(low: float, high: float, typical: float, unit: str) -> str:
    scale, fmt = (2**30, "{:,.2f}") if unit == "GiB" else (1, "{:,.0f}")
    if low == high:
        return f"{fmt.format(low / scale)} {unit}"
    return f"{fmt.format(typical / scale)} {unit} ({fmt.format(low / scale)} to {fmt.format(high / scale)})"


def plan_against_run(context: Context) -> str:
    """The plan `--dry-run` prints (benchmarks/plan_accuracy.py) beside the run it planned: each stage's seconds and
    the peak resident memory, planned before the run (a range where the run's own findings decide: its likely value
    is compared, the middle where the plan gives none) and once Stage 1 is done (the removed layers known, Stage 2's
    fits with them), and the stages together. The `run` cell says which run was measured (`MEASURED_RUNS`): the
    command line's own `prune`, or the main job, which does more."""
    table = Table(
        "plan",
        ("run | what | planned before the run | planned once Stage 1 is done | measured | measured / planned | goal"),
    )
    for planned in load("plan_accuracy"):
        measured = _measured(*planned["measured"])
        if measured is None:
            continue
        seconds, peak, provenance, source = measured
        before = {stage["name"]: stage for stage in planned["plan"]["stages"]}
        after = {stage["name"]: stage for stage in planned.get("plan_after_stage1", {}).get("stages", [])}
        after_seconds = {name: _range(after[name]["seconds"]) for name in seconds} if after else None
        figures = [
            (name, _range(before[name]["seconds"]), after_seconds[name] if after_seconds else None, seconds[name], "s")
            for name in seconds
        ]
        if len(seconds) > 1:  # the stages together: how long the run takes
            together = _summed([_range(before[name]["seconds"]) for name in seconds])
            together_after = _summed(list(after_seconds.values())) if after_seconds else None
            figures.append((" + ".join(seconds), together, together_after, sum(seconds.values()), "s"))
        after_peak = planned.get("plan_after_stage1", {}).get("peak_bytes")
        peak_after = _range(after_peak) if after_peak is not None else None
        figures.append(("peak resident memory", _range(planned["plan"]["peak_bytes"]), peak_after, peak, "GiB"))
        for name, planned_range, refined_range, value, unit in figures:
            ratio_before = value / planned_range[2]
            ratios = f"{ratio_before:.2f}"
            reference = ratio_before
            if refined_range is not None and refined_range != planned_range:
                reference = value / refined_range[2]
                ratios += f"; {reference:.2f} once Stage 1 is done"
            tolerance = 0.3 if unit == "s" else 0.2
            goal = "met" if abs(ratio_before - 1) <= tolerance else f"**not met** ({tolerance:.0%})"
            if goal != "met" and abs(reference - 1) <= tolerance:
                goal += ", met once Stage 1 is done"
            cells = [f"{planned['row']}: {measured_run(source)}", name, _planned_text(*planned_range, unit)]
            cells += [_planned_text(*refined_range, unit) if refined_range is not None else "-"]
            cells += [f"{value / (2**30 if unit == 'GiB' else 1):,.{2 if unit == 'GiB' else 0}f} {unit}", ratios, goal]
            table.add(
                cells,
                planned["provenance"],
                "plan_accuracy",
                more=[(4, provenance, source)],
            )
    return table.markdown()


TABLES["plan-against-run"] = plan_against_run


def heal_from_disk(context: Context) -> str:
    """`optimum-gradmap heal` on the pruned 8B, student and teacher offloaded: tokens, seconds, tokens per second of
    the training steps (after the teacher's pass), peak resident memory."""
    table = Table(
        "scale-heal",
        (
            "model (random weights) | heal tokens | teacher pass s | whole heal s | training tokens/s | "
            "held-out KL, start -> best | peak resident GiB | of which mapped files"
        ),
    )
    for source, row in scale_records():
        if "heal" not in row or row.get("exit_code") != 0:
            continue
        heal = row["heal"]
        memory = row["memory"]
        cells = [f"{row['model']}, pruned 25%, `--max-memory {row['key']['max_memory']}`", f"{heal['trained_tokens']:,}"]
        cells += [f"{heal['teacher_seconds']:,.0f}", f"{heal['seconds']:,.0f}", f"{heal['tokens_per_second']:,.1f}"]
        cells += [f"{heal['start_kl']:.4f} -> {heal['best_kl']:.4f}", f"**{gib(memory['peak_resident_gib'])}**"]
        table.add(cells + [gib(memory["peak_file_mapped_gib"])], row["provenance"], source)
    return table.markdown()


TABLES["scale-heal"] = heal_from_disk
