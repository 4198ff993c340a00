# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""The heal's resumable state: the checkpoint file saved at every held-out check, its fingerprint (what run it belongs
to), and its reading by the main process alone, sent to the others (nodes need not share a file system)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

from .. import distributed
from ..errors import InvalidInputError
from .result import HealResult

if TYPE_CHECKING:
    from .trainable import _Trainable


def _fingerprint_before_pruning(
    train_sha256: str,
    validation_sha256: str,
    trainable: str,
    learning_rate: float,
    batch_size: int,
    lora_rank: int,
    num_layers: int,
    loss: str = "kl",
) -> dict[str, Any]:
    """The part of a heal checkpoint's fingerprint known before Stage 1 (see [`check_heal_checkpoint_origin`]): the
    heal's text, its settings, the number of processes and the dense model's number of layers."""
    return {
        "train_sha256": train_sha256,
        "validation_sha256": validation_sha256,
        "trainable": trainable,
        "learning_rate": learning_rate,
        "batch_size": batch_size,
        "lora_rank": lora_rank,
        "loss": loss,
        "world_size": distributed.world_size(),
        "num_layers": num_layers,
    }


def _read_saved(checkpoint: str | os.PathLike) -> dict[str, Any] | None:
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


def _load_checkpoint(path: str | os.PathLike | None, fingerprint: dict[str, Any]) -> dict[str, Any] | None:
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


def _save_checkpoint(
    path: str | os.PathLike | None,
    fingerprint: dict[str, Any],
    chosen: _Trainable,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    best_state: list[torch.Tensor],
    result: HealResult,
) -> bool:
    """Saves the state in `path` (by the main process). Returns `False` on every process when Ctrl-C stopped the main
    process's write (the last complete file stays): the processes stop after this step together, rather than the main
    process alone. Another error raises on every process ([`distributed.on_main_process`])."""
    if path is None:
        return True

    def write(temporary: str) -> None:
        torch.save(
            {
                "fingerprint": fingerprint,
                "step": result.steps,
                "state": chosen.state(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "best_state": best_state,
                "kl_curve": result.kl_curve,
                "start_kl": result.start_kl,
                "best_kl": result.best_kl,
                "best_tokens": result.best_tokens,
                "budget_tokens": result.budget_tokens,  # what a resumed `heal_tokens="auto"` run trains again
            },
            temporary,
        )

    def save() -> bool:
        temporary = f"{os.fspath(path)}.tmp"
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)  # check_heal_checkpoint: it can be created
        try:
            write(temporary)
            os.replace(temporary, path)
        except BaseException as error:  # no half-written file left behind
            if os.path.exists(temporary):
                os.remove(temporary)
            if isinstance(error, KeyboardInterrupt):
                return False
            raise
        return True

    return distributed.on_main_process(save)
