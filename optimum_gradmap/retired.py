# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""What left the public surface, and why: the Stage 1 metrics, the `GradMAPConfig` settings and the settings' values
retired because none was a default or a preset's, the paper's method or a named peer's, or the best row of a published
table. Each maps to the figure that retired it and what to use instead, the message it is refused with
(docs/changelog.md lists them). A leaf: it imports only the errors and the metric registry."""

from __future__ import annotations

import functools
from typing import Any

from .errors import InvalidInputError
from .metric_registry import importance_metric_names

# Metrics taken off the public surface: none is a default, a preset, the paper's or a peer's method, or the best row
# of a published table. Name -> what retired it and what to use instead (docs/changelog.md).
RETIRED_METRICS: dict[str, str] = {
    "random": "a baseline, never a best row (SmolLM2-135M at 25%: Wikipedia / web-text perplexity 99,783.79 / "
    "378,713.49 against gradmap's 171.01 / 322.20, docs/benchmarks/layer-selection.md). The benchmarks' baseline rows "
    "register it with `import optimum_gradmap.experimental`",
    "gradmap_bound": "in no published table; it ranked the layers' removal losses below gradmap_bound_token on "
    "SmolLM2-135M (Spearman 0.895 against 0.935). Use gradmap_bound_token, the same bound per token",
    "gradmap_bound_squared": "in no published table; Spearman 0.889 with the layers' removal losses on SmolLM2-135M "
    "against gradmap_bound_token's 0.935. Use gradmap_bound_token",
    "taylor_gate": "in no published table; Spearman 0.514 with the layers' removal losses on SmolLM2-135M against "
    "gradmap_bound_token's 0.935. Use gradmap_bound_token, or taylor (Shortened LLaMA's Taylor+)",
    "taylor_gate_abs": "in no published table; Spearman 0.670 with the layers' removal losses on SmolLM2-135M against "
    "gradmap_bound_token's 0.935. Use gradmap_bound_token, or taylor (Shortened LLaMA's Taylor+)",
    "taylor_gate_squared": "in no published table; Spearman 0.669 with the layers' removal losses on SmolLM2-135M "
    "against gradmap_bound_token's 0.935. Use gradmap_bound_token, or taylor (Shortened LLaMA's Taylor+)",
}


def retired_metric_message(name: str) -> str:
    """The error for a retired metric's name: what retired it and what to use instead."""
    return (
        f"The importance metric {name!r} was retired from the public metrics: {RETIRED_METRICS[name]}. "
        f"The metrics are {', '.join(importance_metric_names())}."
    )


# Settings taken off the public surface: name -> (the one value it has now, what retired it and what to use instead).
# `GradMAPConfig` and the command line refuse them with that message; a saved config that holds one at that value
# (a checkpoint made before) still loads.
RETIRED_SETTINGS: dict[str, tuple[Any, str]] = {
    "heal_prompts": (
        "documents",
        "the dense model's text started from a chat template (heal_prompts='chat') healed less than text started from "
        "documents: Wikipedia / web-text KL 0.8928 / 1.0406 against 0.8302 / 0.9911, +2.59 against +3.08 points of "
        "zero-shot accuracy over Stage 1 alone (SmolLM2-135M at 25%, docs/changelog.md). The dense model's text starts "
        "from the calibration documents; remove the setting",
    ),
    "lambda_search": (
        "golden",
        "scoring every strength of the grid (lambda_search='grid') chose the lambdas the golden-section search chose "
        "on all three settings measured, in about twice its passes (nine strengths against four or five, "
        "docs/benchmarks/stage1-cost.md). The golden-section search runs; remove the setting",
    ),
    "verify_from_scoring_pass": (
        False,
        "starting the shortlist's check from the scoring pass saved no time: 221.9 s of Stage 1 against 209.5 s without "
        "it, with the same layers (SmolLM2-135M at 25%, the quality preset's Stage 1, 16 x 128 tokens, "
        "docs/benchmarks/stage1-cost.md). The check runs its own pass; remove the setting",
    ),
}


# Values taken off a setting's choices: (setting, value) -> what retired it and what to use instead. `GradMAPConfig`
# and the command line refuse them with that message.
RETIRED_VALUES: dict[tuple[str, Any], str] = {
    ("heal_loss", "logit_mse"): "alone, the logit MSE cost web-text KL and accuracy against the KL: Wikipedia / web-text "
    "KL 0.9757 / 1.1561 against 0.8302 / 0.9911, +0.67 against +3.08 points of zero-shot accuracy over Stage 1 alone "
    "(SmolLM2-135M at 25%, a heal on the dense model's text, docs/changelog.md). Use heal_loss='kl', the default",
    ("heal_loss", "kl_logit_mse"): "the KL plus the logit MSE did no better than the KL alone: Wikipedia / web-text KL "
    "0.8528 / 1.0106 against 0.8302 / 0.9911, +2.37 against +3.08 points of zero-shot accuracy over Stage 1 alone "
    "(SmolLM2-135M at 25%, a heal on the dense model's text, docs/changelog.md). Use heal_loss='kl', the default",
    ("heal_trainable", "down_projections"): "training the compensated layers' down projections healed least: "
    "Wikipedia / web-text KL 1.1149 / 1.4176 against LoRA's 0.8688 / 1.0667 on the same 40,960 tokens (SmolLM2-135M "
    "at 25%, docs/changelog.md). Use heal_trainable='lora', the default",
    ("heal_trainable", "before_removed"): "training the layers before each removed run healed less than LoRA: "
    "Wikipedia / web-text KL 1.0350 / 1.3090 against LoRA's 0.8688 / 1.0667 on the same 40,960 tokens (SmolLM2-135M "
    "at 25%, docs/changelog.md). Use heal_trainable='lora', the default",
    ("outlier_tokens", "clip"): "weighing the outlier tokens as if their norm were clipped was in no published table: "
    "in the Stage 2 screening (SmolLM2-135M at 25%, GradMAP's layers) it had the lowest perplexity, Wikipedia / web "
    "text 76.7 / 210.1 against the default's 83.7 / 233.1, but a lower mean zero-shot accuracy, 35.1% against 36.0%. "
    "Use outlier_tokens='auto', the default, or 'exclude'",
    ("outlier_tokens", "preserve"): "fitting the outlier tokens to stay as they are measured as keeping them: the same "
    "perplexities, Wikipedia / web text 63.3 / 162.9, and a mean zero-shot accuracy of 36.27% against 36.30% "
    "(SmolLM2-135M at 25%, Block Influence's layers). Use outlier_tokens='keep' or 'auto', the default",
    ("compensation_form", "diagonal"): "a channel-wise scaling without LinearPatch's rotation was in no published "
    "table. Use compensation_form='rotated_diagonal' (LinearPatch's form) or 'full' (the paper's)",
}


def refused_value(name: str, value: Any) -> str | None:
    """The error for a retired value of the setting `name` ([`RETIRED_VALUES`]), or `None` where `value` is not one."""
    try:
        reason = RETIRED_VALUES.get((name, value))
    except TypeError:  # an unhashable value (a list of layers) is no retired word
        return None
    return None if reason is None else f"`{name}={value!r}` was retired: {reason}."


def retired_setting_message(name: str) -> str:
    """The error for a retired setting: what retired it and what to use instead."""
    return f"The setting `{name}` was retired: {RETIRED_SETTINGS[name][1]}."


def refusing_retired_settings(init: Any) -> Any:
    """The dataclass's `__init__`, refusing a retired setting ([`RETIRED_SETTINGS`]) with what retired it rather than
    as an unexpected argument (its signature stays the dataclass's)."""

    @functools.wraps(init)
    def checked(self: Any, *args: Any, **kwargs: Any) -> None:
        retired = [name for name in kwargs if name in RETIRED_SETTINGS]
        if retired:
            raise InvalidInputError(retired_setting_message(retired[0]))
        init(self, *args, **kwargs)

    return checked
