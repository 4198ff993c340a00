"""Which layers to remove (docs/benchmarks/layer-selection.md): the importance metrics compared and every shortlist
measured (benchmarks/compare.py).

The compare records were written before rows carried their provenance
(benchmarks/provenance.py): each row's footnote gives what the record keeps (the command that measured the method,
the machine, the calibration set's SHA-256) and the commit that added the row to the record (`COMMITTED`)."""

from __future__ import annotations

import functools
from collections.abc import Sequence

from .charts import Panel, Point, scatter
from .common import Context, Table, fraction_range, load, multiple, older_record, option_values, paragraph, typical_fraction

QWEN = "compare-qwen2.5-coder-0.5b-0.25"
SMOLLM2_25 = "compare-smollm2-135m-0.25"
SMOLLM2_40 = "compare-smollm2-135m-0.4"
METRICS = ("dense", "gradmap", "sleb", "block_influence", "taylor", "relative_magnitude", "random")


def _by_method(text: str) -> dict[str, str]:
    """`{method: "commit date time"}` from lines `commit date time: method method ...`."""
    found = {}
    for line in text.strip().splitlines():
        when, _, methods = line.strip().partition(": ")
        found.update((method, when) for method in methods.split())
    return found


# The commit (and its UTC time) that first added a method's rows to a record without per-row provenance: the row was
# measured with the code of that commit or an earlier one. Found with
# `git log -S '"method": "NAME"' -- benchmarks/results/RECORD.json` (the oldest commit listed).
COMMITTED = {
    SMOLLM2_25: _by_method(
        """
        a221dd4 2026-11-22 15:03: dense gradmap sleb block_influence taylor relative_magnitude random
        5576f92 2026-11-23 12:47: gradmap_bound_token
        754531d 2026-11-24 17:23: gradmap_bound_token+top8+halving
        72f21f6 2026-11-24 18:06: gradmap_bound_token+top2
        41b3dba 2026-11-24 21:09: gradmap+top8+halving gradmap_bound_token+top4
        1d625c9 2026-11-25 00:45: gradmap+top4
        a7cf647 2026-11-25 01:45: gradmap+top2
        aaaf665 2026-11-25 03:19: gradmap_bound_token+top8
        c3e9cc6 2026-11-25 12:32: gradmap+top8
        """
    ),
    SMOLLM2_40: _by_method(
        """
        8719278 2026-11-22 15:29: dense block_influence relative_magnitude
        400cb69 2026-11-22 18:15: taylor random gradmap sleb
        7c08cee 2026-11-23 15:32: gradmap_bound_token
        c1b8c41 2026-11-24 19:36: gradmap_bound_token+top8+halving
        60bcda7 2026-11-24 23:54: gradmap_bound_token+top4
        47fc328 2026-11-25 00:21: gradmap_bound_token+top2
        74accac 2026-11-25 02:16: gradmap+top4
        64d0c87 2026-11-25 02:53: gradmap+top2
        19b6866 2026-11-25 03:55: gradmap+top8+halving
        e9bc1d3 2026-11-25 08:29: gradmap_bound_token+top8
        """
    ),
    QWEN: _by_method(
        """
        3edb256 2026-11-22 21:00: dense gradmap block_influence relative_magnitude
        a707df0 2026-11-22 21:29: taylor
        35deccf 2026-11-22 22:26: random
        e3a9add 2026-11-23 02:30: sleb
        e0fe579 2026-11-23 16:52: gradmap_bound_token
        4faec6d 2026-11-24 13:45: gradmap_bound_token+top4
        8ea0e66 2026-11-24 16:57: gradmap_bound_token+top8+halving
        a48aba7 2026-11-24 23:25: gradmap_bound_token+top2
        4689223 2026-11-25 06:20: gradmap+top8+halving
        6741604 2026-11-25 07:46: gradmap+top4
        7e7e06c 2026-11-25 11:38: gradmap+top2
        """
    ),
}


# --- provenance of rows from records without it ----------------------------------------------------------------------


def _command(record: dict, method: str, option: str) -> str:
    """The record's command that measured `method`: the last that names it (an earlier one was stopped before it or
    during it, and `--resume` ran it again), the first command for the dense model."""
    if method == "dense":
        return record["commands"][0]
    return [command for command in record["commands"] if method in option_values(command, option)][-1]


def _committed(source: str, method: str | None) -> str:
    commit, date, time = COMMITTED[source][method].split()
    return f"{'row' if method else 'record'} committed in `{commit}` ({date} {time} UTC)"


def _machine(record: dict) -> str:
    machine = record["machine"]
    return f"{machine['cpu_count']}-core CPU, torch {machine['torch']}"


@functools.cache
def compare_provenance(source: str, method: str) -> dict:
    """A compare.py row's provenance, from what its record keeps (the same for its Stage 2 row)."""
    record = load(source)
    row = next(row for row in record["rows"] if row["method"] == method)
    parts = [
        f"`{_command(record, method, '--metrics')}`",
        _machine(record),
        f"calibration SHA-256 `{record['calibration_sha256'][:8]}`",
    ]
    if row.get("stage1_seconds_in_earlier_invocations", 0) >= 0.05:
        parts.append(f"Stage 1 over two invocations ({row['stage1_seconds_in_earlier_invocations']:.1f} s in the first)")
    parts.append(_committed(source, method))
    return older_record("; ".join(parts))


# --- compare.py's tables ---------------------------------------------------------------------------------------------


def _rows(source: str) -> dict[tuple[str, bool], dict]:
    return {(row["method"], row["stage2"]): row for row in load(source)["rows"]}


def _perplexities(row: dict) -> list[float]:
    return [entry["perplexity"] for entry in row["evaluation"]["perplexities"]]


def _layers(layers: Sequence[int]) -> str:
    return " ".join(str(index) for index in layers) or "-"


def _zero_shot(row: dict) -> str:
    zero_shot = row["evaluation"]["zero_shot"]
    return f"{zero_shot['average_acc']:.4f}" if zero_shot else "-"


def _seconds(value: float | None) -> str:
    return f"{value:.1f}" if value is not None else "-"


def compare_table(context: Context, source: str, prefix: str, methods: Sequence[str]) -> str:
    """compare.py's table (its `markdown(record)`), for the rows of `methods`, in the record's order."""
    rows = [row for row in load(source)["rows"] if row["method"] in methods]
    datasets = [entry["dataset"] for entry in rows[0]["evaluation"]["perplexities"]]
    header = ["method", "Stage 2", "removed layers", *[f"{name} ppl" for name in datasets], "zero-shot avg"]
    table = Table(prefix, header + ["Stage 1 s", "Stage 2 s"])
    for row in rows:
        cells = [row["method"], "yes" if row["stage2"] else "no", _layers(row["removed_layers"])]
        cells += [*[f"{value:.2f}" for value in _perplexities(row)], _zero_shot(row)]
        cells += [_seconds(row["stage1_seconds"]), _seconds(row["stage2_seconds"])]
        table.add(cells, compare_provenance(source, row["method"]), source, ("stage2",) if row["stage2"] else ())
    return table.markdown()


# --- every shortlist, side by side ---------------------------------------------------------------------------------

SETTINGS = (("SmolLM2 25%", SMOLLM2_25), ("SmolLM2 40%", SMOLLM2_40), ("Qwen 25%", QWEN))
SCORES = (("gradmap_bound_token", "gradmap_bound_token"), ("gradmap", "gradmap (the paper)"))
SHORTLISTS = (("", "none"), ("+top2", "2"), ("+top4", "4"), ("+top8+halving", "8, halving"), ("+top8", "8"))


def every_shortlist(context: Context) -> str:
    """Stage 1 alone of both scores with every shortlist measured, at the three settings, with their share of SLEB's
    Stage 1 time. A set equal to SLEB's or to the score's own (without a shortlist) is named so; the lowest
    Wikipedia perplexity of each setting's scores is in bold where it is no higher than SLEB's (as shown, two
    decimals)."""
    table = Table(
        "layers-every-shortlist",
        ("setting | score | shortlist | removed layers | wikipedia / web_text ppl | zero-shot avg | Stage 1 s | of SLEB's time"),
    )
    for setting, source in SETTINGS:
        records = _rows(source)
        sleb = records["sleb", False]
        chosen = [(f"{score}{suffix}", label, shortlist) for score, label in SCORES for suffix, shortlist in SHORTLISTS]
        chosen = [entry for entry in chosen if (entry[0], False) in records]
        best = min(round(_perplexities(records[method, False])[0], 2) for method, _, _ in chosen)
        cells = [setting, "sleb (all layers)", "-", _layers(sleb["removed_layers"])]
        cells += [" / ".join(f"{value:.2f}" for value in _perplexities(sleb)[:2]), _zero_shot(sleb)]
        table.add(
            cells + [_seconds(sleb["stage1_seconds"]), "100%"],
            compare_provenance(source, "sleb"),
            source,
            cell=1,
        )
        for method, label, shortlist in chosen:
            row = records[method, False]
            own = records[method.split("+")[0], False]
            layers = _layers(row["removed_layers"])
            if sorted(row["removed_layers"]) == sorted(sleb["removed_layers"]):
                layers = "SLEB's set"
            elif row is not own and sorted(row["removed_layers"]) == sorted(own["removed_layers"]):
                layers = "the bound's own set" if method.startswith("gradmap_bound_token") else "the score's own set"
            wikipedia, web = _perplexities(row)[:2]
            figures = f"{wikipedia:.2f} / {web:.2f}"
            if round(wikipedia, 2) == best <= round(_perplexities(sleb)[0], 2):  # as shown
                figures = f"**{figures}**"
            cells = [setting, label, shortlist, layers, figures, _zero_shot(row), _seconds(row["stage1_seconds"])]
            table.add(
                cells + [f"{row['stage1_seconds'] / sleb['stage1_seconds']:.1%}"],
                compare_provenance(source, method),
                source,
                cell=1,
            )
    return table.markdown()


# --- the page's tables -----------------------------------------------------------------------------------------------

# --- the page's opening: the chart and the short table --------------------------------------------------------------

# The methods the page opens with, by the name a user gives them.
OPENING = (
    ("sleb", "sleb"),
    ("gradmap_bound_token+top8+halving", "quality preset"),
    ("gradmap", "gradmap (the paper)"),
    ("block_influence", "block_influence"),
    ("relative_magnitude", "fast preset"),
    ("taylor", "taylor"),
)


def _opening_rows() -> list[tuple[str, str, str, dict, dict]]:
    """`(setting, source, label, row, SLEB's row)` of Stage 1 alone, for the methods the page opens with."""
    found = []
    for setting, source in SETTINGS:
        rows = _rows(source)
        found += [(setting, source, label, rows[method, False], rows["sleb", False]) for method, label in OPENING]
    return found


def opening_table(context: Context) -> str:
    """Stage 1 alone at the three settings: each method's web-text perplexity, Stage 1 seconds and share of SLEB's."""
    table = Table("layers-opening", "setting | method | web-text ppl | Stage 1 s | of SLEB's time")
    for setting, source, label, row, sleb in _opening_rows():
        method = next(method for method, name in OPENING if name == label)
        cells = [setting if label == OPENING[0][1] else "", label, f"{_perplexities(row)[1]:,.1f}"]
        cells += [_seconds(row["stage1_seconds"]), f"{row['stage1_seconds'] / sleb['stage1_seconds']:.1%}"]
        table.add(cells, compare_provenance(source, method), source, cell=1)
    return table.markdown()


def opening_chart() -> tuple[str, str]:
    """Web-text perplexity against Stage 1's time, both as a multiple of SLEB's at the same setting (log scales)."""
    points = [
        Point(
            row["stage1_seconds"] / sleb["stage1_seconds"],
            _perplexities(row)[1] / _perplexities(sleb)[1],
            label,
            setting,
            f"{setting}, {label}: web-text perplexity {_perplexities(row)[1]:,.1f} in {row['stage1_seconds']:,.0f} s",
        )
        for setting, _, label, row, sleb in _opening_rows()
    ]
    title = "Web-text perplexity after Stage 1 against Stage 1's time, each as a multiple of SLEB's"
    panel = Panel("Quality against Stage 1 time", "Stage 1 time / SLEB's", "web-text ppl / SLEB's", points, True, True)
    return title, scatter([panel], title)


# --- pruning to a loss budget (benchmarks/budget.py) -------------------------------------------------------------


def budget(context: Context) -> str:
    """Prune to a loss budget: the layers each budget kept removing, and where it stopped
    (benchmarks/results/budget-smollm2-135m-gradmap-16.json)."""
    source = "budget-smollm2-135m-gradmap-16"
    record = load(source)
    dense_loss = record["dense_loss"]
    table = Table(
        "budget",
        [
            "budget",
            "K chosen",
            "removed layers",
            f"calibration loss after (dense {dense_loss:.4f})",
            "refused next",
            "Stage 1 s",
            "Wikipedia / web ppl",
        ],  # fmt: skip
        ["---", "---:", "---", "---", "---", "---:", "---"],
    )
    for row in record["rows"]:
        loss = row["loss_curve"][-1]
        rejected = row.get("rejected")
        refused = f"layer {rejected['layer']} ({100 * (rejected['loss'] / dense_loss - 1):+.1f}%)" if rejected else "-"
        ppl = row["perplexity"]
        layers = row["removed_layers"]
        cells = [f"+{100 * row['budget']:.0f}%", str(len(layers)), " ".join(str(layer) for layer in layers)]
        cells += [f"{loss:.4f} ({100 * (loss / dense_loss - 1):+.1f}%)", refused, f"{row['stage1_seconds']:.0f}"]
        table.add(cells + [f"{ppl['offline:wikipedia']:.2f} / {ppl['offline:web_text']:.2f}"], row["provenance"], source)
    return table.markdown()


def answer(context: Context) -> str:
    """The page's answer, from the opening table's rows: the quality preset's and the paper's score's Stage 1 time as a
    share of SLEB's, and the web-text perplexity of their layers against SLEB's."""
    rows = _opening_rows()

    def shares(label: str) -> list[float]:
        return [row["stage1_seconds"] / sleb["stage1_seconds"] for _, _, name, row, sleb in rows if name == label]

    def web_text(label: str) -> list[float]:
        return [_perplexities(row)[1] / _perplexities(sleb)[1] for _, _, name, row, sleb in rows if name == label]

    quality, paper = web_text("quality preset"), web_text("gradmap (the paper)")
    layers = "SLEB's layers, or better ones" if max(quality) <= 1 + 1e-6 else "layers close to SLEB's"
    return paragraph(
        f"**`--preset quality` removes {layers}, in {fraction_range(shares('quality preset'))} of SLEB's time.** "
        f"The paper's score (`gradmap`, the default) takes {typical_fraction(shares('gradmap (the paper)'))} of it but "
        f"loses: web-text perplexity {multiple(min(paper))}x to {multiple(max(paper))}x SLEB's. Stage 1 alone:"
    )


CHARTS = {"layers-chart": opening_chart}

TABLES = {
    "layer-selection-answer": answer,
    "budget": budget,
    "layers-opening": opening_table,
    "layers-every-shortlist": every_shortlist,
    # every importance metric, with and without the paper's Stage 2
    "layers-metrics-smollm2-25": functools.partial(
        compare_table, source=SMOLLM2_25, prefix="layers-metrics-smollm2-25", methods=METRICS
    ),
    "layers-metrics-smollm2-40": functools.partial(
        compare_table, source=SMOLLM2_40, prefix="layers-metrics-smollm2-40", methods=METRICS
    ),
    "layers-metrics-qwen-25": functools.partial(compare_table, source=QWEN, prefix="layers-metrics-qwen-25", methods=METRICS),
}
