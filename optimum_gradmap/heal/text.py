# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""The heal's text: windows of a corpus, the dense model's own text ([`~optimum_gradmap.heal.generation`]), or equal parts
of both ([`heal_sequences`]), with the dense model's targets where they come with its text."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from ..adapters import get_adapter
from ..data import (
    CalibrationData,
    describe_calibration_data,
    is_text_data,
    prepare_calibration_data,
    text_documents,
    tokenize_documents,
)
from ..distillation import teacher_targets
from ..errors import InvalidInputError
from ..objectives import TeacherTargets
from ..precision import uses_bfloat16_autocast
from .cost import HealCounts
from .generation import (
    GENERATED,
    GENERATION_BATCH_SIZE,
    GeneratedText,
    GenerationSettings,
    corpus_part,
    generate_sequences,
    is_generated,
    start_token_of,
)
from .loss import seam_indices
from .settings import HealSettings, PrunedLayout


@dataclass
class HealText:
    """The heal stage's sequences and where they came from.

    Attributes:
        train_ids (`torch.LongTensor` of shape `(N, T)`): The training sequences, in the order they are trained on.
        validation_ids (`torch.LongTensor` of shape `(M, T)`): The held-out sequences.
        source (`str`): What they are (the dataset's name or a description).
        generation_seconds (`float`): The seconds spent on the dense model's own text (reading its cache, or
            generating it, and the teacher's targets on the corpus part of a mix); 0 for corpus text. They count in the
            heal stage's time.
        train_targets ([`TeacherTargets`], *optional*), validation_targets ([`TeacherTargets`], *optional*): The
            dense model's targets on the sequences, where they came with its text (kept while it wrote): the heal
            then makes no teacher pass.
    """

    train_ids: torch.LongTensor
    validation_ids: torch.LongTensor
    source: str = ""
    generation_seconds: float = 0.0
    train_targets: TeacherTargets | None = None
    validation_targets: TeacherTargets | None = None


def prepare_heal_data(
    data: CalibrationData,
    tokenizer: PreTrainedTokenizerBase | None,
    num_train: int,
    num_validation: int,
    seq_len: int,
    seed: int,
    text_column: str = "text",
) -> tuple[torch.LongTensor, torch.LongTensor]:
    """The training and held-out sequences of the heal stage ([`optimum_gradmap.heal`]), which never overlap.

    Text (a dataset name, names joined by `+`, a local path, a `datasets.Dataset`, a list of strings) is tokenized
    document by document and cut into non-overlapping windows of `seq_len` tokens (each inside one document; the tails
    are dropped); the windows are shuffled with `seed`, the first `num_validation` are held out and the next
    `num_train` are trained on. Token ids (a list of lists, or a `LongTensor` of shape `(N, T)`) are used as given: the
    last `num_validation` rows are held out and the first `num_train` of the others trained on. No window is trained on
    twice: text too short for the budget is refused.

    Args:
        data: The heal text, in any form `prepare_calibration_data` takes (`None` is not accepted: resolve the default
            dataset first).
        tokenizer (`PreTrainedTokenizerBase`, *optional*): Needed for text.
        num_train (`int`): Training sequences wanted.
        num_validation (`int`): Held-out sequences wanted.
        seq_len (`int`): Tokens per sequence (for text).
        seed (`int`): The shuffle's seed.
        text_column (`str`, defaults to `"text"`): The text column of a `datasets.Dataset`.

    Returns:
        `tuple[torch.LongTensor, torch.LongTensor]`: the training `(num_train, T)` and held-out `(num_validation, T)`
        sequences.

    Raises:
        InvalidInputError: for data that gives fewer than `num_validation + num_train` sequences.
    """
    if is_text_data(data):
        generator = torch.Generator().manual_seed(seed)
        if tokenizer is None:
            raise InvalidInputError("Heal text needs a tokenizer: pass `tokenizer=` or a model whose name points to one.")
        windows = [
            window
            for document in tokenize_documents(text_documents(data, text_column), tokenizer)
            for window in document[: document.numel() // seq_len * seq_len].view(-1, seq_len)
        ]
        if len(windows) < num_validation + num_train:
            raise InvalidInputError(
                f"The heal text gives {len(windows)} windows of {seq_len} tokens, and the budget needs "
                f"{num_validation + num_train} ({num_train} to train on, {num_validation} held out): give more text "
                f"(`heal_dataset`, e.g. names joined by '+'), or a budget of at most "
                f"{max(0, len(windows) - num_validation) * seq_len} tokens (`heal_tokens`)."
            )
        ids = torch.stack(windows)[torch.randperm(len(windows), generator=generator)]
        return ids[num_validation : num_validation + num_train], ids[:num_validation]
    ids = prepare_calibration_data(data, tokenizer, 0, seq_len, seed, "", text_column)
    if ids.shape[0] < num_validation + num_train:
        raise InvalidInputError(
            f"The heal token ids have {ids.shape[0]} sequences, and the budget needs {num_validation + num_train} "
            f"({num_train} to train on, {num_validation} held out: the last rows): give more, or a smaller `heal_tokens`."
        )
    return ids[:num_train], ids[ids.shape[0] - num_validation :]


def _generate(
    teacher: Callable[[], AbstractContextManager[nn.Module]],
    tokenizer: PreTrainedTokenizerBase,
    settings: HealSettings,
    num_sequences: int,
    cache: str | os.PathLike | None,
    progress_bar: bool,
    prompt_data: CalibrationData = None,
    layout: PrunedLayout | None = None,
) -> GeneratedText:
    """`num_sequences` of the dense model's own text as `settings` say: prompts from the first tokens of `prompt_data`'s
    documents (text; `settings.dataset` by default) or sequences (token ids); `heal_temperature`, seed `seed + 2`.
    The targets kept while it writes hold what `heal_loss` reads (the seams' outputs where `layout` is given)."""
    drawing = GenerationSettings(
        settings.heal_seq_len,
        settings.heal_temperature,
        settings.seed + 2,
        keep_layers=tuple(seam_indices(settings.heal_loss, layout)),
        start_token=start_token_of(tokenizer),
        autocast=settings.heal_autocast,
    )
    data = settings.dataset if prompt_data is None else prompt_data
    if is_text_data(data):
        documents = tokenize_documents(text_documents(data, settings.text_column), tokenizer)
    else:
        documents = list(prepare_calibration_data(data, tokenizer, 0, settings.seq_len, settings.seed, "", settings.text_column))
    return generate_sequences(teacher, documents, num_sequences, drawing, cache, progress_bar)


def generation_seconds_per_sequence(
    teacher: Callable[[], AbstractContextManager[nn.Module]],
    tokenizer: PreTrainedTokenizerBase,
    settings: HealSettings,
    cache: str | os.PathLike | None = None,
    prompt_data: CalibrationData = None,
    layout: PrunedLayout | None = None,
) -> float:
    """What a sequence of the dense model's own text costs, for `heal_tokens="auto"`: its first batch is generated
    (or read from the cache, which records what it cost) and kept in the cache for the heal (`layout` as in
    [`heal_sequences`])."""
    first = _generate(teacher, tokenizer, settings, GENERATION_BATCH_SIZE, cache, False, prompt_data, layout)
    return first.seconds_per_sequence


def heal_sequences(
    data: CalibrationData,
    tokenizer: PreTrainedTokenizerBase | None,
    settings: HealSettings,
    teacher: Callable[[], AbstractContextManager[nn.Module]] | None = None,
    cache: str | os.PathLike | None = None,
    progress_bar: bool = True,
    prompt_data: CalibrationData = None,
    layout: PrunedLayout | None = None,
) -> HealText:
    """The training and held-out sequences of a heal run as `settings` say: `heal_tokens` worth of `heal_seq_len`-token
    windows of `data` (or `settings.heal_dataset`) and `heal_validation_sequences` held out, shuffled with seed
    `seed + 2` ([`prepare_heal_data`]).

    With `generated` in `settings.heal_dataset` (and no `data`), the dense model writes the text itself
    ([`~optimum_gradmap.heal.generation`]): from the first tokens of the calibration documents (`prompt_data`, the
    calibration text or token ids Stage 1 read; `settings.dataset` by default), at
    `settings.heal_temperature`, seed `seed + 2`. Joined to corpus names (`generated+offline:web_text`), half the
    training and half the held-out sequences (rounded up) are generated and the rest are corpus windows, shuffled
    together.

    Args:
        data: The heal text in any form calibration data takes, or `None` for `settings.heal_dataset`.
        tokenizer (`PreTrainedTokenizerBase`, *optional*): Needed for text.
        settings ([`HealSettings`]): The heal's settings.
        teacher (`Callable`, *optional*): Returns a context manager that gives the dense model for its block; needed
            for the dense model's own text.
        cache (`str` or `os.PathLike`, *optional*): The file that caches the dense model's own text
            ([`~optimum_gradmap.heal.generation.generate_sequences`]).
        progress_bar (`bool`, defaults to `True`): Show a progress bar while the dense model writes.
        prompt_data (*optional*): The calibration data whose documents' (or sequences') first tokens prompt the dense
            model; defaults to `settings.dataset`.
        layout ([`PrunedLayout`], *optional*): The pruned model's layers: with `heal_loss="kl_hidden_mse"` the dense
            model keeps its seams' outputs with its targets (without it, the heal runs the dense model over the text
            again for them).

    Returns:
        [`HealText`].

    Raises:
        InvalidInputError: for too little text, or the dense model's own text without a teacher or a tokenizer.
    """
    counts = HealCounts.of(settings)
    if data is not None or not is_generated(settings.heal_dataset):
        train_ids, validation_ids = prepare_heal_data(
            settings.heal_dataset if data is None else data,
            tokenizer,
            counts.train_sequences,
            counts.validation_sequences,
            settings.heal_seq_len,
            settings.seed + 2,
            settings.text_column,
        )
        source = describe_calibration_data(data, settings.heal_dataset, settings.text_column)
        return HealText(train_ids, validation_ids, source)
    if teacher is None or tokenizer is None:
        raise InvalidInputError(
            f"heal_dataset={settings.heal_dataset!r}: the dense model writes the heal text, and it needs the dense model "
            "and its tokenizer here."
        )
    text = _generated_text(teacher, tokenizer, settings, counts, cache, progress_bar, prompt_data, layout)
    if corpus_part(settings.heal_dataset) is not None:
        text = _with_corpus_part(text, teacher, tokenizer, settings, counts, progress_bar, layout)
    return text


def _generated_text(
    teacher: Callable[[], AbstractContextManager[nn.Module]],
    tokenizer: PreTrainedTokenizerBase,
    settings: HealSettings,
    counts: HealCounts,
    cache: str | os.PathLike | None,
    progress_bar: bool,
    prompt_data: CalibrationData = None,
    layout: PrunedLayout | None = None,
) -> HealText:
    """The training and held-out sequences of the dense model's own text that `counts` say (the held-out ones first:
    their targets keep only what the held-out KL reads), with the targets kept while it wrote them."""
    num_train, num_validation = counts.generated_train, counts.generated_validation
    generated = _generate(teacher, tokenizer, settings, num_validation + num_train, cache, progress_bar, prompt_data, layout)
    train_ids, validation_ids = generated.input_ids[num_validation:], generated.input_ids[:num_validation]
    train_targets = generated.targets.rows(slice(num_validation, None))
    validation_targets = generated.targets.rows(slice(0, num_validation))
    validation_targets.layer_states = None  # the held-out check is the KL
    prompts = describe_calibration_data(prompt_data, settings.dataset, settings.text_column)
    source = f"{GENERATED} (the dense model's own text, temperature {settings.heal_temperature:g}, prompts from {prompts})"
    return HealText(train_ids, validation_ids, source, generated.seconds, train_targets, validation_targets)


def _with_corpus_part(
    text: HealText,
    teacher: Callable[[], AbstractContextManager[nn.Module]],
    tokenizer: PreTrainedTokenizerBase,
    settings: HealSettings,
    counts: HealCounts,
    progress_bar: bool,
    layout: PrunedLayout | None = None,
) -> HealText:
    """`text` (the dense model's own) joined by the training and held-out windows of the corpus names in
    `heal_dataset` that `counts` leave to them, with the teacher's targets on them (keeping what the generated text's
    keep), the training sequences shuffled together with seed `seed + 2`."""
    corpus = corpus_part(settings.heal_dataset)
    num_train = counts.train_sequences - counts.generated_train
    num_validation = counts.validation_sequences - counts.generated_validation
    corpus_train, corpus_validation = prepare_heal_data(
        corpus, tokenizer, num_train, num_validation, settings.heal_seq_len, settings.seed + 2, settings.text_column
    )
    tick = time.perf_counter()  # the corpus windows' targets, from the teacher (the generated ones have theirs)
    autocast = settings.heal_autocast
    with teacher() as dense_model:
        autocast = uses_bfloat16_autocast(autocast, dense_model)
        # the corpus part's targets keep what the generated text's do
        layers = get_adapter(dense_model).layers_at(dense_model, seam_indices(settings.heal_loss, layout))
        corpus_targets = teacher_targets(
            dense_model,
            corpus_train,
            settings.heal_batch_size,
            progress_bar,
            autocast,
            layers,
        )
        corpus_validation_targets = teacher_targets(dense_model, corpus_validation, settings.heal_batch_size, False, autocast)
        del dense_model, layers
    seconds = text.generation_seconds + time.perf_counter() - tick
    order = torch.randperm(
        text.train_ids.shape[0] + corpus_train.shape[0], generator=torch.Generator().manual_seed(settings.seed + 2)
    )
    return HealText(
        torch.cat([text.train_ids, corpus_train])[order],
        torch.cat([text.validation_ids, corpus_validation]),
        text.source + f" and {corpus}, equal parts",
        seconds,
        TeacherTargets.concatenate([text.train_targets, corpus_targets]).rows(order),
        TeacherTargets.concatenate([text.validation_targets, corpus_validation_targets]),
    )
