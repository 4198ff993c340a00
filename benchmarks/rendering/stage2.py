"""Stage 2 variants (docs/benchmarks/stage2.md)."""

from __future__ import annotations

import datetime
import shlex
from collections.abc import Sequence

from .common import Context, Table, load, number, older_record

# --- shared by this page's modules (stage1_cost.py, streaming_memory.py) ------------------------------------------


def machine_text(machine: dict) -> str:
    """A record's top-level machine, as the footnotes say it."""
    where = machine.get("accelerator") or f"{machine.get('cpu_count') or machine.get('threads') or '?'}-core CPU"
    return where + (f", torch {machine['torch']}" if machine.get("torch") else "")


def scientific(value: float) -> str:
    """`2.6e-5` rather than Python's `2.6e-05`."""
    mantissa, exponent = f"{value:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


# --- benchmarks/stage2.py's records (issue 19) ----------------------------------------------------------------------


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


def _option(command: str, name: str) -> list[str]:
    """The values given to `--name` in a command line."""
    words = shlex.split(command)
    if f"--{name}" not in words:
        return []
    values = []
    for word in words[words.index(f"--{name}") + 1 :]:
        if word.startswith("--"):
            break
        values.append(word)
    return values


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
            if row["method"] in _option(command, "methods") and row["variant"] in _option(command, "variants")
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


ISSUE19_METHODS = ("gradmap", "sleb", "gradmap_bound_token", "block_influence", "relative_magnitude", "taylor", "random")
ISSUE19_VARIANTS = ("none", "paper", "span_end+auto")


def stage2_variants_smollm2_25(context: Context) -> str:
    """benchmarks/stage2.py's table of SmolLM2-135M at 25%: dense and the seven selections of issue 19 with no Stage 2,
    the paper's and `span_end+auto` (the record's other rows are in the tables further down)."""
    source = "stage2-smollm2-135m-0.25"
    record = load(source)
    table = Table(
        "stage2-smollm2-25",
        [
            "method",
            "Stage 2",
            "removed layers",
            "compensated (lambda)",
            "wikipedia ppl",
            "web_text ppl",
            "zero-shot avg",
            "Stage 2 s",
            "measured here, or copied from",
        ],
    )
    methods = list(dict.fromkeys(row["method"] for row in record["rows"]))  # each method's rows together
    for row in sorted(record["rows"], key=lambda row: methods.index(row["method"])):
        if row["method"] not in ("dense", *ISSUE19_METHODS) or row["variant"] not in ISSUE19_VARIANTS:
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
        rows = [stage2_row(record, method, variant) for variant in ISSUE19_VARIANTS]
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
    """The seven selections at SmolLM2-135M 40%, each Stage 2 variant of issue 19 a column."""
    methods = ("gradmap", "sleb", "gradmap_bound_token", "block_influence", "relative_magnitude", "taylor", "random")
    return _pivot("stage2-smollm2-135m-0.4", "stage2-smollm2-40", methods, {}, against_stage1=False)


def stage2_variants_qwen_25(context: Context) -> str:
    """The seven selections and the shortlists of issue 18 at Qwen2.5-Coder-0.5B 25%, each Stage 2 variant of issue
    19 a column, and `span_end+auto` against Stage 1 alone."""
    source = "stage2-qwen2.5-coder-0.5b-0.25"
    methods = [*ISSUE19_METHODS[:5], "taylor", "random", "gradmap_bound_token+top4", "gradmap_bound_token+top2"]
    labels = {method: f"{method} (issue 18)" for method in methods if "+top" in method}
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
        [
            "Stage 2",
            "calibration of the fit",
            "compensated (lambda)",
            "wikipedia ppl",
            "web_text ppl",
            "zero-shot avg",
            "Stage 2 s",
        ],  # fmt: skip
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
    commands = [command for command in record["commands"] if row["method"] in _option(command, "metrics")]
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
        ["selection", "Stage 2", "removed layers", "wikipedia ppl", "web_text ppl", "zero-shot avg", "Stage 1 s"],
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
        table.add(
            [
                "gradmap+each_round",
                label,
                " ".join(map(str, row["removed_layers"])),
                f"{wikipedia:.2f}",
                f"{web_text:.2f}",
                f"{row['evaluation']['zero_shot']['average_acc']:.4f}",
                f"{row['stage1_seconds']:.1f}",
            ],
            compare_provenance(compare_record, row),
            compare_source,
            cell=1,
        )
    return table.markdown()


# --- benchmarks/quality.py's and benchmarks/evaluation.py's records (before issue 19) -------------------------------


def quality_provenance(record: dict, command: str, more: str = "") -> dict:
    """A benchmarks/quality.py record's provenance: the command the page gives, the record's settings, machine and
    date."""
    calibration, evaluation = record["calibration"], record["evaluation"]
    environment = record["environment"]
    parts = [
        f"`{command}` (the command the page gives)",
        f"{calibration['num_samples']} x {calibration['seq_len']} calibration tokens, the first {evaluation['segments']} "
        "held-out Wikipedia segments",
        f"{environment['threads']}-core CPU, torch {environment['torch']}",
        record["date"] + " (the record's date, no time)",
    ]
    return older_record("; ".join(parts + ([more] if more else [])))


def stage2_main_job_first(context: Context) -> str:
    """Dense, Stage 1 and the paper's Stage 2 on GradMAP's layers of SmolLM2-135M at 25%, every held-out segment."""
    source = "evaluation-smollm2-135m-0.25-limit100"
    record = load(source)
    provenance = older_record(
        f"`{record['command']}` (the record's command), {machine_text(record['machine'])}, no date in the record; "
        "the same three perplexities as `quality-smollm2-135m-layers-lambda-sweep-sum-objective.json` and as the "
        "README's main job printed for its checkpoint saved and reloaded"
    )
    table = Table("stage2-main-job-first", ["model", "held-out perplexity"])
    labels = ("dense", "GradMAP Stage 1 only", "GradMAP Stage 1 + the paper's Stage 2 (closed form)")
    for label, row in zip(labels, record["rows"], strict=True):
        wikipedia = next(entry for entry in row["perplexities"] if entry["dataset"] == "wikipedia")
        table.add([label, f"{wikipedia['perplexity']:.3f}"], provenance, source)
    return table.markdown()


def _clock(date: str, elapsed: str | None = None) -> str:
    """`18:36` from an ISO date, plus an `elapsed` of `/usr/bin/time` (`12:22.15`) when given."""
    start = datetime.datetime.fromisoformat(date)
    if elapsed is None:
        return start.strftime("%H:%M")
    minutes, seconds = elapsed.split(":")
    return (start + datetime.timedelta(minutes=int(minutes), seconds=float(seconds))).strftime("%H:%M")


def main_job_provenance(run: dict) -> dict:
    """A run of benchmarks/results/main_job-smollm2-135m.json (written from the run's log) as a row's provenance."""
    return {
        "commit": run["commit"],
        "date": run["date"],
        "command": run["command"],
        "machine": run["machine"],
        "quiet": run["others_running"].startswith("none"),
        "note": f"load before {run['load_before']}, after {run['load_after']}; other processes: {run['others_running']}",
    }


def stage2_main_job_runs(context: Context) -> str:
    """The README's main job from a fresh clone, each run a row (benchmarks/results/main_job-smollm2-135m.json)."""
    source = "main_job-smollm2-135m"
    table = Table(
        "stage2-main-job-runs",
        [
            "commit",
            "UTC",
            "in all",
            "Stage 1",
            "Stage 2",
            "dense / Stage 1 only / both stages (128 segments)",
            "peak memory",
        ],
    )
    for run in load(source)["runs"]:
        minutes, seconds = run["elapsed"].split(":")
        perplexities = run["perplexity_128_segments"]
        table.add(
            [
                f"{run['commit']} ({run['note']})",
                f"{_clock(run['date'])}-{_clock(run['date'], run['elapsed'])}",
                f"{int(minutes)} min {float(seconds):.0f} s",
                f"{run['stage1_seconds']:.1f} s",
                f"{run['stage2_seconds']:.1f} s",
                f"{perplexities['dense']:.3f} / {perplexities['stage1']:.3f} / {perplexities['both_stages']:.3f}",
                f"{run['max_rss_kb'] / 2**20:.1f} GiB",
            ],
            main_job_provenance(run),
            source,
            ("stage2",),
        )
    return table.markdown()


def stage2_random_removal(context: Context) -> str:
    """Eight of SmolLM2-135M's 30 layers removed at random, three draws."""
    source = "quality-smollm2-135m-0.25-sum-objective"
    record = load(source)
    table = Table("stage2-random", ["random removal", "held-out perplexity"])
    for draw in record["random_removal"]:
        provenance = quality_provenance(
            record, "python benchmarks/quality.py --model smollm2-135m --ratio 0.25", f"seed {draw['seed']}"
        )
        table.add([f"`{draw['removed_layers']}`", number(draw["perplexity"])], provenance, source)
    return table.markdown()


SOLVER_RECORDS = (
    # (objective, record, closed-form key, Adam key, the command the page gives)
    (
        "squared error **summed** per sequence, averaged over sequences",
        "quality-smollm2-135m-0.25-sum-objective",
        "stage1+2 (closed_form)",
        "stage1+2 (adam)",
        "python benchmarks/quality.py --model smollm2-135m --ratio 0.25",
    ),
    (
        "squared error **averaged over all elements** (`nn.MSELoss`)",
        "quality-smollm2-135m-layers-lambda-sweep-sum-objective",
        "stage1+2 (closed_form, lambda=73.728)",
        "stage1+2 (adam, lambda=73.728)",
        "python benchmarks/quality.py --layers 26 25 21 18 14 13 17 10 --solvers closed_form adam --reg-lambdas 73.728 "
        "--random-seeds 0",
    ),
)


def stage2_solvers(context: Context) -> str:
    """The closed form against Adam, with the objective summed per sequence or averaged over elements, on GradMAP's
    layers of SmolLM2-135M at 25% (the lowest perplexity in bold)."""
    table = Table(
        "stage2-solvers",
        ["Stage 2 objective (lambda = 1e-3)", "closed form", "Adam (2000 full-batch steps, lr 1e-3)"],
    )
    best = min(load(source)["perplexity"][key] for _, source, *keys, _ in SOLVER_RECORDS for key in keys)
    for objective, source, *keys, command in SOLVER_RECORDS:
        record = load(source)
        more = "the per-sequence objective with lambda x 128 x 576 = 73.728" if "73.728" in command else ""
        cells = [objective]
        for key in keys:
            value = record["perplexity"][key]
            cells.append(f"**{value:.3f}**" if value == best else f"{value:.3f}")
        table.add(cells, quality_provenance(record, command, more), source)
    _, source, _, _, command = SOLVER_RECORDS[0]
    record = load(source)
    stage1 = f"{record['perplexity']['stage1']:.3f}"
    table.add(["(Stage 1 only, for reference)", stage1, stage1], quality_provenance(record, command), source)
    return table.markdown()


def _quality_model_table(source: str, prefix: str, header: Sequence[str], command: str, random_row: bool) -> str:
    """Dense, Stage 1 only and Stage 1 + the closed-form Stage 2 of one benchmarks/quality.py record."""
    record = load(source)
    provenance = quality_provenance(record, command)
    [(solver_key, solver)] = record["solvers"].items()
    perplexity = record["perplexity"]
    table = Table(prefix, list(header))
    stage1 = f"`{record['removed_layers']}`"
    compensated = ", ".join(map(str, solver["compensated_layers"]))
    rows = [("dense", f"{perplexity['dense']:.3f}")]
    if random_row:
        rows += [
            (
                f"GradMAP Stage 1 only (removed {stage1}, {record['stage1_seconds']:.0f} s)",
                f"{perplexity['stage1']:.3f}",
            ),
            (
                f"GradMAP Stage 1 + Stage 2 (closed form, layer {compensated} compensated, {solver['stage2_seconds']:.0f} s)",
                f"**{perplexity[solver_key]:.3f}**",
            ),
        ]
        rows += [(f"random removal `{draw['removed_layers']}`", f"{draw['perplexity']:.3f}") for draw in record["random_removal"]]
    else:
        rows += [
            (f"Stage 1 only ({stage1})", f"{perplexity['stage1']:.3f}"),
            (
                f"Stage 1 + Stage 2 (closed form, layer {compensated}, {solver['stage2_seconds']:.0f} s)",
                f"**{perplexity[solver_key]:.3f}**",
            ),
        ]
    for cells in rows:
        table.add(list(cells), provenance, source)
    return table.markdown()


def stage2_qwen_quality(context: Context) -> str:
    """Qwen2.5-Coder-0.5B at 25%: dense, GradMAP's Stage 1, the closed-form Stage 2 and a random removal."""
    return _quality_model_table(
        "quality-qwen2.5-coder-0.5b-0.25",
        "stage2-qwen-quality",
        ("model", "held-out perplexity"),
        "python benchmarks/quality.py --model qwen2.5-coder-0.5b --ratio 0.25 --num-samples 32 --max-eval-segments 128 "
        "--solvers closed_form --random-seeds 1",
        random_row=True,
    )


def stage2_mistral(context: Context) -> str:
    """SmolLM2-135M's weights in Mistral's classes: the same layers, the closed-form Stage 2."""
    return _quality_model_table(
        "quality-smollm2-135m-as-mistral-layers-26-25-21-18-14-13-17-10",
        "stage2-mistral",
        ("model (Mistral classes)", "held-out perplexity, first 128 segments"),
        "python benchmarks/quality.py --model smollm2-135m --architecture mistral --layers 26 25 21 18 14 13 17 10 "
        "--solvers closed_form --random-seeds 0 --max-eval-segments 128",
        random_row=False,
    )


TABLES = {
    "stage2-main-job-first": stage2_main_job_first,
    "stage2-main-job-runs": stage2_main_job_runs,
    "stage2-random-removal": stage2_random_removal,
    "stage2-solvers": stage2_solvers,
    "stage2-qwen-quality": stage2_qwen_quality,
    "stage2-mistral": stage2_mistral,
    "stage2-variants-smollm2-25": stage2_variants_smollm2_25,
    "stage2-variants-smollm2-40": stage2_variants_smollm2_40,
    "stage2-variants-qwen-25": stage2_variants_qwen_25,
    "stage2-mixtures": stage2_mixtures,
    "stage2-each-round": stage2_each_round,
}
