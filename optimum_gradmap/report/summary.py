# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""The report for the terminal: [`format_report`] (`optimum-gradmap inspect`) and the calibration loss curve
([`curve_lines`], also printed by `optimum-gradmap prune`)."""

from __future__ import annotations

from typing import Any

from .content import run_steps


def curve_lines(report: dict[str, Any]) -> list[str]:
    """The curve for the terminal: one line per number of layers removed."""
    dense = report.get("dense_loss")
    if dense is None:
        return []
    lines = [f"calibration loss:    dense {dense:.4f}"]
    for count, (layer, loss) in enumerate(zip(report["removed_layers"], report["loss_curve"]), 1):
        lines.append(f"  {count:>2} removed (layer {layer:>2}): {loss:.4f} ({loss / dense - 1:+.1%})")
    if report.get("rejected"):
        rejected = report["rejected"]
        lines.append(f"  refused (layer {rejected['layer']:>2}): {rejected['loss']:.4f} ({rejected['loss'] / dense - 1:+.1%})")
    return lines


def passes_sentence(precision: dict[str, Any]) -> str:
    """How Stage 1's and Stage 2's passes computed and what their decisions cost (`PruningResult.precision`)."""
    if precision["computed_in"] == "model dtype":
        return "in the model's dtype"
    recomputed = precision["recomputed"]
    in_float32 = "".join(f"; in float32: {reason}" for reason in precision.get("float32", []))
    return (
        f"{precision['computed_in']}; {len(recomputed)} of {precision['decisions']} decisions lay within the bound and "
        f"were recomputed in float32 ({precision['recompute_seconds']:.1f} s){in_float32}"
    )


def format_report(report: dict[str, Any]) -> str:
    """A summary of a pruning report, for the terminal (`optimum-gradmap inspect`)."""
    config = report.get("gradmap_config", {})
    compensation = report.get("compensation") or {}
    lines = [
        f"base model:          {report.get('base_model')} (revision {report.get('base_model_revision') or 'unknown'})",
        f"importance metric:   {config.get('importance', 'gradmap')}",
        f"steps:               {' -> '.join(report.get('steps') or ['Stage 1', *(['Stage 2'] if compensation else [])])}",
        f"layers:              {report['original_num_layers']} -> {len(report['kept_layers'])}",
        f"removed (in order):  {report['removed_layers']}",
        f"kept:                {report['kept_layers']}",
        f"compensated:         {compensation.get('compensated_layers') or 'none'}",
        f"parameters:          {report.get('original_num_parameters', 0):,} -> {report.get('num_parameters', 0):,}",
        "timings:             " + ", ".join(f"{stage} {seconds:.1f} s" for stage, seconds in report.get("timings", {}).items()),
        f"calibration:         {config.get('num_samples')} x {config.get('seq_len')} tokens of "
        f"{report.get('calibration_source') or config.get('dataset')}",
    ]
    if report.get("precision"):
        lines.append(f"passes:              {passes_sentence(report['precision'])}")
    fitted_on = compensation.get("calibration_sha256")
    if fitted_on and fitted_on != report.get("calibration_sha256"):
        source = config.get("compensation_dataset") or "the compensation_data given"
        lines.append(f"stage 2 fitted on:   {source} (SHA-256 {fitted_on[:12]}), not the calibration sequences")
    before = report.get("evaluation_before_heal") or {}
    measured = [("", report.get("evaluation"))] if report.get("evaluation") else []
    if before.get("evaluation"):  # the heal's report: the healed weights' figures, then those it started from
        measured = [(" after heal", report.get("evaluation"))] * bool(measured)
        measured.append((f" after {before['measured_after']} (before heal)", before["evaluation"]))
    for entry, stage in ((entry, stage) for stage, evaluation in measured for entry in evaluation.get("perplexities", [])):
        line = f"{entry['dataset']} perplexity{stage}: {entry['perplexity']:.3f} ({entry['protocol']})"
        if entry.get("kl_to_reference") is not None:
            error = f" +/- {entry['kl_stderr']:.4f}" if entry.get("kl_stderr") is not None else ""
            line += f"; KL from {entry.get('reference')}: {entry['kl_to_reference']:.4f}{error} nats/token"
        lines.append(line)
    heal = report.get("heal")
    if heal:
        lines.append(
            f"heal:                {heal['trainable']} on {heal['trained_tokens']:,} tokens of {heal['dataset']}, held-out "
            f"KL {heal['start_kl']:.4f} -> {heal['best_kl']:.4f}" + (" (interrupted)" if heal.get("interrupted") else "")
        )
    flips = report.get("flips_against_dense")
    if flips:
        pooled = flips["pooled"]
        lines.append(
            f"zero-shot flips:     {pooled['flips']:.2%} of {pooled['num_questions']} questions against {flips['reference']} "
            f"({pooled['right_to_wrong']} right -> wrong, {pooled['wrong_to_right']} wrong -> right)"
        )
        confident = flips.get("confident")
        if confident is not None and flips.get("margin_edges"):
            lines.append(
                f"confident flips:     {confident['flips']:.2%} of {confident['num_questions']} questions "
                f"({flips['reference']} margin above its task's median)"
            )
    earlier_flips = before.get("flips_against_dense")
    if earlier_flips:  # the pruning run's, before the heal: zero-shot is not run again after it
        pooled = earlier_flips["pooled"]
        lines.append(
            f"zero-shot flips:     {pooled['flips']:.2%} of {pooled['num_questions']} questions against "
            f"{earlier_flips['reference']}, after {before['measured_after']} (before heal)"
        )
    lines += curve_lines(report)
    if report.get("stopped"):
        lines.append(f"stage 1 stopped:     {report['stopped']}")
    environment = report.get("environment", {})
    lines.append(
        f"made with:           optimum-gradmap {environment.get('optimum_gradmap')}, transformers "
        f"{environment.get('transformers')}, torch {environment.get('torch')}"
    )
    for step in run_steps(report):
        if step.get("command") or step.get("produced_by"):
            lines.append(f"{step.get('step', 'prune') + ':':<21}{step.get('command') or 'through the ' + step['produced_by']}")
    return "\n".join(lines)
