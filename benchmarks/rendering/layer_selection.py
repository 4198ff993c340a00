"""Which layers to remove (docs/benchmarks/layer-selection.md): the importance metrics compared (compare.py), the
scores' rankings against the true damage (score_probe.py), the shortlists and their rounds.

The compare, score_probe and rounds records were written before rows carried their provenance
(benchmarks/provenance.py): each row's footnote gives what the record keeps (the command that measured the method,
the machine, the calibration set's SHA-256) and the commit that added the row to the record (`COMMITTED`)."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

from .common import Context, Table, load, older_record

QWEN = "compare-qwen2.5-coder-0.5b-0.25"
SMOLLM2_25 = "compare-smollm2-135m-0.25"
SMOLLM2_40 = "compare-smollm2-135m-0.4"
QWEN_TOP4_ROUNDS = "compare-qwen2.5-coder-0.5b-0.25-gradmap_bound_token+top4-rounds"
ISSUE_6_METHODS = ("dense", "gradmap", "sleb", "block_influence", "taylor", "relative_magnitude", "random")
NAMES = {
    "sleb": "SLEB",
    "block_influence": "Block Influence",
    "relative_magnitude": "relative magnitude",
    "gradmap": "GradMAP",
    "random": "random",
    "taylor": "Taylor+",
}

# The commit (and its UTC time) that first added a method's rows to a record without per-row provenance: the row was
# measured with the code of that commit or an earlier one. Found with
# `git log -S '"method": "NAME"' -- benchmarks/results/RECORD.json` (the oldest commit listed).
COMMITTED = {
    SMOLLM2_25: {
        "dense": "a221dd4 2026-11-22 15:03",
        "gradmap": "a221dd4 2026-11-22 15:03",
        "sleb": "a221dd4 2026-11-22 15:03",
        "block_influence": "a221dd4 2026-11-22 15:03",
        "taylor": "a221dd4 2026-11-22 15:03",
        "relative_magnitude": "a221dd4 2026-11-22 15:03",
        "random": "a221dd4 2026-11-22 15:03",
        "gradmap_bound_token": "5576f92 2026-11-23 12:47",
        "gradmap_bound_token+top8+halving": "754531d 2026-11-24 17:23",
        "gradmap_bound_token+top2": "72f21f6 2026-11-24 18:06",
        "gradmap+top8+halving": "41b3dba 2026-11-24 21:09",
        "gradmap_bound_token+top4": "41b3dba 2026-11-24 21:09",
        "gradmap+top4": "1d625c9 2026-11-25 00:45",
        "gradmap+top2": "a7cf647 2026-11-25 01:45",
        "gradmap_bound_token+top8": "aaaf665 2026-11-25 03:19",
        "gradmap+top8": "c3e9cc6 2026-11-25 12:32",
    },
    SMOLLM2_40: {
        "dense": "8719278 2026-11-22 15:29",
        "block_influence": "8719278 2026-11-22 15:29",
        "relative_magnitude": "8719278 2026-11-22 15:29",
        "taylor": "400cb69 2026-11-22 18:15",
        "random": "400cb69 2026-11-22 18:15",
        "gradmap": "400cb69 2026-11-22 18:15",
        "sleb": "400cb69 2026-11-22 18:15",
        "gradmap_bound_token": "7c08cee 2026-11-23 15:32",
        "gradmap_bound_token+top8+halving": "c1b8c41 2026-11-24 19:36",
        "gradmap_bound_token+top4": "60bcda7 2026-11-24 23:54",
        "gradmap_bound_token+top2": "47fc328 2026-11-25 00:21",
        "gradmap+top4": "74accac 2026-11-25 02:16",
        "gradmap+top2": "64d0c87 2026-11-25 02:53",
        "gradmap+top8+halving": "19b6866 2026-11-25 03:55",
        "gradmap_bound_token+top8": "e9bc1d3 2026-11-25 08:29",
    },
    QWEN: {
        "dense": "3edb256 2026-11-22 21:00",
        "gradmap": "3edb256 2026-11-22 21:00",
        "block_influence": "3edb256 2026-11-22 21:00",
        "relative_magnitude": "3edb256 2026-11-22 21:00",
        "taylor": "a707df0 2026-11-22 21:29",
        "random": "35deccf 2026-11-22 22:26",
        "sleb": "e3a9add 2026-11-23 02:30",
        "gradmap_bound_token": "e0fe579 2026-11-23 16:52",
        "gradmap_bound_token+top4": "4faec6d 2026-11-24 13:45",
        "gradmap_bound_token+top8+halving": "8ea0e66 2026-11-24 16:57",
        "gradmap_bound_token+top2": "a48aba7 2026-11-24 23:25",
        "gradmap+top8+halving": "4689223 2026-11-25 06:20",
        "gradmap+top4": "6741604 2026-11-25 07:46",
        "gradmap+top2": "7e7e06c 2026-11-25 11:38",
    },
    "stage2-smollm2-135m-0.25": {
        "gradmap_bound_token+top8+halving": "72f21f6 2026-11-24 18:06",
        "gradmap+top8+halving": "dedbf61 2026-11-24 21:32",
    },
    "stage2-smollm2-135m-0.4": {"gradmap_bound_token+top8+halving": "c1b8c41 2026-11-24 19:36"},
    "score_probe-smollm2-135m": {None: "b46ec28 2026-11-23 11:06"},
    "score_probe-qwen2.5-coder-0.5b": {None: "41b3dba 2026-11-24 21:09"},
    QWEN_TOP4_ROUNDS: {None: "cb11891 2026-11-24 13:23"},
}


# --- provenance of rows from records without it ----------------------------------------------------------------------


def _listed(command: str, option: str) -> list[str]:
    """The values after `option` in a command line (up to the next option)."""
    words = command.split()
    if option not in words:
        return []
    values = []
    for word in words[words.index(option) + 1 :]:
        if word.startswith("--"):
            break
        values.append(word)
    return values


def _command(record: dict, method: str, option: str) -> str:
    """The record's command that measured `method`: the last that names it (an earlier one was stopped before it or
    during it, and `--resume` ran it again), the first command for the dense model."""
    if method == "dense":
        return record["commands"][0]
    return [command for command in record["commands"] if method in _listed(command, option)][-1]


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


@functools.cache
def stage2_provenance(source: str, method: str) -> dict:
    """A stage2.py row's (variant `span_end+auto`) provenance, from what its record keeps."""
    record = load(source)
    row = next(row for row in record["rows"] if row["method"] == method and row["variant"] == "span_end+auto")
    parts = [f"`{_command(record, method, '--methods')}`", _machine(record)]
    if row.get("same_model_as"):
        parts.append(f"the same layers as `{row['same_model_as']}`'s row, whose figures it reuses (`same_model_as`)")
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
        cells = [
            row["method"],
            "yes" if row["stage2"] else "no",
            _layers(row["removed_layers"]),
            *[f"{value:.2f}" for value in _perplexities(row)],
            _zero_shot(row),
            _seconds(row["stage1_seconds"]),
            _seconds(row["stage2_seconds"]),
        ]
        table.add(cells, compare_provenance(source, row["method"]), source, ("stage2",) if row["stage2"] else ())
    return table.markdown()


def _short(value: float) -> str:
    """A perplexity with two decimals, or to the unit with separators from 1,000 on."""
    return f"{value:,.0f}" if value >= 1000 else f"{value:.2f}"


def stage1_ranking(context: Context, source: str, prefix: str) -> str:
    """The issue-6 metrics ranked by held-out Wikipedia perplexity after Stage 1 (ties share a rank)."""
    rows = _rows(source)
    ranked = sorted((rows[method, False] for method in NAMES), key=lambda row: _perplexities(row)[0])
    table = Table(prefix, ["rank", "method", "Wikipedia ppl", "web-text ppl"])
    for row in ranked:
        wikipedia, web = _perplexities(row)[:2]
        rank = 1 + sum(_perplexities(other)[0] < wikipedia for other in ranked)
        tied = sum(_perplexities(other)[0] == wikipedia for other in ranked) > 1
        table.add(
            [f"{rank} (tied)" if tied else str(rank), NAMES[row["method"]], _short(wikipedia), _short(web)],
            compare_provenance(source, row["method"]),
            source,
            cell=1,
        )
    return table.markdown()


def stage2_effect(context: Context, source: str, prefix: str) -> str:
    """Held-out Wikipedia perplexity of each issue-6 metric, Stage 1 alone and with the paper's Stage 2; metrics with
    the same figures (the same layers) share a row."""
    rows = _rows(source)
    groups: dict[tuple[float, float], list[str]] = {}
    for method in sorted(NAMES, key=lambda method: _perplexities(rows[method, False])[0]):
        key = (_perplexities(rows[method, False])[0], _perplexities(rows[method, True])[0])
        groups.setdefault(key, []).append(method)
    table = Table(prefix, ["method", "Wikipedia ppl, Stage 1 -> + Stage 2"])
    for (alone, both), methods in groups.items():
        provenances = [compare_provenance(source, method) for method in methods]
        table.add(
            [", ".join(NAMES[method] for method in methods), f"{_short(alone)} -> {_short(both)}"],
            provenances[0],
            source,
            ("stage2",),
            more=[(0, provenance, source) for provenance in provenances[1:]],
        )
    return table.markdown()


STAGE2_LABELS = {"no": "no", "paper": "paper's", "default": "default (span end, auto)"}
BOLD_COLUMNS = {"wiki": 3, "web": 4, "zero-shot": 5, "stage1": 6}


def selection(
    context: Context,
    source: str,
    prefix: str,
    rows: Sequence[str],
    bold: Sequence[str] = (),
    same: bool = False,
    stage2_source: str | None = None,
) -> str:
    """Chosen rows of a compare.py record, without the Stage 2 seconds. A row is `METHOD` (Stage 1 alone),
    `METHOD:paper` (the paper's Stage 2, compare.py's) or `METHOD:default` (the default Stage 2, from the stage2.py
    record `stage2_source`, with the Stage 1 seconds of the compare row); a leading `**` sets the method and the
    `bold` columns in bold. `same`: a Stage 2 row whose layers are those of its method's Stage 1 row above reads
    "the same". GradMAP's own score is labelled "gradmap (the paper)"."""
    records = _rows(source)
    table = Table(prefix, ["method", "Stage 2", "removed layers", "wikipedia ppl", "web_text ppl", "zero-shot avg", "Stage 1 s"])
    shown: dict[str, list[int]] = {}
    for spec in rows:
        strong = spec.startswith("**")
        method, _, variant = spec.removeprefix("**").partition(":")
        variant = variant or "no"
        alone = records[method, False]
        more = []
        if variant == "default":
            row = next(
                row for row in load(stage2_source)["rows"] if row["method"] == method and row["variant"] == "span_end+auto"
            )
            provenance, row_source = stage2_provenance(stage2_source, method), stage2_source
            more = [(6, compare_provenance(source, method), source)]
        else:
            row = records[method, variant == "paper"]
            provenance, row_source = compare_provenance(source, method), source
        layers = _layers(row["removed_layers"])
        if variant != "no" and same and shown.get(method) == row["removed_layers"]:
            layers = "the same"
        if variant == "no":
            shown[method] = row["removed_layers"]
        wikipedia, web = _perplexities(row)[:2]
        cells = [
            "gradmap (the paper)" if method == "gradmap" else method,
            STAGE2_LABELS[variant],
            layers,
            f"{wikipedia:.2f}",
            f"{web:.2f}",
            _zero_shot(row),
            _seconds(alone["stage1_seconds"]),
        ]
        if strong:
            for index in [0] + [BOLD_COLUMNS[name] for name in bold]:
                cells[index] = f"**{cells[index]}**"
        table.add(cells, provenance, row_source, ("stage2",) if variant != "no" else (), more=more)
    return table.markdown()


# --- the rounds of a shortlist -------------------------------------------------------------------------------------


def _shortlist(round_: dict, marked: Sequence[int] = ()) -> str:
    """The round's verified layers in score order (lowest first), each with the mean loss without it."""
    verified = round_["verified"]
    order = sorted(verified, key=lambda layer: round_["scores"][layer])
    return ", ".join(f"{layer}: {verified[layer]:.4f}{'*' if int(layer) in marked else ''}" for layer in order)


def rounds_table(context: Context, source: str, method: str, prefix: str, score: str, finalists: str | None = None) -> str:
    """Each round of a compare.py row's Stage 1 (`stage1_rounds`): the shortlist with the mean calibration loss
    without each candidate, the layer removed, and SLEB's. `finalists`: a method whose rounds measured every
    candidate on every sequence (an unhalved shortlist, `QWEN_TOP4_ROUNDS`'s); a candidate whose mean loss equals the
    one that run measured from the same model state ran on every sequence, and so reached the last rung (marked *,
    as the layer removed is)."""
    records = _rows(source)
    row, sleb = records[method, False], records["sleb", False]
    full = load(finalists)["rounds"] if finalists else []
    header = ["round", f"shortlist (lowest {score} first): mean loss without it", "removed", "SLEB removed"]
    table = Table(prefix, header)
    for index, round_ in enumerate(row["stage1_rounds"]):
        removed = row["removed_layers"][index]
        marked = [removed] if finalists else []
        before = row["removed_layers"][:index]
        if index < len(full) and [layer for past in full[:index] for layer in past["removed"]] == before:
            for layer, loss in round_["verified"].items():
                other = full[index]["verified"].get(layer)
                if other is not None and math.isclose(loss, other, rel_tol=1e-6):
                    marked.append(int(layer))
        table.add(
            [str(index + 1), _shortlist(round_, marked), str(removed), str(sleb["removed_layers"][index])],
            compare_provenance(source, method),
            source,
            more=[(3, compare_provenance(source, "sleb"), source)],
        )
    return table.markdown()


def top4_rounds(context: Context) -> str:
    """The rounds of the bound's unhalved shortlist of four on Qwen, from its Stage 1 checkpoint file."""
    record = load(QWEN_TOP4_ROUNDS)
    sleb = _rows(QWEN)["sleb", False]
    command = _command(load(QWEN), "gradmap_bound_token+top4", "--metrics")
    provenance = older_record(
        f"the Stage 1 checkpoint of `{command}` (its machine: {_machine(load(QWEN))}); {_committed(QWEN_TOP4_ROUNDS, None)}"
    )
    table = Table(
        "layers-qwen-bound4-rounds",
        ["round", "shortlist (lowest bound score first): loss without it", "removed", "SLEB removed", "seconds"],
    )
    for index, round_ in enumerate(record["rounds"]):
        table.add(
            [
                str(index + 1),
                _shortlist(round_),
                " ".join(str(layer) for layer in round_["removed"]),
                str(sleb["removed_layers"][index]),
                f"{round_['seconds']:.0f}",
            ],
            provenance,
            QWEN_TOP4_ROUNDS,
            more=[(3, compare_provenance(QWEN, "sleb"), QWEN)],
        )
    return table.markdown()


# --- score_probe.py ----------------------------------------------------------------------------------------------


def score_probe(context: Context, source: str, prefix: str) -> str:
    """score_probe.py's table (its `markdown(record)` without the line above it), sorted by Spearman correlation."""
    record = load(source)
    provenance = older_record(
        f"`{record['commands'][0]}`; {_machine(record)}; calibration SHA-256 `{record['calibration_sha256'][:8]}`; "
        + _committed(source, None)
    )
    table = Table(
        prefix,
        ["score", "Spearman vs true damage", "its first choice (true rank)", "true best layer's rank in it", "seconds"],
    )
    for name, entry in sorted(record["scores"].items(), key=lambda item: -item[1]["spearman"]):
        table.add(
            [
                "gradmap (the paper's Eq. 5)" if name == "gradmap" else name,
                f"{entry['spearman']:.3f}",
                f"layer {entry['first_choice']} ({entry['first_choice_true_rank']})",
                str(entry["true_best_rank_in_score"]),
                f"{entry['seconds']:.1f}{'*' if entry.get('shared_pass') else ''}",
            ],
            provenance,
            source,
        )
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
        [
            "setting",
            "score",
            "shortlist",
            "removed layers",
            "wikipedia / web_text ppl",
            "zero-shot avg",
            "Stage 1 s",
            "of SLEB's time",
        ],
    )
    for setting, source in SETTINGS:
        records = _rows(source)
        sleb = records["sleb", False]
        chosen = [(f"{score}{suffix}", label, shortlist) for score, label in SCORES for suffix, shortlist in SHORTLISTS]
        chosen = [entry for entry in chosen if (entry[0], False) in records]
        best = min(round(_perplexities(records[method, False])[0], 2) for method, _, _ in chosen)
        table.add(
            [
                setting,
                "sleb (all layers)",
                "-",
                _layers(sleb["removed_layers"]),
                " / ".join(f"{value:.2f}" for value in _perplexities(sleb)[:2]),
                _zero_shot(sleb),
                _seconds(sleb["stage1_seconds"]),
                "100%",
            ],
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
            table.add(
                [
                    setting,
                    label,
                    shortlist,
                    layers,
                    figures,
                    _zero_shot(row),
                    _seconds(row["stage1_seconds"]),
                    f"{row['stage1_seconds'] / sleb['stage1_seconds']:.1%}",
                ],
                compare_provenance(source, method),
                source,
                cell=1,
            )
    return table.markdown()


# --- the page's tables -----------------------------------------------------------------------------------------------

BOUND = "gradmap_bound_token"
HALVING = "gradmap_bound_token+top8+halving"


def _selection(source: str, prefix: str, rows: Sequence[str], **options) -> functools.partial:
    return functools.partial(selection, source=source, prefix=prefix, rows=rows, **options)


TABLES = {
    # importance metrics compared (issue 6)
    "layers-issue6-smollm2-25": functools.partial(
        compare_table, source=SMOLLM2_25, prefix="layers-issue6-smollm2-25", methods=ISSUE_6_METHODS
    ),
    "layers-issue6-smollm2-40": functools.partial(
        compare_table, source=SMOLLM2_40, prefix="layers-issue6-smollm2-40", methods=ISSUE_6_METHODS
    ),
    "layers-issue6-qwen-25": functools.partial(
        compare_table, source=QWEN, prefix="layers-issue6-qwen-25", methods=ISSUE_6_METHODS
    ),
    "layers-qwen-ranking": functools.partial(stage1_ranking, source=QWEN, prefix="layers-qwen-ranking"),
    "layers-qwen-stage2": functools.partial(stage2_effect, source=QWEN, prefix="layers-qwen-stage2"),
    # scores from the paper's bound (issue 18)
    "layers-probe-smollm2": functools.partial(score_probe, source="score_probe-smollm2-135m", prefix="layers-probe-smollm2"),
    "layers-probe-qwen": functools.partial(score_probe, source="score_probe-qwen2.5-coder-0.5b", prefix="layers-probe-qwen"),
    "layers-smollm2-25-bound": _selection(
        SMOLLM2_25, "layers-smollm2-25-bound", ["sleb", BOUND, "relative_magnitude", "gradmap"]
    ),
    "layers-smollm2-25-quality": _selection(
        SMOLLM2_25,
        "layers-smollm2-25-quality",
        ["sleb", f"**{HALVING}", BOUND, f"{HALVING}:paper"],
        bold=("wiki", "web", "zero-shot"),
    ),
    "layers-smollm2-25-gradmap8": _selection(
        SMOLLM2_25,
        "layers-smollm2-25-gradmap8",
        ["sleb", "gradmap+top8+halving", "gradmap", "gradmap+top8+halving:paper", "gradmap+top8+halving:default"],
        stage2_source="stage2-smollm2-135m-0.25",
    ),
    "layers-smollm2-25-gradmap8-unhalved": _selection(
        SMOLLM2_25,
        "layers-smollm2-25-gradmap8-unhalved",
        ["gradmap+top8", "gradmap+top8+halving", "gradmap+top8:paper"],
        same=True,
    ),
    "layers-smollm2-25-gradmap4": _selection(
        SMOLLM2_25,
        "layers-smollm2-25-gradmap4",
        ["gradmap+top4", "gradmap", "gradmap+top8+halving", "gradmap+top4:paper"],
        same=True,
    ),
    "layers-smollm2-25-gradmap2": _selection(
        SMOLLM2_25,
        "layers-smollm2-25-gradmap2",
        ["gradmap+top2", "gradmap+top4", "gradmap", "gradmap+top2:paper"],
        same=True,
    ),
    "layers-smollm2-40-bound": _selection(
        SMOLLM2_40, "layers-smollm2-40-bound", ["sleb", BOUND, "relative_magnitude", "block_influence", "gradmap"]
    ),
    "layers-smollm2-40-quality": _selection(
        SMOLLM2_40,
        "layers-smollm2-40-quality",
        ["sleb", f"**{HALVING}", BOUND, f"{HALVING}:paper", f"{HALVING}:default"],
        bold=("wiki", "web", "stage1"),
        same=True,
        stage2_source="stage2-smollm2-135m-0.4",
    ),
    "layers-smollm2-40-bound4": _selection(
        SMOLLM2_40,
        "layers-smollm2-40-bound4",
        ["sleb", f"**{BOUND}+top4", HALVING, f"{BOUND}+top4:paper"],
        bold=("wiki", "web", "stage1"),
        same=True,
    ),
    "layers-smollm2-40-bound2": _selection(
        SMOLLM2_40,
        "layers-smollm2-40-bound2",
        [f"**{BOUND}+top2", f"{BOUND}+top2:paper"],
        bold=("wiki", "web", "stage1"),
        same=True,
    ),
    "layers-smollm2-40-bound8-unhalved": _selection(
        SMOLLM2_40,
        "layers-smollm2-40-bound8-unhalved",
        ["sleb", f"{BOUND}+top8", HALVING, f"{BOUND}+top8:paper"],
        same=True,
    ),
    "layers-smollm2-40-gradmap4": _selection(
        SMOLLM2_40,
        "layers-smollm2-40-gradmap4",
        ["sleb", "gradmap+top4", "gradmap", "gradmap+top4:paper"],
        same=True,
    ),
    "layers-smollm2-40-gradmap2": _selection(
        SMOLLM2_40, "layers-smollm2-40-gradmap2", ["gradmap+top2", "gradmap+top2:paper"], same=True
    ),
    "layers-smollm2-40-gradmap8": _selection(
        SMOLLM2_40, "layers-smollm2-40-gradmap8", ["gradmap+top8+halving", "gradmap+top8+halving:paper"], same=True
    ),
    "layers-qwen-bound": _selection(
        QWEN, "layers-qwen-bound", ["sleb", "block_influence", "relative_magnitude", BOUND, "gradmap"]
    ),
    "layers-qwen-bound4": _selection(
        QWEN, "layers-qwen-bound4", ["sleb", "block_influence", f"{BOUND}+top4", BOUND, f"{BOUND}+top4:paper"]
    ),
    "layers-qwen-bound4-rounds": top4_rounds,
    "layers-qwen-quality": _selection(
        QWEN,
        "layers-qwen-quality",
        ["sleb", f"**{HALVING}", f"{BOUND}+top4", "block_influence", BOUND, "gradmap", "sleb:paper", f"{HALVING}:paper"],
        bold=("wiki", "web", "stage1"),
    ),
    "layers-qwen-quality-rounds": functools.partial(
        rounds_table,
        source=QWEN,
        method=HALVING,
        prefix="layers-qwen-quality-rounds",
        score="bound score",
        finalists=QWEN_TOP4_ROUNDS,
    ),
    "layers-qwen-bound2": _selection(
        QWEN,
        "layers-qwen-bound2",
        ["sleb", HALVING, f"{BOUND}+top4", f"{BOUND}+top2", BOUND, f"{BOUND}+top2:paper"],
    ),
    "layers-qwen-gradmap8": _selection(
        QWEN,
        "layers-qwen-gradmap8",
        ["sleb", HALVING, BOUND, "gradmap+top8+halving", "gradmap", "gradmap+top8+halving:paper"],
    ),
    "layers-qwen-gradmap8-rounds": functools.partial(
        rounds_table, source=QWEN, method="gradmap+top8+halving", prefix="layers-qwen-gradmap8-rounds", score="Fisher trace"
    ),
    "layers-qwen-gradmap4": _selection(
        QWEN, "layers-qwen-gradmap4", ["sleb", "gradmap+top8+halving", "gradmap+top4", "gradmap", "gradmap+top4:paper"]
    ),
    "layers-qwen-gradmap4-rounds": functools.partial(
        rounds_table, source=QWEN, method="gradmap+top4", prefix="layers-qwen-gradmap4-rounds", score="Fisher trace"
    ),
    "layers-qwen-gradmap2": _selection(
        QWEN,
        "layers-qwen-gradmap2",
        ["sleb", "gradmap+top8+halving", "gradmap+top4", "gradmap+top2", "gradmap", "gradmap+top2:paper"],
    ),
    "layers-every-shortlist": every_shortlist,
}
