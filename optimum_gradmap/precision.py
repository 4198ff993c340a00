# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Which dtype the weights are stored in, and which precision the passes compute in.

**The weights** (`dtype`, the CLI's `--dtype`, `GradMAPPruner.from_pretrained(..., dtype=...)`): `"float32"` by
default; `dtype="auto"` ([`resolve_dtype`]) is bfloat16 where the hardware computes it natively
([`has_native_bfloat16`]: CUDA GPUs of compute capability 8.0 or more, CPUs with AVX512-BF16 or AMX) and float32
elsewhere. Weights stored in bfloat16 halve their memory; the decisions are then those of the rounded weights.

**The passes** (`GradMAPConfig.precision`, the CLI's `--precision`): with `"auto"` (the default), Stage 1's and
Stage 2's passes over a float32 model run under bfloat16 autocast where the hardware computes bfloat16 natively
([`Precision.for_model`]); the weights stay float32, so the saved checkpoint is what float32 passes would save up to
Stage 2's fits. Every decision is made as float32 makes it:

- each value a decision compares has a bound on how far bfloat16 moves it from its float32 value, measured (not
  derived) on the main job's settings by `benchmarks/precision_bound.py`: `SCORE_BOUND` for GradMAP's Stage 1 scores,
  `LOSS_BOUND` for mean next-token losses (SLEB's scores, the verified shortlist's losses, the budget's loss, Stage 2's
  held-out losses). docs/benchmarks/stage1-cost.md gives the measurement;
- where the bound cannot order the candidates ([`settled_lowest`]), only the undecided ones are recomputed in float32
  and the decision is made on those values ([`Precision.lowest`]): which layer each round removes, the verified
  shortlist and its choice, the budget's stop, and whether Stage 2 fits a layer at all (a lambda against W' = I);
  the drift that chooses Stage 2's targets and the validation that keeps its folds are computed in float32;
- a metric scores in bfloat16 only on the devices where its bfloat16 passes pay for the recomputations its bound
  leaves (`ImportanceMetric.bfloat16_devices`): GradMAP's score on CUDA GPUs. On a CPU it scores in float32: a
  bfloat16 round took 0.69 of a float32 one on an AVX512-BF16 CPU, and its bound (12%) left 7 of the main job's 8
  rounds to score again, so that Stage 1 would take longer than in float32 (`result.precision["float32"]` says so);
- Stage 2's lambda is chosen on bfloat16 losses, among the strengths the bound cannot tell apart (logged as
  `within_bound`), and its W' is fitted on statistics of bfloat16 activations;
- metrics and choices with no measured bound (the other Stage 1 metrics, the hidden-state choice of lambda, the
  Adam solver) compute in float32, as does the evaluation;
- the result says how often a decision was recomputed and what it cost (`result.precision`,
  `result.timings["float32_recompute"]`, the report and the card). `precision="float32"` computes in float32
  throughout.

Whatever the passes compute in, these stay in float32 or float64, because rounding there would change a decision or a
figure rather than the model:

- **Stage 1's scores**: each per-sample squared gradient norm is summed in float32 from the (bfloat16) gradients
  (the Gram matrices in float32 under autocast too), and the scores accumulate over samples in float64
  (`optimum_gradmap.importance.gradient`); the losses behind them are computed from float32 logits.
- **Stage 2's sufficient statistics and solves**: the MLP outputs, residual streams and dense targets are cast to
  float64 before A = sum y y^T, C = sum r y^T and sum ||r||^2 are accumulated; W' is solved in float64 and folded into
  the down projection in float64 before the result is rounded once to the weights' dtype
  (`optimum_gradmap.compensation`).
- **Losses, perplexity and KL**: the cross-entropy (and any divergence) is computed from logits cast to float32 and
  summed in float64 (`optimum_gradmap.objectives.summed_next_token_loss`).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from .errors import InvalidInputError

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16", "checkpoint")


def has_native_bfloat16(device: str | torch.device | None = None) -> bool:
    """Whether `device` computes bfloat16 natively: a CUDA GPU of compute capability 8.0 (Ampere) or more, or a CPU
    with AVX512-BF16 or AMX-BF16 instructions (as `torch.cpu.get_capabilities` reports them). Other devices (MPS,
    older GPUs and CPUs, where bfloat16 is emulated and slower than float32) answer `False`.

    Args:
        device (`str` or `torch.device`, *optional*): Defaults to the CPU.
    """
    device = torch.device(device if device is not None else "cpu")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return False
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.get_device_capability(index) >= (8, 0)
    if device.type == "cpu":
        get_capabilities = getattr(torch.cpu, "get_capabilities", None)
        capabilities = get_capabilities() if get_capabilities is not None else {}
        return bool(capabilities.get("avx512_bf16") or capabilities.get("amx_bf16"))
    return False


def compute_device(device: str | torch.device | None = None, device_map: object = None) -> torch.device:
    """Where a model loaded with `device` or `device_map` computes, for [`resolve_dtype`]: `device`; with a
    `device_map` and a CUDA GPU, the GPU; else the CPU."""
    if device is not None:
        return torch.device(device)
    return torch.device("cuda" if device_map is not None and torch.cuda.is_available() else "cpu")


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device | None = None) -> torch.dtype | str:
    """The dtype to load a model in for `dtype`:

    - `"auto"`: bfloat16 where `device` computes it natively ([`has_native_bfloat16`]), float32 elsewhere;
    - `"float32"`, `"bfloat16"`, `"float16"` (or a `torch.dtype`): that dtype;
    - `"checkpoint"`: the dtype the checkpoint was saved in (what transformers' own `dtype="auto"` loads), returned
      as the string `"auto"` for `from_pretrained`.

    Args:
        dtype (`str` or `torch.dtype`): One of `DTYPE_CHOICES`, or a floating `torch.dtype`.
        device (`str` or `torch.device`, *optional*): Where the model will compute (defaults to the CPU); for a
            `device_map`, the first GPU if there is one.

    Returns:
        `torch.dtype`, or `"auto"` for `"checkpoint"`.

    Raises:
        InvalidInputError: for another name.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if has_native_bfloat16(device) else torch.float32
    if dtype == "checkpoint":
        return "auto"
    if dtype in ("float32", "bfloat16", "float16"):
        return getattr(torch, dtype)
    raise InvalidInputError(
        f"dtype={dtype!r}: expected one of {', '.join(DTYPE_CHOICES)} ('auto': bfloat16 where the hardware computes it "
        "natively, float32 elsewhere; 'checkpoint': the dtype the checkpoint was saved in)."
    )


def uses_bfloat16_autocast(requested: bool, model: torch.nn.Module) -> bool:
    """The heal's autocast rule (`heal_autocast`): bfloat16 autocast where it was asked for, the device that takes the
    model's inputs computes bfloat16 natively ([`has_native_bfloat16`]), and the model is float32.

    Args:
        requested (`bool`): Whether autocast was asked for.
        model (`torch.nn.Module`): The model the passes run.

    Returns:
        `bool`.
    """
    from .passes import input_device

    return bool(requested) and has_native_bfloat16(input_device(model)) and model.dtype == torch.float32


# Decisions in bfloat16 passes, recomputed in float32 where the margin is within the bound (`precision="auto"`).

PrecisionSetting = Literal["auto", "float32"]

# How far (relative) a value computed in bfloat16 passes (autocast, float32 weights) may lie from the same value
# computed in float32; measured, not derived: docs/benchmarks/stage1-cost.md#the-bound gives the runs. Over the main
# job's 8 rounds, every score within 1.25x of the round's lowest moved by at most 10.7%; larger moves (up to 34%) were
# all on layers so far above the lowest that a move of that size leaves them above it.
SCORE_BOUND = 0.12  # GradMAP's Stage 1 scores (Eq. 5): up to 10.7% measured near the lowest score
LOSS_BOUND = 0.002  # mean next-token losses: SLEB's removal losses, the shortlist's, the budget's, Stage 2's lambda


@dataclass
class PrecisionLog:
    """What a run's decisions cost in float32: how many decisions were made on bfloat16 passes, and each one whose
    margin lay within the bound and was recomputed in float32 (what, the candidates, the seconds)."""

    decisions: int = 0
    recomputed: list[dict[str, Any]] = field(default_factory=list)
    within_bound: list[dict[str, Any]] = field(default_factory=list)
    # The passes that computed in float32 although bfloat16 was available, and why.
    float32: list[str] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        """The seconds spent recomputing in float32."""
        return sum(event["seconds"] for event in self.recomputed)

    def as_dict(self) -> dict[str, Any]:
        return {
            "decisions": self.decisions,
            "recomputed": list(self.recomputed),
            "recompute_seconds": self.seconds,
            "within_bound": list(self.within_bound),
            "float32": list(self.float32),
        }


@dataclass(frozen=True)
class Precision:
    """How a step's passes compute (`GradMAPConfig.precision`) and what its decisions cost: `low` is bfloat16 where the
    passes run under bfloat16 autocast (the model's weights stay float32: the saved checkpoint is the same), `None`
    where they compute in the model's own dtype. Built by [`Precision.for_model`].

    A decision compares values computed in the passes (scores, losses). With `low` set, each value lies within a
    bound of its float32 value (`SCORE_BOUND`, `LOSS_BOUND`): where the low-precision values cannot tell which
    candidates are the lowest under that bound ([`settled_lowest`]), the undecided candidates are recomputed in float32
    ([`Precision.exact`]) and the decision is made on those values ([`Precision.lowest`]); `log` counts both.
    """

    low: torch.dtype | None = None
    device_type: str = "cpu"
    log: PrecisionLog = field(default_factory=PrecisionLog, compare=False)

    @classmethod
    def for_model(cls, setting: str, model: torch.nn.Module) -> Precision:
        """`"auto"`: bfloat16 autocast where the device that takes the model's inputs computes bfloat16 natively
        ([`has_native_bfloat16`]) and the model's weights are float32; otherwise (and for `"float32"`) the model's own
        dtype."""
        from .passes import input_device

        device = input_device(model)
        native = sys.modules[__name__].bfloat16_passes_available(device)  # looked up here: the tests turn it off
        if setting == "auto" and native and model.dtype == torch.float32:
            return cls(torch.bfloat16, device.type)
        return cls(None, device.type)

    @property
    def computed_in(self) -> str:
        """How the passes computed, for the report: `"bfloat16 autocast"` or `"model dtype"`."""
        return "bfloat16 autocast" if self.low is not None else "model dtype"

    def passes(self) -> contextlib.AbstractContextManager:
        """The context the step's passes run in: bfloat16 autocast, or nothing."""
        if self.low is None:
            return contextlib.nullcontext()
        # No cache of the cast weights: Stage 2 folds W' into weights between passes, which a cached copy would hide.
        return torch.autocast(self.device_type, dtype=self.low, cache_enabled=False)

    def exact(self) -> contextlib.AbstractContextManager:
        """The context of a float32 recomputation (and of statistics kept in float32): autocast off."""
        return torch.autocast(self.device_type, enabled=False)

    def lowest(
        self,
        values: dict[Any, float],
        k: int,
        bound: float,
        exact_values: Callable[[list[Any]], dict[Any, float]],
        what: str,
    ) -> tuple[list[Any], dict[Any, float]]:
        """The `k` candidates with the lowest values (ties to the lower key), decided as float32 decides them.

        Args:
            values (`dict`): Each candidate's value (positive), computed in the passes.
            k (`int`): How many to choose.
            bound (`float`): How far (relative) each value may lie from its float32 value.
            exact_values (`Callable`): The float32 values of the candidates given (one recomputation).
            what (`str`): The decision, for the log.

        Returns:
            `(chosen, values)`: the chosen keys, lowest first, and the values with the recomputed ones replaced.
        """
        undecided: list[Any] = []
        if self.low is not None:
            self.log.decisions += 1
            _, undecided = settled_lowest(values, k, bound)
        if undecided:
            values = {**values, **self.recomputed(what, undecided, lambda: exact_values(undecided))}
        ranked = sorted(values, key=lambda key: (values[key], key))
        return ranked[:k], values

    def recomputed(self, what: str, candidates: list[Any], compute: Callable[[], Any]) -> Any:
        """`compute()` in float32, logged as the recomputation of decision `what` among `candidates`."""
        started = time.perf_counter()
        with self.exact():
            value = compute()
        self.log.recomputed.append(
            {"decision": what, "candidates": [str(key) for key in candidates], "seconds": time.perf_counter() - started}
        )
        return value


def bfloat16_passes_available(device: torch.device) -> bool:
    """Whether `precision="auto"` runs the passes in bfloat16 on `device`: where it computes bfloat16 natively
    ([`has_native_bfloat16`]). The test suite answers `False` here (float32 passes, as on a CPU without bfloat16),
    except where it tests the bfloat16 passes."""
    return has_native_bfloat16(device)


def settled_lowest(values: dict[Any, float], k: int, bound: float) -> tuple[list[Any], list[Any]]:
    """Which of `values` are the `k` lowest whatever their float32 values are, when each value `v` lies within
    `bound` (relative) of its float32 value `x` (`|v - x| <= bound * x`, so `x` is in `[v / (1 + bound), v / (1 - bound)]`).

    Returns:
        `(certain, undecided)`: the candidates certainly among the `k` lowest, and those whose place the bound leaves
        open (empty when the low-precision values decide). The `k` lowest are the certain ones and the lowest
        `k - len(certain)` of the undecided by their float32 values.
    """
    ranked = sorted(values, key=lambda key: (values[key], key))
    if k >= len(ranked):
        return ranked, []
    low = {key: values[key] / (1 + bound) for key in ranked}
    high = {key: values[key] / (1 - bound) for key in ranked}
    inside, outside = ranked[:k], ranked[k:]
    lowest_outside = min(low[key] for key in outside)
    highest_inside = max(high[key] for key in inside)
    undecided_inside = [key for key in inside if high[key] >= lowest_outside]
    undecided_outside = [key for key in outside if low[key] <= highest_inside]
    if not undecided_inside or not undecided_outside:
        return inside, []
    certain = [key for key in inside if key not in undecided_inside]
    return certain, undecided_inside + undecided_outside
