# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""What left the public surface, and why: the Stage 1 metrics and the `GradMAPConfig` settings retired because none
was a default or a preset's, the paper's method or a named peer's, or the best row of a published table. Each name
maps to the figure that retired it and what to use instead, the message it is refused with (docs/changelog.md lists
them). A leaf: it imports only the errors and the metric registry."""

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
    "verify_from_scoring_pass": (
        False,
        "starting the shortlist's check from the scoring pass saved no time: 221.9 s of Stage 1 against 209.5 s without "
        "it, with the same layers (SmolLM2-135M at 25%, the quality preset's Stage 1, 16 x 128 tokens, "
        "docs/benchmarks/stage1-cost.md). The check runs its own pass; remove the setting",
    ),
}


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
