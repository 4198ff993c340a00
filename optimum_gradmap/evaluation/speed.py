# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Inference speed with the KV cache: prefill latency and decoding throughput.

One measurement: a forward pass over a `prompt_length`-token prompt that fills the KV cache
(prefill), then `new_tokens` single-token forward passes that each append one greedy token to the
cache (decoding). After warm-up runs, the median of repeated measurements is reported. Removing K
of L decoder layers leaves the embeddings and the output head untouched, so the decoding speed-up
approaches L / (L - K) when the decoder layers dominate the cost.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import DynamicCache
from transformers.utils import logging

from ..errors import InvalidInputError
from ..passes import calibration_mode, input_device

logger = logging.get_logger(__name__)


@dataclass
class SpeedResult:
    """Inference speed of one model.

    Attributes:
        device (`str`), dtype (`str`): Where and in which precision it ran.
        num_layers (`int`, *optional*): Decoder layers of the model, as its config says (`None` if it does not).
        batch_size (`int`): Sequences decoded together.
        prompt_length (`int`): Tokens in each prompt.
        new_tokens (`int`): Tokens decoded after the prompt.
        warmup (`int`), repeats (`int`): Unmeasured and measured runs.
        prefill_latency_ms (`float`): Median time of the prefill forward pass.
        decode_tokens_per_second (`float`): Median decoding throughput, `batch_size * new_tokens` over
            the decoding time.
        prefill_latencies_ms (`list[float]`), decode_times_s (`list[float]`): Every measured run.
    """

    device: str
    dtype: str
    num_layers: int | None
    batch_size: int
    prompt_length: int
    new_tokens: int
    warmup: int
    repeats: int
    prefill_latency_ms: float
    decode_tokens_per_second: float
    prefill_latencies_ms: list[float] = field(default_factory=list)
    decode_times_s: list[float] = field(default_factory=list)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _greedy(logits: torch.Tensor) -> torch.LongTensor:
    return logits[:, -1:, :].argmax(dim=-1)


def inference_speed(
    model: nn.Module,
    batch_size: int = 1,
    prompt_length: int = 128,
    new_tokens: int = 128,
    warmup: int = 2,
    repeats: int = 5,
    seed: int = 0,
) -> SpeedResult:
    """Measures prefill latency and decoding throughput with the KV cache.

    The prompt is random token ids (speed does not depend on the text); decoding is greedy, one
    token per forward pass, through a `DynamicCache`.

    Args:
        model (`nn.Module`): A causal LM (`PreTrainedModel`).
        batch_size (`int`, defaults to 1): Sequences per forward pass.
        prompt_length (`int`, defaults to 128): Prompt tokens.
        new_tokens (`int`, defaults to 128): Decoded tokens.
        warmup (`int`, defaults to 2): Runs before measuring.
        repeats (`int`, defaults to 5): Measured runs; the median is reported.
        seed (`int`, defaults to 0): Seed of the random prompt.

    Returns:
        [`SpeedResult`].
    """
    if min(batch_size, prompt_length, new_tokens, repeats) < 1 or warmup < 0:
        raise InvalidInputError("batch_size, prompt_length, new_tokens and repeats must be positive, warmup non-negative.")
    embeddings = model.get_input_embeddings().weight  # its shape and dtype are known even when offloaded ("meta")
    vocab_size = embeddings.shape[0]
    device = input_device(model)  # where the embeddings run, also when Accelerate offloaded them
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab_size, (batch_size, prompt_length), generator=generator).to(device)
    prefill_ms, decode_s = [], []
    with calibration_mode(model):
        for run in range(warmup + repeats):
            cache = DynamicCache(config=model.config)
            _synchronize(device)
            start = time.perf_counter()
            output = model(input_ids=prompt, past_key_values=cache, use_cache=True)
            next_token = _greedy(output.logits)
            _synchronize(device)
            prefilled = time.perf_counter()
            for _ in range(new_tokens):
                output = model(input_ids=next_token, past_key_values=output.past_key_values, use_cache=True)
                next_token = _greedy(output.logits)
            _synchronize(device)
            finished = time.perf_counter()
            if run >= warmup:
                prefill_ms.append(1000.0 * (prefilled - start))
                decode_s.append(finished - prefilled)
    return SpeedResult(
        device=str(device),
        dtype=str(embeddings.dtype).replace("torch.", ""),
        num_layers=getattr(model.config.get_text_config(decoder=True), "num_hidden_layers", None),
        batch_size=batch_size,
        prompt_length=prompt_length,
        new_tokens=new_tokens,
        warmup=warmup,
        repeats=repeats,
        prefill_latency_ms=statistics.median(prefill_ms),
        decode_tokens_per_second=batch_size * new_tokens / statistics.median(decode_s),
        prefill_latencies_ms=prefill_ms,
        decode_times_s=decode_s,
    )
