# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Healing a quantized checkpoint: quantize first, then heal the part the quantized checkpoint stores as it is.

A compressed-tensors checkpoint ([`optimum_gradmap.quantize`]) stores its linear maps' weights rounded (INT4 or INT8
with their scales) and everything else (the normalisation weights, the embeddings, the head) as plain tensors. A heal
that trains only the normalisation weights (`heal_trainable="norms"`) on the quantized model, its linear maps held at
their rounded values, learns to correct the error of pruning and of the rounding together, and what it trains is
stored as it is: the healed checkpoint is the quantized one with new normalisation weights, its rounded weights
bit-identical, with nothing quantized a second time. This is the other order of heal and quantization, against the
heal, merge, quantize of `GradMAPConfig(quantization=...)`, whose rounding comes after the heal and undoes part of it;
its cost is the heal's usual cost on the dequantized model. It is measured in the docs' deploy benchmark.

Only weight quantization is healed this way: where the activations are rounded too (`w8a8`, `fp8`), the gradient that
reaches the normalisation weights passes through that rounding, whose gradient is zero almost everywhere.

References: training the parameters a quantized model keeps in full precision, its rounded weights frozen, is
EfficientQAT's second phase (Chen et al., 2024, arXiv 2407.11062, Sec. 3.3: "end-to-end training of quantization
parameters", there the step sizes); the norms here, as in the heal's `norms` choice.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
from collections.abc import Callable, Iterable
from typing import Any

import safetensors.torch  # the module: a function bound at import would keep whatever stood in for it then
from transformers import PreTrainedModel

from ..errors import InvalidInputError

# The files that describe the checkpoint rather than hold it: the healed checkpoint writes its own.
DESCRIPTIONS = ("README.md", "pruning_report.json", "gradmap_config.json")


def stored_quantization(path: str) -> dict[str, Any] | None:
    """The `quantization_config` of the checkpoint folder at `path`, or `None` (a folder without one, or a Hub id)."""
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        return None
    with open(config, encoding="utf-8") as file:
        return json.load(file).get("quantization_config")


def check_quantized_heal(quantization: dict[str, Any], trainable: str, name: str) -> None:
    """Refuses, before anything loads, a heal of a quantized checkpoint this module cannot do.

    Args:
        quantization (`dict`): The checkpoint's `quantization_config`.
        trainable (`str`): The heal's `heal_trainable`.
        name (`str`): The checkpoint, as the user named it.

    Raises:
        InvalidInputError: for a format other than compressed-tensors, activations quantized too, a choice of
            trainable parameters other than `norms`, or compressed-tensors not installed.
    """
    method = quantization.get("quant_method")
    if method != "compressed-tensors":
        raise InvalidInputError(
            f"{name} is quantized with {method}: only compressed-tensors checkpoints (`optimum-gradmap quantize`, "
            "llm-compressor) can be healed. Heal the unquantized checkpoint, then quantize it."
        )
    rounded = [key for key, group in (quantization.get("config_groups") or {}).items() if group.get("input_activations")]
    if rounded:
        raise InvalidInputError(
            f"{name} rounds its activations too ({', '.join(rounded)}): the heal's gradient would pass through that "
            "rounding, which has none. Heal before quantizing (`--quantization` with the heal), or heal a weight-only "
            "scheme such as w4a16."
        )
    if trainable != "norms":
        raise InvalidInputError(
            f"{name} is quantized: the heal can train only the weights it stores as they are, the normalisation "
            f"weights. Use --heal-trainable norms (not {trainable}), or heal the unquantized checkpoint and quantize "
            "after it."
        )
    try:
        import compressed_tensors  # noqa: F401
    except ImportError as error:
        raise InvalidInputError(
            f"{name} is a compressed-tensors checkpoint: loading it needs `pip install compressed-tensors` (or "
            "`pip install optimum-gradmap[quantize]`)."
        ) from error


def dequantized_loading() -> dict[str, Any]:
    """`from_pretrained` arguments that load a compressed-tensors checkpoint with its weights dequantized into plain
    tensors (the values the quantized model computes with), so that the heal can differentiate through them."""
    from transformers import CompressedTensorsConfig

    return {"quantization_config": CompressedTensorsConfig(run_compressed=False)}


def stored_weights_writer(source: str, model: PreTrainedModel, trained: Iterable[str]) -> Callable[[str], None]:
    """A writer for [`~optimum_gradmap.checkpoint.save_checkpoint`]: copies the quantized checkpoint at `source` (its
    config, weights and other files, not its report and card) and replaces every tensor named in `trained` with the
    model's value, in the stored dtype. Every other tensor (the rounded weights and their scales, and the embeddings
    and head the heal did not train, whatever dtype the model was loaded in) is copied as stored, bit for bit.

    Args:
        source (`str`): The quantized checkpoint folder the model was loaded from.
        model (`PreTrainedModel`): The healed model, loaded with [`dequantized_loading`].
        trained (`Iterable[str]`): The names of the parameters the heal trained
            ([`~optimum_gradmap.heal.changed_parameters`]).

    Returns:
        `Callable[[str], None]`: writes into the folder it is given.
    """
    names = set(trained)

    def write(folder: str) -> None:
        values = {name: tensor.detach() for name, tensor in model.state_dict().items() if name in names}
        for name in os.listdir(source):
            if name in DESCRIPTIONS or not os.path.isfile(os.path.join(source, name)):
                continue
            shutil.copy2(os.path.join(source, name), os.path.join(folder, name))
        for shard in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
            stored = safetensors.torch.load_file(shard)
            for name, tensor in stored.items():
                if name in values and tensor.is_floating_point() and values[name].shape == tensor.shape:
                    stored[name] = values[name].to(device="cpu", dtype=tensor.dtype).contiguous()
            safetensors.torch.save_file(stored, shard, metadata={"format": "pt"})

    return write
