# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Writing pruned checkpoints and checking them.

A GradMAP checkpoint is a plain transformers checkpoint: the pruned model's `config.json` says how
many layers it has and every per-layer setting, and its weights are named `...layers.0` to
`...layers.{n-1}`. Nothing else is needed to load it: no custom code, no `auto_map`. Two extra
files say how it was made: `gradmap_config.json` and `pruning_report.json` (see [`optimum_gradmap.report`]).
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging

from . import distributed
from .adapters import DecoderAdapter, get_adapter
from .configuration import GradMAPConfig
from .errors import InvalidInputError
from .files import file_mode, folder_mode
from .report import REPORT_NAME, write_report
from .surgery import rewrite_fields

logger = logging.get_logger(__name__)


class InvalidCheckpointError(ValueError):
    """Raised by [`validate_checkpoint`] with every problem it found."""


def _checkpoint_tensors(path: str) -> dict[str, tuple[int, ...]]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as file:
            files = sorted(set(json.load(file)["weight_map"].values()))
    elif os.path.isfile(os.path.join(path, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise InvalidCheckpointError(f"{path} holds no model.safetensors (or sharded index): nothing to validate.")
    shapes: dict[str, tuple[int, ...]] = {}
    for name in files:
        with safe_open(os.path.join(path, name), framework="pt") as weights:
            for key in weights.keys():
                shapes[key] = tuple(weights.get_slice(key).get_shape())
    return shapes


# The tensors compressed-tensors stores beside (or instead of) a quantized linear map's `weight`.
COMPRESSED_TENSOR_PARTS = (
    "weight_packed",
    "weight_scale",
    "weight_zero_point",
    "weight_shape",
    "weight_g_idx",
    "weight_global_scale",
    "input_scale",
    "input_zero_point",
    "input_global_scale",
    "output_scale",
    "output_zero_point",
)


def _fold_compressed_tensors(stored: dict[str, tuple[int, ...]]) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """A compressed-tensors checkpoint's tensors as the full-precision model names them: each quantized linear map's
    parts (packed weight, scales, zero points) folded into its `weight`. Returns them and the names of those weights,
    whose stored shapes are the compressed ones (not checked against the config's)."""
    folded: dict[str, tuple[int, ...]] = {}
    quantized: set[str] = set()
    for name, shape in stored.items():
        prefix, _, part = name.rpartition(".")
        if part in COMPRESSED_TENSOR_PARTS:
            quantized.add(f"{prefix}.weight")
            folded.setdefault(f"{prefix}.weight", shape)
        else:
            folded[name] = shape
    return folded, quantized


def _saved_state_dict(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """The tensors `save_pretrained` writes for `model`: transformers 5 renames and regroups some
    weights on load (fused mixture-of-experts weights, legacy names) and reverts that on save."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers without weight conversions saves the state dict as it is
        return model.state_dict()
    return revert_weight_conversion(model, model.state_dict())


def _stale_layer_config(path: str, adapter: DecoderAdapter, text_config: PretrainedConfig) -> list[str]:
    """Fields of `text_config` that differ from what surgery derives from the report's dense values."""
    report_path = os.path.join(path, REPORT_NAME)
    if not os.path.isfile(report_path):
        return []
    with open(report_path, encoding="utf-8") as file:
        report = json.load(file)
    dense_values, kept = report.get("dense_layer_config"), report.get("kept_layers")
    if not dense_values or kept is None:
        return []
    expected_config = copy.deepcopy(text_config)
    rewrite_fields(adapter, expected_config, dense_values, report["original_num_layers"], kept)
    problems = []
    for name in dense_values:
        expected, found = (json.loads(json.dumps(getattr(c, name, None))) for c in (expected_config, text_config))
        if expected != found:
            problems.append(
                f"config {name}={found} is stale: the dense model's {dense_values[name]} for kept layers {kept} "
                f"gives {expected} (pruning_report.json)"
            )
    return problems


def validate_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Checks, from the files alone, that a checkpoint is what serving engines (vLLM, TGI) expect.

    They build the layer stack from the layer count in `config.json` and index every per-layer
    setting by the layer number in the weight names. So:

    - every tensor the config implies is present with the implied shape (tied weights may be
      stored once), and there is no other tensor (a compressed-tensors checkpoint's quantized weights are
      stored in parts, their shapes the compressed ones: each part must belong to a weight the config implies);
    - the weight names number the decoder layers exactly 0 .. n-1, n the config's layer count;
    - per-layer config lists (`layer_types`, ...: the fields the layer surgery slices, see
      [`DecoderAdapter.per_layer_config_fields`]) have length n, and layer-index lists point inside the stack;
    - the config needs no custom code (`auto_map`);
    - if the folder has a `pruning_report.json` that records the dense model's layer-dependent config
      values (`dense_layer_config`) and the kept layers, every such field says what the layer surgery
      makes of them for those layers: a per-layer list of the right length but describing other layers
      (e.g. `layer_types` cut to length instead of sliced) is caught here, though the files are consistent.

    Args:
        path (`str` or `os.PathLike`): A checkpoint folder.

    Returns:
        `dict`: `model_type`, `num_layers` and `num_tensors` of the valid checkpoint.

    Raises:
        InvalidCheckpointError: listing every problem found.
    """
    path = str(path)
    problems: list[str] = []
    with open(os.path.join(path, "config.json"), encoding="utf-8") as file:
        raw_config = json.load(file)
    if raw_config.get("auto_map"):
        problems.append(f"config.json has auto_map {raw_config['auto_map']}: loading would need custom code.")
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as error:  # noqa: BLE001 - transformers validates configs (e.g. layer_types against the layer count)
        problems.append(f"config.json does not load: {error}")
        raise InvalidCheckpointError(f"Checkpoint {path} is not valid:\n- " + "\n- ".join(problems)) from error
    text_config = config.get_text_config(decoder=True)
    adapter = get_adapter(config)
    num_layers = getattr(text_config, adapter.layer_count_field)

    stored, quantized = _checkpoint_tensors(path), set()
    if (raw_config.get("quantization_config") or {}).get("quant_method") == "compressed-tensors":
        stored, quantized = _fold_compressed_tensors(stored)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    expected = {name: tuple(tensor.shape) for name, tensor in _saved_state_dict(skeleton).items()}
    tied: dict[int, list[str]] = {}
    for name, parameter in skeleton.named_parameters(remove_duplicate=False):
        tied.setdefault(id(parameter), []).append(name)
    stored_once = {name for names in tied.values() if len(names) > 1 and any(n in stored for n in names) for name in names}
    for name in sorted(set(expected) - set(stored) - stored_once):
        problems.append(f"missing tensor {name}")
    for name, shape in stored.items():
        if name not in expected:
            problems.append(f"unexpected tensor {name} {list(shape)}")
        elif expected[name] != shape and name not in quantized:
            problems.append(f"tensor {name} has shape {list(shape)}, the config implies {list(expected[name])}")

    layer_name = re.compile(re.escape(adapter.layers_path) + r"\.(\d+)\.")
    numbered = {int(match.group(1)) for name in stored for match in [layer_name.search(name)] if match}
    if numbered != set(range(num_layers)):
        problems.append(f"weight names number layers {sorted(numbered)}, but {adapter.layer_count_field}={num_layers}")
    for field_name in adapter.per_layer_config_fields(text_config, num_layers):
        value = getattr(text_config, field_name)
        if len(value) != num_layers:
            problems.append(f"config {field_name} has {len(value)} entries for {num_layers} layers")
    for field_name in adapter.index_config_fields:
        value = getattr(text_config, field_name, None)
        if isinstance(value, list) and any(not 0 <= i < num_layers for i in value):
            problems.append(f"config {field_name}={value} points outside layers 0..{num_layers - 1}")
    problems.extend(_stale_layer_config(path, adapter, text_config))
    if problems:
        raise InvalidCheckpointError(f"Checkpoint {path} is not valid:\n- " + "\n- ".join(problems))
    return {"model_type": text_config.model_type, "num_layers": num_layers, "num_tensors": len(stored)}


def check_output_location(
    save_directory: str | os.PathLike, overwrite: bool = False, keep_safe: tuple[str | os.PathLike, ...] = ()
) -> str:
    """Checks, before any work, that a checkpoint can be written to `save_directory`.

    Args:
        save_directory (`str` or `os.PathLike`): The folder to write.
        overwrite (`bool`): Whether an existing non-empty folder may be replaced.
        keep_safe (`tuple`): Folders that must never be replaced, e.g. the model being pruned.

    Returns:
        `str`: The absolute path of the folder.

    Raises:
        FileExistsError: if it is a file, a folder in `keep_safe`, or a non-empty folder without `overwrite`.
        PermissionError: if it cannot be created or written.
    """
    target = os.path.abspath(save_directory)
    for folder in keep_safe:
        if os.path.isdir(folder) and os.path.realpath(folder) == os.path.realpath(target):
            raise FileExistsError(
                f"{save_directory} is the folder of the model being pruned: writing there would replace the dense "
                "model's weights. Give another output folder."
            )
    if os.path.exists(target) and not os.path.isdir(target):
        raise FileExistsError(f"{save_directory} is a file, not a folder: give a folder for the checkpoint.")
    if os.path.isdir(target) and os.listdir(target) and not overwrite:
        entries = sorted(os.listdir(target))
        shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
        raise FileExistsError(
            f"{save_directory} already holds {len(entries)} file(s) ({shown}): "
            "give a new folder, or pass overwrite=True (`--overwrite`) to replace its contents."
        )
    existing = target
    while not os.path.isdir(existing):  # the nearest folder that exists: the new ones are created in it
        existing = os.path.dirname(existing)
    parent = os.path.dirname(target) if os.path.isdir(target) else existing
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(f"Cannot write {save_directory}: {parent} is not writable.")
    return target


def _give_umask_modes(folder: str) -> None:
    """Gives `folder`, and every folder and file in it, the mode the umask gives a new one ([`folder_mode`],
    [`file_mode`]: 0o755 and 0o644 with the usual 022), so that another user, or a server running under another
    UID, reads the checkpoint as it reads any other: `tempfile.mkdtemp` creates the staging folder 0700, and
    safetensors >= 0.8 writes the weights 0600 (it renames a temporary file into place)."""
    files, folders = file_mode(), folder_mode()
    os.chmod(folder, folders)
    for root, subfolders, names in os.walk(folder):
        for name in subfolders:
            os.chmod(os.path.join(root, name), folders)
        for name in names:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, files)


def replace_folder(staging: str, target: str) -> None:
    """Moves the complete folder `staging` to `target`, replacing what was there: each step is a rename,
    so an interruption leaves either the old folder or the new one (and at worst a hidden leftover beside it)."""
    if not os.path.exists(target):
        os.rename(staging, target)
        return
    backup = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.old-", dir=os.path.dirname(target))
    os.rmdir(backup)
    os.rename(target, backup)
    try:
        os.rename(staging, target)
    except BaseException:
        os.rename(backup, target)
        raise
    shutil.rmtree(backup, ignore_errors=True)


# The shard size of the Hub's own large checkpoints (transformers' `save_pretrained` defaults to 50GB). An offloaded
# model is written a shard at a time, each shard's weights read into memory: this bounds what saving holds.
DEFAULT_MAX_SHARD_SIZE = "5GB"


def save_checkpoint(
    save_directory: str | os.PathLike,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase | None,
    config: GradMAPConfig,
    report: dict[str, Any] | None = None,
    repo_id: str | None = None,
    overwrite: bool = False,
    write_weights: Callable[[str], None] | None = None,
    **save_kwargs: Any,
) -> str:
    """Writes model, tokenizer, `gradmap_config.json` and, if a report is given, `pruning_report.json`,
    its pictures and a model card (`README.md`), see [`optimum_gradmap.report`].

    Saving is atomic: everything is written into a hidden folder beside `save_directory`, checked with
    [`validate_checkpoint`], then renamed into place. A failed or interrupted save leaves the folder as it
    was (or absent), never old and new files mixed.

    Args:
        save_directory (`str` or `os.PathLike`): Output folder.
        model (`PreTrainedModel`): The pruned model.
        tokenizer (`PreTrainedTokenizerBase`, *optional*): Its tokenizer.
        config ([`GradMAPConfig`]): The configuration it was pruned with.
        report (`dict`, *optional*): From [`optimum_gradmap.report.build_report`]; written with
            [`optimum_gradmap.report.write_report`].
        repo_id (`str`, *optional*): The Hub repository the model card should name in its examples.
        overwrite (`bool`): Replace the contents of an existing non-empty folder (refused otherwise).
        write_weights (`Callable[[str], None]`, *optional*): Writes the model's config and weights into the folder it
            is given, in place of the model's `save_pretrained` (a healed quantized checkpoint:
            [`optimum_gradmap.heal.quantized.stored_weights_writer`]).
        save_kwargs: Passed to the model's `save_pretrained`; `max_shard_size` defaults to
            `DEFAULT_MAX_SHARD_SIZE` (5GB, as the Hub's large checkpoints are sharded): an offloaded model is
            written a shard at a time, so saving holds at most one shard's weights in memory.

    With several processes ([`optimum_gradmap.distributed`]) the main process writes; the others wait
    for it, write nothing, and raise if it failed.

    Returns:
        `str`: The folder.

    Raises:
        FileExistsError, PermissionError: from [`check_output_location`], before anything is written.
    """

    def write() -> str:  # on one process
        quantization = getattr(model.config, "quantization_config", None)
        if quantization is not None and (
            getattr(quantization, "quant_method", None) == "gguf"
            or (isinstance(quantization, dict) and quantization.get("quant_method") == "gguf")
        ):
            raise InvalidInputError(
                "This model was loaded from a GGUF file and transformers cannot save it back. Convert it first "
                "(see `optimum_gradmap.assets.get_model_path`, which does this for the offline models)."
            )
        target = check_output_location(save_directory, overwrite)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        staging = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.saving-", dir=os.path.dirname(target))
        try:
            if write_weights is not None:
                write_weights(staging)
            else:
                model.save_pretrained(staging, **{"max_shard_size": DEFAULT_MAX_SHARD_SIZE, **save_kwargs})
            if tokenizer is not None:
                tokenizer.save_pretrained(staging)
            config.save_pretrained(staging)
            if report is not None:
                write_report(report, staging, repo_id, title=repo_id or os.path.basename(target))
            validate_checkpoint(staging)
            _give_umask_modes(staging)
            replace_folder(staging, target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        logger.info(f"Saved pruned checkpoint to {save_directory}")
        return str(save_directory)

    return distributed.on_main_process(write)
