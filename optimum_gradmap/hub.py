# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""The Hugging Face Hub: uploading a checkpoint folder, and what the library reads about a base model."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable

from transformers.utils import logging

from . import distributed

logger = logging.get_logger(__name__)


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


def save_and_upload(
    save: Callable[[str], object],
    repo_id: str,
    private: bool | None = None,
    token: str | bool | None = None,
    commit_message: str = "Upload model pruned with GradMAP",
) -> str:
    """Saves a checkpoint with `save(folder)` into a temporary folder and uploads it ([`upload_checkpoint`]).
    With several processes ([`optimum_gradmap.distributed`]), every process saves (a collective step) and the
    main process uploads; every process returns the URL.

    Returns:
        `str`: The URL of the commit.
    """
    with tempfile.TemporaryDirectory() as folder:
        save(folder)
        return distributed.on_main_process(
            lambda: upload_checkpoint(folder, repo_id, private=private, token=token, commit_message=commit_message)
        )


def base_model_license(repo_id: str, revision: str | None = None) -> str | None:
    """The license a Hub model declares in its model card, or `None` when it declares none or the Hub
    cannot be reached (the pruned model inherits it; say so rather than guess)."""
    from huggingface_hub import HfApi

    try:
        card_data = HfApi().model_info(repo_id, revision=revision).card_data
    except Exception as error:  # noqa: BLE001 - offline, private, gated or missing: no license is known
        logger.info(f"Could not read the license of {repo_id} from the Hub ({type(error).__name__}); the model card omits it.")
        return None
    return getattr(card_data, "license", None) if card_data is not None else None
