"""Stage 1 cost (docs/benchmarks/stage1-cost.md): Stage 1 against SLEB's own code, and float32 against bfloat16."""

from __future__ import annotations

import os

from .charts import Panel, Point, scatter
from .common import RESULTS, Context, Table, fraction_range, load, number, paragraph

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
        (
            "setting, calibration | method | removed layers | SLEB's layers | Stage 1 s | share of SLEB's time | "
            "share of our SLEB's time | Wikipedia ppl | web ppl"
        ),
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
            same = sorted(row["removed_layers"]) == sorted(reference["removed_layers"])
            cells = [setting if index == 0 else "", f"`{row['method']}`", str(row["removed_layers"]), "yes" if same else "no"]
            cells += [f"{row['stage1_seconds']:.1f}", f"{row['stage1_seconds'] / reference['stage1_seconds']:.3f}"]
            cells += [f"{row['stage1_seconds'] / ours['stage1_seconds']:.3f}"]
            table.add(
                cells + [number(row["perplexity"][text]) for text in ("offline:wikipedia", "offline:web_text")],
                provenance,
                source,
                cell=1,
            )
    return table.markdown()


# --- the default passes against float32 passes ----------------------------------------------------------------------

PRECISION_RECORDS = (
    ("precision-smollm2-135m-0.25", "dtype-smollm2-135m-0.25"),
    ("precision-smollm2-135m-0.4", "dtype-smollm2-135m-0.4"),
    ("precision-qwen2.5-coder-0.5b-0.25", "dtype-qwen2.5-coder-0.5b-0.25"),
)


def _float32_layers(record: dict, reference: str) -> tuple[list[int], str]:
    """float32's removed layers for a precision record: its own float32 row, else the float32 row of the dtype record of
    the same setting (benchmarks/dtype.py, an earlier commit), and where they come from."""
    own = [row for row in record["rows"] if row["precision"] == "float32"]
    if own:
        return own[0]["removed_layers"], "this run"
    row = next(row for row in load(reference)["rows"] if row["dtype"] == "float32")
    return row["removed_layers"], f"`{reference}.json`, commit `{row['provenance']['commit'][:7]}`"


def precision(context: Context) -> str:
    """The main job with the default passes (`--precision auto`) and with float32 passes (benchmarks/precision.py):
    one row each, then the default against float32."""
    rows = Table(
        "precision",
        (
            "setting | passes | removed layers | fitted layers (lambda) | Stage 1 s | Stage 2 s | recomputed in float32 "
            "(s) | Wikipedia ppl | wall s | peak RSS GiB | quiet"
        ),
        ["---", "---", "---", "---", "---:", "---:", "---", "---:", "---:", "---:", "---"],
    )
    against = Table(
        "precision",
        "default against float32 | float32's layers from | same removed layers | same fitted layers | wall time ratio",
    )
    against.notes = rows.notes
    for source, reference in PRECISION_RECORDS:
        if not os.path.exists(os.path.join(RESULTS, source + ".json")):
            continue
        record = load(source)
        setting = f"{MODEL_NAMES.get(record['model'], record['model'])}, {record['ratio']:.0%}"
        by_setting = {}
        for index, row in enumerate(record["rows"]):
            by_setting[row["precision"]] = row
            fitted = ", ".join(f"{layer} ({value:.2g})" for layer, value in row["compensation_lambda"].items()) or "none"
            passes = row["passes"]
            recomputed = f"{len(passes['recomputed'])} of {passes['decisions']} ({passes['recompute_seconds']:.1f})"
            if passes["computed_in"] == "model dtype":
                recomputed = "none: float32"
            cells = [setting if index == 0 else "", f"`{row['precision']}`", str(row["removed_layers"]), fitted]
            cells += [f"{row['stage1_seconds']:.1f}", f"{row['stage2_seconds']:.1f}", recomputed]
            cells += [f"{row['wikipedia_perplexity']['stage 1 + 2']:.3f}", f"{row['wall_seconds']:.0f}"]
            cells += [f"{row['peak_rss_kib'] / 2**20:.2f}", "yes" if row["provenance"]["quiet"] else "no"]
            rows.add(cells, row["provenance"], source, cell=1)
        auto = by_setting["auto"]
        layers, origin = _float32_layers(record, reference)
        full = by_setting.get("float32")
        same_fits = "yes" if full and full["compensated_layers"] == auto["compensated_layers"] else "no" if full else "-"
        ratio = f"{auto['wall_seconds'] / full['wall_seconds']:.2f}" if full else "-"
        cells = [setting, origin, "yes" if layers == auto["removed_layers"] else "no", same_fits, ratio]
        more = [(0, full["provenance"], source)] if full else []
        against.add(cells, auto["provenance"], source, more=more)
    return rows.markdown(notes=False) + "\n" + against.markdown()


BOUND_RECORDS = (("SmolLM2-135M", "precision-bound-smollm2-135m"), ("Qwen2.5-Coder-0.5B", "precision-bound-qwen2.5-coder-0.5b"))
NEAR_LOWEST = 1.5  # the layers whose float32 score is within this factor of the round's lowest: those a choice compares


def _relative(low: float, exact: float) -> float:
    return abs(low - exact) / abs(exact)


def precision_bound(context: Context) -> str:
    """Each Stage 1 round scored in float32 and under bfloat16 autocast on the same model (benchmarks/precision_bound.py):
    the largest relative difference over the layers near the lowest score and over all layers, whether bfloat16 alone
    chooses float32's layer, and the candidates `SCORE_BOUND` leaves to float32."""
    from optimum_gradmap.precision import SCORE_BOUND, settled_lowest

    table = Table(
        "bound",
        (
            f"model | round | float32 removes | bfloat16 alone removes | largest difference, layers within {NEAR_LOWEST}x "
            f"of the lowest | largest difference, all layers | left to float32 by the bound ({SCORE_BOUND:g})"
        ),
        ["---", "---:", "---:", "---:", "---:", "---:", "---"],
    )
    for name, source in BOUND_RECORDS:
        if not os.path.exists(os.path.join(RESULTS, source + ".json")):
            continue
        for index, done in enumerate(load(source)["rounds"]):
            kept, exact, low = done["kept"], done["float32"], done["bfloat16"]
            lowest = min(exact)
            near = [_relative(b, f) for b, f in zip(low, exact) if f <= NEAR_LOWEST * lowest]
            alone = kept[min(range(len(kept)), key=lambda position: (low[position], kept[position]))]
            _, undecided = settled_lowest({kept[p]: low[p] for p in range(len(kept))}, 1, SCORE_BOUND)
            cells = [name if index == 0 else "", str(index + 1), str(done["removed"]), str(alone)]
            cells += [f"{max(near):.2%}", f"{max(_relative(b, f) for b, f in zip(low, exact)):.2%}"]
            table.add(cells + [", ".join(map(str, undecided)) or "none"], done["provenance"], source, cell=1)
    return table.markdown()


def stage2_bound(context: Context) -> str:
    """Stage 2's held-out losses of every strength and of W' = I in float32 and in bfloat16
    (benchmarks/precision_bound.py): the largest relative difference, and the lambdas each chooses."""
    from optimum_gradmap.precision import LOSS_BOUND

    table = Table(
        "bound",
        "model | fitted layer | lambda, float32 | lambda, bfloat16 | largest loss difference | "
        f"within the bound ({LOSS_BOUND:g})",
        ["---", "---:", "---:", "---:", "---:", "---"],
    )
    for name, source in BOUND_RECORDS:
        if not os.path.exists(os.path.join(RESULTS, source + ".json")):
            continue
        measured = load(source)["stage2"]
        if measured is None:  # Stage 2 not measured yet
            continue
        exact, low = measured["float32"], measured["bfloat16"]
        for index, (fit_exact, fit_low) in enumerate(zip(exact["fits"], low["fits"])):
            pairs = [(fit_low["identity"], fit_exact["identity"])]
            pairs += [(fit_low["losses"][alpha], loss) for alpha, loss in fit_exact["losses"].items()]
            largest = max(_relative(b, f) for b, f in pairs)
            targets = exact.get("targets", exact["compensated_layers"])  # the fitted layers, in the order of the fits
            layer = targets[index] if index < len(targets) else "-"
            cells = [name if index == 0 else "", str(layer), f"{exact['lambda'].get(str(layer), 0):.2g}"]
            cells += [f"{low['lambda'].get(str(layer), 0):.2g}", f"{largest:.4%}", "yes" if largest <= LOSS_BOUND else "no"]
            table.add(cells, measured["provenance"], source, cell=1)
    if not table.rows:
        return "Stage 2's losses: not measured by this script yet.\n"
    return table.markdown()


# --- float32 against bfloat16 ----------------------------------------------------------------------------------------

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
        (
            "setting | dtype | removed layers | fitted layers (lambda) | Stage 1 s | Stage 2 s | "
            "Wikipedia ppl (fp32 / own) | web text ppl (fp32 / own) | quiet"
        ),
    )
    against = Table(
        "dtype",
        (
            "bfloat16 against float32 | same removed layers | "
            "Wikipedia perplexity after both stages (float32 evaluation) | "
            "web text perplexity after both stages (float32 evaluation) | Stage 1 time ratio | "
            "Stage 2 time ratio | both rows quiet (time ratios comparable)"
        ),
    )
    against.notes = rows.notes  # the same rows, the same footnotes
    for source in DTYPE_RECORDS:
        record = load(source)
        setting = _dtype_setting(record)
        for index, row in enumerate(record["rows"]):
            fitted = ", ".join(f"{layer} ({value:.2g})" for layer, value in row["compensation_lambda"].items()) or "none"
            ppl = [f"{row['perplexity_float32'][name]:.3f} / {row['perplexity_own_dtype'][name]:.3f}" for name in EVALUATION]
            cells = [setting if index == 0 else "", row["dtype"], str(row["removed_layers"]), fitted]
            cells += [f"{row['stage1_seconds']:.1f}", f"{row['stage2_seconds']:.1f}", *ppl]
            rows.add(
                cells + ["yes" if row["provenance"]["quiet"] else "no"],
                row["provenance"],
                source,
                ("stage2",),
                cell=1,
            )
        by_dtype = {row["dtype"]: row for row in record["rows"]}
        full, half = by_dtype["float32"], by_dtype["bfloat16"]
        changes = [f"{half['perplexity_float32'][name] / full['perplexity_float32'][name] - 1:+.2%}" for name in EVALUATION]
        cells = [setting, "yes" if full["removed_layers"] == half["removed_layers"] else "no", *changes]
        cells += [f"{half[key] / full[key]:.2f}" for key in ("stage1_seconds", "stage2_seconds")]
        against.add(
            cells + ["yes" if full["provenance"]["quiet"] and half["provenance"]["quiet"] else "no"],
            full["provenance"],
            source,
            ("stage2",),
            more=[(0, half["provenance"], source)],
        )
    return rows.markdown(notes=False) + "\n" + against.markdown()


# --- the page's opening: the chart and the short table --------------------------------------------------------------

PEER_NAMES = {
    "sleb_reference": "SLEB's own code",
    "sleb": "our SLEB",
    "quality": "quality preset",
    "paper": "gradmap (the paper)",
    "fast": "fast preset",
}


def opening_chart() -> tuple[str, str]:
    """Web-text perplexity after Stage 1 against its time as a share of SLEB's own code's, per method and setting."""
    points = []
    for setting, source in PEER_RECORDS:
        rows = load(source)["rows"]
        reference = next(row for row in rows if row["method"] == "sleb_reference")
        for row in rows:
            share, web = row["stage1_seconds"] / reference["stage1_seconds"], row["perplexity"]["offline:web_text"]
            label = f"{setting}, {PEER_NAMES[row['method']]}: {row['stage1_seconds']:,.0f} s, web-text perplexity {web:,.1f}"
            points.append(Point(share, web, PEER_NAMES[row["method"]], ", ".join(setting.split(", ")[:2]), label))
    title = "Web-text perplexity after Stage 1 against Stage 1's time as a share of SLEB's own code's"
    panel = Panel("Quality against Stage 1 time", "Stage 1 time / SLEB's own code's", "web-text perplexity", points, True, True)
    return title, scatter([panel], title)


def precision_opening(context: Context) -> str:
    """The main job's seconds per stage and wall time with the default passes and with float32 passes."""
    table = Table("precision-opening", "setting | passes | Stage 1 s | Stage 2 s | wall s")
    for source, _ in PRECISION_RECORDS:
        if not os.path.exists(os.path.join(RESULTS, source + ".json")):
            continue
        record = load(source)
        setting = f"{MODEL_NAMES.get(record['model'], record['model'])}, {record['ratio']:.0%}"
        for index, row in enumerate(record["rows"]):
            cells = [setting if index == 0 else "", f"`{row['precision']}`", f"{row['stage1_seconds']:.1f}"]
            table.add(cells + [f"{row['stage2_seconds']:.1f}", f"{row['wall_seconds']:.0f}"], row["provenance"], source, cell=1)
    return table.markdown()


def shares_of_sleb(method: str) -> list[float]:
    """Stage 1's time of `method` as a share of SLEB's own code's, one per setting of `PEER_RECORDS`."""
    shares = []
    for _, source in PEER_RECORDS:
        seconds = {row["method"]: row["stage1_seconds"] for row in load(source)["rows"]}
        shares.append(seconds[method] / seconds["sleb_reference"])
    return shares


def main_job_passes() -> tuple[dict, dict]:
    """The main job's `auto` and `float32` rows (benchmarks/precision.py, SmolLM2-135M at 25%)."""
    rows = {row["precision"]: row for row in load(PRECISION_RECORDS[0][0])["rows"]}
    return rows["auto"], rows["float32"]


def answer(context: Context) -> str:
    """The page's answer: the paper's score's and the quality preset's Stage 1 time as a share of SLEB's own code's, and
    the main job's wall time with the default passes as a share of float32's."""
    auto, full = main_job_passes()
    return paragraph(
        f"**GradMAP's score takes {fraction_range(shares_of_sleb('paper'))} of SLEB's time, `--preset quality` "
        f"{fraction_range(shares_of_sleb('quality'))}.** By default Stage 2 passes in bfloat16 where the hardware has it "
        f"(Stage 1 too, on a GPU): the main job in {auto['wall_seconds'] / full['wall_seconds']:.2f} of float32's time."
    )


CHARTS = {"stage1-cost-chart": opening_chart}

TABLES = {
    "stage1-cost-answer": answer,
    "precision-opening": precision_opening,
    "precision": precision,
    "precision-bound": precision_bound,
    "stage2-bound": stage2_bound,
    "stage1-peers": stage1_peers,
    "dtype": dtype,
}
