"""The heal stage (docs/benchmarks/heal.md)."""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Sequence

from .charts import Panel, Point, scatter
from .common import (
    RESULTS,
    Context,
    Table,
    fraction_range,
    kl_cell,
    load,
    number,
    paired,
    paired_without_boolq,
    paragraph,
    perplexity,
    typical_fraction,
)

HEAL_RECORDS = (
    "heal-smollm2-135m-0.25-gradmap-screening-notasks-trainables",
    "heal-smollm2-135m-0.25-gradmap-screening-notasks-lr",
)


def heal_kl_rows(prefix: str, records: Sequence[str]) -> Callable[[Context], str]:
    """Heal rows measured without tasks (held-out perplexities and KL only), after the default Stage 2 of their
    records: on SmolLM2-135M 25% (GradMAP's layers) each trainable choice."""
    return lambda context: _kl_table(prefix, records)


def _kl_table(prefix: str, records: Sequence[str]) -> str:
    table = Table(
        prefix,
        (
            "row | trained parameters | learning rate | Wikipedia ppl | web ppl | KL Wikipedia | KL web | "
            "heal seconds (teacher) | tokens"
        ),
        ["---", "---:", "---:", "---:", "---:", "---:", "---:", "---:", "---:"],
    )
    for source in records:
        for row in load(source)["rows"]:
            heal = row.get("heal") or {}
            evaluation = row["evaluation"]
            name = "Stage 1 + default Stage 2" if row["variant"] == "default" else f"`{row['variant']}`"
            cells = [
                name,
                f"{heal['num_trainable_parameters']:,}" if heal else "-",
                f"{heal['learning_rate']:g}" if heal else "-",
            ]
            cells += [number(perplexity(evaluation, text), 2) for text in KL_TEXTS] + [kl_cell(evaluation, t) for t in KL_TEXTS]
            cells += [f"{heal['seconds']:.0f} ({heal['teacher_seconds']:.0f})" if heal else "-"]
            table.add(
                cells + [f"{heal['trained_tokens']:,}" if heal else "-"],
                row["provenance"],
                source,
                ("heal",) if heal else ("stage2",),
            )
    return table.markdown()


# The main job's Stage 1, quiet (benchmarks/results/main_job-smollm2-135m.json): the unit of the heal budgets. A heal
# row's seconds are divided by it when no other busy process was seen at either end of the row (the 1-minute load
# before a row counts the same run's previous rows, so consecutive rows are never "quiet" by benchmarks/provenance.py).
STAGE1_SECONDS_QUIET = 476.3


def flips_cell(row: dict) -> str:
    fidelity = row.get("flips_without_boolq")
    if not fidelity:
        return "-"
    return f"{100 * fidelity['flips']:.1f}% ({100 * row['flips']['flips']:.1f}%)"


def confident_flips_cell(row: dict) -> str:
    """The flips on confident questions, without BoolQ (with it in brackets); `-` for rows counted without margins."""
    confident, confident_all = row.get("confident_flips_without_boolq"), row.get("confident_flips")
    if not confident:
        return "-"
    return f"{100 * confident['flips']:.1f}% ({100 * confident_all['flips']:.1f}%)"


def boolq_yes_cell(row: dict) -> str:
    return f"{100 * row['boolq_yes']:.1f}%" if row.get("boolq_yes") is not None else "-"


def loss_cell(heal: dict) -> str:
    """The loss a heal row minimised; `-` for a row without a heal (rows from before `heal_loss` minimised the KL)."""
    return heal.get("loss", "kl") if heal else "-"


def row_kinds(row: dict) -> tuple[str, ...]:
    """The changes whose older code marks a row: the heal's for a heal row (and the generation's for a heal on the
    dense model's own text), Stage 2's for Stage 1 + 2."""
    heal = row.get("heal")
    if heal:
        return ("heal", "generation") if "generated" in str(heal.get("dataset", "")) else ("heal",)
    return ("stage2",) if row["variant"] == "default" else ()


def is_floor_row(variant: str) -> bool:
    """The rows that measure how flips follow the KL divergence at small damage (benchmarks/heal.py): the dense
    model with its weights rounded to bfloat16, and Stage 1 with only its first K layers removed."""
    return variant == "dense@bf16" or variant.startswith("stage1@")


def stage1_unit(source: str, unit_from: str | None = None) -> tuple[float, str]:
    """The unit of a record's heal budgets and what it is: GradMAP's own Stage 1 timed on the record's device
    (`--time-stage1`, in `unit_from`'s record where given: the same model, ratio and device), else the record's CPU
    reference (`stage1_seconds_reference`), else the main job's Stage 1 at 25%."""
    record = load(unit_from or source)
    on_device = record.get("stage1_on_device")
    if on_device:
        return on_device["seconds"], f"GradMAP's Stage 1 on the {on_device['provenance']['machine']['accelerator']}"
    if record.get("stage1_seconds_reference"):
        return record["stage1_seconds_reference"], "Stage 1, this CPU"
    return STAGE1_SECONDS_QUIET, "Stage 1 at 25%, this CPU"


def heal_rows(source: str, unit_from: str | None = None) -> Callable[[Context], str]:
    """Dense, Stage 1, Stage 1 + 2 and the heal rows of one record of benchmarks/heal.py with zero-shot tasks; the
    heal seconds also in units of Stage 1's (`stage1_unit`)."""

    def render(context: Context) -> str:
        unit, unit_name = stage1_unit(source, unit_from)
        table = Table(
            source.removeprefix("heal-"),
            (
                "row | Wikipedia ppl | web ppl | KL Wikipedia | KL web | flips, no BoolQ (all) | answer changes | "
                f"accuracy (pooled) | vs Stage 1 | vs Stage 1 + 2 | heal seconds (x {unit:.1f} s, {unit_name}) | tokens"
            ),
            ["---"] + ["---:"] * 11,
        )
        for row in load(source)["rows"]:
            if is_floor_row(row["variant"]) or is_timed_budget(row["variant"]):  # the latter: `heal_text_rows`
                continue
            heal = row.get("heal") or {}
            evaluation = row["evaluation"]
            changes = row.get("flips_without_boolq", {}).get("answer_changes")
            seconds = "-"
            if heal:
                alone = not row["provenance"]["others_running_before"] and not row["provenance"]["others_running_after"]
                share = f"{heal['seconds'] / unit:.2f}x" if alone else "shared machine"
                seconds = f"{heal['seconds']:.0f} ({share})"
            cells = [_row_name(row["variant"]) + (f", lr {heal['learning_rate']:g}" if heal else "")]
            cells += [number(perplexity(evaluation, text), 2) for text in KL_TEXTS] + [kl_cell(evaluation, t) for t in KL_TEXTS]
            cells += [flips_cell(row), f"{100 * changes:.1f}%" if changes is not None else "-"]
            cells += [f"{100 * row['pooled_acc']:.2f}" if row.get("pooled_acc") is not None else "-"]
            cells += [paired(row, key) if key in row else "-" for key in ("against_stage1", "against_default")]
            table.add(
                cells + [seconds, f"{heal['trained_tokens']:,}" if heal else "-"],
                row["provenance"],
                source,
                row_kinds(row),
            )
        return table.markdown()

    return render


def is_timed_budget(variant: str) -> bool:
    """A heal row whose budget is time (`lora@1.5x...`: `heal_tokens="auto"` for a multiple of Stage 1's time)."""
    head = variant.split("+")[0]
    return "@" in head and head.endswith("x")


def _text_name(heal: dict) -> str:
    dataset = heal.get("dataset", "")
    if dataset.startswith("generated") and " and " in dataset:
        return "dense model's + corpus, equal parts"
    if dataset.startswith("generated"):
        temperature = dataset.partition("temperature ")[2].partition(",")[0]
        return f"dense model's own (temperature {temperature})"
    return "corpus (web + Wikipedia)"


def heal_text_rows(source: str) -> Callable[[Context], str]:
    """The time-budget rows of one record: the heals whose budget is time (`@FACTORx`: as many tokens as fit, the dense
    model's text included), on corpus text or the dense model's own, from Stage 1 + 2 or Stage 1 alone, with the loss
    they minimised (`heal_loss`), against Stage 1 + 2 (`default`): flips (pooled and on confident questions), the
    answers' drift where the rows keep their log-likelihoods, KL, paired accuracy, and the goals (flips at most 0.8x
    Stage 1 + 2's, KL at least 35% lower on both texts, paired accuracy against Stage 1 alone >= 0)."""

    def render(context: Context) -> str:
        record = load(source)
        rows = {row["variant"]: row for row in record["rows"]}
        default = rows.get("default")
        table = Table(
            source.removeprefix("heal-") + "-text",
            (
                "row | text | from | loss | KL Wikipedia | KL web | flips, no BoolQ (all) | "
                "confident flips, no BoolQ (all) | answer drift, no BoolQ | BoolQ yes | vs Stage 1 | "
                "vs Stage 1, no BoolQ | vs Stage 1 + 2 | heal seconds (text) | tokens chosen | "
                "goals: flips x, KL, vs Stage 1"
            ),
            ["---", "---", "---", "---"] + ["---:"] * 12,
        )
        for variant in ("dense", "stage1", "default", *(v for v in rows if is_timed_budget(v))):
            row = rows.get(variant)
            if row is None:
                continue
            heal = row.get("heal") or {}
            evaluation = row["evaluation"]
            goals = "-"
            if heal and default and row.get("flips_without_boolq") and default.get("flips_without_boolq"):
                ratio = row["flips_without_boolq"]["flips"] / default["flips_without_boolq"]["flips"]
                drops = [1 - kl_on(evaluation, d) / kl_on(default["evaluation"], d) for d in KL_TEXTS]
                gain = (row.get("against_stage1") or {}).get("difference")
                met = ratio <= 0.8 and min(drops) >= 0.35 and gain is not None and gain >= 0
                goals = (
                    f"x{ratio:.2f}, {-100 * drops[0]:+.0f}% / {-100 * drops[1]:+.0f}%, "
                    f"{100 * gain:+.2f}: {'met' if met else '**not met**'}"
                )
            seconds = "-"
            if heal:
                generation = heal.get("generation_seconds") or 0.0
                seconds = f"{heal['seconds']:.0f} ({generation:.0f})"
            start = ("Stage 1 alone" if "from=stage1" in variant else "Stage 1 + 2") if heal else "-"
            cells = [_row_name(variant), _text_name(heal) if heal else "-", start, loss_cell(heal)]
            cells += [kl_cell(evaluation, text) for text in KL_TEXTS] + [flips_cell(row), confident_flips_cell(row)]
            cells += [f"{row['answer_drift_without_boolq']:.3f}" if "answer_drift_without_boolq" in row else "-"]
            cells += [boolq_yes_cell(row), paired(row, "against_stage1") if "against_stage1" in row else "-"]
            cells += [paired_without_boolq(row, rows.get("stage1")) if variant not in ("dense", "stage1") else "-"]
            cells += [paired(row, "against_default") if "against_default" in row else "-", seconds]
            table.add(
                cells + [f"{heal['trained_tokens']:,} of {heal['budget_tokens']:,}" if heal else "-", goals],
                row["provenance"],
                source,
                row_kinds(row),
            )
        return table.markdown()

    return render


KL_TEXTS = ("offline:wikipedia", "offline:web_text")


def kl_on(evaluation: dict, dataset: str) -> float:
    """The KL divergence from the dense model on one held-out text."""
    return next(entry["kl_to_reference"] for entry in evaluation["perplexities"] if entry["dataset"] == dataset)


def _row_name(variant: str) -> str:
    names = {"dense": "dense", "stage1": "Stage 1 alone", "default": "Stage 1 + default Stage 2"}
    return names.get(variant, f"+ heal `{variant}`")


# --- the page's opening: the chart and the short table --------------------------------------------------------------

OPENING_RECORDS = (
    ("SmolLM2 25%", "heal-smollm2-135m-0.25-gradmap-screening"),
    ("SmolLM2 40%", "heal-smollm2-135m-0.4-gradmap-screening"),
    ("SmolLM2 25%, quality", "heal-smollm2-135m-0.25-quality-screening"),
    ("Qwen 25%", "heal-qwen2.5-coder-0.5b-0.25-gradmap-screening"),
)


def _opening_label(variant: str) -> str | None:
    """The short name of a row the page opens with, None for the others: Stage 1 alone, Stage 1 + 2, the default heal
    on corpus text at about Stage 1's time, and the recommended one on the dense model's own text."""
    if variant in ("stage1", "default"):
        return {"stage1": "Stage 1 alone", "default": "Stage 1 + 2"}[variant]
    if variant.startswith("lora@") and "+" not in variant and not is_timed_budget(variant):
        return "heal, corpus text"
    return "heal, own text" if variant == "lora@1.5x+text=generated" else None


def _opening_rows() -> list[tuple[str, str, str, dict, float]]:
    """`(setting, source, label, row, heal time in Stage 1's)` of the rows the page opens with."""
    found = []
    for setting, source in OPENING_RECORDS:
        unit, _ = stage1_unit(source)
        for row in load(source)["rows"]:
            label = _opening_label(row["variant"])
            if label:
                found.append((setting, source, label, row, (row.get("heal") or {}).get("seconds", 0.0) / unit))
    return found


def _alone(row: dict) -> bool:
    return not row["provenance"]["others_running_before"] and not row["provenance"]["others_running_after"]


def opening_table(context: Context) -> str:
    """Per setting: Stage 1 alone, Stage 1 + 2 and two heals, with the heal's time, the KL and the flips."""
    table = Table("heal-opening", "setting | row | heal time (x Stage 1) | KL web text | flips, no BoolQ")
    previous = None
    for setting, source, label, row, share in _opening_rows():
        time = "-" if not row.get("heal") else f"{share:.2f}x" if _alone(row) else "shared machine"
        cells = [setting if setting != previous else "", label, time, f"{kl_on(row['evaluation'], 'offline:web_text'):.3f}"]
        table.add(
            cells + [f"{100 * row['flips_without_boolq']['flips']:.1f}%"], row["provenance"], source, row_kinds(row), cell=1
        )
        previous = setting
    return table.markdown()


def opening_chart() -> tuple[str, str]:
    """The KL from the dense model on web text and the flips against it, against the heal's time (in Stage 1's)."""
    kl, flips = [], []
    for setting, _, label, row, share in _opening_rows():
        if row.get("heal") and not _alone(row):  # its time was shared with other work
            continue
        kind = label if not row.get("heal") else "heal"
        value = kl_on(row["evaluation"], "offline:web_text")
        flipped = 100 * row["flips_without_boolq"]["flips"]
        tip = f"{setting}, {label}: KL {value:.3f}, flips {flipped:.1f}%, heal {share:.2f}x Stage 1's time"
        kl.append(Point(share, value, setting, kind, tip))
        flips.append(Point(share, flipped, setting, kind, tip))
    title = "KL from the dense model and flips against it, against the heal's time in units of Stage 1's"
    panels = [
        Panel("KL on web text", "heal time / Stage 1's", "KL from the dense model", kl),
        Panel("Flips against the dense model", "heal time / Stage 1's", "flips, no BoolQ (%)", flips),
    ]
    return title, scatter(panels, title)


def lowest_flips_ratio() -> float:
    """The lowest flips (BoolQ left out) of any heal measured with tasks, as a multiple of its record's Stage 1 + 2's."""
    ratios = []
    for path in sorted(glob.glob(os.path.join(RESULTS, "heal-*.json"))):
        rows = load(os.path.basename(path)[: -len(".json")])["rows"]
        default = next((row for row in rows if row["variant"] == "default" and row.get("flips_without_boolq")), None)
        if default is None:  # a record without tasks
            continue
        ratios += [
            row["flips_without_boolq"]["flips"] / default["flips_without_boolq"]["flips"]
            for row in rows
            if row.get("heal") and row.get("flips_without_boolq")
        ]
    return min(ratios)


# A heal's time "about Stage 1's": its seconds within these multiples of Stage 1's.
ABOUT_STAGE1 = (0.75, 1.25)


def about_stage1(shares: Sequence[float]) -> bool:
    return all(ABOUT_STAGE1[0] <= share <= ABOUT_STAGE1[1] for share in shares)


def answer(context: Context) -> str:
    """The page's answer, from the opening table's heals of about Stage 1's time (`ABOUT_STAGE1`, timed alone): how much
    they lower the web-text KL from the dense model, and the flips (BoolQ left out), against Stage 1 + 2."""
    rows = _opening_rows()
    default = {setting: row for setting, _, label, row, _ in rows if label == "Stage 1 + 2"}
    heals = [
        (default[setting], row) for setting, _, _, row, share in rows if row.get("heal") and _alone(row) and about_stage1([share])
    ]
    kl = [1 - kl_on(row["evaluation"], KL_TEXTS[1]) / kl_on(base["evaluation"], KL_TEXTS[1]) for base, row in heals]
    flips = [1 - row["flips_without_boolq"]["flips"] / base["flips_without_boolq"]["flips"] for base, row in heals]
    return paragraph(
        f"**The heal lowers the KL from the dense model by {fraction_range(kl)} in about Stage 1's time, but not the "
        f"flips:** the answers that differ from the dense model's fall by {typical_fraction(flips)}. Off by default, on "
        "in `--preset quality`."
    )


CHARTS = {"heal-chart": opening_chart}

TABLES = {
    "heal-answer": answer,
    "heal-opening": opening_table,
    "heal-trainables": heal_kl_rows("heal", HEAL_RECORDS),
    "heal-smollm2-25-gradmap": heal_rows("heal-smollm2-135m-0.25-gradmap-screening"),
    "heal-smollm2-25-gradmap-text": heal_text_rows("heal-smollm2-135m-0.25-gradmap-screening"),
    "heal-smollm2-40-gradmap-text": heal_text_rows("heal-smollm2-135m-0.4-gradmap-screening"),
    "heal-smollm2-25-quality-text": heal_text_rows("heal-smollm2-135m-0.25-quality-screening"),
    "heal-qwen-25-gradmap-text": heal_text_rows("heal-qwen2.5-coder-0.5b-0.25-gradmap-screening"),
    "heal-smollm2-40-gradmap-tasks": heal_rows("heal-smollm2-135m-0.4-gradmap-screening"),
    "heal-smollm2-25-quality-tasks": heal_rows("heal-smollm2-135m-0.25-quality-screening"),
    "heal-qwen-25-gradmap-tasks": heal_rows("heal-qwen2.5-coder-0.5b-0.25-gradmap-screening"),
    "heal-smollm2-25-gradmap-standard-gpu": heal_rows("heal-smollm2-135m-0.25-gradmap-standard-cuda"),
    "heal-smollm2-25-quality-standard-gpu": heal_rows(
        "heal-smollm2-135m-0.25-quality-standard-cuda", unit_from="heal-smollm2-135m-0.25-gradmap-standard-cuda"
    ),
}
