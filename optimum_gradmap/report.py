# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""The pruning report written beside every checkpoint: `pruning_report.json`, two pictures and a
model card (`README.md`).

- `pruning_report.json`: base model and revision, library versions, the GradMAP config (every field:
  `GradMAPConfig(**report["gradmap_config"])` rebuilds it), how to reproduce the run (`reproduce`: the exact
  `optimum-gradmap` command line, or a Python snippet when it was made through the API, see [`reproduction`]),
  removed / kept / compensated layers (original indices), Stage 1 scores of every round, drift per layer
  before and after compensation, timings, environment, and evaluation results when run, with the fidelity to
  the dense model where measured (the KL divergence beside each perplexity, the zero-shot flips). Every top-level
  figure describes the checkpoint's own weights: a checkpoint `optimum-gradmap heal` wrote holds the evaluation run
  again after the heal, and what the pruning run measured before it under `evaluation_before_heal`.
- `importance.png`: each layer's Stage 1 score in every round; `drift.png`: each kept layer's mean
  drift (Eq. 10) before and after compensation; `loss_curve.png` (when the loss was followed): the
  calibration loss after each removal, the budget and the K chosen. They need matplotlib (`pip install matplotlib`);
  without it the report and the model card are written without pictures.
- `README.md`: a Hub model card (`huggingface_hub.ModelCard`) that says what was removed, what it
  cost, how to load the model, and how to reproduce it (the command or the Python snippet, and the versions).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from typing import TYPE_CHECKING, Any

import torch
import transformers
from transformers import PreTrainedModel
from transformers.utils import logging

from .configuration import GradMAPConfig
from .errors import InvalidInputError
from .passes import input_device

if TYPE_CHECKING:
    from huggingface_hub import ModelCard

    from .evaluation import EvaluationResult

logger = logging.get_logger(__name__)

REPORT_NAME = "pruning_report.json"
IMPORTANCE_PICTURE = "importance.png"
DRIFT_PICTURE = "drift.png"
CURVE_PICTURE = "loss_curve.png"
HEAL_PICTURE = "heal_kl.png"
MODEL_CARD_NAME = "README.md"


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def library_version() -> str:
    """The installed optimum-gradmap's version (the package's metadata, else `optimum_gradmap.__version__`)."""
    from . import __version__

    return _version("optimum-gradmap") or __version__


def versions() -> dict[str, str]:
    """The versions of optimum-gradmap, transformers and torch this process runs."""
    return {"optimum_gradmap": library_version(), "transformers": transformers.__version__, "torch": torch.__version__}


API_SNIPPET = """from optimum_gradmap import GradMAPConfig, GradMAPPruner, load_report
from transformers import AutoModelForCausalLM, AutoTokenizer

report = load_report({folder})
config = GradMAPConfig(**report["gradmap_config"])
model = AutoModelForCausalLM.from_pretrained(report["base_model"], revision=report["base_model_revision"])
tokenizer = AutoTokenizer.from_pretrained(report["base_model"], revision=report["base_model_revision"])
result = GradMAPPruner(config, model=model, tokenizer=tokenizer).prune()"""


def reproduction(command: str | None, step: str = "prune", earlier: dict[str, Any] | None = None) -> dict[str, Any]:
    """The report's `reproduce` entry: how the checkpoint was made, for whoever wants to make it again.

    Args:
        command (`str`, *optional*): The exact command line that made it (`optimum-gradmap prune ...`, quoted as
            `shlex.join` quotes it); `None` when it was made through the Python API.
        step (`str`, defaults to `"prune"`): What this run did: `"prune"` or `"heal"` (a checkpoint pruned earlier).
        earlier (`dict`, *optional*): The `reproduce` entry of the checkpoint this run started from (a heal's).

    Returns:
        `dict`: `step`, `produced_by` (`"command line"` or `"Python API"`), `command`, `python` (through the API:
        a snippet that rebuilds the config from the report and prunes the base model again), `versions`
        (optimum-gradmap, transformers, torch) and `earlier`.
    """
    return {
        "step": step,
        "produced_by": "command line" if command else "Python API",
        "command": command or None,
        "python": None if command else API_SNIPPET.format(folder='"path/to/this/checkpoint"'),
        "versions": versions(),
        "earlier": earlier,
    }


def environment(model: PreTrainedModel) -> dict[str, Any]:
    """The report's `environment`: library versions, Python, platform, and the model's device and dtype."""
    return {
        **versions(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "device": str(input_device(model)),
        "dtype": str(model.get_input_embeddings().weight.dtype).replace("torch.", ""),
    }


def build_report(
    model: PreTrainedModel,
    summary: dict[str, Any],
    config: GradMAPConfig,
    base_model: str | None = None,
    base_model_revision: str | None = None,
    license: str | None = None,
    evaluation: EvaluationResult | None = None,
    dense_evaluation: EvaluationResult | None = None,
    command: str | None = None,
) -> dict[str, Any]:
    """The content of `pruning_report.json`.

    Args:
        model (`PreTrainedModel`): The pruned model.
        summary (`dict`): What the pruner did, [`PruningResult.to_dict`].
        config ([`GradMAPConfig`]): How it was configured.
        base_model (`str`, *optional*): Hub id (or path) of the dense model; defaults to the model's `name_or_path`.
        base_model_revision (`str`, *optional*): Its revision; defaults to the commit it was loaded from, if known.
        license (`str`, *optional*): The base model's license, inherited by the pruned model.
        evaluation ([`EvaluationResult`], *optional*): Evaluation results to include: of the model as saved (after the
            heal stage when it ran: the model card labels them "after heal").
        dense_evaluation ([`EvaluationResult`], *optional*): The same evaluation of the dense model.
        command (`str`, *optional*): The command line that made the checkpoint (`optimum-gradmap prune ...`), for
            `reproduce` ([`reproduction`]); `None`: it was made through the Python API.

    Returns:
        `dict`: JSON-serialisable.
    """
    return {
        "base_model": base_model or getattr(model, "name_or_path", "") or None,
        "base_model_revision": base_model_revision or getattr(model.config, "_commit_hash", None),
        "license": license,
        "model_type": model.config.model_type,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gradmap_config": config.to_dict(),
        "reproduce": reproduction(command),
        **summary,
        "evaluation": evaluation.to_dict() if evaluation is not None else None,
        "dense_evaluation": dense_evaluation.to_dict() if dense_evaluation is not None else None,
        "zero_shot_against_dense": _zero_shot_against_dense(evaluation, dense_evaluation),
        "flips_against_dense": _flips_against_dense(evaluation, dense_evaluation),
        "environment": environment(model),
    }


def _zero_shot_against_dense(evaluation: EvaluationResult | None, dense: EvaluationResult | None) -> dict[str, Any] | None:
    """The pruned model's zero-shot answers against the dense model's, question by question (paired
    difference, its standard error, McNemar's test, retained accuracy), when both were evaluated on the same
    questions with their records."""
    from .evaluation import compare_zero_shot

    if evaluation is None or dense is None or evaluation.zero_shot is None or dense.zero_shot is None:
        return None
    try:
        comparison = compare_zero_shot(
            dense.zero_shot, evaluation.zero_shot, reference=dense.zero_shot, names=("dense", "pruned", "dense")
        )
    except InvalidInputError as error:  # other questions, or no records: the table shows both averages without the pairing
        logger.info(f"The pruning report compares no zero-shot answers: {error}")
        return None
    return comparison.to_dict()


def _flips_against_dense(evaluation: EvaluationResult | None, dense: EvaluationResult | None) -> dict[str, Any] | None:
    """The pruned model's zero-shot flips against the dense model's answers (Dutta et al., "Accuracy is Not All You
    Need", NeurIPS 2024): counted from both evaluations' records where both have them on the same questions, else
    those the evaluation carries (`evaluate(..., reference=...)`), else none."""
    from .evaluation import flips

    if evaluation is None:
        return None
    if dense is not None and dense.zero_shot is not None and evaluation.zero_shot is not None:
        try:
            return flips(evaluation.zero_shot, dense.zero_shot, names=("pruned", "dense")).to_dict()
        except InvalidInputError as error:  # other questions, or no records
            logger.info(f"The pruning report counts no flips against the dense evaluation: {error}")
    return evaluation.flips.to_dict() if evaluation.flips is not None else None


def write_report(
    report: dict[str, Any], directory: str | os.PathLike, repo_id: str | None = None, title: str | None = None
) -> list[str]:
    """Writes `pruning_report.json`, its pictures and the model card into `directory`.

    Args:
        report (`dict`): From [`build_report`].
        directory (`str` or `os.PathLike`): The checkpoint folder.
        repo_id (`str`, *optional*): The Hub repository the model card names in its examples.
        title (`str`, *optional*): The model card's title; defaults to `repo_id`, else the folder's name.

    Returns:
        `list[str]`: The file names written.
    """
    with open(os.path.join(directory, REPORT_NAME), "w", encoding="utf-8") as file:
        json.dump(report, file, indent=2)
    pictures = write_pictures(report, directory)
    title = title or repo_id or os.path.basename(os.path.abspath(directory))
    build_model_card(report, pictures, repo_id, title).save(os.path.join(directory, MODEL_CARD_NAME))
    return [REPORT_NAME, *pictures, MODEL_CARD_NAME]


def load_report(directory: str | os.PathLike) -> dict[str, Any]:
    """Reads the `pruning_report.json` written next to a GradMAP checkpoint.

    Args:
        directory (`str` or `os.PathLike`): A folder written by `GradMAPPruner.save_pretrained`,
            `PruningResult.save_pretrained` or `optimum-gradmap prune`.

    Returns:
        `dict[str, Any]`: The report, as written.

    Raises:
        `InvalidInputError` (a `ValueError`): the folder has no `pruning_report.json`.
    """
    path = os.path.join(directory, REPORT_NAME)
    if not os.path.isfile(path):
        raise InvalidInputError(
            f"{os.fspath(directory)} has no {REPORT_NAME}: give a folder written by `save_pretrained` or `optimum-gradmap prune`."
        )
    with open(path, encoding="utf-8") as file:
        return json.load(file)


def write_pictures(report: dict[str, Any], directory: str | os.PathLike) -> list[str]:
    """Draws `importance.png`, `drift.png`, `loss_curve.png` and `heal_kl.png` (those the report has data for) into
    `directory`.

    Returns:
        `list[str]`: The file names written; empty when matplotlib is not installed (logged).
    """
    try:
        from matplotlib import colormaps
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        logger.warning("matplotlib is not installed: the pruning report has no pictures (`pip install matplotlib`).")
        return []

    def new_axis() -> tuple[Figure, Any]:  # drawn with Agg directly: the process's pyplot backend is left as it is
        figure = Figure(figsize=(9, 4.5))
        FigureCanvasAgg(figure)
        return figure, figure.add_subplot()

    written = []
    num_layers = report["original_num_layers"]
    removed = report["removed_layers"]
    metric = report["gradmap_config"].get("importance", "gradmap")
    if report["scores"]:
        figure, axis = new_axis()
        colours = colormaps["viridis"]([i / max(1, len(report["scores"]) - 1) for i in range(len(report["scores"]))])
        for round_index, (round_scores, colour) in enumerate(zip(report["scores"], colours)):
            indices = sorted(int(index) for index in round_scores)
            values = [round_scores[str(index)] for index in indices]
            label = f"round {round_index + 1}: removed {removed[round_index]}" if len(report["scores"]) > 1 else "scores"
            axis.plot(indices, values, marker="o", markersize=3, color=colour, label=label)
        for index in removed:
            axis.axvline(index, color="tab:red", alpha=0.25, linewidth=3)
        axis.set_yscale("log" if all(v > 0 for r in report["scores"] for v in r.values()) else "linear")
        axis.set_xlim(-0.5, num_layers - 0.5)
        axis.set_xlabel("layer index in the dense model (red bands: removed layers)")
        axis.set_ylabel(f"importance score ({metric}; lower is removed first)")
        axis.set_title(f"Stage 1 importance of each layer, every round ({len(removed)} of {num_layers} layers removed)")
        axis.legend(fontsize=7, ncol=2)
        figure.tight_layout()
        figure.savefig(os.path.join(directory, IMPORTANCE_PICTURE), dpi=110)
        written.append(IMPORTANCE_PICTURE)
    if report.get("dense_loss") is not None:
        figure, axis = new_axis()
        _draw_curve(axis, report)
        figure.savefig(os.path.join(directory, CURVE_PICTURE), dpi=110)
        written.append(CURVE_PICTURE)
    compensation = report.get("compensation") or {}
    if compensation.get("drift"):
        figure, axis = new_axis()
        indices = sorted(int(index) for index in compensation["drift"])
        drift = [compensation["drift"][str(i)] for i in indices]
        axis.plot(indices, drift, marker="o", markersize=4, label="after Stage 1 (pruned)")
        if compensation["drift_after_compensation"]:
            after = [compensation["drift_after_compensation"][str(i)] for i in indices]
            axis.plot(indices, after, marker="s", markersize=4, label="after Stage 2 (compensated)")
        for index in compensation["compensated_layers"]:
            axis.axvline(index, color="tab:green", alpha=0.3, linewidth=3, label=f"compensated layer {index}")
        axis.set_xlim(-0.5, num_layers - 0.5)
        axis.set_xlabel("kept layer index in the dense model")
        axis.set_ylabel("drift: L2 norm of the mean hidden-state shift (Eq. 10)")
        axis.set_title("Drift of each kept layer's mean output from the dense model's")
        axis.legend(fontsize=8)
        figure.tight_layout()
        figure.savefig(os.path.join(directory, DRIFT_PICTURE), dpi=110)
        written.append(DRIFT_PICTURE)
    heal = report.get("heal") or {}
    if heal.get("kl_curve"):
        figure, axis = new_axis()
        tokens, kl = zip(*heal["kl_curve"])
        axis.plot(tokens, kl, marker="o", markersize=3, label="held-out KL from the dense model")
        axis.plot([heal["best_tokens"]], [heal["best_kl"]], marker="*", color="tab:green", markersize=14, linestyle="none",
                  label=f"kept: {heal['best_kl']:.4f} after {heal['best_tokens']:,} tokens")  # fmt: skip
        axis.set_xlabel(f"tokens trained ({heal['dataset']})")
        axis.set_ylabel("next-token KL (top-64 and the rest), nats/token")
        axis.set_title(f"Heal: distillation from the dense model ({heal['trainable']})")
        axis.legend(fontsize=8)
        figure.tight_layout()
        figure.savefig(os.path.join(directory, HEAL_PICTURE), dpi=110)
        written.append(HEAL_PICTURE)
    return written


def _heal_sentence(report: dict[str, Any]) -> str:
    """What the heal stage did, in words; empty without it."""
    heal = report.get("heal")
    if not heal:
        return ""
    stopped = " (stopped early by the user)" if heal.get("interrupted") else ""
    merged = ", merged into the weights" if heal["trainable"] == "lora" else ""
    sentence = (
        f"Then the heal stage distilled the dense model into it{stopped}: {heal['trainable']} "
        f"({heal['num_trainable_parameters']:,} parameters{merged}) trained on {heal['trained_tokens']:,} tokens of "
        f"{heal['dataset']} (SHA-256 {heal['train_sha256'][:12]}); held-out KL from the dense model "
        f"{heal['start_kl']:.4f} -> {heal['best_kl']:.4f} nats/token."
    )
    if heal.get("budget_seconds") is not None:
        sentence += (
            f' Its budget was time (`heal_tokens="auto"`, {heal["budget_seconds"]:.0f} s, Stage 1\'s): it chose '
            f"{heal['budget_tokens']:,} tokens (`heal_tokens={heal['budget_tokens']}` reproduces it)"
            + (", and stopped when the time was up." if heal.get("stopped_at_budget") else ".")
        )
    if heal.get("generation_seconds"):
        sentence += (
            f" The dense model wrote its text in {heal['generation_seconds']:.0f} s of the heal's {heal['seconds']:.0f} s."
        )
    if not heal["best_tokens"]:
        compensation = report.get("compensation")
        if compensation and compensation.get("compensated_layers"):
            sentence += " No trained state beat the start, so the weights are Stage 2's."
        else:
            stage2 = "compensated no layer" if compensation else "was not run"
            sentence += f" No trained state beat the start, so the weights are Stage 1's (Stage 2 {stage2})."
    return sentence


def _draw_curve(axis: Any, report: dict[str, Any]) -> None:
    """The calibration loss against the number of layers removed, the budget line, the refused removal and the K chosen."""
    dense, curve = report["dense_loss"], report["loss_curve"]
    axis.plot(range(len(curve) + 1), [dense, *curve], marker="o", markersize=4, label="calibration loss after each removal")
    budget = report["gradmap_config"].get("max_loss_increase")
    if budget is not None:
        axis.axhline(
            dense * (1 + budget), color="tab:red", linestyle="--", label=f"budget: {100 * budget:+g}% over the dense model"
        )
    if report.get("rejected"):
        rejected = report["rejected"]
        axis.plot([len(curve) + 1], [rejected["loss"]], marker="x", color="tab:red", markersize=9, linestyle="none",
                  label=f"refused: removing layer {rejected['layer']}")  # fmt: skip
    axis.plot([len(curve)], [[dense, *curve][-1]], marker="*", color="tab:green", markersize=14, linestyle="none",
              label=f"chosen: {len(curve)} layers removed")  # fmt: skip
    axis.set_xlabel("layers removed (in removal order)")
    axis.set_ylabel("calibration loss (mean next-token cross-entropy)")
    axis.set_title(f"What each number of removed layers costs ({report['gradmap_config'].get('importance', 'gradmap')})")
    axis.legend(fontsize=8)


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


def _stage2_sentence(report: dict) -> str:
    """What Stage 2 did, in words: the compensated layers, their targets and lambdas, and the layers left alone."""
    compensation = report.get("compensation")
    if not compensation:
        return "Stage 2 (compensation) was not run."
    compensated, skipped = compensation["compensated_layers"], compensation["skipped_layers"]
    targets, lambdas = compensation["targets"], compensation["reg_lambda"]
    described = [
        f"{index}"
        + (f" (fitted to the dense output of layer {targets[str(index)]}" if str(index) in targets else " (")
        + (f", lambda {lambdas[str(index)]:.3g})" if str(index) in lambdas else ")")
        for index in compensated
    ]
    sentence = (
        f"Stage 2 compensated layer(s) {', '.join(described)}: a matrix folded into the MLP down projection, "
        "so inference costs nothing extra."
        if compensated
        else "Stage 2 compensated no layer."
    )
    for index, why in skipped.items():
        sentence += f" Layer {index} was left as it was: {why}."
    return sentence


def stage_before_heal(report: dict[str, Any]) -> str:
    """The stage that left the weights a heal starts from: `"Stage 1 + 2"`, or `"Stage 1"` when Stage 2 did not run.

    Args:
        report (`dict`): A pruning report ([`build_report`]).

    Returns:
        `str`: The stage's name, as the model card's column headers give it ("after Stage 1 + 2").
    """
    return "Stage 1 + 2" if report.get("compensation") else "Stage 1"


def _evaluation_columns(report: dict[str, Any]) -> list[tuple[str, Any, Any, Any]]:
    """The model card's columns beside the dense model's: each column's header, evaluation, and zero-shot comparison
    and flips against the dense model. A checkpoint that was not healed has one, "pruned". A healed one's are labelled
    with the stage their figures were measured after: "after heal" for the healed weights (`prune` with a heal budget
    evaluates after the heal, `optimum-gradmap heal` evaluates again), "after Stage 1 + 2" for what the pruning run
    measured before the heal (`evaluation_before_heal`), with "(before heal)" when nothing was measured after it
    (`heal --no-evaluate`, an interrupted heal, or a report written before `heal` evaluated)."""
    now = (report.get("evaluation"), report.get("zero_shot_against_dense"), report.get("flips_against_dense"))
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


def _cost_table(report: dict[str, Any]) -> str:
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


def _steps(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The runs that made the checkpoint, the first first (a heal's pruning, then the heal); one entry with no
    command for a report written before the library recorded it."""
    step = report.get("reproduce") or {"step": "prune", "versions": report.get("environment", {})}
    steps = [step]
    while steps[0].get("earlier"):
        steps.insert(0, steps[0]["earlier"])
    return steps


def _reproduce_section(report: dict[str, Any], repo_id: str | None) -> str:
    """The model card's "Reproduce" section: each run's command (or, through the Python API, a snippet that rebuilds
    the config from `pruning_report.json` and prunes again) and the versions it ran with."""
    steps = _steps(report)
    parts = [f"Made in {len(steps)} runs, each from the checkpoint the one before wrote." if len(steps) > 1 else ""]
    for step in steps:
        versions = step.get("versions") or {}
        made = (
            f"{'Healed' if step.get('step') == 'heal' else 'Pruned'} with optimum-gradmap {versions.get('optimum_gradmap')} "
            f"(transformers {versions.get('transformers')}, torch {versions.get('torch')})"
        )
        if step.get("command"):
            parts.append(f"{made}, from the command line:\n\n```bash\n{step['command']}\n```")
        elif step.get("produced_by") == "Python API":
            folder = f'snapshot_download("{repo_id}", allow_patterns="{REPORT_NAME}")' if repo_id else '"path/to/this/checkpoint"'
            snippet = API_SNIPPET.format(folder=folder)
            if repo_id:
                snippet = "from huggingface_hub import snapshot_download\n" + snippet
            parts.append(
                f"{made}, through the Python API. This rebuilds its configuration from `{REPORT_NAME}` and prunes the "
                f"base model again:\n\n```python\n{snippet}\n```\n\nIt calibrates on the text `config.dataset` names; "
                f"the run calibrated on {report.get('calibration_source') or 'text it did not record'} (give other text "
                "as `prune(calibration_data=...)`)."
            )
        else:
            parts.append(f"{made}; its report records no command.")
    parts.append(
        f"`{REPORT_NAME}` holds every setting of the run: `gradmap_config`, which "
        '`GradMAPConfig(**report["gradmap_config"])` rebuilds (`gradmap_config.json` holds the same), the SHA-256 of the '
        "calibration sequences, and the environment it ran in."
    )
    return "\n\n".join(part for part in parts if part)


def build_model_card(
    report: dict[str, Any], pictures: list[str], repo_id: str | None = None, title: str | None = None
) -> ModelCard:
    """A `huggingface_hub.ModelCard` for the pruned checkpoint.

    Args:
        report (`dict`): From [`build_report`].
        pictures (`list[str]`): File names of the pictures beside the card.
        repo_id (`str`, *optional*): The Hub repository, named in the loading examples.
        title (`str`, *optional*): The card's heading; defaults to `repo_id`'s name.

    The metadata names the base model but no `base_model_relation`: the Hub's vocabulary (adapter,
    merge, quantized, finetune) has no word for removing layers, and none of those is true.
    """
    from huggingface_hub import ModelCard, ModelCardData

    base_model = report.get("base_model")
    on_hub = bool(base_model) and not os.path.isabs(base_model) and base_model.count("/") == 1
    data = ModelCardData(
        base_model=base_model if on_hub else None,
        library_name="transformers",
        license=report.get("license"),
        pipeline_tag="text-generation",
        tags=["gradmap", "layer-pruning", "pruned", "optimum"],
    )
    name = repo_id or "path/to/this/checkpoint"
    removed, num_layers = report["removed_layers"], report["original_num_layers"]
    metric = report["gradmap_config"].get("importance", "gradmap")
    stage2 = " ".join(part for part in (_stage2_sentence(report), _heal_sentence(report)) if part)
    picture_lines = "\n\n".join(f"![{picture}]({picture})" for picture in pictures)
    timings = ", ".join(f"{stage} {seconds:.1f} s" for stage, seconds in report["timings"].items())
    content = f"""---
{data.to_yaml()}
---

# {title or os.path.basename(name.rstrip("/"))}

{"[" + base_model + "](https://huggingface.co/" + base_model + ")" if on_hub else (base_model or "A model")} with
{len(removed)} of its {num_layers} decoder layers removed with optimum-gradmap, an implementation of GradMAP
("GradMAP: Faster Layer Pruning with Gradient Metric and Projection Compensation"); importance metric:
`{metric}`. {stage2}

Removed layers (indices in the dense model, in removal order): {removed}.
Kept layers: {report["kept_layers"]}.

## What it cost

{_cost_table(report)}

Pruning time: {timings}. Every figure comes from `pruning_report.json` in this repository, which
also holds the importance scores of every round and the drift of every layer.

{picture_lines}

## How to use

A plain transformers checkpoint: no custom code.

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("{name}")
tokenizer = AutoTokenizer.from_pretrained("{name}")
```

With vLLM: `vllm serve {name}`.

## Reproduce

{_reproduce_section(report, repo_id)}
"""
    return ModelCard(content)


def format_report(report: dict[str, Any]) -> str:
    """A summary of a pruning report, for the terminal (`optimum-gradmap inspect`)."""
    config = report.get("gradmap_config", {})
    compensation = report.get("compensation") or {}
    lines = [
        f"base model:          {report.get('base_model')} (revision {report.get('base_model_revision') or 'unknown'})",
        f"importance metric:   {config.get('importance', 'gradmap')}",
        f"layers:              {report['original_num_layers']} -> {len(report['kept_layers'])}",
        f"removed (in order):  {report['removed_layers']}",
        f"kept:                {report['kept_layers']}",
        f"compensated:         {compensation.get('compensated_layers') or 'none'}",
        f"parameters:          {report.get('original_num_parameters', 0):,} -> {report.get('num_parameters', 0):,}",
        "timings:             " + ", ".join(f"{stage} {seconds:.1f} s" for stage, seconds in report.get("timings", {}).items()),
        f"calibration:         {config.get('num_samples')} x {config.get('seq_len')} tokens of "
        f"{report.get('calibration_source') or config.get('dataset')}",
    ]
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
    for step in _steps(report):
        if step.get("command") or step.get("produced_by"):
            lines.append(f"{step.get('step', 'prune') + ':':<21}{step.get('command') or 'through the ' + step['produced_by']}")
    return "\n".join(lines)
