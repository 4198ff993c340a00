"""The README's results table and the main job's figures (docs/getting-started.md)."""

from __future__ import annotations

from dataclasses import dataclass

from .common import (
    Context,
    Table,
    flips_without_boolq,
    kl_cell,
    load,
    mean_accuracy,
    number,
    perplexity,
    stage1_share_of_sleb,
)
from .heal import row_kinds


@dataclass(frozen=True)
class ReadmeRow:
    """One row of the README's table: `variant` of the model's record (or of `source`), its Stage 1 time from the
    cost record's `cost_method` row, linked to `page` (or the model's page)."""

    variant: str
    label: str
    source: str | None = None
    cost_method: str = "paper"
    page: str | None = None


STAGE1_COST_PAGE = "docs/benchmarks/stage1-cost.md#stage-1-against-slebs-own-code"
QUALITY_PAGE = "docs/benchmarks/heal.md#the-dense-models-own-text-on-the-quality-presets-layers"

# (model, record, its rows, Stage 1 cost record, page); the screening protocol for all, the records with a heal row
# (the standard protocol's rows are on the accuracy and heal pages)
README_ROWS = (
    (
        "SmolLM2-135M, 25%",
        "heal-smollm2-135m-0.25-gradmap-screening",
        (
            ReadmeRow("dense", "dense"),
            ReadmeRow("stage1", "Stage 1 (GradMAP)"),
            ReadmeRow("default", "Stage 1 + 2"),
            ReadmeRow("lora@196608", "+ heal (LoRA, 196,608 tokens)"),
            ReadmeRow(  # the pipeline as the code now runs it (`+loss=kl` is the default loss: the same settings)
                "lora@1.5x+text=generated+loss=kl",
                "`--preset quality`: its layers, Stage 2, heal on the dense model's own text (1.5x GradMAP's Stage 1 time)",
                source="heal-smollm2-135m-0.25-quality-screening",
                cost_method="quality",
                page=QUALITY_PAGE,
            ),
        ),
        "stage1_peers-smollm2-135m-0.25-16",
        "docs/benchmarks/heal.md#smollm2-135m-25-gradmaps-layers-with-tasks",
    ),
    (
        "Qwen2.5-Coder-0.5B, 25%",
        "heal-qwen2.5-coder-0.5b-0.25-gradmap-screening",
        (
            ReadmeRow("dense", "dense"),
            ReadmeRow("stage1", "Stage 1 (GradMAP)"),
            ReadmeRow("default", "Stage 1 + 2"),
            ReadmeRow("lora@131072", "+ heal (LoRA, 131,072 tokens)"),
            ReadmeRow("lora@1.5x+text=generated", "+ heal on the dense model's own text (1.5x Stage 1's time)"),
        ),
        "stage1_peers-qwen2.5-coder-0.5b-0.25-8",
        "docs/benchmarks/heal.md#qwen25-coder-05b-25-gradmaps-layers-with-tasks",
    ),
)


def _row_flips(row: dict) -> str:
    """Flips against the dense model, BoolQ left out: from benchmarks/heal.py's records or from a paired comparison."""
    if "flips_without_boolq" in row:
        return f"{100 * row['flips_without_boolq']['flips']:.1f}%"
    if "against_dense" in row:
        return f"{100 * flips_without_boolq(row['against_dense']):.1f}%"
    return "-"


def readme_results(context: Context) -> str:
    """The README's table: dense, Stage 1, Stage 1 + 2 (and heal) on the two models, screening protocol."""
    return readme_table(context).markdown()


def readme_table(context: Context) -> Table:
    """[`readme_results`]' table. Its rows carry no footnotes: each row links to the page that shows it with its
    provenance (the heal page), and the Stage 1 time's header to the Stage 1 cost page; `notes` holds the
    footnotes those pages carry (tests/test_docs.py checks that they do)."""
    table = Table(
        "readme",
        "model | row | Wikipedia ppl | web ppl | KL to dense (Wikipedia) | accuracy, mean of 7 tasks | "
        f"flips vs dense (no BoolQ) | [Stage 1 time / SLEB's]({context.link(STAGE1_COST_PAGE)})",
        ["---", "---", "---:", "---:", "---:", "---:", "---:", "---:"],
        cite=False,
    )
    for model, source, variants, cost_source, page in README_ROWS:
        cost = {row["method"]: row for row in load(cost_source)["rows"]}
        first = True
        for entry in variants:
            rows = {row["variant"]: row for row in load(entry.source or source)["rows"]}
            if entry.variant not in rows:
                continue
            row = rows[entry.variant]
            evaluation = row["evaluation"]
            accuracy, stderr = mean_accuracy(evaluation["zero_shot"])
            kl = kl_cell(evaluation, "offline:wikipedia").split(" ±")[0]
            dense = entry.variant == "dense"
            share = "-" if dense else f"{100 * stage1_share_of_sleb(load(cost_source), entry.cost_method):.0f}%"
            more = [] if dense else [(7, cost[entry.cost_method]["provenance"], cost_source)]
            cells = [model if first else "", f"[{entry.label}]({context.link(entry.page or page)})"]
            cells += [number(perplexity(evaluation, text)) for text in ("offline:wikipedia", "offline:web_text")]
            cells += [kl if not dense else "0", f"{100 * accuracy:.1f} ± {100 * stderr:.1f}", _row_flips(row), share]
            table.add(
                cells,
                row["provenance"],
                entry.source or source,
                row_kinds(row),
                cell=1,
                more=more,
            )
            first = False
    return table


def main_job(context: Context) -> str:
    """The main job's last measured run with its defaults (the `auto` row of
    benchmarks/results/precision-smollm2-135m-0.25.json, benchmarks/precision.py)."""
    source = "precision-smollm2-135m-0.25"
    run = next(row for row in load(source)["rows"] if row["precision"] == "auto")
    perplexities = run["wikipedia_perplexity"]
    fitted = ", ".join(f"{layer} (lambda {value:.2g})" for layer, value in run["compensation_lambda"].items()) or "none"
    left_alone = ", ".join(f"layer {layer} ({reason})" for layer, reason in run["skipped_layers"].items()) or "none"
    passes = run["passes"]
    table = Table("main-job", "what | figure")
    rows = [
        ("removed layers, in removal order", str(run["removed_layers"])),
        ("compensated layers (Stage 2)", fitted),
        ("left alone", left_alone),
        ("held-out Wikipedia perplexity, dense", f"{perplexities['dense']:.3f}"),
        ("... Stage 1 only", f"{perplexities['stage 1 only']:.3f}"),
        ("... Stage 1 + 2 (the checkpoint reloaded)", f"{perplexities['stage 1 + 2']:.3f}"),
        ("Stage 1 / Stage 2 seconds", f"{run['stage1_seconds']:.1f} / {run['stage2_seconds']:.1f}"),
        (
            "passes",
            f"{passes['computed_in']}: {len(passes['recomputed'])} of {passes['decisions']} decisions recomputed in "
            f"float32 ({passes['recompute_seconds']:.0f} s)",
        ),
        ("wall time, peak memory", f"{run['wall_seconds'] / 60:.1f} min, {run['peak_rss_kib'] / 2**20:.1f} GiB"),
    ]
    for index, cells in enumerate(rows):
        table.add(list(cells), run["provenance"] if index == 0 else None, source)
    return table.markdown()


TABLES = {
    "readme-results": readme_results,
    "main-job": main_job,
}
