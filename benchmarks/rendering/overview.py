"""The README: its results table, and its paragraphs whose figures come from the records."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .common import (
    Context,
    Table,
    flips_without_boolq,
    kl_cell,
    load,
    mean_accuracy,
    number,
    paragraph,
    perplexity,
    stage1_share_of_sleb,
)
from .deploy import pruned_w8a8
from .heal import about_stage1, lowest_flips_ratio, row_kinds, stage1_unit
from .scale import largest_machine, largest_pruned
from .stage1_cost import main_job_passes


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


# --- the README's paragraphs -----------------------------------------------------------------------------------------


def readme_main_job(context: Context) -> str:
    """The quick start's main job, with its wall time and cores from its last run with the default passes
    (benchmarks/results/precision-smollm2-135m-0.25.json)."""
    auto, _ = main_job_passes()
    cores = auto["provenance"]["machine"]["cpu_count"]
    return paragraph(
        "**Main job**: prune SmolLM2-135M by 25% with both stages on the paper's calibration set (128 x 128 tokens of "
        "Wikipedia), save it, reload it with plain `AutoModelForCausalLM`, and print what was removed and the held-out "
        f"perplexity before and after (about {auto['wall_seconds'] / 60:.0f} minutes on {cores} CPU cores; "
        f"[its output]({context.link('docs/getting-started.md#the-main-job')})):"
    )


def readme_quantization(context: Context) -> str:
    """Where quantization fits, with what pruning and W8A8 save on SmolLM2 and what the healed W8A8 model keeps of the
    dense model's accuracy (benchmarks/results/deploy-smollm2-135m.json)."""
    size, speed, healed = pruned_w8a8()
    against = healed["against_dense"]
    return paragraph(
        "**Where quantization fits:** last, after pruning and the heal: llm-compressor quantizes the result to a "
        "compressed-tensors checkpoint that vLLM serves (`--quantization w8a8` on `prune`, or `quantize` on a saved "
        f"checkpoint; [guide]({context.link('docs/guides/quantization.md')})). On SmolLM2-135M, 25% pruned and W8A8: "
        f"{size:.2f}x the dense bfloat16 bytes and {speed:.1f}x its vLLM decode speed on this CPU, the two steps' losses "
        "adding up; healed, then W8A8, it keeps the dense model's zero-shot accuracy "
        f"({100 * against['difference']:+.1f} +/- {100 * against['stderr']:.1f} points); INT4 (W4A16) loses its LoRA "
        "heal's gain, keeps more of a norms heal, and on Qwen2.5-0.5B keeps the LoRA heal's and less of a norms heal "
        f"([figures]({context.link('docs/benchmarks/deploy.md')}))."
    )


def _heal_shares(own_text: bool) -> list[float]:
    """The heal time of the README table's heal rows, on corpus text or on the dense model's own, in Stage 1's."""
    shares = []
    for _, source, variants, _, _ in README_ROWS:
        for entry in variants:
            rows = {row["variant"]: row for row in load(entry.source or source)["rows"]}
            heal = (rows.get(entry.variant) or {}).get("heal")
            if heal and ("generated" in str(heal.get("dataset", ""))) == own_text:
                shares.append(heal["seconds"] / stage1_unit(entry.source or source)[0])
    return shares


def readme_heal(context: Context) -> str:
    """What the table says of Stage 2 and the heal: the heal rows' time in Stage 1's, and the lowest flips of any heal
    measured against Stage 1 + 2's."""
    corpus, own = _heal_shares(False), _heal_shares(True)
    corpus_time = (
        "about Stage 1's own time" if about_stage1(corpus) else f"{min(corpus):.1f}x to {max(corpus):.1f}x Stage 1's time"
    )
    heal_page = "docs/benchmarks/heal.md"
    lowest = math.floor(100 * lowest_flips_ratio()) / 100  # "below" it: rounded down
    return paragraph(
        "Stage 2 lowers both perplexities, the KL and the flips, but costs accuracy on some rows: a d x d patch repairs "
        f"little ([accuracy and fidelity]({context.link('docs/benchmarks/accuracy-and-fidelity.md')})). The optional "
        f"heal stage (`--heal-tokens N`, [guide]({context.link('docs/guides/heal.md')})) distils the dense model back "
        f"with LoRA adapters merged into plain weights; the LoRA rows above cost {corpus_time}, the rows on the dense "
        f"model's own text {sum(own) / len(own):.1f}x (of a 1.5x budget), the text's writing included "
        f"([heal]({context.link(heal_page)})). "
        "The recommended pipeline, `--preset quality`, gives SmolLM2 the lowest flips and KL of the table; on Qwen the "
        "heal on its own text lowers the flips but its accuracy falls below Stage 1's, on BoolQ alone: Stage 1 answers "
        'BoolQ "yes" far more often than the dense model and the heal undoes most of that bias (the figures, and the '
        "accuracy without BoolQ, on the "
        f"[heal page]({context.link(heal_page + '#the-dense-models-own-text-on-qwen25-coder-05b')})). No heal measured "
        f"brings the flips (BoolQ left out) below {lowest:.2f}x Stage 1 + 2's: the KL falls faster than the answers that "
        f"differ from the dense model's come back ([why]({context.link(heal_page + '#what-it-decided')}))."
    )


def readme_precision(context: Context) -> str:
    """The passes' precision, with the main job's default passes against float32 passes
    (benchmarks/results/precision-smollm2-135m-0.25.json)."""
    auto, full = main_job_passes()
    same = {
        (True, True): "removes and fits the same layers either way",
        (True, False): "removes the same layers either way, fits others",
        (False, True): "removes other layers, fits the same",
        (False, False): "removes and fits other layers",
    }[auto["removed_layers"] == full["removed_layers"], auto["compensated_layers"] == full["compensated_layers"]]
    return paragraph(
        "**Precision.** The weights load in float32 (`--dtype`). Stage 1's and Stage 2's passes compute in bfloat16 "
        "where the hardware has it natively (CUDA compute capability 8.0 or more, CPUs with AVX512-BF16 or AMX), and "
        "every choice whose margin lies within bfloat16's measured error is computed again in float32, so the layers "
        "removed and fitted are float32's; `--precision float32` computes in float32 throughout. GradMAP's Stage 1 "
        "passes in bfloat16 on GPUs only: on a CPU the near ties it would score again cost more than bfloat16 saves. "
        f"On this project's CPU the main job {same} in {auto['wall_seconds'] / full['wall_seconds']:.2f} of float32's "
        f"time, Stage 2 in {auto['stage2_seconds'] / full['stage2_seconds']:.2f} of its time "
        f"([the figures]({context.link('docs/benchmarks/stage1-cost.md#the-default-passes-against-float32')}))."
    )


def readme_scale(context: Context) -> str:
    """What has run: the largest model pruned from disk, its machine and its peak resident memory
    (benchmarks/results/scale-*.json)."""
    peak = max(row["memory"]["peak_resident_gib"] for row in largest_pruned())
    return paragraph(
        "**What has run:** real weights up to Qwen2.5-Coder-0.5B (quality figures); Llama-3.1-8B's shape with random "
        f"weights (time, memory and correctness only), pruned from disk on a {largest_machine()} CPU machine at "
        f"{peak:.1f} GiB peak resident memory ([scale]({context.link('docs/benchmarks/scale.md')})). `prune --dry-run` "
        "tells the layers, passes, FLOPs, memory, disk and time of a run before it starts "
        f"([will it fit]({context.link('docs/guides/big-models.md#will-it-fit-how-long-will-it-take')}))."
    )


TABLES = {
    "readme-results": readme_results,
    "readme-main-job": readme_main_job,
    "readme-quantization": readme_quantization,
    "readme-heal": readme_heal,
    "readme-precision": readme_precision,
    "readme-scale": readme_scale,
}
