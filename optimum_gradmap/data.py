# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Calibration and evaluation text.

Offline datasets (real text shipped inside PyPI wheels, see [`optimum_gradmap.assets`]):

- `"wikipedia"`: 2,349 English Wikipedia articles. They are split by document: every tenth
  article (positions 9, 19, 29, ...) is held out for evaluation, the other 90% are the calibration
  pool. Calibration never sees an evaluation article. This is not WikiText-2.
- `"web_text"`: real web pages, one per line (evaluation only). This is not C4.

Hub datasets (need the `datasets` package and network access), loaded as the standard layer
pruning papers load them: `"wikitext2"`, `"c4"`, `"ptb"`.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from typing import Union

import torch
from transformers import PreTrainedTokenizerBase

from . import assets

OFFLINE_DATASETS = ("wikipedia", "web_text")
HUB_DATASETS = ("wikitext2", "c4", "ptb")
EVALUATION_EVERY = 10  # every tenth Wikipedia article is held out for evaluation

CalibrationData = Union[None, str, Sequence[str], Sequence[Sequence[int]], torch.Tensor]

_DOCUMENT = re.compile(r"<doc[^>]*>\n(.*?)</doc>", re.DOTALL)


def wikipedia_documents(split: str) -> list[str]:
    """The offline Wikipedia articles of one split.

    Args:
        split (`str`): `"calibration"` (90% of the articles) or `"evaluation"` (every tenth article).
    """
    if split not in ("calibration", "evaluation"):
        raise ValueError(f"`split` must be 'calibration' or 'evaluation', got {split!r}.")
    with open(assets.get_text_path("wikipedia"), encoding="utf-8") as file:
        documents = [match.strip() for match in _DOCUMENT.findall(file.read())]
    held_out = split == "evaluation"
    return [doc for position, doc in enumerate(documents) if (position % EVALUATION_EVERY == EVALUATION_EVERY - 1) == held_out]


def web_text_documents() -> list[str]:
    """The offline web pages (one per line of the shipped file)."""
    with open(assets.get_text_path("web_text"), encoding="utf-8") as file:
        return [line.strip() for line in file if line.strip()]


def _load_hub_text(name: str, split: str) -> str:
    try:
        from datasets import load_dataset
    except ImportError as error:
        raise ImportError(
            f"Dataset {name!r} is loaded from the Hugging Face Hub with the `datasets` package: "
            "`pip install datasets`. Offline, use dataset='wikipedia'."
        ) from error
    try:
        if name == "wikitext2":
            rows = load_dataset("wikitext", "wikitext-2-raw-v1", split=split)
            return "\n\n".join(rows["text"])
        if name == "ptb":
            rows = load_dataset("ptb_text_only", "penn_treebank", split=split)
            return "\n\n".join(rows["sentence"])
        shard = "en/c4-train.00000-of-01024.json.gz" if split == "train" else "en/c4-validation.00000-of-00008.json.gz"
        rows = load_dataset("allenai/c4", data_files={split: shard}, split=split)
        return "\n\n".join(rows["text"][:3000] if split == "train" else rows["text"][:1100])
    except Exception as error:  # no network, no Hub, missing dataset: say what to do instead
        raise ConnectionError(
            f"Could not load dataset {name!r} ({split} split) from the Hugging Face Hub: {error}. "
            "Without Hub access, use the offline dataset 'wikipedia' (calibration and held-out evaluation) "
            "or 'web_text' (evaluation)."
        ) from error


def load_text(name: str, split: str) -> str:
    """Raw text of a named dataset.

    Args:
        name (`str`): One of `"wikipedia"`, `"web_text"`, `"wikitext2"`, `"c4"`, `"ptb"`.
        split (`str`): `"calibration"` or `"evaluation"`. Hub datasets map these to their train and
            test (validation for C4) splits.
    """
    if split not in ("calibration", "evaluation"):
        raise ValueError(f"`split` must be 'calibration' or 'evaluation', got {split!r}.")
    if name == "wikipedia":
        return "\n\n".join(wikipedia_documents(split))
    if name == "web_text":
        if split == "calibration":
            raise ValueError("'web_text' is an evaluation set; calibrate on 'wikipedia'.")
        return "\n\n".join(web_text_documents())
    if name in HUB_DATASETS:
        hub_split = "train" if split == "calibration" else ("validation" if name == "c4" else "test")
        return _load_hub_text(name, hub_split)
    raise ValueError(f"Unknown dataset {name!r}. Available: {', '.join(OFFLINE_DATASETS + HUB_DATASETS)}.")


def tokenize_text(text: str, tokenizer: PreTrainedTokenizerBase) -> torch.LongTensor:
    """Tokenizes `text` into one stream of token ids, without special tokens."""
    if not text or not text.strip():
        raise ValueError("The calibration text is empty: give non-empty strings or a dataset name such as 'wikipedia'.")
    ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False, verbose=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def sample_sequences(token_ids: torch.LongTensor, num_samples: int, seq_len: int, seed: int) -> torch.LongTensor:
    """Draws `num_samples` random windows of `seq_len` tokens from a token stream (paper: 128 x 128).

    Returns:
        `torch.LongTensor` of shape `(num_samples, seq_len)`.
    """
    if token_ids.numel() < seq_len:
        raise ValueError(
            f"The calibration text has {token_ids.numel()} tokens, fewer than one sequence of seq_len={seq_len}: "
            "give more text or a smaller seq_len."
        )
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, token_ids.numel() - seq_len + 1, (num_samples,), generator=generator)
    return torch.stack([token_ids[start : start + seq_len] for start in starts.tolist()])


def calibration_sha256(calibration_ids: torch.LongTensor) -> str:
    """The SHA-256 of a calibration set's token ids: equal for the same sequences in the same order."""
    return hashlib.sha256(calibration_ids.cpu().numpy().tobytes()).hexdigest()


def is_text_data(calibration_data: CalibrationData) -> bool:
    """Whether `calibration_data` is text (or a dataset name), which needs a tokenizer."""
    if calibration_data is None or isinstance(calibration_data, str):
        return True
    return (
        isinstance(calibration_data, Sequence)
        and bool(calibration_data)
        and all(isinstance(item, str) for item in calibration_data)
    )


def prepare_calibration_data(
    calibration_data: CalibrationData,
    tokenizer: PreTrainedTokenizerBase | None,
    num_samples: int,
    seq_len: int,
    seed: int,
    default_dataset: str,
) -> torch.LongTensor:
    """Turns any accepted form of calibration data into a `(num_samples, seq_len)` tensor of token ids.

    Args:
        calibration_data: `None` (use `default_dataset`), a dataset name, a list of strings (joined,
            tokenized, then `num_samples` random windows of `seq_len` tokens are drawn), a list of
            token-id lists (one sequence each, all of the same length), or a `LongTensor` of shape
            `(N, T)` (used as given).
        tokenizer: Needed for text.
        num_samples (`int`), seq_len (`int`), seed (`int`): Sampling of windows from text.
        default_dataset (`str`): The dataset used when `calibration_data` is `None`.
    """
    if calibration_data is None:
        calibration_data = default_dataset
    if isinstance(calibration_data, torch.Tensor):
        ids = calibration_data
    elif is_text_data(calibration_data):
        if tokenizer is None:
            raise ValueError("Calibration text needs a tokenizer: pass `tokenizer=` or a model whose name points to one.")
        text = load_text(calibration_data, "calibration") if isinstance(calibration_data, str) else "\n\n".join(calibration_data)
        return sample_sequences(tokenize_text(text, tokenizer), num_samples, seq_len, seed)
    elif (
        isinstance(calibration_data, Sequence)
        and calibration_data
        and all(isinstance(item, Sequence) for item in calibration_data)
    ):
        lengths = {len(item) for item in calibration_data}
        if len(lengths) != 1:
            raise ValueError(f"Token-id sequences must all have the same length, got lengths {sorted(lengths)}.")
        ids = torch.tensor([list(item) for item in calibration_data], dtype=torch.long)
    else:
        raise ValueError(
            "`calibration_data` must be None, a dataset name, a non-empty list of strings, a list of token-id "
            f"lists, or a LongTensor of shape (N, T); got {type(calibration_data).__name__}"
            + (" (empty)" if isinstance(calibration_data, Sequence) and not calibration_data else "")
            + "."
        )
    if ids.dim() != 2 or ids.dtype not in (torch.long, torch.int32, torch.int64) or ids.shape[0] < 1 or ids.shape[1] < 2:
        raise ValueError(
            f"Calibration token ids must be an integer tensor of shape (N, T) with N >= 1 and T >= 2, "
            f"got shape {tuple(ids.shape)} and dtype {ids.dtype}."
        )
    return ids.long()
