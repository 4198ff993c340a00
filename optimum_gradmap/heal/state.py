# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""The heal's resumable state: the checkpoint file saved at every held-out check, its fingerprint (what run it belongs
to), and its reading by the main process alone, sent to the others (nodes need not share a file system)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from .. import distributed
from ..errors import InvalidInputError
from .settings import HealSettings


def fingerprint_before_pruning(
    train_sha256: str | None, validation_sha256: str | None, settings: HealSettings, num_layers: int
) -> dict[str, Any]:
    """The part of a heal checkpoint's fingerprint known before Stage 1 (see
    [`~optimum_gradmap.heal.check_heal_checkpoint_origin`]): the heal's text (`None` where it is not known yet), the
    settings that decide its training, the number of processes and the dense model's number of layers."""
    return {
        "train_sha256": train_sha256,
        "validation_sha256": validation_sha256,
        "trainable": settings.heal_trainable,
        "learning_rate": settings.learning_rate,
        "batch_size": settings.heal_batch_size,
        "lora_rank": settings.heal_lora_rank,
        "loss": settings.heal_loss,
        "world_size": distributed.world_size(),
        "num_layers": num_layers,
    }


def read_heal_checkpoint(checkpoint: str | os.PathLike) -> dict[str, Any] | None:
    """The fingerprint of the heal checkpoint file `checkpoint` (with the default loss) and the training tokens of its
    run (`budget_tokens`, `None` in files that do not record it); `None` without a file. Read by the main process
    alone, mapped rather than read (the state is not needed), and sent to the others.

    Raises:
        InvalidInputError: for a file that cannot be read.
    """

    def read() -> dict[str, Any] | None:
        if not os.path.isfile(checkpoint):
            return None
        try:
            saved = torch.load(checkpoint, map_location="cpu", weights_only=True, mmap=True)
        except Exception as error:
            raise InvalidInputError(
                f"The heal checkpoint {checkpoint} cannot be read ({type(error).__name__}: {error}): delete it."
            ) from error
        saved = saved if isinstance(saved, dict) else {}
        fingerprint = _with_default_loss(saved.get("fingerprint") or {})
        return {"fingerprint": fingerprint, "budget_tokens": saved.get("budget_tokens")}

    return distributed.on_main_process(read)


def _with_default_loss(fingerprint: dict[str, Any]) -> dict[str, Any]:
    """A saved fingerprint, with the loss of the checkpoints written before `heal_loss` existed (the KL) where it has
    none: they resume."""
    return {"loss": "kl", **fingerprint}


def load_heal_state(path: str | os.PathLike | None, fingerprint: dict[str, Any]) -> dict[str, Any] | None:
    """The state an interrupted run with this `fingerprint` saved in `path` (`None` without a file). The main process
    reads it and sends it to the others, which need not see the file (nodes without a shared file system): every
    process resumes from the same state."""
    if path is None:
        return None
    saved = distributed.on_main_process(
        lambda: torch.load(path, map_location="cpu", weights_only=True) if os.path.isfile(path) else None
    )
    if saved is None:
        return None
    saved["fingerprint"] = _with_default_loss(saved.get("fingerprint") or {})
    if saved["fingerprint"] != fingerprint:
        differs = sorted(key for key in fingerprint if saved.get("fingerprint", {}).get(key) != fingerprint[key])
        raise InvalidInputError(
            f"The heal checkpoint {path} comes from another run (it differs in {', '.join(differs)}): delete it, or "
            "resume with the same model, pruning, text, settings and number of processes."
        )
    return saved


def save_heal_state(path: str | os.PathLike | None, state: Callable[[], dict[str, Any]]) -> bool:
    """Saves `state()` (the training's state, made by the main process alone) in `path`. Returns `False` on every
    process when Ctrl-C stopped the main process's write (the last complete file stays): the processes stop after this
    step together, rather than the main process alone. Another error raises on every process
    ([`distributed.on_main_process`])."""
    if path is None:
        return True

    def save() -> bool:
        temporary = f"{os.fspath(path)}.tmp"
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)  # check_heal_checkpoint: it can be created
        try:
            torch.save(state(), temporary)
            os.replace(temporary, path)
        except BaseException as error:  # no half-written file left behind
            if os.path.exists(temporary):
                os.remove(temporary)
            if isinstance(error, KeyboardInterrupt):
                return False
            raise
        return True

    return distributed.on_main_process(save)
