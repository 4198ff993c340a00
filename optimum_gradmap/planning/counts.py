# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""What the plan counts: [`Count`] (a quantity known exactly or within a range), [`Work`] (what a stage computes, in
layer-tokens and head tokens) and [`flops`] (its FLOPs for a model's shape)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .shape import ModelShape

# The time of one step of a loop over columns (GPTQ's: a few small kernel calls), measured with llm-compressor 0.14's
# GPTQ on SmolLM2-135M's linear maps on a 2-core CPU (about 50 to 100 microseconds a column beside its FLOPs).
SECONDS_PER_SEQUENTIAL_STEP = 75e-6
# The float64 work of a symmetric eigendecomposition with its vectors, in units of d^3 (LAPACK's syevd, about 9 d^3).
EIGH_FLOPS_PER_CUBE = 9.0


@dataclass(frozen=True)
class Count:
    """A quantity known exactly (`low == high`) or only within a range, because it depends on what the run finds.

    Args:
        low (`float`): The smallest value the run can give.
        high (`float`): The largest.
        likely (`float`, *optional*): The value the run gives when it finds nothing unusual (the count of a
            golden-section search whose losses have one minimum, the median over the layouts Stage 1 may leave), where
            that is known better than the range's middle; `None`: the middle.
    """

    low: float = 0.0
    high: float = 0.0
    likely: float | None = None

    @classmethod
    def of(cls, value: float) -> Count:
        """An exact count."""
        return cls(value, value)

    @property
    def exact(self) -> bool:
        return self.low == self.high

    @property
    def middle(self) -> float:
        return (self.low + self.high) / 2

    @property
    def typical(self) -> float:
        """The value to expect: `likely` where it is known, else the range's middle."""
        return self.middle if self.likely is None else self.likely

    def __add__(self, other: Count | float) -> Count:
        other = other if isinstance(other, Count) else Count.of(other)
        likely = None if self.likely is None and other.likely is None else self.typical + other.typical
        return Count(self.low + other.low, self.high + other.high, likely)

    __radd__ = __add__

    def __mul__(self, factor: float) -> Count:
        return Count(self.low * factor, self.high * factor, None if self.likely is None else self.likely * factor)

    __rmul__ = __mul__

    def __truediv__(self, divisor: float) -> Count:
        return self * (1 / divisor)

    def to_dict(self) -> dict[str, float] | float:
        if self.exact:
            return self.low
        return {"low": self.low, "high": self.high} | ({} if self.likely is None else {"likely": self.likely})


ZERO = Count()


@dataclass
class Work:
    """What a stage computes, in the units [`DeviceThroughput`] turns into seconds.

    Args:
        layer_forward (`Count`): Layer-tokens run forward without gradients (one decoder layer over one token).
        layer_gradient (`Count`): Layer-tokens run forward with gradients and then differentiated.
        head_forward (`Count`): Tokens whose logits are formed without gradients.
        head_gradient (`Count`): Tokens whose logits are formed with gradients and differentiated.
        device_float64_flops (`Count`): float64 products on the device (Stage 2's statistics and Adam fits on rows).
        host_float64_flops (`Count`): float64 products on the host (Stage 2's solves).
        host_eigh (`Count`): d x d float64 eigendecompositions on the host.
        device_float32_flops (`Count`): float32 matrix products on the device outside the layers' passes (GPTQ's
            Hessians), counted at the device's float64 rate: with the inputs' conversion to float32, they ran at
            about that rate on a CPU (llm-compressor 0.14 on SmolLM2-135M).
        factorization_flops (`Count`): Small factorisations and their sweeps on the device (GPTQ's Cholesky factors
            and column updates), counted at the eigendecompositions' rate on a CPU.
        sequential_steps (`Count`): Steps a loop takes one after the other, each a few small kernel calls (GPTQ's
            columns), counted at `SECONDS_PER_SEQUENTIAL_STEP` each.
        generated_tokens (`Count`): Tokens the dense model writes itself (`heal_dataset="generated"`), a position at a
            time with its KV cache: each runs every decoder layer of the dense model and its head.
        per_sample_norms (`bool`): The gradient passes compute per-sample gradient norms (GradMAP's score).
        weight_gradients (`bool`): The gradient passes form the parameters' gradients (Taylor+, a full heal).
    """

    layer_forward: Count = ZERO
    layer_gradient: Count = ZERO
    head_forward: Count = ZERO
    head_gradient: Count = ZERO
    device_float64_flops: Count = ZERO
    host_float64_flops: Count = ZERO
    host_eigh: Count = ZERO
    device_float32_flops: Count = ZERO
    factorization_flops: Count = ZERO
    sequential_steps: Count = ZERO
    generated_tokens: Count = ZERO
    per_sample_norms: bool = False
    weight_gradients: bool = False

    def __add__(self, other: Work) -> Work:
        sums = {item.name: getattr(self, item.name) + getattr(other, item.name) for item in fields(self) if is_count(item)}
        return Work(
            **sums,
            per_sample_norms=self.per_sample_norms or other.per_sample_norms,
            weight_gradients=self.weight_gradients or other.weight_gradients,
        )

    def to_dict(self) -> dict[str, Any]:
        return {item.name: plain(getattr(self, item.name)) for item in fields(self)}


def is_count(item: Any) -> bool:
    """Whether the dataclass field `item` holds a [`Count`]."""
    return item.type in ("Count", Count)


def plain(value: Any) -> Any:
    """`value` as JSON-serialisable values (counts, plans and their parts by their `to_dict`)."""
    if isinstance(value, Count):
        return value.to_dict()
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    return value


def flops(work: Work, shape: ModelShape, heal: bool = False) -> Count:
    """The FLOPs `work` makes for a model of `shape` (device and host, every dtype).

    Args:
        work ([`Work`]): What a stage computes.
        shape ([`ModelShape`]): The model.
        heal (`bool`, defaults to `False`): Use the layers' cost at the heal batch's shape.

    Returns:
        `Count`.
    """
    forward = shape.mean("forward_flops", heal)
    gradient = forward + shape.mean("backward_flops", heal)
    gradient += shape.mean("per_sample_flops", heal) if work.per_sample_norms else 0.0
    gradient += forward if work.weight_gradients else 0.0
    head = 2 * shape.hidden_size * shape.vocab_size
    return (
        work.layer_forward * forward
        + work.layer_gradient * gradient
        + work.head_forward * head
        + work.head_gradient * (2 * head)
        + work.device_float64_flops
        + work.host_float64_flops
        + work.host_eigh * (EIGH_FLOPS_PER_CUBE * shape.hidden_size**3)
        + work.device_float32_flops
        + work.factorization_flops
        + work.generated_tokens * (shape.num_layers * forward + head)
    )
