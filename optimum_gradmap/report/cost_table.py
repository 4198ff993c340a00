# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""The model card's "What it cost" table: the dense model's figures beside the checkpoint's (and, for a healed one,
those measured before the heal), with the fidelity rows (KL divergence, flips) and the notes that say what they mean."""

from __future__ import annotations

from typing import Any

from .content import stage_before_heal


def _evaluation_columns(report: dict[str, Any]) -> list[tuple[str, Any, Any, Any]]:
    """The model card's columns beside the dense model's: each column's header, evaluation, and zero-shot comparison
    and flips against the dense model. A checkpoint that was not healed has one, "pruned". A healed one's are labelled
    with the stage their figures were measured after: "after heal" for the healed weights (`prune` with a heal budget
    evaluates after the heal, `optimum-gradmap heal` evaluates again), "after Stage 1 + 2" for what the pruning run
    measured before the heal (`evaluation_before_heal`), with "(before heal)" when nothing was measured after it
    (`heal --no-evaluate`, an interrupted heal, or a report written before `heal` evaluated). A checkpoint quantized
    later has one, "before quantization": what was measured on its unquantized weights."""
    now = (report.get("evaluation"), report.get("zero_shot_against_dense"), report.get("flips_against_dense"))
    unquantized = report.get("evaluation_before_quantization") or {}
    if not now[0] and unquantized.get("evaluation"):  # `optimum-gradmap quantize` measures nothing again
        keys = ("evaluation", "zero_shot_against_dense", "flips_against_dense")
        return [("before quantization", *(unquantized.get(key) for key in keys))]
    if not report.get("heal"):
        return [("pruned", *now)]
    before = report.get("evaluation_before_heal")
    if "evaluation_before_heal" not in report and (report.get("reproduce") or {}).get("step") == "heal":
        before = dict(zip(("evaluation", "zero_shot_against_dense", "flips_against_dense"), now))  # measured before
        before["measured_after"], now = stage_before_heal(report), (None, None, None)
    columns = []
    if before and before.get("evaluation"):
        header = f"after {before['measured_after']}" + ("" if now[0] else " (before heal)")
        columns.append((header, before["evaluation"], before.get("zero_shot_against_dense"), before.get("flips_against_dense")))
    if now[0] or not columns:
        columns.append(("after heal", *now))
    return columns


def cost_table(report: dict[str, Any]) -> str:
    """The model card's table of what the pruning cost, in Markdown, with its notes."""
    columns = _evaluation_columns(report)
    width = len(columns)
    rows: dict[Any, list[str]] = {
        "layers": ["decoder layers", str(report["original_num_layers"]), *[str(len(report["kept_layers"]))] * width],
        "parameters": ["parameters", f"{report['original_num_parameters']:,}", *[f"{report['num_parameters']:,}"] * width],
    }

    def row(key: Any, label: str, dense_value: str) -> list[str]:
        return rows.setdefault(key, [label, dense_value, *[""] * width])

    dense = report.get("dense_evaluation") or {}
    dense_perplexities = {(e["dataset"], e["protocol"]): e["perplexity"] for e in dense.get("perplexities", [])}
    for position, (_, evaluation, paired, flips) in enumerate(columns, 2):
        evaluation = evaluation or {}
        for entry in evaluation.get("perplexities", []):
            key = (entry["dataset"], entry["protocol"])
            before = dense_perplexities.get(key)
            cells = row(("perplexity", *key), f"{entry['dataset']} perplexity ({entry['protocol']})", "")
            cells[1] = f"{before:.3f}" if before is not None else ""
            cells[position] = f"{entry['perplexity']:.3f}"
            if entry.get("kl_to_reference") is not None:
                label, _, value = _kl_row(entry)
                row(("kl", *key), label, "")[position] = value
        if evaluation.get("zero_shot"):
            label, dense_value, value = _zero_shot_row(evaluation["zero_shot"], dense.get("zero_shot"), paired)
            row("zero_shot", label, dense_value)[position] = value
        if flips:
            label, _, value = _flips_row(flips)
            row("flips", label, "")[position] = value
            for label, _, value in _margin_flips_rows(flips):
                row(("margin flips", label), label, "")[position] = value
    if width > 1:  # measured before the heal only: said in the healed column, never left to be read as its figure
        for key, cells in rows.items():
            if (key in ("zero_shot", "flips") or key[0] == "margin flips") and not cells[-1]:
                cells[-1] = "not run after the heal"
    lines = [
        f"| | dense | {' | '.join(header for header, *_ in columns)} |",
        "|---|---|" + "---|" * width,
        *[f"| {' | '.join(cells)} |" for cells in rows.values()],
    ]
    if ("kl",) in {key[:1] for key in rows if isinstance(key, tuple)} or "flips" in rows:
        lines += [
            "",
            "KL divergence: KL(p_dense || p_pruned) of the next-token distributions, in nats per predicted token, on the "
            "perplexity segments, ± its standard error over segments. Flips: the share of zero-shot questions whose "
            'right/wrong differs from the dense model\'s answer. Both from Dutta et al., "Accuracy is Not All You Need" '
            "(NeurIPS 2024): they show what compression changes where accuracy differences cancel out.",
        ]
        if any(isinstance(key, tuple) and key[0] == "margin flips" for key in rows):
            lines[-1] += (
                " A question's margin: the dense model's log-likelihood of its answer minus the next best answer's, "
                "compared within its task (margins are on very different scales per task): the quartiles are cut "
                "within each task and pooled over tasks, and confident questions are those whose margin is above "
                "their own task's median. Flips come mostly from questions where the dense model's answer barely "
                "wins; a flip on a confident question is one it was sure of."
            )
    stage_note = _stage_note(columns)
    return "\n".join(lines + (["", stage_note] if stage_note else []))


def _stage_note(columns: list[tuple[str, Any, Any, Any]]) -> str:
    """What the cost table's columns of a healed checkpoint were measured on; empty for one that was not healed."""
    headers = [header for header, *_ in columns]
    if headers == ["pruned"] or not any(evaluation for _, evaluation, *_ in columns):
        return ""
    if headers == ["before quantization"]:
        return (
            "Every figure in this column was measured before the quantization, on the unquantized weights this "
            "checkpoint was quantized from, and not again on its quantized ones."
        )
    if len(headers) > 1:
        return (
            f"*{headers[0]}*: measured by the pruning run, on the weights the heal started from. *after heal*: measured "
            "again on this checkpoint's weights, on the same segments. Zero-shot accuracy and flips, where shown, were "
            "measured before the heal only."
        )
    if headers[0].endswith("(before heal)"):
        return (
            "Every figure in this column was measured by the pruning run, on the weights the heal started from, and not "
            "again on this checkpoint's (`optimum-gradmap heal --no-evaluate`, an interrupted heal, or a heal by a version "
            "that did not evaluate): they are not the healed model's."
        )
    return "Measured after the heal, on this checkpoint's weights."


def _kl_row(entry: dict[str, Any]) -> tuple[str, str, str]:
    """The model card's row of a perplexity's KL divergence from the reference model, with its standard error."""
    error = f" ± {entry['kl_stderr']:.4f}" if entry.get("kl_stderr") is not None else ""
    label = f"{entry['dataset']} KL divergence from {entry.get('reference') or 'the reference'} ({entry['protocol']})"
    return label, "", f"{entry['kl_to_reference']:.4f}{error}"


def _flips_row(flips: dict[str, Any]) -> tuple[str, str, str]:
    """The model card's row of the zero-shot flips against the reference, pooled over every question."""
    pooled = flips["pooled"]
    label = f"zero-shot flips against {flips['reference']} ({len(flips['tasks'])} tasks, {pooled['num_questions']} questions)"
    pruned = (
        f"{pooled['flips']:.2%} ({pooled['right_to_wrong']} right → wrong, {pooled['wrong_to_right']} wrong → right; "
        f"answer changed on {pooled['answer_changes']:.2%})"
    )
    return label, "", pruned


def _margin_flips_rows(flips: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The model card's rows of the zero-shot flips on the confident questions (the reference's margin above its
    task's median) and per quartile of the reference's margins cut within each task, where the flips have them (with
    each task's edges, `margin_edges`: a split without them was cut over the pooled margins, and is not shown)."""
    rows = []
    if not flips.get("margin_edges"):
        return rows
    confident = flips.get("confident")
    if confident is not None:
        rows.append(
            (
                f"zero-shot flips on confident questions ({flips['reference']} margin above its task's median)",
                "",
                f"{confident['flips']:.2%} of {confident['num_questions']} ({confident['right_to_wrong']} right → wrong, "
                f"{confident['wrong_to_right']} wrong → right)",
            )
        )
    if flips.get("by_margin"):
        quartiles = ", ".join(
            f"Q{entry['quartile']} {entry['flips']:.1%} of {entry['num_questions']}" for entry in flips["by_margin"]
        )
        label = f"zero-shot flips by within-task quartile of {flips['reference']} margin (Q1: smallest)"
        rows.append((label, "", quartiles))
    return rows


def _average_with_stderr(zero_shot: dict[str, Any]) -> str:
    """The average over tasks, with its standard error sqrt(sum of the tasks' SE^2) / number of tasks when every
    task has one (a sum over only some of them would understate it: then none is given)."""
    errors = [task.get("acc_stderr") for task in zero_shot["tasks"]]
    complete = bool(errors) and all(error is not None for error in errors)
    stderr = (sum(error**2 for error in errors) ** 0.5 / len(errors)) if complete else None
    return f"{zero_shot['average_acc']:.4f}" + (f" ± {stderr:.4f}" if stderr is not None else "")


def _zero_shot_row(
    zero_shot: dict[str, Any], dense: dict[str, Any] | None, paired: dict[str, Any] | None
) -> tuple[str, str, str]:
    """The model card's zero-shot row: each average with its standard error; against the dense model, the
    retained accuracy and the paired difference with its standard error."""
    questions = sum(task["num_samples"] for task in zero_shot["tasks"])
    label = f"zero-shot average accuracy ({len(zero_shot['tasks'])} tasks, {questions} questions)"
    pruned = _average_with_stderr(zero_shot)
    if paired is not None:
        retained = "retained undefined" if paired["retained_b"] is None else f"{paired['retained_b']:.1f}% of dense"
        pruned += f" ({retained}; paired difference {paired['average_difference']:+.4f} ± {paired['average_stderr']:.4f})"
    return label, _average_with_stderr(dense) if dense else "", pruned
