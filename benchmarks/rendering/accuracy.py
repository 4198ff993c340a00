"""Accuracy and fidelity (docs/benchmarks/accuracy-and-fidelity.md).

The tables read benchmarks/accuracy.py's records (importing that script pulls torch), with a provenance footnote on
every measured cell: a row of the paired table holds one record row per cell."""

from __future__ import annotations

from collections.abc import Sequence

from common import SELECTIONS  # benchmarks/common.py: the selections of benchmarks/accuracy.py

from .charts import Panel, Point, scatter
from .common import (
    CHANGES,
    Context,
    Table,
    flips_without_boolq,
    footnote,
    load,
    mean_accuracy,
    measured_commit,
    number,
    older_code,
    older_than,
    paired,
    paired_without_boolq,
    perplexity,
)

HEADLINE_RECORDS = (
    ("SmolLM2-135M, 25%", "accuracy-smollm2-135m-0.25-cuda"),
    ("SmolLM2-135M, 40%", "accuracy-smollm2-135m-0.4-cuda"),
    ("Qwen2.5-Coder-0.5B, 25%", "accuracy-qwen2.5-coder-0.5b-0.25"),
)
SELECTION_NAMES = {"gradmap": "GradMAP's", "quality": "`quality` preset's"}
VARIANT_NAMES = {"dense": "dense", "stage1": "Stage 1 alone", "default": "+ default Stage 2", "paper": "+ the paper's Stage 2"}

SCREENING_25 = "accuracy-smollm2-135m-0.25-screening"
SCREENING_40 = "accuracy-smollm2-135m-0.4-screening"
CUDA_25 = "accuracy-smollm2-135m-0.25-cuda"
CUDA_40 = "accuracy-smollm2-135m-0.4-cuda"
WIKIPEDIA, WEB = "offline:wikipedia", "offline:web_text"

PRETTY = {
    "gradmap": "GradMAP",
    "quality": "`quality` preset",
    "sleb": "SLEB",
    "fast": "`fast` preset",
    "block_influence": "Block Influence",
}


# --- rows, their provenance and the changes that concern them ----------------------------------------------------


def row_kinds(row: dict) -> tuple[str, ...]:
    """The kinds of `rendering.common.CHANGES` that concern a row: "stage2" (the outlier threshold, the
    next-token selection) for the default Stage 2 and every variant that chooses lambda by the next-token loss or
    leaves out, clips or preserves outlier tokens."""
    settings = row.get("stage2_settings")
    if settings is None:  # dense, Stage 1 alone
        return ()
    changed = (
        row["variant"] == "default"
        or settings.get("compensation_selection") == "next_token_loss"
        or settings.get("exclude_outlier_tokens")
        or settings.get("outlier_tokens", "keep") != "keep"
    )
    return ("stage2",) if changed else ()


def row_provenance(row: dict, record: dict | None = None) -> dict:
    """A row's provenance, saying when the row was renamed (`renamed_from`) and when it stands for another selection
    whose removed layers are the same (the record's `same_layers`)."""
    provenance = dict(row["provenance"])
    notes = [provenance["note"]] if provenance.get("note") else []
    if row.get("renamed_from"):
        name, _, why = row["renamed_from"].partition(" (")
        notes.append(f"renamed: measured as variant `{name}`" + (f" ({why}" if why else ""))
    twins = [s for s, twin in (record or {}).get("same_layers", {}).items() if twin == row["selection"]]
    if twins:
        same = ", ".join(f"{PRETTY.get(twin, twin)}'s" for twin in twins)
        notes.append(f"{same} removed layers are the same set: measured once, this row stands for both")
    if notes:
        provenance["note"] = "; ".join(note.replace("\n", " ").rstrip(".") for note in notes)
    return provenance


def add_row(table: Table, cells: Sequence[str], marks: Sequence[tuple[int, dict, str, Sequence[str]]]) -> None:
    """`Table.add` with a footnote on several cells, each from its own record row: `(cell, provenance, source, kinds)`,
    the cell marked when its row was measured by code older than a change of `kinds`."""
    cells = list(cells)
    for index, provenance, source, kinds in marks:
        table.notes.append(footnote(provenance, source, kinds))
        cells[index] += f"[^{table.prefix}-{len(table.notes)}]"
        if older_than(provenance, kinds):
            cells[index] += " (older code)"
    table.rows.append(cells)


def mark(row: dict, record: dict, source: str) -> tuple[dict, str, Sequence[str]]:
    return row_provenance(row, record), source, row_kinds(row)


def rows_by_key(record: dict) -> dict[tuple[str, str], dict]:
    return {(row["selection"], row["variant"]): row for row in record["rows"]}


def selections_in(record: dict) -> list[str]:
    """The selections with a Stage 1 row, in the order they were first measured (benchmarks/accuracy.py's)."""
    rows = rows_by_key(record)
    return [s for s in dict.fromkeys(row["selection"] for row in record["rows"]) if (s, "stage1") in rows]


def twins(record: dict) -> dict[str, list[str]]:
    """For each selection of `record`, the selections without rows of their own whose removed layers are the same set
    (the record's `same_layers`, and benchmarks/results/compare-<model>-<ratio>.json's Stage 1 rows)."""
    found: dict[str, list[str]] = {}
    for selection, twin in record.get("same_layers", {}).items():
        found.setdefault(twin, []).append(selection)
    compare = load(f"compare-{record['model']}-{record['ratio']:g}")
    layers = {row["method"]: sorted(row["removed_layers"]) for row in compare["rows"] if not row["stage2"]}
    measured = set(selections_in(record))
    for selection in measured:
        for other, method in SELECTIONS.items():
            if other not in measured and other not in found.get(selection, []) and method in layers:
                if layers[method] == layers.get(SELECTIONS[selection]):
                    found.setdefault(selection, []).append(other)
    return found


def selection_label(selection: str, record: dict, pretty: bool) -> str:
    name = PRETTY.get(selection, selection) if pretty else selection
    same = twins(record).get(selection)
    return f"{name} (= {', '.join(PRETTY[s] for s in same)})" if same else name


def lowers_both(row: dict, stage1: dict) -> bool:
    return all(perplexity(row["evaluation"], d) < perplexity(stage1["evaluation"], d) for d in (WIKIPEDIA, WEB))


def within_one_se(row: dict) -> bool:
    pooled = row["against_stage1"]["pooled"]
    return pooled["difference"] >= -pooled["stderr"]


def meets_goal(row: dict, stage1: dict) -> bool:
    """Issue 38's condition on one row (benchmarks/accuracy.py's `meets_goal`): both held-out perplexities below Stage
    1's and a pooled paired change against Stage 1 of at least -1 standard error."""
    return lowers_both(row, stage1) and within_one_se(row)


def perplexity_pair(row: dict) -> str:
    return " / ".join(f"{entry['perplexity']:,.1f}" for entry in row["evaluation"]["perplexities"])


# --- the headline rows ---------------------------------------------------------------------------------------------


def accuracy_headline(context: Context) -> str:
    """The six headline rows with the standard protocol: Stage 1 alone and both Stage 2s, flips against dense."""
    table = Table(
        "headline",
        (
            "setting | layers of | row | Wikipedia ppl | web ppl | accuracy, mean of 7 | "
            "pooled vs Stage 1 (points) | flips (no BoolQ) | flips (all)"
        ),
        ["---", "---", "---", "---:", "---:", "---:", "---:", "---:", "---:"],
    )
    for setting, source in HEADLINE_RECORDS:
        first = True
        record = load(source)
        for row in record["rows"]:
            evaluation = row["evaluation"]
            accuracy, stderr = mean_accuracy(evaluation["zero_shot"])
            against_dense = row.get("against_dense")
            flips_all = "-"
            if against_dense:
                pooled = against_dense["pooled"]
                flips_all = f"{100 * (pooled['only_a'] + pooled['only_b']) / pooled['num_questions']:.1f}%"
            selection = SELECTION_NAMES.get(row["selection"], "") if row["variant"] != "dense" else ""
            cells = [setting if first else "", selection, VARIANT_NAMES.get(row["variant"], row["variant"])]
            cells += [number(perplexity(evaluation, WIKIPEDIA)), number(perplexity(evaluation, WEB))]
            cells += [f"{100 * accuracy:.1f} ± {100 * stderr:.1f}", paired(row.get("against_stage1"))]
            cells += [f"{100 * flips_without_boolq(against_dense):.1f}%" if against_dense else "-"]
            table.add(
                cells + [flips_all],
                row_provenance(row, record),
                source,
                row_kinds(row),
                cell=2,
            )
            first = False
    return table.markdown()


# --- the headline rows with the standard protocol on the lent GPU --------------------------------------------------

STANDARD_ROWS = (("25%", CUDA_25), ("40%", CUDA_40))


def standard_paired(context: Context) -> str:
    """Each Stage 2 against Stage 1 alone on SmolLM2's headline rows, standard protocol: with and without BoolQ."""
    table = Table(
        "standard-paired",
        "setting, layers of | Stage 1 | default Stage 2 | without BoolQ | the paper's Stage 2 | without BoolQ",
    )
    for ratio, source in STANDARD_ROWS:
        record = load(source)
        rows = rows_by_key(record)
        for selection in selections_in(record):
            stage1 = rows[(selection, "stage1")]
            cells = [f"{ratio}, {selection_label(selection, record, pretty=True)}", perplexity_pair(stage1)]
            marks = [(1, *mark(stage1, record, source))]
            for variant in ("default", "paper"):
                row = rows.get((selection, variant))
                if row is None:
                    cells += ["not measured", ""]
                    continue
                pooled = row["against_stage1"]["pooled"]
                change, stderr = 100 * pooled["difference"], 100 * pooled["stderr"]
                text = f"{change:+.2f} ± {stderr:.2f} ({change / stderr:+.2f} SE, p = {pooled['p_value']:.2g})"
                marks.append((len(cells), *mark(row, record, source)))
                cells.append(f"{f'**{text}**' if meets_goal(row, stage1) else text}; {perplexity_pair(row)}")
                cells.append(paired_without_boolq(row, stage1))
            add_row(table, cells, marks)
    return table.markdown()


# --- what decided the default Stage 2 -------------------------------------------------------------------

DECISION_RECORDS = (SCREENING_25, SCREENING_40)
DECISION_ROWS = (
    ("previous default (`hidden_state`, every token)", "previous_default"),
    ("`next_token+no_outliers`", "next_token+no_outliers"),
    ("`mixed`", "mixed"),
    ("the paper's", "paper"),
)


def decision(context: Context) -> str:
    """Each candidate for the default over SmolLM2-135M's screening rows (every selection at 25% and 40%): its mean
    change against Stage 1 alone, the rows within one standard error and the rows where both perplexities fall."""
    table = Table(
        "decision",
        "Stage 2 | mean change against Stage 1 (points) | rows within -1 SE | lowers both perplexities",
    )
    selections = [(source, selection) for source in DECISION_RECORDS for selection in selections_in(load(source))]
    for label, variant in DECISION_ROWS:
        measured = []
        for source, selection in selections:
            rows = rows_by_key(load(source))
            if (selection, variant) in rows:
                measured.append((source, rows[(selection, variant)], rows[(selection, "stage1")]))
        n = len(measured)
        mean = sum(100 * row["against_stage1"]["pooled"]["difference"] for _, row, _ in measured) / n
        over = "" if n == len(selections) else f" over {n}"
        ratios = sorted({load(source)["ratio"] for source, _, _ in measured})
        only = "" if n == len(selections) else " (" + ", ".join(f"{100 * ratio:g}%" for ratio in ratios) + " only)"
        cells = [
            label + only,
            f"{mean:+.2f}{over}",
            f"{sum(within_one_se(row) for _, row, _ in measured)} of {n}",
            f"{sum(lowers_both(row, stage1) for _, row, stage1 in measured)} of {n}",
        ]
        provenances = [row_provenance(row, load(source)) for source, row, _ in measured]
        kinds = {kind for _, row, _ in measured for kind in row_kinds(row)}
        older = {change for provenance in provenances for change in older_than(provenance, tuple(kinds))}
        dates = sorted(provenance["date"][:16].replace("T", " ") for provenance in provenances)
        commits = sorted({measured_commit(provenance)[:8] for provenance in provenances})
        sources = sorted({source for source, _, _ in measured})
        note = (
            f"the {n} rows `{variant}` of "
            + " and ".join(f"`benchmarks/results/{source}.json`" for source in sources)
            + f", measured {dates[0]} to {dates[-1]} UTC at commits {', '.join(f'`{c}`' for c in commits)}"
            + "; each row's own provenance is in its record"
        )
        note += "".join(f"; {older_code(change)}" for change in CHANGES if change in older)
        table.notes.append(note + ".")
        cells[0] += f"[^{table.prefix}-{len(table.notes)}]" + (" (older code)" if older else "")
        table.rows.append(cells)
    return table.markdown()


# --- the page's opening: the chart and the short table --------------------------------------------------------------

SHORT_SETTINGS = {"SmolLM2-135M, 25%": "SmolLM2 25%", "SmolLM2-135M, 40%": "SmolLM2 40%", "Qwen2.5-Coder-0.5B, 25%": "Qwen 25%"}


def _headline_rows() -> list[tuple[str, str, dict, dict]]:
    """`(setting, source, record, row)` of the headline rows with a comparison against the dense model."""
    return [
        (SHORT_SETTINGS[setting], source, record, row)
        for setting, source in HEADLINE_RECORDS
        for record in [load(source)]
        for row in record["rows"]
        if row["variant"] != "dense" and row.get("against_dense")
    ]


SHORT_VARIANTS = {"stage1": "Stage 1 alone", "default": "+ default Stage 2", "paper": "+ paper's Stage 2"}


def _label(row: dict) -> str:
    return f"{'quality' if row['selection'] == 'quality' else 'GradMAP'}, {SHORT_VARIANTS[row['variant']]}"


def opening_table(context: Context) -> str:
    """Per headline row: web-text perplexity, accuracy and the flips against the dense model (BoolQ left out)."""
    table = Table("accuracy-opening", "setting | row | web ppl | accuracy | flips, no BoolQ")
    previous = None
    for setting, source, record, row in _headline_rows():
        accuracy, _ = mean_accuracy(row["evaluation"]["zero_shot"])
        cells = [setting if setting != previous else "", _label(row), number(perplexity(row["evaluation"], WEB))]
        cells += [f"{100 * accuracy:.1f}", f"{100 * flips_without_boolq(row['against_dense']):.1f}%"]
        table.add(cells, row_provenance(row, record), source, row_kinds(row), cell=1)
        previous = setting
    return table.markdown()


def opening_chart() -> tuple[str, str]:
    """Flips against the dense model (BoolQ left out) against web-text perplexity, per headline row."""
    points = []
    for setting, _, _, row in _headline_rows():
        web, flips = perplexity(row["evaluation"], WEB), 100 * flips_without_boolq(row["against_dense"])
        label = f"{setting}, {_label(row)}: web-text perplexity {web:,.1f}, flips {flips:.1f}%"
        points.append(Point(web, flips, SHORT_VARIANTS[row["variant"]], setting, label))
    title = "Flips against the dense model against web-text perplexity: Stage 1 alone and with each Stage 2"
    panel = Panel("Fidelity against perplexity", "web-text perplexity", "flips, no BoolQ (%)", points, True)
    return title, scatter([panel], title)


CHARTS = {"accuracy-chart": opening_chart}

TABLES = {
    "accuracy-opening": opening_table,
    "accuracy-headline": accuracy_headline,
    "accuracy-standard-paired": standard_paired,
    "accuracy-decision": decision,
}
