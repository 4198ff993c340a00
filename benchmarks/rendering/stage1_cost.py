"""Stage 1 cost (docs/benchmarks/stage1-cost.md): Stage 1 against SLEB's own code, one GradMAP round in forward
passes, Stage 1's speed and memory, and Stage 2's time and bfloat16 (issue 55)."""

from __future__ import annotations

import re

from .common import Context, Table, load, number, older_record
from .stage2 import scientific

PEER_RECORDS = (
    ("SmolLM2-135M, 25%, 16 x 128", "stage1_peers-smollm2-135m-0.25-16"),
    ("SmolLM2-135M, 40%, 8 x 128", "stage1_peers-smollm2-135m-0.4-8"),
    ("Qwen2.5-Coder-0.5B, 25%, 8 x 128", "stage1_peers-qwen2.5-coder-0.5b-0.25-8"),
)
MODEL_NAMES = {"smollm2-135m": "SmolLM2-135M", "qwen2.5-coder-0.5b": "Qwen2.5-Coder-0.5B"}


def stage1_peers(context: Context) -> str:
    """Stage 1's seconds of each method against SLEB at the cost of SLEB's own code, one run per setting (the columns
    of benchmarks/stage1_peers.py's table; the busy processes and the load in each row's footnote)."""
    table = Table(
        "peers",
        [
            "setting, calibration",
            "method",
            "removed layers",
            "SLEB's layers",
            "Stage 1 s",
            "share of SLEB's time",
            "share of our SLEB's time",
            "Wikipedia ppl",
            "web ppl",
        ],  # fmt: skip
        ["---", "---", "---", "---", "---:", "---:", "---:", "---:", "---:"],
    )
    for setting, source in PEER_RECORDS:
        rows = load(source)["rows"]
        reference = next(row for row in rows if row["method"] == "sleb_reference")
        ours = next(row for row in rows if row["method"] == "sleb")
        for index, row in enumerate(rows):
            provenance = dict(row["provenance"])
            busy = (
                f"other processes busy at start / end: {len(provenance['others_running_before'])} / "
                f"{len(provenance['others_running_after'])}, 1-minute load before: {provenance['load_before'][0]:.2f}"
            )
            provenance["note"] = busy + (f"; {row['note']}" if row.get("note") else "")
            table.add(
                [
                    setting if index == 0 else "",
                    f"`{row['method']}`",
                    str(row["removed_layers"]),
                    "yes" if sorted(row["removed_layers"]) == sorted(reference["removed_layers"]) else "no",
                    f"{row['stage1_seconds']:.1f}",
                    f"{row['stage1_seconds'] / reference['stage1_seconds']:.3f}",
                    f"{row['stage1_seconds'] / ours['stage1_seconds']:.3f}",
                    number(row["perplexity"]["offline:wikipedia"]),
                    number(row["perplexity"]["offline:web_text"]),
                ],
                provenance,
                source,
                cell=1,
            )
    return table.markdown()


# --- one GradMAP round, in forward passes (issue 39) ---------------------------------------------------------------

ROUND_GROUPS = (
    # (benchmarks/profile_round.py's group, the row's name)
    (
        "model matrix products (mm, addmm, linear)",
        "the model's matrix products: forward with autograd, input-gradient backward, the head's forward and backward",
    ),
    ("attention", "attention, forward and backward"),
    ("per-sample Gram products (aten::bmm)", "per-sample Gram products (`aten::bmm`, the score's own work)"),
    (
        "everything else",
        "everything else (element-wise forward and backward, the loss, the norms' per-sample gradients)",
    ),
)


def profile_round(context: Context) -> str:
    """Where the time of one warm GradMAP round goes, under torch's profiler, in plain forward passes."""
    source = "profile_round-smollm2-135m-16x128-batch8"
    record = load(source)
    table = Table("profile-round", ["part of the round", "forward passes"], ["---", "---:"])
    for group, name in ROUND_GROUPS:
        table.add([name, f"{record['round_groups'][group] / record['forward_seconds']:.2f}"], record["provenance"], source)
    table.add(["total under the profiler", f"{record['round_over_forward']:.2f}"], record["provenance"], source)
    return table.markdown()


# --- Stage 1's speed and memory (issue 4) --------------------------------------------------------------------------


def stage1_speed(context: Context) -> str:
    """One Stage 1 round of SmolLM2-135M at batch 8 against a plain forward pass and against the naive per-sample
    implementation, with issue 4's goals (benchmarks/results/stage1_speed-smollm2-135m-cpu-float32-batch8.json)."""
    source = "stage1_speed-smollm2-135m-cpu-float32-batch8"
    record = load(source)
    figures, seconds = record["figures"], record["seconds"]
    environment = record["environment"]
    provenance = older_record(
        "`python benchmarks/stage1_speed.py --batch-size 8` (the command the page gives); "
        f"{record['calibration']}, {record['dtype']}, {record['device']}; "
        f"{environment['cpu_threads']}-core CPU, shared, torch {environment['torch']}; {record['date']} (the record's "
        "date, no time); the fastest of the repeats"
    )
    mib = 2**20
    same = [key for key in figures if re.fullmatch(r"same_\w+_lowest", key)]
    lowest = [f"same {key[5:-7].replace('k', '8')} lowest" for key in same if figures[key]]  # `k`: the script's 8

    def goal(met: bool) -> str:
        return "met" if met else "**not met**"

    table = Table("stage1-speed", ["figure", "batch 8", "goal (issue 4)"])
    rows = [
        (
            "one round / one plain forward pass over the calibration set",
            f"**{figures['round_time_over_forward_time']:.2f}** ({seconds['fast']:.1f} s / {seconds['forward']:.1f} s)",
            f"<= 2.5: {goal(figures['round_time_over_forward_time'] <= 2.5)}",
        ),
        (
            "forward + loss gradient + input-gradient backward, no per-sample work (floor)",
            f"{figures['gradient_passes_over_forward_time']:.2f} ({seconds['gradient_passes']:.1f} s)",
            "-",
        ),
        (
            "speed-up over the naive per-sample implementation (one backward per sample)",
            f"{figures['speedup_over_naive']:.2f}x ({seconds['naive']:.1f} s / {seconds['fast']:.1f} s)",
            "CPU: modest expected; GPU >= 5x: not measured (no GPU lent)",
        ),
        (
            f"peak extra memory / weight bytes ({record['weight_bytes'] / mib:,.0f} MiB)",
            f"**{figures['peak_memory_over_weight_bytes']:.2f}** ({record['peak_extra_bytes']['fast'] / mib:,.0f} MiB; "
            f"naive {figures['naive_peak_memory_over_weight_bytes']:.2f})",
            f"<= 0.5: {goal(figures['peak_memory_over_weight_bytes'] <= 0.5)} (met at batch 1, below)",
        ),
        (
            "scores vs naive",
            "; ".join(
                [f"max relative difference {scientific(figures['max_relative_score_difference'])}"]
                + (["same first removal"] if figures["same_first_removal"] else [])
                + lowest
            ),
            "<= 1e-4, same layers: "
            + goal(
                figures["max_relative_score_difference"] <= 1e-4 and figures["same_first_removal"] and len(lowest) == len(same)
            ),
        ),
    ]
    for cells in rows:
        table.add(list(cells), provenance, source)
    return table.markdown()


# --- Stage 2 time and bfloat16 (issue 55) --------------------------------------------------------------------------

STAGE2_TIME_RECORDS = (
    ("SmolLM2-135M 25%, before issue 55", "stage2_time-smollm2-135m-0.25-gradmap"),
    ("SmolLM2-135M 25%, issue 55 before its last two changes", "stage2_time-smollm2-135m-0.25-gradmap-issue55"),
    ("SmolLM2-135M 25%, issue 55", "stage2_time-smollm2-135m-0.25-gradmap-issue55-final"),
    ("Qwen2.5-Coder-0.5B 25%, issue 55", "stage2_time-qwen2.5-coder-0.5b-0.25-gradmap-issue55-final"),
    ("SmolLM2-135M 40%, issue 55", "stage2_time-smollm2-135m-0.4-gradmap-issue55-final"),
)
DEFAULT_STAGE2_VARIANTS = ("default", "grid")  # the default Stage 2 (outlier tokens out of the fit), `grid` its search


def stage2_time(context: Context) -> str:
    """Stage 2's seconds of the previous and the current default on GradMAP's layers, one run per row in one process
    per record (benchmarks/stage2_time.py's rows; the date in each row's footnote)."""
    table = Table("stage2-time", ["run", "variant", "Stage 2 seconds", "fitted layers (lambda)", "left alone", "quiet"])
    for label, source in STAGE2_TIME_RECORDS:
        for index, row in enumerate(load(source)["rows"]):
            fitted = ", ".join(f"{layer} ({reg_lambda:.2g})" for layer, reg_lambda in row["compensation_lambda"].items())
            table.add(
                [
                    label if index == 0 else "",
                    row["variant"],
                    f"{row['stage2_seconds']:.1f}",
                    fitted,
                    ", ".join(row["skipped_layers"]) or "none",
                    "yes" if row["provenance"]["quiet"] else "no",
                ],
                row["provenance"],
                source,
                ("stage2",) if row["variant"] in DEFAULT_STAGE2_VARIANTS else (),
                cell=1,
            )
    return table.markdown()


def next_token_selection(context: Context) -> str:
    """The strength each fit of the default Stage 2 chose from the fitted layer on (the library), by the whole model
    per candidate (the reference) and by the golden-section search (benchmarks/next_token_selection.py's table)."""
    source = "next_token_selection-smollm2-135m-0.25-gradmap"
    record = load(source)
    table = Table(
        "next-token",
        ["fitted layer", "grid", "reference", "largest relative loss difference", "golden", "golden passes (of 9)"],
    )
    for fit in record["fits"]:
        difference = f"{fit['largest_relative_difference']:.1e}" if "largest_relative_difference" in fit else "-"
        table.add(
            [
                str(fit["layer"]),
                str(fit["alpha"]),
                str(fit.get("reference_alpha", "not run")),
                difference,
                str(fit["golden_alpha"]),
                str(fit["golden_passes"]),
            ],
            record["provenance"],
            source,
            ("stage2",),
        )
    return table.markdown()


DTYPE_RECORDS = (
    "dtype-smollm2-135m-0.25",
    "dtype-smollm2-135m-k4-16x128",
    "dtype-smollm2-135m-0.4",
    "dtype-qwen2.5-coder-0.5b-0.25",
)
EVALUATION = ("offline:wikipedia", "offline:web_text")


def _dtype_setting(record: dict) -> str:
    size = f"{record['num_layers_to_prune']} layers" if record.get("num_layers_to_prune") else f"{record['ratio']:.0%}"
    return f"{MODEL_NAMES.get(record['model'], record['model'])}, {size}, {record['num_samples']} x 128"


def dtype(context: Context) -> str:
    """GradMAP's Stage 1 and the default Stage 2 from weights loaded in float32 and in bfloat16, then each bfloat16 row
    against the float32 row (benchmarks/dtype.py's two tables, one row per setting)."""
    rows = Table(
        "dtype",
        [
            "setting",
            "dtype",
            "removed layers",
            "fitted layers (lambda)",
            "Stage 1 s",
            "Stage 2 s",
            "Wikipedia ppl (fp32 / own)",
            "web text ppl (fp32 / own)",
            "quiet",
        ],
    )
    against = Table(
        "dtype",
        [
            "bfloat16 against float32",
            "same removed layers",
            "Wikipedia perplexity after both stages (float32 evaluation)",
            "web text perplexity after both stages (float32 evaluation)",
            "Stage 1 time ratio",
            "Stage 2 time ratio",
            "both rows quiet (time ratios comparable)",
        ],
    )
    against.notes = rows.notes  # the same rows, the same footnotes
    for source in DTYPE_RECORDS:
        record = load(source)
        setting = _dtype_setting(record)
        for index, row in enumerate(record["rows"]):
            fitted = ", ".join(f"{layer} ({value:.2g})" for layer, value in row["compensation_lambda"].items()) or "none"
            ppl = [f"{row['perplexity_float32'][name]:.3f} / {row['perplexity_own_dtype'][name]:.3f}" for name in EVALUATION]
            rows.add(
                [
                    setting if index == 0 else "",
                    row["dtype"],
                    str(row["removed_layers"]),
                    fitted,
                    f"{row['stage1_seconds']:.1f}",
                    f"{row['stage2_seconds']:.1f}",
                    *ppl,
                    "yes" if row["provenance"]["quiet"] else "no",
                ],
                row["provenance"],
                source,
                ("stage2",),
                cell=1,
            )
        by_dtype = {row["dtype"]: row for row in record["rows"]}
        full, half = by_dtype["float32"], by_dtype["bfloat16"]
        changes = [f"{half['perplexity_float32'][name] / full['perplexity_float32'][name] - 1:+.2%}" for name in EVALUATION]
        against.add(
            [
                setting,
                "yes" if full["removed_layers"] == half["removed_layers"] else "no",
                *changes,
                f"{half['stage1_seconds'] / full['stage1_seconds']:.2f}",
                f"{half['stage2_seconds'] / full['stage2_seconds']:.2f}",
                "yes" if full["provenance"]["quiet"] and half["provenance"]["quiet"] else "no",
            ],
            full["provenance"],
            source,
            ("stage2",),
            more=[(0, half["provenance"], source)],
        )
    return rows.markdown(notes=False) + "\n" + against.markdown()


def dtype_scores(context: Context) -> str:
    """The four lowest GradMAP scores of SmolLM2-135M's eighth round, in float32, from bfloat16 weights in float32 and
    in bfloat16 (benchmarks/dtype_scores.py's table)."""
    source = "dtype_scores-smollm2-135m-7"
    record = load(source)
    table = Table("dtype-scores", ["computed", "four lowest (layer: score)"])
    for name, scores in record["ways"].items():
        lowest = sorted(scores.items(), key=lambda item: item[1])[:4]
        table.add([name, ", ".join(f"{layer}: {score:.4f}" for layer, score in lowest)], record["provenance"], source)
    return table.markdown()


TABLES = {
    "stage1-peers": stage1_peers,
    "profile-round": profile_round,
    "stage1-speed": stage1_speed,
    "stage2-time": stage2_time,
    "next-token-selection": next_token_selection,
    "dtype": dtype,
    "dtype-scores": dtype_scores,
}
