# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Does a quantized checkpoint serve in vLLM as it runs in transformers? [`verify_quantized_serving`] runs both.

An unquantized checkpoint must serve exactly ([`optimum_gradmap.serving.verify_serving`]). A quantized one cannot:
vLLM's CPU kernels for INT8 and INT4 weights take bfloat16 activations only, and its INT8 kernels round the
activations their own way. So the check measures the agreement and sets it beside what bfloat16 arithmetic alone
does to the same checkpoint in transformers:

- `served`: vLLM (bfloat16 activations) against transformers in float32 on the same checkpoint;
- `bfloat16`: transformers in bfloat16 against transformers in float32, the same checkpoint (the rounding's share);
- `quantization` (with `unquantized`): the unquantized checkpoint against the quantized one, both in transformers
  float32 (what quantizing changed).

vLLM is asked to compute what the checkpoint stores: on CPUs with AMX its CPU build otherwise serves INT4 weights with
activations rounded to INT8 (`VLLM_CPU_INT4_W4A8`, on by default; measured on SmolLM2-135M W4A16: a mean difference
0.368 nats from float32 transformers with it, 0.077 without, bfloat16 transformers 0.087), which the checkpoint does
not say. Each says how far the prompt tokens' log-probabilities move (mean and largest absolute difference, nats) and how many
greedy tokens are equal before the first difference. The served checkpoint agrees when its mean difference is at most
[`AGREEMENT_FACTOR`] times bfloat16's plus [`AGREEMENT_FLOOR`].
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch
from transformers import AutoModelForCausalLM

from ..checkpoint import validate_checkpoint
from ..serving import find_vllm_python, prompt_ids_for, reference_outputs, run_vllm

AGREEMENT_FACTOR = 3.0
"""How many times bfloat16's own mean log-probability difference the served one may reach. vLLM adds its kernels'
rounding (INT8 activations rounded per token in its own order, bfloat16 accumulation) to bfloat16's."""
AGREEMENT_FLOOR = 0.02
"""Nats added to the bound, for checkpoints whose bfloat16 difference is near zero."""
AS_STORED = {"VLLM_CPU_INT4_W4A8": "0"}
"""vLLM's environment for the check: INT4 weights with the activations the checkpoint says (bfloat16), not INT8."""


@dataclass
class Agreement:
    """How far one run's outputs are from the float32 transformers reference.

    Args:
        mean_logprob_difference (`float`): Mean absolute difference of the prompt tokens' log-probabilities.
        max_logprob_difference (`float`): The largest.
        greedy_tokens_equal (`int`): Greedy tokens equal before each prompt's first difference, summed.
        greedy_tokens (`int`): Greedy tokens compared.
    """

    mean_logprob_difference: float
    max_logprob_difference: float
    greedy_tokens_equal: int
    greedy_tokens: int


def agreement(reference: Sequence[dict], other: Sequence[dict]) -> Agreement:
    """[`Agreement`] of `other` with `reference` (both as [`~optimum_gradmap.serving.reference_outputs`] returns). Where
    `other` lacks a prompt or a prompt token's log-probability that `reference` has (or has more), or where there is
    nothing to compare, its log-probability differences are infinite: missing data never reads as agreement."""
    complete = len(reference) == len(other) and all(
        len(ours["prompt_logprobs"]) == len(theirs["prompt_logprobs"]) for ours, theirs in zip(reference, other)
    )
    differences = [
        abs(a - b) for ours, theirs in zip(reference, other) for a, b in zip(ours["prompt_logprobs"], theirs["prompt_logprobs"])
    ]
    if not complete or not differences:
        differences = [float("inf")]
    equal = 0
    for ours, theirs in zip(reference, other):
        for a, b in zip(ours["tokens"], theirs["tokens"]):
            if a != b:
                break
            equal += 1
    return Agreement(
        mean_logprob_difference=sum(differences) / len(differences),
        max_logprob_difference=max(differences),
        greedy_tokens_equal=equal,
        greedy_tokens=sum(len(ours["tokens"]) for ours in reference),
    )


@dataclass
class QuantizedServingCheck:
    """What [`verify_quantized_serving`] found.

    Args:
        checkpoint (`str`): The folder served.
        engine (`str`): vLLM and its version.
        served, bfloat16 ([`Agreement`]): vLLM, and transformers in bfloat16, against transformers in float32.
        quantization ([`Agreement`], *optional*): The unquantized checkpoint against the quantized one.
        seconds (`dict[str, float]`): vLLM's start and generation.
    """

    checkpoint: str
    engine: str
    served: Agreement
    bfloat16: Agreement
    quantization: Agreement | None = None
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def bound(self) -> float:
        """The largest mean log-probability difference the served checkpoint may have."""
        return AGREEMENT_FACTOR * self.bfloat16.mean_logprob_difference + AGREEMENT_FLOOR

    @property
    def agrees(self) -> bool:
        return self.served.mean_logprob_difference <= self.bound

    def summary(self) -> str:
        """A few lines for the terminal."""
        lines = [f"{'AGREES' if self.agrees else 'DISAGREES'}: {self.checkpoint} in {self.engine} against transformers"]
        rows = [("vLLM, bfloat16", self.served), ("transformers, bfloat16", self.bfloat16)]
        rows += [("unquantized (transformers, float32)", self.quantization)] if self.quantization else []
        for name, measured in rows:
            lines.append(
                f"  {name} against transformers float32: log-probability difference mean "
                f"{measured.mean_logprob_difference:.4f}, largest {measured.max_logprob_difference:.4f} nats; greedy tokens "
                f"equal before the first difference {measured.greedy_tokens_equal} of {measured.greedy_tokens}"
            )
        lines.append(f"  bound on vLLM's mean: {AGREEMENT_FACTOR:g} x bfloat16's + {AGREEMENT_FLOOR:g} = {self.bound:.4f}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {**asdict(self), "bound": self.bound, "agrees": self.agrees}


def verify_quantized_serving(
    checkpoint: str | os.PathLike,
    vllm_python: str | os.PathLike | None = None,
    prompts: Sequence[str] | Sequence[Sequence[int]] | None = None,
    max_new_tokens: int = 16,
    unquantized: str | os.PathLike | None = None,
) -> QuantizedServingCheck:
    """Serves a quantized `checkpoint` with vLLM (bfloat16 activations) and measures its agreement with transformers.

    Args:
        checkpoint (`str` or `os.PathLike`): A compressed-tensors checkpoint folder.
        vllm_python (`str`, *optional*): The Python of an environment with vLLM.
        prompts (*optional*): Texts or token id lists (as [`~optimum_gradmap.serving.verify_serving`] takes them).
        max_new_tokens (`int`): Greedy tokens per prompt.
        unquantized (`str` or `os.PathLike`, *optional*): The checkpoint it was quantized from, to measure what
            quantizing changed beside.

    Returns:
        [`QuantizedServingCheck`]: its `agrees` says whether vLLM is within the bound.
    """
    checkpoint = str(checkpoint)
    python = find_vllm_python(vllm_python)
    validate_checkpoint(checkpoint)
    runs = {}
    for name, folder, dtype in (("float32", checkpoint, torch.float32), ("bfloat16", checkpoint, torch.bfloat16)) + (
        (("unquantized", str(unquantized), torch.float32),) if unquantized else ()
    ):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
        if name == "float32":
            prompt_ids = prompt_ids_for(checkpoint, prompts, model.config.get_text_config(decoder=True).vocab_size)
        runs[name] = reference_outputs(model.eval(), prompt_ids, max_new_tokens)
        del model
    served = run_vllm(checkpoint, prompt_ids, max_new_tokens, python, dtype="bfloat16", environment=AS_STORED)
    return QuantizedServingCheck(
        checkpoint=checkpoint,
        engine=f"vLLM {served['vllm_version']}",
        served=agreement(runs["float32"], served["results"]),
        bfloat16=agreement(runs["float32"], runs["bfloat16"]),
        quantization=agreement(runs["float32"], runs["unquantized"]) if unquantized else None,
        seconds={f"vllm_{key}": value for key, value in served["seconds"].items()},
    )
