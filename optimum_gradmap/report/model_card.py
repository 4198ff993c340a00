# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""The model card (`README.md`): a `huggingface_hub.ModelCard` that says what was removed, what it cost, how to load
the model, and how to reproduce it (the command or the Python snippet, and the versions)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from .content import API_SNIPPET, REPORT_NAME, run_steps
from .cost_table import cost_table
from .summary import passes_sentence

if TYPE_CHECKING:
    from huggingface_hub import ModelCard


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


def heal_sentence(report: dict[str, Any]) -> str:
    """What the heal stage did, in words; empty without it."""
    heal = report.get("heal")
    if not heal:
        return ""
    stopped = " (stopped early by the user)" if heal.get("interrupted") else ""
    merged = ", merged into the weights" if heal["trainable"] == "lora" else ""
    into = "the quantized model, its rounded weights as stored" if heal.get("after_quantization") else "it"
    sentence = (
        f"Then the heal stage distilled the dense model into {into}{stopped}: {heal['trainable']} "
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


def _quantization_sentence(report: dict[str, Any]) -> str:
    """What the quantization step did, in words; empty without it."""
    quantization = report.get("quantization")
    if not quantization:
        return ""
    calibration = (
        f", calibrated on {quantization['num_samples']} x {quantization['seq_len']} tokens of "
        f"{quantization['calibration_source']} (SHA-256 {quantization['calibration_sha256'][:12]})"
        if quantization.get("calibration_sha256")
        else ""
    )
    when = "Then" if (report.get("heal") or {}).get("after_quantization") else "Last"
    return (
        f"{when}, llm-compressor {quantization['versions'].get('llmcompressor')} quantized it to `{quantization['scheme']}` "
        f"({quantization['description']}; {quantization['algorithm']}){calibration}; "
        f"{', '.join(quantization['ignored']) or 'no linear map'} kept in full precision. The weights are stored in the "
        "compressed-tensors format: transformers loads them with `compressed-tensors` installed, vLLM serves them."
    )


# What loading a quantized checkpoint needs, in the card's "How to use".
QUANTIZED_NOTE = " (its quantized weights need `pip install compressed-tensors`)"
# How the card names each run that made the checkpoint (`reproduce.step`).
STEP_WORDS = {"prune": "Pruned", "heal": "Healed", "quantize": "Quantized"}


def _reproduce_section(report: dict[str, Any], repo_id: str | None) -> str:
    """The model card's "Reproduce" section: each run's command (or, through the Python API, a snippet that rebuilds
    the config from `pruning_report.json` and prunes again) and the versions it ran with."""
    steps = run_steps(report)
    parts = [f"Made in {len(steps)} runs, each from the checkpoint the one before wrote." if len(steps) > 1 else ""]
    for step in steps:
        versions = step.get("versions") or {}
        made = (
            f"{STEP_WORDS.get(step.get('step'), 'Pruned')} with optimum-gradmap {versions.get('optimum_gradmap')} "
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
        tags=["gradmap", "layer-pruning", "pruned", "optimum"]
        + (["compressed-tensors", report["quantization"]["scheme"]] if report.get("quantization") else []),
    )
    name = repo_id or "path/to/this/checkpoint"
    removed, num_layers = report["removed_layers"], report["original_num_layers"]
    metric = report["gradmap_config"].get("importance", "gradmap")
    steps = (heal_sentence(report), _quantization_sentence(report))
    if (report.get("heal") or {}).get("after_quantization"):
        steps = steps[::-1]  # the order the runs came in
    stage2 = " ".join(part for part in (_stage2_sentence(report), *steps) if part)
    picture_lines = "\n\n".join(f"![{picture}]({picture})" for picture in pictures)
    timings = ", ".join(f"{stage} {seconds:.1f} s" for stage, seconds in report["timings"].items())
    if report.get("precision"):
        timings += f". Passes: {passes_sentence(report['precision'])}"
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

{cost_table(report)}

Pruning time: {timings}. Every figure comes from `pruning_report.json` in this repository, which
also holds the importance scores of every round and the drift of every layer.

{picture_lines}

## How to use

A plain transformers checkpoint: no custom code{QUANTIZED_NOTE if report.get("quantization") else ""}.

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
