# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""The quantization step: a pruned (and healed) model quantized in place by llm-compressor's `oneshot`, calibrated on
token sequences we give it; [`QuantizationResult`] says what was done, for the report and the model card.

After it, the model's linear maps carry compressed-tensors quantization (their forward pass rounds as the kernels
will), and its `save_pretrained` (wrapped by llm-compressor) writes the compressed checkpoint that vLLM serves and
plain `AutoModelForCausalLM.from_pretrained` loads.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging

from ..data import calibration_sha256
from ..errors import InvalidInputError
from .checks import check_linear_maps, check_quantization, scheme_named

logger = logging.get_logger(__name__)


@dataclass
class QuantizationResult:
    """What the quantization step did.

    Args:
        scheme (`str`): `GradMAPConfig.quantization` (`"w8a8"`, `"w4a16"`, `"fp8"`).
        description (`str`): What the checkpoint stores, in words.
        algorithm (`str`): How the weights were rounded (`"SmoothQuant + GPTQ"`, `"GPTQ"`, `"round to nearest"`).
        recipe (`list[str]`): The llm-compressor modifiers that ran, as they print.
        ignored (`list[str]`): Linear maps left in full precision (the output embedding).
        group_size (`int`, *optional*): The input columns that share a weight scale (`w4a16`); `None` otherwise.
        calibration_source (`str`, *optional*): Where the calibration sequences came from; `None` for a scheme
            that reads none.
        calibration_sha256 (`str`, *optional*): Their SHA-256 (equal to Stage 1's when they are Stage 1's).
        num_samples, seq_len (`int`): Their count and length (0 without calibration).
        seconds (`float`): The time `oneshot` took.
        versions (`dict[str, str]`): llm-compressor's and compressed-tensors' versions.
    """

    scheme: str
    description: str
    algorithm: str
    recipe: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    group_size: int | None = None
    calibration_source: str | None = None
    calibration_sha256: str | None = None
    num_samples: int = 0
    seq_len: int = 0
    seconds: float = 0.0
    versions: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable copy."""
        return asdict(self)


def head_names(model: PreTrainedModel) -> list[str]:
    """The names of the linear maps that compute the logits (the output embedding), which stay unquantized as
    llm-compressor's own recipes leave `lm_head`."""
    head = model.get_output_embeddings()
    return [name for name, module in model.named_modules() if head is not None and module is head]


@contextlib.contextmanager
def config_on_disk(model: PreTrainedModel) -> Iterator[None]:
    """Points `model.config.name_or_path` at a temporary folder holding the model's current config while it is open:
    llm-compressor reads the config back from there (to check the model is not quantized already), and a pruned
    model's own `name_or_path` names the dense model, or a Hub id this machine may not reach."""
    original = model.config._name_or_path
    with tempfile.TemporaryDirectory(prefix="gradmap-quantize-") as folder:
        model.config.save_pretrained(folder)
        model.config._name_or_path = folder
        try:
            yield
        finally:
            model.config._name_or_path = original


# The settings of a modifier the report shows (the others are llm-compressor's defaults and its state).
_RECIPE_SETTINGS = (
    "smoothing_strength",
    "scheme",
    "config_groups",
    "targets",
    "ignore",
    "block_size",
    "dampening_frac",
    "actorder",
)


def _setting(value: Any) -> str:
    if isinstance(value, dict):  # config_groups: each group's weights, in brief
        return str(
            {
                name: f"{group.weights.num_bits}-bit {group.weights.type}, group {group.weights.group_size}"
                for name, group in value.items()
            }
        )
    return str(value)


def _described(modifier: Any) -> str:
    """A llm-compressor modifier as the report shows it: its class and the settings that define it."""
    settings = ", ".join(
        f"{name}={_setting(getattr(modifier, name))}"
        for name in _RECIPE_SETTINGS
        if getattr(modifier, name, None) not in (None, [], {})
    )
    return f"{type(modifier).__name__}({settings})"


def keep_own_config_on_save(model: PreTrainedModel) -> None:
    """Makes the quantized model's `save_pretrained` write its own config. llm-compressor's `save_pretrained` (which
    compresses the weights) rewrites `config.json` from the config file at `name_or_path`, the folder or Hub repository
    the model was loaded from: for a pruned model, the dense model's, with its layer count. Wrapped here, it reads the
    model's current config instead, whoever calls it."""
    compressed_save = model.save_pretrained

    @functools.wraps(compressed_save)
    def save_pretrained(*args: Any, **kwargs: Any) -> Any:
        with config_on_disk(model):
            return compressed_save(*args, **kwargs)

    model.save_pretrained = save_pretrained


def _versions() -> dict[str, str]:
    return {package: importlib.metadata.version(package) for package in ("llmcompressor", "compressed-tensors")}


def quantize_model(
    model: PreTrainedModel,
    scheme: str,
    calibration_ids: torch.LongTensor | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    calibration_source: str | None = None,
) -> QuantizationResult:
    """Quantizes `model` in place with llm-compressor (`oneshot`), every linear map but the output embedding.

    Args:
        model (`PreTrainedModel`): A full-precision causal LM (pruned, healed, or dense).
        scheme (`str`): `"w8a8"`, `"w4a16"` or `"fp8"` ([`~optimum_gradmap.quantize.SCHEMES`]).
        calibration_ids (`torch.LongTensor` of shape `(num_samples, seq_len)`, *optional*): What a calibrated scheme
            (`w8a8`, `w4a16`) reads; ignored by `fp8`.
        tokenizer (`PreTrainedTokenizerBase`, *optional*): The model's tokenizer; llm-compressor needs one beside
            calibration data (it tokenizes nothing here: the sequences are token ids already).
        calibration_source (`str`, *optional*): Where the sequences came from, for the report.

    Returns:
        [`QuantizationResult`].

    Raises:
        InvalidInputError: what [`check_quantization`] refuses, or a calibrated scheme without sequences or tokenizer;
            the model is untouched then.
    """
    quantization = scheme_named(scheme)
    if quantization.calibrated and (calibration_ids is None or tokenizer is None):
        raise InvalidInputError(
            f"`{scheme}` calibrates on token sequences: give both `calibration_ids` and the model's `tokenizer`."
        )
    ignored = head_names(model)
    group_size = check_linear_maps(model, quantization, ignored)
    check_quantization(model.config, scheme, calibration_ids)
    from llmcompressor import oneshot

    recipe = quantization.recipe(ignored, group_size)
    data: dict[str, Any] = {}
    if quantization.calibrated:
        from datasets import Dataset

        ids = calibration_ids.cpu()
        data = dict(
            processor=tokenizer,
            dataset=Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()}),
            num_calibration_samples=ids.shape[0],
            max_seq_length=ids.shape[1],
            shuffle_calibration_samples=False,
        )
    logger.info(f"Quantizing to {scheme} ({quantization.algorithm}) with llm-compressor")
    started = time.perf_counter()
    with config_on_disk(model):
        oneshot(model=model, recipe=recipe, **data)
    keep_own_config_on_save(model)
    return QuantizationResult(
        scheme=scheme,
        description=quantization.describe(group_size),
        algorithm=quantization.algorithm,
        recipe=[_described(modifier) for modifier in recipe],
        ignored=ignored,
        group_size=group_size,
        calibration_source=calibration_source if quantization.calibrated else None,
        calibration_sha256=calibration_sha256(calibration_ids) if quantization.calibrated else None,
        num_samples=int(calibration_ids.shape[0]) if quantization.calibrated else 0,
        seq_len=int(calibration_ids.shape[1]) if quantization.calibrated else 0,
        seconds=time.perf_counter() - started,
        versions=_versions(),
    )
