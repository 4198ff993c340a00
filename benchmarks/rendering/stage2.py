"""Stage 2 variants (docs/benchmarks/stage2.md)."""

from __future__ import annotations

from collections.abc import Sequence

from .charts import Panel, Point, scatter
from .common import Context, Table, load, machine_text, older_record, option_values, paragraph

# --- benchmarks/stage2.py's records ----------------------------------------------------------------------------


def copied_from(row: dict, record: dict) -> str | None:
    """Where a stage2 record's row was copied from (`None`: measured in that run). The record's paper rows come from
    compare.py's record, a selection with the same removed set as another from that row; rows written before
    `copied_from` was recorded say it by their other keys (benchmarks/stage2.py writes its tables with this too)."""
    if "copied_from" in row:
        return row["copied_from"]
    if "same_model_as" in row:
        return f"COPY of the {row['same_model_as']} row (same removed layers)"
    if "from" in row or row["variant"] == "none":
        return f"COPY of {row.get('from', record.get('stage1_rows_from', 'compare.py'))}"
    return None


def stage2_provenance(record: dict, row: dict) -> dict:
    """A benchmarks/stage2.py row's provenance, from its record (rows carry none): the command that names the row,
    the settings, the machine, and what a copied row copies."""
    settings = record["settings"]
    parts = []
    copy = copied_from(row, record)
    if copy:
        parts.append(f"the row is a {copy}")
    else:
        commands = [
            command
            for command in record["commands"]
            if row["method"] in option_values(command, "--methods") and row["variant"] in option_values(command, "--variants")
        ]
        if len(commands) == 1:
            parts.append(f"`{commands[0]}`")
        elif commands:
            parts.append(f"one of the record's {len(commands)} commands that name the row, the first `{commands[0]}`")
    parts.append(
        f"{settings['num_samples']} x 128 calibration tokens (sha256 {record['calibration_sha256'][:12]}), the first "
        f"{settings['max_eval_segments']} held-out segments of each domain, {settings['task_limit']} questions per task"
    )
    parts.append(machine_text(record["machine"]))
    parts.append("no date in the record")
    return older_record("; ".join(parts))


def stage2_cells(row: dict, record: dict) -> dict[str, str]:
    """The cells of a stage2 record's row, as benchmarks/stage2.py's own table shows them."""
    evaluation = row["evaluation"]
    wikipedia, web_text = (entry["perplexity"] for entry in evaluation["perplexities"])
    average = evaluation["zero_shot"]["average_acc"] if evaluation["zero_shot"] else None
    lambdas = row.get("compensation_lambda") or {}
    compensated = " ".join(
        f"{layer} ({lambdas[str(layer)]:.2g})" if str(layer) in lambdas else f"{layer} (1e-3)"
        for layer in row.get("compensated_layers", [])
    )
    if row.get("uncompensated_layers"):
        compensated += " skipped " + " ".join(str(layer) for layer in row["uncompensated_layers"])
    seconds = row.get("stage2_seconds")
    return {
        "method": row["method"],
        "variant": row["variant"],
        "removed": " ".join(map(str, row["removed_layers"])),
        "compensated": compensated or "-",
        "wikipedia": f"{wikipedia:.2f}",
        "web_text": f"{web_text:.2f}",
        "average": "-" if average is None else f"{average:.4f}",
        "seconds": "-" if seconds is None else f"{seconds:.1f}",
        "copied": copied_from(row, record) or "measured",
    }


def stage2_row(record: dict, method: str, variant: str) -> dict:
    return next(row for row in record["rows"] if row["method"] == method and row["variant"] == variant)


SELECTIONS = ("gradmap", "sleb", "gradmap_bound_token", "block_influence", "relative_magnitude", "taylor", "random")
VARIANTS = ("none", "paper", "span_end+auto")


def stage2_variants_smollm2_25(context: Context) -> str:
    """benchmarks/stage2.py's table of SmolLM2-135M at 25%: dense and the seven selections with no Stage 2,
    the paper's and `span_end+auto` (the record's other rows are in the tables further down)."""
    source = "stage2-smollm2-135m-0.25"
    record = load(source)
    table = Table(
        "stage2-smollm2-25",
        (
            "method | Stage 2 | removed layers | compensated (lambda) | wikipedia ppl | web_text ppl | "
            "zero-shot avg | Stage 2 s | measured here, or copied from"
        ),
    )
    methods = list(dict.fromkeys(row["method"] for row in record["rows"]))  # each method's rows together
    for row in sorted(record["rows"], key=lambda row: methods.index(row["method"])):
        if row["method"] not in ("dense", *SELECTIONS) or row["variant"] not in VARIANTS:
            continue
        cells = stage2_cells(row, record)
        table.add(
            [cells[key] for key in ("method", "variant", "removed", "compensated", "wikipedia", "web_text", "average")]
            + [cells["seconds"], cells["copied"]],
            stage2_provenance(record, row),
            source,
            cell=1,
        )
    return table.markdown()


def _pivot_cell(row: dict) -> str:
    evaluation = row["evaluation"]
    wikipedia, web_text = (entry["perplexity"] for entry in evaluation["perplexities"])
    return f"{wikipedia:.2f} / {web_text:.2f}, {evaluation['zero_shot']['average_acc']:.4f}"


def _pivot(source: str, prefix: str, methods: Sequence[str], labels: dict[str, str], against_stage1: bool) -> str:
    """Wikipedia / web-text perplexity and zero-shot average of each selection (a row) with each Stage 2 variant (a
    column), from one benchmarks/stage2.py record; `against_stage1` adds `span_end+auto`'s change from Stage 1 alone."""
    record = load(source)
    header = [
        "selection",
        "Stage 1 alone (COPY of compare.py's row)",
        "paper's Stage 2 (COPY of compare.py's row)",
        "span_end+auto",
    ]
    if against_stage1:
        header.append("span_end+auto against Stage 1 alone")
    table = Table(prefix, header)
    for method in methods:
        rows = [stage2_row(record, method, variant) for variant in VARIANTS]
        cells = [labels.get(method, method)] + [_pivot_cell(row) for row in rows]
        if against_stage1:
            stage1, _, fitted = (row["evaluation"] for row in rows)
            changes = [
                f"{100 * (after['perplexity'] / before['perplexity'] - 1):.0f}%"
                for before, after in zip(stage1["perplexities"], fitted["perplexities"], strict=True)
            ]
            difference = fitted["zero_shot"]["average_acc"] - stage1["zero_shot"]["average_acc"]
            cells.append(f"{changes[0]} / {changes[1]}, {difference:+.3f}")
        table.add(
            cells,
            stage2_provenance(record, rows[0]),
            source,
            cell=1,
            more=[(index, stage2_provenance(record, row), source) for index, row in enumerate(rows[1:], 2)],
        )
    return table.markdown()


def stage2_variants_smollm2_40(context: Context) -> str:
    """The seven selections at SmolLM2-135M 40%, each Stage 2 variant a column."""
    methods = ("gradmap", "sleb", "gradmap_bound_token", "block_influence", "relative_magnitude", "taylor", "random")
    return _pivot("stage2-smollm2-135m-0.4", "stage2-smollm2-40", methods, {}, against_stage1=False)


def stage2_variants_qwen_25(context: Context) -> str:
    """The seven selections and two shortlists at Qwen2.5-Coder-0.5B 25%, each Stage 2 variant a column, and
    `span_end+auto` against Stage 1 alone."""
    source = "stage2-qwen2.5-coder-0.5b-0.25"
    methods = [*SELECTIONS[:5], "taylor", "random", "gradmap_bound_token+top4", "gradmap_bound_token+top2"]
    labels = {method: f"{method} (shortlist)" for method in methods if "+top" in method}
    for row in load(source)["rows"]:
        if row["variant"] == "span_end+auto" and row.get("same_model_as"):
            labels[row["method"]] = f"{row['method']} (COPY of {row['same_model_as']}'s row: same layers)"
    return _pivot(source, "stage2-qwen-25", methods, labels, against_stage1=True)


MIXTURE_ROWS = (
    # (variant, label, calibration of the fit)
    ("none", "none", "-"),
    ("paper", "paper", "Wikipedia"),
    ("mixed", "paper (`mixed`)", "Wikipedia + web text"),
    ("span_end+auto", "span_end+auto (default)", "Wikipedia"),
    ("span_end+auto+mixed", "span_end+auto+mixed", "Wikipedia + web text"),
)


def stage2_mixtures(context: Context) -> str:
    """GradMAP's layers of SmolLM2-135M at 25%: Stage 2 fitted on Wikipedia or on Wikipedia and web text."""
    source = "stage2-smollm2-135m-0.25"
    record = load(source)
    table = Table(
        "stage2-mixtures",
        ("Stage 2 | calibration of the fit | compensated (lambda) | wikipedia ppl | web_text ppl | zero-shot avg | Stage 2 s"),
    )
    for variant, label, calibration in MIXTURE_ROWS:
        row = stage2_row(record, "gradmap", variant)
        cells = stage2_cells(row, record)
        table.add(
            [label, calibration] + [cells[key] for key in ("compensated", "wikipedia", "web_text", "average", "seconds")],
            stage2_provenance(record, row),
            source,
        )
    return table.markdown()


def compare_provenance(record: dict, row: dict) -> dict:
    """A benchmarks/compare.py row's provenance, from its record (rows carry none)."""
    commands = [command for command in record["commands"] if row["method"] in option_values(command, "--metrics")]
    settings = record["settings"]
    parts = [f"`{commands[0]}`"] if commands else []
    parts.append(
        f"{settings['num_samples']} x 128 calibration tokens (sha256 {record['calibration_sha256'][:12]}), the first "
        f"{settings['max_eval_segments']} held-out segments of each domain, {settings['task_limit']} questions per task"
    )
    parts += [machine_text(record["machine"]), "no date in the record"]
    return older_record("; ".join(parts))


def stage2_each_round(context: Context) -> str:
    """GradMAP's layers with one Stage 2 after Stage 1, against compensation between removals
    (`compensate_each_round`), SmolLM2-135M at 25%."""
    stage2_source, compare_source = "stage2-smollm2-135m-0.25", "compare-smollm2-135m-0.25"
    stage2_record, compare_record = load(stage2_source), load(compare_source)
    compare = {(row["method"], row["stage2"]): row for row in compare_record["rows"]}
    table = Table(
        "stage2-each-round",
        "selection | Stage 2 | removed layers | wikipedia ppl | web_text ppl | zero-shot avg | Stage 1 s",
    )
    once = stage2_row(stage2_record, "gradmap", "span_end+auto")
    stage1 = compare[("gradmap", False)]
    cells = stage2_cells(once, stage2_record)
    table.add(
        ["gradmap", "default, once after Stage 1", cells["removed"], cells["wikipedia"], cells["web_text"]]
        + [cells["average"], f"{stage1['stage1_seconds']:.1f}"],
        stage2_provenance(stage2_record, once),
        stage2_source,
        cell=1,
        more=[(6, compare_provenance(compare_record, stage1), compare_source)],
    )
    for stage2, label in ((False, "the fits made between removals"), (True, "those, then the paper's fit on top")):
        row = compare[("gradmap+each_round", stage2)]
        wikipedia, web_text = (entry["perplexity"] for entry in row["evaluation"]["perplexities"])
        cells = ["gradmap+each_round", label, " ".join(map(str, row["removed_layers"])), f"{wikipedia:.2f}", f"{web_text:.2f}"]
        table.add(
            cells + [f"{row['evaluation']['zero_shot']['average_acc']:.4f}", f"{row['stage1_seconds']:.1f}"],
            compare_provenance(compare_record, row),
            compare_source,
            cell=1,
        )
    return table.markdown()


# --- the page's opening: the chart and the short table --------------------------------------------------------------

OPENING_RECORDS = (
    ("SmolLM2 25%", "stage2-smollm2-135m-0.25"),
    ("SmolLM2 40%", "stage2-smollm2-135m-0.4"),
    ("Qwen 25%", "stage2-qwen2.5-coder-0.5b-0.25"),
)
OPENING_VARIANTS = {"none": "no Stage 2", "paper": "the paper's Stage 2", "span_end+auto": "span_end, lambda auto"}


def _opening_rows() -> list[tuple[str, str, dict, str, dict]]:
    """`(setting, source, record, selection, {variant: row})` for the public selections each record has every variant of."""
    found = []
    for setting, source in OPENING_RECORDS:
        record = load(source)
        for method in SELECTIONS:
            rows = {row["variant"]: row for row in record["rows"] if row["method"] == method and row["variant"] in VARIANTS}
            if method != "random" and len(rows) == len(VARIANTS):
                found.append((setting, source, record, method, rows))
    return found


def _web_text(row: dict) -> float:
    return row["evaluation"]["perplexities"][1]["perplexity"]


def opening_table(context: Context) -> str:
    """Web-text perplexity of each selection with no Stage 2, the paper's and the span-end fits with lambda chosen."""
    table = Table("stage2-opening", "setting | selection | " + " | ".join(OPENING_VARIANTS.values()))
    previous = None
    for setting, source, record, method, rows in _opening_rows():
        cells = [setting if setting != previous else "", method]
        cells += [f"{_web_text(rows[variant]):,.1f}" for variant in OPENING_VARIANTS]
        table.add(cells, stage2_provenance(record, rows["span_end+auto"]), source, cell=1)
        previous = setting
    return table.markdown()


def opening_chart() -> tuple[str, str]:
    """Each selection's Wikipedia against web-text perplexity, with no Stage 2, the paper's and the span-end fits."""
    points = [
        Point(
            row["evaluation"]["perplexities"][0]["perplexity"],
            _web_text(row),
            OPENING_VARIANTS[variant],
            setting,
            f"{setting}, {method}, {OPENING_VARIANTS[variant]}: web-text perplexity {_web_text(row):,.1f}",
        )
        for setting, _, _, method, rows in _opening_rows()
        for variant, row in rows.items()
    ]
    title = "Wikipedia against web-text perplexity of each Stage 1 selection, with no Stage 2, the paper's and span_end's"
    panel = Panel("Held-out perplexity", "Wikipedia perplexity", "web-text perplexity", points, True, True)
    return title, scatter([panel], title)


def answer(context: Context) -> str:
    """The page's answer, from the opening table's selections: for how many the span-end fits lowered both perplexities
    against Stage 1 alone, and for how many the paper's Stage 2 raised web-text perplexity."""
    rows = [rows for _, _, _, _, rows in _opening_rows()]

    def perplexities(row: dict) -> list[float]:
        return [entry["perplexity"] for entry in row["evaluation"]["perplexities"]]

    lowered = sum(
        all(after < before for after, before in zip(perplexities(row["span_end+auto"]), perplexities(row["none"])))
        for row in rows
    )
    raised = sum(_web_text(row["paper"]) > _web_text(row["none"]) for row in rows)
    each = "every selection" if lowered == len(rows) else f"{lowered} of the {len(rows)} selections"
    return paragraph(
        f"**Fitting the kept layer before each removed run (`span_end`) lowered both perplexities for {each}; the "
        f"paper's Stage 2 raised web-text perplexity for {raised} of these {len(rows)}.** Neither repairs zero-shot "
        "accuracy."
    )


CHARTS = {"stage2-chart": opening_chart}

TABLES = {
    "stage2-answer": answer,
    "stage2-opening": opening_table,
    "stage2-variants-smollm2-25": stage2_variants_smollm2_25,
    "stage2-variants-smollm2-40": stage2_variants_smollm2_40,
    "stage2-variants-qwen-25": stage2_variants_qwen_25,
    "stage2-mixtures": stage2_mixtures,
    "stage2-each-round": stage2_each_round,
}
