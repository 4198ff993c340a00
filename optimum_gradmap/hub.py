# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Writing pruned checkpoints and publishing them on the Hugging Face Hub.

A GradMAP checkpoint is a plain transformers checkpoint: the pruned model's `config.json` says how
many layers it has and every per-layer setting, and its weights are named `...layers.0` to
`...layers.{n-1}`. Nothing else is needed to load it: no custom code, no `auto_map`. Two extra
files say how it was made: `gradmap_config.json` and `pruning_report.json`.
"""

from __future__ import annotations

import json
import os
from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging

from .configuration import GradMAPConfig

logger = logging.get_logger(__name__)

REPORT_NAME = "pruning_report.json"


def save_checkpoint(
    save_directory: str | os.PathLike,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase | None,
    config: GradMAPConfig,
    report: dict[str, Any] | None = None,
    **save_kwargs: Any,
) -> str:
    """Writes model, tokenizer, `gradmap_config.json` and (if given) `pruning_report.json`.

    Returns:
        `str`: The folder.
    """
    quantization = getattr(model.config, "quantization_config", None)
    if quantization is not None and (getattr(quantization, "quant_method", None) == "gguf" or (isinstance(quantization, dict) and quantization.get("quant_method") == "gguf")):
        raise ValueError(
            "This model was loaded from a GGUF file and transformers cannot save it back. Convert it first "
            "(see `optimum_gradmap.assets.get_model_path`, which does this for the offline models)."
        )
    os.makedirs(save_directory, exist_ok=True)
    model.save_pretrained(save_directory, **save_kwargs)
    if tokenizer is not None:
        tokenizer.save_pretrained(save_directory)
    config.save_pretrained(save_directory)
    if report is not None:
        with open(os.path.join(save_directory, REPORT_NAME), "w", encoding="utf-8") as file:
            json.dump(report, file, indent=2)
    logger.info(f"Saved pruned checkpoint to {save_directory}")
    return str(save_directory)


def upload_checkpoint(
    folder: str | os.PathLike,
    repo_id: str,
    private: bool | None = None,
    token: str | bool | None = None,
    commit_message: str = "Upload model pruned with GradMAP",
) -> str:
    """Creates `repo_id` on the Hub if needed and uploads `folder` to it in one commit.

    The token comes from `token`, else from the usual places (`HF_TOKEN`, `hf auth login`); it is never printed.

    Returns:
        `str`: The URL of the commit.
    """
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, repo_type="model", exist_ok=True)
    commit = api.upload_folder(repo_id=repo_id, folder_path=str(folder), repo_type="model", commit_message=commit_message)
    logger.info(f"Uploaded {folder} to https://huggingface.co/{repo_id}")
    return getattr(commit, "commit_url", str(commit))
