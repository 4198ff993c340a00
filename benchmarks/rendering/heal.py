"""The heal stage (docs/benchmarks/heal.md)."""

from __future__ import annotations

from .common import Context, Table, kl_cell, load, number, perplexity

HEAL_RECORDS = ("heal-smollm2-135m-0.25-gradmap-screening-notasks-trainables",)


def heal_trainables(context: Context) -> str:
    """Each trainable choice of the heal stage on SmolLM2-135M 25% (GradMAP's layers), after the default Stage 2."""
    table = Table(
        "heal",
        [
            "row",
            "trained parameters",
            "learning rate",
            "Wikipedia ppl",
            "web ppl",
            "KL Wikipedia",
            "KL web",
            "heal seconds",
            "tokens",
        ],  # fmt: skip
        ["---", "---:", "---:", "---:", "---:", "---:", "---:", "---:", "---:"],
    )
    for source in HEAL_RECORDS:
        for row in load(source)["rows"]:
            heal = row.get("heal") or {}
            evaluation = row["evaluation"]
            table.add(
                [
                    "Stage 1 + default Stage 2" if row["variant"] == "default" else f"`{row['variant']}`",
                    f"{heal['num_trainable_parameters']:,}" if heal else "-",
                    f"{heal['learning_rate']:g}" if heal else "-",
                    number(perplexity(evaluation, "offline:wikipedia"), 2),
                    number(perplexity(evaluation, "offline:web_text"), 2),
                    kl_cell(evaluation, "offline:wikipedia"),
                    kl_cell(evaluation, "offline:web_text"),
                    f"{heal['seconds']:.0f}" if heal else "-",
                    f"{heal['trained_tokens']:,}" if heal else "-",
                ],
                row["provenance"],
                source,
                ("heal",) if heal else ("stage2",),
            )
    return table.markdown()


TABLES = {
    "heal-trainables": heal_trainables,
}
