"""Streaming and memory (docs/benchmarks/streaming-memory.md)."""

from __future__ import annotations

from .charts import Panel, Point, scatter
from .common import Context, Table, fraction_range, load, machine_text, older_record, paragraph, scientific, typical_fraction

STREAMING_RECORDS = (
    ("SmolLM2-135M", "streaming_memory-smollm2-135m-batch8"),
    ("Qwen2.5-Coder-0.5B", "streaming_memory-qwen2.5-coder-0.5b-batch8"),
)


def streaming_provenance(record: dict) -> dict:
    """A benchmarks/streaming_memory.py record's provenance (it carries none per row): its command, settings and
    machine, and what the page says of the machine's load."""
    settings = record["settings"]
    return older_record(
        f"`{record['command']}` (the record's command); {settings['num_samples']} x {settings['seq_len']} calibration "
        f"tokens at batch {settings['batch_size']}, fp32; {machine_text(record['machine'])}, shared with a Stage 2 "
        "benchmark (the page's text); the second of two rounds; no date in the record"
    )


def layer_streamed(context: Context) -> str:
    """One GradMAP Stage 1 round in memory and layer-streamed (weights on disk): seconds, peak memory over the
    weight bytes, and how far the streamed scores are from the in-memory ones."""
    table = Table(
        "streaming",
        "model | mode | s per round | peak memory / weight bytes | scores vs in memory",
    )
    mib = 2**20
    for model, source in STREAMING_RECORDS:
        record = load(source)
        results, figures = record["results"], record["figures"]
        provenance = streaming_provenance(record)
        weights = results["in_memory"]["weight_bytes"]
        cells = [f"{model} ({weights / mib:,.0f} MiB fp32)", "in memory", f"{results['in_memory']['seconds']:.1f}"]
        table.add(
            cells + [f"{figures['in_memory_peak_over_weight_bytes']:.2f}", "-"],
            provenance,
            source,
            cell=1,
        )
        table.add(
            [
                model,
                "layer-streamed, weights on disk",
                f"{results['layer_streamed']['seconds']:.1f} (**{figures['streamed_time_over_in_memory_time']:.2f}x**)",
                f"**{figures['streamed_peak_over_weight_bytes']:.3f}** "
                f"({results['layer_streamed']['peak_extra_bytes'] / mib:,.0f} MiB)",
                f"max relative difference {scientific(figures['max_relative_score_difference'])}",
            ],
            provenance,
            source,
            cell=1,
        )
    return table.markdown()


def opening_chart() -> tuple[str, str]:
    """Peak memory over the weight bytes against the seconds of a round, in memory and layer-streamed."""
    points = []
    for model, source in STREAMING_RECORDS:
        record = load(source)
        results, figures = record["results"], record["figures"]
        for mode, name in (("in_memory", "in memory"), ("layer_streamed", "layer-streamed")):
            peak = figures[f"{'in_memory' if mode == 'in_memory' else 'streamed'}_peak_over_weight_bytes"]
            label = f"{model}, {name}: {results[mode]['seconds']:.1f} s a round, peak {peak:.2f}x the weights"
            points.append(Point(results[mode]["seconds"], peak, model, name, label))
    title = "Peak memory over the weight bytes against the seconds of a Stage 1 round, in memory and layer-streamed"
    panel = Panel("Memory against time", "seconds per Stage 1 round", "peak memory / weight bytes", points)
    return title, scatter([panel], title)


def answer(context: Context) -> str:
    """The page's answer: the streamed round's peak memory over the weight bytes, and its time over the in-memory
    round's, on both models."""
    figures = [load(source)["figures"] for _, source in STREAMING_RECORDS]
    peaks = [entry["streamed_peak_over_weight_bytes"] for entry in figures]
    more = [entry["streamed_time_over_in_memory_time"] - 1 for entry in figures]
    return paragraph(
        "**Layer streaming holds one layer's weights and activations at a time: "
        f"{fraction_range(peaks)} of the weight bytes, for {typical_fraction(more)} more time, with the in-memory "
        "scores.** It is the path for models larger than memory."
    )


CHARTS = {"streaming-chart": opening_chart}

TABLES = {
    "streaming-memory-answer": answer,
    "layer-streamed": layer_streamed,
}
