"""Accuracy and fidelity (docs/benchmarks/accuracy-and-fidelity.md)."""

from __future__ import annotations

from .common import Context, Table, flips_without_boolq, load, mean_accuracy, number, paired, perplexity

HEADLINE_RECORDS = (
    ("SmolLM2-135M, 25%", "accuracy-smollm2-135m-0.25-cuda"),
    ("SmolLM2-135M, 40%", "accuracy-smollm2-135m-0.4-cuda"),
    ("Qwen2.5-Coder-0.5B, 25%", "accuracy-qwen2.5-coder-0.5b-0.25"),
)
SELECTION_NAMES = {"gradmap": "GradMAP's", "quality": "`quality` preset's"}
VARIANT_NAMES = {"dense": "dense", "stage1": "Stage 1 alone", "default": "+ default Stage 2", "paper": "+ the paper's Stage 2"}


def accuracy_headline(context: Context) -> str:
    """The six headline rows with the standard protocol: Stage 1 alone and both Stage 2s, flips against dense."""
    table = Table(
        "headline",
        [
            "setting",
            "layers of",
            "row",
            "Wikipedia ppl",
            "web ppl",
            "accuracy, mean of 7",
            "pooled vs Stage 1 (points)",
            "flips (no BoolQ)",
            "flips (all)",
        ],
        ["---", "---", "---", "---:", "---:", "---:", "---:", "---:", "---:"],
    )
    for setting, source in HEADLINE_RECORDS:
        first = True
        for row in load(source)["rows"]:
            evaluation = row["evaluation"]
            accuracy, stderr = mean_accuracy(evaluation["zero_shot"])
            against_dense = row.get("against_dense")
            flips_all = "-"
            if against_dense:
                pooled = against_dense["pooled"]
                flips_all = f"{100 * (pooled['only_a'] + pooled['only_b']) / pooled['num_questions']:.1f}%"
            table.add(
                [
                    setting if first else "",
                    SELECTION_NAMES.get(row["selection"], "") if row["variant"] != "dense" else "",
                    VARIANT_NAMES.get(row["variant"], row["variant"]),
                    number(perplexity(evaluation, "offline:wikipedia")),
                    number(perplexity(evaluation, "offline:web_text")),
                    f"{100 * accuracy:.1f} ± {100 * stderr:.1f}",
                    paired(row.get("against_stage1")),
                    f"{100 * flips_without_boolq(against_dense):.1f}%" if against_dense else "-",
                    flips_all,
                ],
                row["provenance"],
                source,
                ("stage2",) if row["variant"] == "default" else (),
                cell=2,
            )
            first = False
    return table.markdown()


TABLES = {
    "accuracy-headline": accuracy_headline,
}
