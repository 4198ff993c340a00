# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""The report's files in a checkpoint folder: [`write_report`] writes `pruning_report.json`, its pictures and the
model card; [`load_report`] reads the report back."""

from __future__ import annotations

import json
import os
from typing import Any

from ..errors import InvalidInputError
from .content import MODEL_CARD_NAME, REPORT_NAME
from .model_card import build_model_card
from .pictures import write_pictures


def write_report(
    report: dict[str, Any], directory: str | os.PathLike, repo_id: str | None = None, title: str | None = None
) -> list[str]:
    """Writes `pruning_report.json`, its pictures and the model card into `directory`.

    Args:
        report (`dict`): From [`build_report`].
        directory (`str` or `os.PathLike`): The checkpoint folder.
        repo_id (`str`, *optional*): The Hub repository the model card names in its examples.
        title (`str`, *optional*): The model card's title; defaults to `repo_id`, else the folder's name.

    Returns:
        `list[str]`: The file names written.
    """
    with open(os.path.join(directory, REPORT_NAME), "w", encoding="utf-8") as file:
        json.dump(report, file, indent=2)
    pictures = write_pictures(report, directory)
    title = title or repo_id or os.path.basename(os.path.abspath(directory))
    build_model_card(report, pictures, repo_id, title).save(os.path.join(directory, MODEL_CARD_NAME))
    return [REPORT_NAME, *pictures, MODEL_CARD_NAME]


def load_report(directory: str | os.PathLike) -> dict[str, Any]:
    """Reads the `pruning_report.json` written next to a GradMAP checkpoint.

    Args:
        directory (`str` or `os.PathLike`): A folder written by `GradMAPPruner.save_pretrained`,
            `PruningResult.save_pretrained` or `optimum-gradmap prune`.

    Returns:
        `dict[str, Any]`: The report, as written.

    Raises:
        `InvalidInputError` (a `ValueError`): the folder has no `pruning_report.json`.
    """
    path = os.path.join(directory, REPORT_NAME)
    if not os.path.isfile(path):
        raise InvalidInputError(
            f"{os.fspath(directory)} has no {REPORT_NAME}: give a folder written by `save_pretrained` or `optimum-gradmap prune`."
        )
    with open(path, encoding="utf-8") as file:
        return json.load(file)
