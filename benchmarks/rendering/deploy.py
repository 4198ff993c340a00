"""Prune, heal, quantize, serve (docs/benchmarks/deploy.md): benchmarks/deploy.py's rows, and what the composition
of pruning and quantization costs against the sum of each alone."""

from __future__ import annotations

import os

from .charts import Panel, Point, scatter
from .common import RESULTS, Context, Table, load, paragraph

MODELS = {"smollm2-135m": "SmolLM2-135M", "qwen2.5-coder-0.5b": "Qwen2.5-Coder-0.5B"}
HELD_OUT = ("offline:wikipedia", "offline:web_text")
VARIANTS = ("dense", "gradmap-25", "gradmap-25-healed", "gradmap-25-healed-norms", "gradmap-25-w4a16-healed-norms")
ORDERS = {
    "gradmap-25-healed/w4a16": "heal (LoRA), then W4A16",
    "gradmap-25-healed-norms/w4a16": "heal (norms), then W4A16",
    "gradmap-25-w4a16-healed-norms/w4a16": "W4A16, then heal (norms)",
}
PRECISIONS = ("bfloat16", "w8a8", "w4a16")


def _in_order(rows: list[dict]) -> list[dict]:
    """The rows by variant, then by how they are stored."""
    return sorted(rows, key=lambda row: (VARIANTS.index(row["variant"]), PRECISIONS.index(row["precision"])))


def _records() -> list[tuple[str, str, dict]]:
    return [
        (name, f"deploy-{model}", load(f"deploy-{model}"))
        for model, name in MODELS.items()
        if os.path.exists(os.path.join(RESULTS, f"deploy-{model}.json"))
    ]


def deploy_table(context: Context) -> str:
    """One row per stored model: bytes on disk, vLLM's speed on this CPU, held-out perplexity with its KL from the dense
    model, zero-shot accuracy with the paired difference from the dense float32 model (+/- its standard error), flips."""
    table = Table(
        "deploy",
        "model | stored as | MB on disk | vLLM TTFT ms | decode tok/s, batch 1 | batch 16 | Wikipedia ppl (KL) | "
        "web text ppl (KL) | zero-shot acc | vs dense (+/- SE) | flips",
    )
    for model, source, record in _records():
        dense = record["dense_float32"]
        table.add(
            [f"{model} dense, float32 (the reference)", "float32", "", "", "", ""]
            + [f"{dense['perplexities'][name]:.2f}" for name in HELD_OUT]
            + [f"{100 * dense['accuracy']:.1f}", "", ""],
            None,
            source,
        )
        for row in _in_order(record["rows"]):
            if "refused" in row:
                reason = row["refused"].split(":")[0]
                cells = [f"{model} {row['variant']}", row["precision"], f"refused by the library: {reason}"] + [""] * 8
                table.add(cells, row["provenance"], source)
                continue
            speed = row["vllm"]
            against = row["against_dense"]
            cells = [f"{model} {row['variant']}", row["precision"], f"{row['bytes_on_disk'] / 1e6:,.0f}"]
            cells += [f"{speed['batch1']['ttft_ms']:,.0f}", f"{speed['batch1']['decode_tokens_per_second']:,.1f}"]
            cells += [f"{speed['batch16']['decode_tokens_per_second']:,.1f}"]
            cells += [f"{row['perplexities'][name]:.2f} ({row['kl_to_dense'][name]:.3f})" for name in HELD_OUT]
            cells += [f"{100 * row['accuracy']:.1f}", f"{100 * against['difference']:+.1f} (+/- {100 * against['stderr']:.1f})"]
            cells += [f"{row['flips']['flips']:.1%}"]
            more = [(3, row["vllm_provenance"], source)] if "vllm_provenance" in row else []
            table.add(cells, row["provenance"], source, more=more)
    return table.markdown()


def composition(context: Context) -> str:
    """Does pruning compose with quantization? For each scheme and pruned variant: the loss of both together against
    the sum of the loss of each alone (pruned in bfloat16, dense quantized), in web-text KL from the dense model and in
    zero-shot accuracy; and what quantizing cost that pruned model, paired per question."""
    table = Table(
        "deploy-composition",
        "pruned model | scheme | web-text KL: both | pruning + quantization alone | accuracy change: both | "
        "pruning + quantization alone | quantizing this model (paired, +/- SE)",
    )
    for model, source, record in _records():
        rows = {row["label"]: row for row in record["rows"] if "refused" not in row}

        kl = {label: row["kl_to_dense"]["offline:web_text"] for label, row in rows.items()}
        drop = {label: 100 * row["against_dense"]["difference"] for label, row in rows.items()}

        for variant in ("gradmap-25", "gradmap-25-healed"):
            for scheme in ("w8a8", "w4a16"):
                labels = (f"{variant}/{scheme}", f"{variant}/bfloat16", f"dense/{scheme}")
                if not all(label in rows for label in labels):
                    continue
                both, pruned, quantized = labels
                cells = [
                    f"{model} {variant}",
                    scheme,
                    f"{kl[both]:.3f}",
                    f"{kl[pruned]:.3f} + {kl[quantized]:.3f} = {kl[pruned] + kl[quantized]:.3f}",
                ]
                cells += [
                    f"{drop[both]:+.1f}",
                    f"{drop[pruned]:+.1f} {drop[quantized]:+.1f} = {drop[pruned] + drop[quantized]:+.1f}",
                ]
                own = rows[both].get("against_unquantized")
                cells += [f"{100 * own['difference']:+.1f} (+/- {100 * own['stderr']:.1f})" if own else ""]
                table.add(cells, rows[both]["provenance"], source)
    return table.markdown()


def _paired(measured: dict | None) -> str:
    return f"{100 * measured['difference']:+.1f} (+/- {100 * measured['stderr']:.1f})" if measured else ""


def order(context: Context) -> str:
    """Which order of heal and INT4 quantization: each W4A16 row made from a healed model, or healed after W4A16, with
    its web-text KL and accuracy, paired against the same heal unquantized and against the other order."""
    table = Table(
        "deploy-order",
        "model | order | web-text KL | zero-shot acc | vs dense (+/- SE) | vs the same heal, unquantized (+/- SE) | "
        "vs heal, then W4A16 (+/- SE)",
    )
    for model, source, record in _records():
        rows = {row["label"]: row for row in record["rows"] if "refused" not in row}
        for label, name in ORDERS.items():
            if label not in rows:
                continue
            row = rows[label]
            cells = [model, name, f"{row['kl_to_dense']['offline:web_text']:.3f}", f"{100 * row['accuracy']:.1f}"]
            cells += [_paired(row["against_dense"]), _paired(row.get("against_unquantized"))]
            cells += [_paired(row.get("against_other_order"))]
            table.add(cells, row["provenance"], source)
    return table.markdown()


# The forms the page opens with, by short name: dense, pruned (GradMAP 25%), and pruned then healed (LoRA).
SHORT = {"dense": "dense", "gradmap-25": "pruned", "gradmap-25-healed": "healed"}
SHORT_MODELS = {"SmolLM2-135M": "SmolLM2", "Qwen2.5-Coder-0.5B": "Qwen"}


def _summary_rows() -> list[tuple[str, str, dict]]:
    """`(model, source, row)` for the dense, pruned and healed forms in every precision that was served."""
    return [
        (model, source, row)
        for model, source, record in _records()
        for row in _in_order(record["rows"])
        if row["variant"] in SHORT and "refused" not in row
    ]


def _form(model: str, row: dict) -> str:
    return f"{SHORT_MODELS[model]} {SHORT[row['variant']]}, {row['precision']}"


def summary(context: Context) -> str:
    """The page's opening table, five columns: each form's size, decode speed, web-text KL and zero-shot accuracy."""
    table = Table("deploy-summary", "model and form | MB on disk | decode tok/s, batch 1 | web-text KL | zero-shot acc")
    for model, source, row in _summary_rows():
        cells = [_form(model, row), f"{row['bytes_on_disk'] / 1e6:,.0f}"]
        cells += [f"{row['vllm']['batch1']['decode_tokens_per_second']:,.1f}", f"{row['kl_to_dense']['offline:web_text']:.3f}"]
        cells += [f"{100 * row['accuracy']:.1f}"]
        table.add(
            cells, row["provenance"], source, more=[(2, row["vllm_provenance"], source)] if "vllm_provenance" in row else []
        )
    return table.markdown()


def chart() -> tuple[str, str]:
    """Web-text KL from the dense model against the size on disk and against vLLM's decode speed on this CPU."""
    size, speed = [], []
    for model, _, row in _summary_rows():
        series, kl = f"{SHORT_MODELS[model]} {SHORT[row['variant']]}", row["kl_to_dense"]["offline:web_text"]
        label = f"{_form(model, row)}: web-text KL {kl:.3f}"
        size.append(Point(row["bytes_on_disk"] / 1e6, kl, series, row["precision"], label))
        speed.append(Point(row["vllm"]["batch1"]["decode_tokens_per_second"], kl, series, row["precision"], label))
    title = "Web-text KL from the dense model against size on disk and decode speed, each model dense, pruned, healed"
    panels = [
        Panel("Quality against size", "MB on disk", "web-text KL (lower is better)", size),
        Panel("Quality against speed", "decode tokens/s, batch 1", "", speed),
    ]
    return title, scatter(panels, title)


def _decode(row: dict) -> float:
    return row["vllm"]["batch1"]["decode_tokens_per_second"]


def pruned_w8a8(model: str = "SmolLM2-135M") -> tuple[float, float, dict]:
    """`model` pruned (GradMAP 25%) and W8A8 against its dense bfloat16 form: its bytes on disk and its decode speed in
    vLLM at batch 1 as multiples of the dense model's, and its healed form's W8A8 row."""
    record = next(record for name, _, record in _records() if name == model)
    rows = {row["label"]: row for row in record["rows"] if "refused" not in row}
    dense, both = rows["dense/bfloat16"], rows["gradmap-25/w8a8"]
    return both["bytes_on_disk"] / dense["bytes_on_disk"], _decode(both) / _decode(dense), rows["gradmap-25-healed/w8a8"]


def answer(context: Context) -> str:
    """The page's answer: what pruning and W8A8 together save on SmolLM2, in bytes and in vLLM's decode speed."""
    size, speed, _ = pruned_w8a8()
    return paragraph(
        "**Pruning composes with quantization: the losses add, or less.** Pruned and W8A8, "
        f"{SHORT_MODELS['SmolLM2-135M']} is {size:.2f}x the dense bytes and decodes {speed:.1f}x as fast in vLLM on this "
        "CPU; a heal first wins back the accuracy, and W8A8 keeps it."
    )


TABLES = {
    "deploy": deploy_table,
    "deploy-composition": composition,
    "deploy-order": order,
    "deploy-summary": summary,
    "deploy-answer": answer,
}
CHARTS = {"deploy-chart": chart}
