"""Stage 1 cost (docs/benchmarks/stage1-cost.md)."""

from __future__ import annotations

from .common import Context, Table, load, number

PEER_RECORDS = (
    ("SmolLM2-135M, 25%, 16 x 128", "stage1_peers-smollm2-135m-0.25-16"),
    ("SmolLM2-135M, 40%, 8 x 128", "stage1_peers-smollm2-135m-0.4-8"),
    ("Qwen2.5-Coder-0.5B, 25%, 8 x 128", "stage1_peers-qwen2.5-coder-0.5b-0.25-8"),
)


def stage1_peers(context: Context) -> str:
    """Stage 1's seconds of each method against SLEB at the cost of SLEB's own code, one run per setting."""
    table = Table(
        "peers",
        [
            "setting, calibration",
            "method",
            "removed layers",
            "SLEB's layers",
            "Stage 1 s",
            "share of SLEB's time",
            "Wikipedia ppl",
            "web ppl",
        ],  # fmt: skip
        ["---", "---", "---", "---", "---:", "---:", "---:", "---:"],
    )
    for setting, source in PEER_RECORDS:
        rows = load(source)["rows"]
        reference = next(row for row in rows if row["method"] == "sleb_reference")
        for index, row in enumerate(rows):
            provenance = dict(row["provenance"])
            if row.get("note"):
                provenance["note"] = row["note"]
            table.add(
                [
                    setting if index == 0 else "",
                    f"`{row['method']}`",
                    str(row["removed_layers"]),
                    "yes" if sorted(row["removed_layers"]) == sorted(reference["removed_layers"]) else "no",
                    f"{row['stage1_seconds']:.1f}",
                    f"{row['stage1_seconds'] / reference['stage1_seconds']:.3f}",
                    number(row["perplexity"]["offline:wikipedia"]),
                    number(row["perplexity"]["offline:web_text"]),
                ],
                provenance,
                source,
                cell=1,
            )
    return table.markdown()


TABLES = {
    "stage1-peers": stage1_peers,
}
