# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""The checks the heal makes before any work: what the model and the environment can run as the settings say, the
origin of a heal checkpoint file, the heal text's name and the dense model's prompts, and the arguments of a training
run. Every refusal the inputs decide comes from here, before Stage 1 (or, for a checkpoint pruned earlier, before
the teacher loads)."""

from __future__ import annotations

import os

import torch
from torch import nn

from .. import distributed, streaming
from ..adapters import get_adapter
from ..data import calibration_sha256, check_dataset_name
from ..errors import InvalidInputError
from ..retired import refused_value
from .generation import PROMPT_TOKENS, corpus_part, is_generated
from .loss import no_seam_refusal, reads_hidden_states, streamed_loss_refusal, uses_layer_states
from .settings import HEAL_LOSS_CHOICES, HEAL_TRAINABLE_CHOICES, HealSettings, PlannedPruning, PrunedLayout
from .state import fingerprint_before_pruning, read_heal_checkpoint
from .trainable import check_no_peft_adapters, choose_trainable, offloaded_refusal


def check_heal_settings(model: nn.Module, settings: HealSettings, pruning: PrunedLayout | PlannedPruning) -> None:
    """Refuses, before anything changes, a heal the model or the environment cannot run as `settings` say.

    Args:
        model (`nn.Module`): The model to prune (or pruned).
        settings ([`HealSettings`]): The heal's settings.
        pruning ([`PrunedLayout`] or [`PlannedPruning`]): For a model pruned already, its layers; before the pruning,
            what is known of it (whether Stage 2 will run, the layers given to remove).

    Before pruning it also refuses what would leave the heal nothing to train, where the dense model tells it already:
    no linear map for `lora`, no normalisation for `norms`.

    Raises:
        InvalidInputError: for a model that carries PEFT adapters, `lora` without PEFT, full weights in bfloat16 or
            float16, a choice other than `lora` on a model with offloaded weights, a loss that reads hidden states
            layer-streamed, `kl_hidden_mse` with a `layers_to_prune` that leaves no kept layer after a removed run, or
            nothing to train.
    """
    check_no_peft_adapters(model)
    trainable, planned = settings.heal_trainable, isinstance(pruning, PlannedPruning)
    if trainable == "lora":
        try:
            import peft  # noqa: F401
        except ImportError as error:
            raise InvalidInputError(
                "heal_trainable='lora' needs PEFT: `pip install peft` (or `pip install optimum-gradmap[heal]`), or choose "
                "heal_trainable='norms'."
            ) from error
    dtype = next(model.parameters()).dtype
    if trainable != "lora" and dtype in (torch.bfloat16, torch.float16):
        raise InvalidInputError(
            f"heal_trainable={trainable!r} would train {str(dtype).replace('torch.', '')} weights in place, "
            "where AdamW's small steps round away: load the model in float32 (`--dtype float32`), or heal with "
            "heal_trainable='lora' (its adapters are float32 whatever the model's dtype)."
        )
    if trainable != "lora" and streaming.is_offloaded(model):
        raise InvalidInputError(offloaded_refusal(trainable))
    if reads_hidden_states(settings.heal_loss) and (settings.execution == "layer_streamed" or streaming.is_offloaded(model)):
        raise InvalidInputError(streamed_loss_refusal(settings.heal_loss))
    if settings.execution == "in_memory" and streaming.is_offloaded(model):
        raise InvalidInputError(
            "execution='in_memory' with offloaded weights: the heal's backward pass would keep every weight Accelerate "
            "brings in until it runs, a whole copy of the model. Use execution='auto' (layer-streamed), or load the "
            "model without offload."
        )
    if settings.heal_batch_size < distributed.world_size():
        raise InvalidInputError(
            f"heal_batch_size={settings.heal_batch_size} cannot be shared by {distributed.world_size()} processes: use a "
            "batch at least as large as the number of processes."
        )
    if planned:
        _check_planned_layers(model, settings, pruning)


def _check_planned_layers(model: nn.Module, settings: HealSettings, pruning: PlannedPruning) -> None:
    """Before pruning: nothing to train, or no seam, where the dense model and the layers given show it already."""
    adapter = get_adapter(model)
    num_layers = adapter.num_layers(model)
    choose_trainable(model, adapter, settings.heal_trainable)  # the kept layers are of the dense model's kinds
    if pruning.layers_to_prune is None:
        return
    layout = PrunedLayout.without(pruning.layers_to_prune, num_layers)
    if uses_layer_states(settings.heal_loss) and not layout.seams():
        raise InvalidInputError(no_seam_refusal(layout.kept))


def check_heal_checkpoint_origin(
    checkpoint: str | os.PathLike | None,
    model: nn.Module,
    train_ids: torch.LongTensor | None,
    validation_ids: torch.LongTensor | None,
    settings: HealSettings,
) -> None:
    """Refuses, before pruning starts, a heal checkpoint file that comes from another run.

    A heal checkpoint's fingerprint has two parts. The first is known before Stage 1: the heal's training and held-out
    sequences, its settings (`heal_trainable`, the learning rate, `heal_batch_size`, `heal_lora_rank`, `heal_loss`),
    the number of processes and the dense model's number of layers. The second is what Stage 1 and 2 made: the kept and
    compensated layers and a digest of the weights. This compares the first part: a file that differs in it is refused
    here, before anything changes. Where the sequences are made only when the heal starts (the dense model's own text,
    `heal_tokens="auto"`), they are not given, and the settings, the number of processes and the number of layers are
    compared alone. A file that matches is taken as this run's own, left by an interrupted run of the same command
    (what the file is for), and [`heal`] compares the whole fingerprint when it starts: a file from a run with the same
    heal but another pruning (other calibration text or Stage 1 settings, the same output) is refused only then, after
    Stage 1 and 2, which `prune` undoes. The file is read by the main process alone (the others need not see it).

    Args:
        checkpoint (`str` or `os.PathLike`, *optional*): The heal checkpoint file; nothing is checked without one, or
            when it does not exist.
        model (`nn.Module`): The dense model to prune.
        train_ids (`torch.LongTensor`, *optional*), validation_ids (`torch.LongTensor`, *optional*): The heal's
            sequences ([`heal_sequences`]), where they are known before Stage 1.
        settings ([`HealSettings`]): The heal's settings.

    Raises:
        InvalidInputError: for a path that cannot be written ([`check_heal_checkpoint`]), a file that cannot be read, or
            that differs in the first part, saying where.
    """
    if checkpoint is None:
        return
    distributed.on_main_process(lambda: check_heal_checkpoint(checkpoint))  # a path it cannot write: refused here too
    saved = read_heal_checkpoint(checkpoint)
    if saved is None:
        return
    expected = fingerprint_before_pruning(
        calibration_sha256(train_ids) if train_ids is not None else None,
        calibration_sha256(validation_ids) if validation_ids is not None else None,
        settings,
        get_adapter(model).num_layers(model),
    )
    compared = {key: value for key, value in expected.items() if value is not None}  # the sequences, where known
    differs = [key for key, value in compared.items() if saved["fingerprint"].get(key) != value]
    if differs:
        raise InvalidInputError(
            f"The heal checkpoint {checkpoint} comes from another run (it differs in {', '.join(differs)}): delete it, or "
            "resume with the same model, text, heal settings and number of processes. Refused before pruning started."
        )


def check_heal_dataset_name(name: str) -> None:
    """Refuses a `heal_dataset` that names no text, before anything loads: the corpus names in it are checked as
    calibration datasets (or paths); `generated` (the dense model's own text) needs no check.

    Raises:
        InvalidInputError: for an unknown name, saying which are available.
    """
    corpus = corpus_part(name) if is_generated(name) else name
    if corpus is not None and not os.path.exists(corpus):
        check_dataset_name(corpus, "calibration")


def check_generation_prompts(settings: HealSettings) -> None:
    """Refuses, before any work, the dense model's own text (`generated` in `heal_dataset`) with prompts longer than
    `heal_seq_len`: the first `PROMPT_TOKENS` tokens of the calibration documents.

    Args:
        settings ([`HealSettings`]): Its `heal_dataset` and `heal_seq_len` are read.

    Raises:
        InvalidInputError: for a prompt longer than `heal_seq_len`.
    """
    if is_generated(settings.heal_dataset) and PROMPT_TOKENS > settings.heal_seq_len:
        raise InvalidInputError(
            f"heal_seq_len={settings.heal_seq_len} is shorter than the dense model's prompts (the first tokens of a "
            f"calibration document: {PROMPT_TOKENS} tokens), which start each sequence it writes: use heal_seq_len > "
            f"{PROMPT_TOKENS}."
        )


def check_heal_arguments(model: nn.Module, validation_ids: torch.LongTensor, settings: HealSettings) -> None:
    """Refuses, before the teacher runs, what [`heal`] cannot train as `settings` say: an unknown `heal_trainable` or
    `heal_loss`, a loss that reads hidden states layer-streamed, a batch smaller than the number of processes,
    `heal_check_every` below 1, or no held-out sequence of 2 tokens or more.

    Raises:
        InvalidInputError: saying what and how to fix it.
    """
    if settings.heal_trainable not in HEAL_TRAINABLE_CHOICES:
        raise InvalidInputError(
            refused_value("heal_trainable", settings.heal_trainable)
            or f"`heal_trainable` must be one of {HEAL_TRAINABLE_CHOICES}, got {settings.heal_trainable!r}."
        )
    if settings.heal_loss not in HEAL_LOSS_CHOICES:
        raise InvalidInputError(
            refused_value("heal_loss", settings.heal_loss)
            or f"`heal_loss` must be one of {HEAL_LOSS_CHOICES}, got {settings.heal_loss!r}."
        )
    if reads_hidden_states(settings.heal_loss) and streaming.streams(model):
        raise InvalidInputError(streamed_loss_refusal(settings.heal_loss))
    if settings.heal_batch_size < distributed.world_size():
        raise InvalidInputError(
            f"heal_batch_size={settings.heal_batch_size} cannot be shared by {distributed.world_size()} processes: every "
            "process takes at least one sequence of each step. Use a batch at least as large as the number of processes."
        )
    if settings.heal_check_every < 1:
        raise InvalidInputError(
            f"heal_check_every={settings.heal_check_every}: the held-out KL is measured every `heal_check_every` steps, "
            "which must be at least 1. Use a positive number of steps (e.g. 25)."
        )
    if validation_ids.shape[0] == 0 or validation_ids.shape[1] < 2:
        raise InvalidInputError(
            f"The heal got {validation_ids.shape[0]} held-out sequence(s) of {validation_ids.shape[1]} token(s): their KL "
            "to the dense model chooses the state it keeps, so it needs at least one sequence of 2 tokens or more. Hold "
            "out some sequences (heal_validation_sequences >= 1, heal_seq_len >= 2)."
        )


def check_heal_checkpoint(path: str | os.PathLike | None) -> None:
    """Refuses, before anything runs, a heal checkpoint file that could not be written at the first held-out check.
    Folders on its path that do not exist yet are fine: the first save creates them.

    Args:
        path (`str` or `os.PathLike`, *optional*): The heal checkpoint file; `None` (no checkpoint) passes.

    Raises:
        InvalidInputError: for a path that is a folder, that lies under a file, or whose nearest existing folder is not
            writable.
    """
    if path is None:
        return
    target = os.path.abspath(os.fspath(path))
    if os.path.isdir(target):
        raise InvalidInputError(
            f"The heal checkpoint {path} is a folder: give a file path for the heal's state, e.g. "
            f"{os.path.join(os.fspath(path), 'heal.pt')}."
        )
    existing = os.path.dirname(target)
    while not os.path.exists(existing):  # the nearest existing folder: the missing ones are created in it
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise InvalidInputError(
            f"The heal checkpoint {path} cannot be written: {existing} is a file, not a folder. Give a path in a folder."
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise InvalidInputError(
            f"The heal checkpoint {path} cannot be written: {existing} is not writable. Give a path in a folder you can write to."
        )
