"""Measured tables of the guides (docs/guides/)."""

from __future__ import annotations

from .common import Context, Table, load


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


TABLES = {
    "budget": budget,
}
