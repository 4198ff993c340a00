"""Reading and writing the benchmarks' records, `benchmarks/results/*.json`: every script writes its record with
`write` and reads it back (`--resume`) with `read`, and the tables read them through `read` too.

A record is plain JSON, a container put on one line where it fits in `WIDTH` characters. The per-question answers of a
zero-shot evaluation (`answers[task]`: `doc_ids`, `acc` as a string of 0/1 digits, and where kept `choice`, `margin`,
`loglikelihoods`) are stored packed: `acc` as the base64 text of its bits, every other array as the base64 text of its
zlib-compressed variable-length integers (floats as integers of ten-thousandths: they are kept to 4 decimals), and
the question ids once per record and task, as ranges (`"0-1837"`, `"9,12,25-27"`), under the record's
`question_ids`. `read` gives back the arrays exactly as they were written.

Every string a record holds is written with the paths of this machine made relative (`relative_paths`): the
repository's own folder is left out, a folder beside it is `../NAME`, the temporary folder is `$TMPDIR` and the home
folder `~`.
"""

from __future__ import annotations

import base64
import json
import os
import re
import tempfile
import zlib
from collections.abc import Iterator, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WIDTH = 130
QUESTION_IDS = "question_ids"
FLOATS = ("margin", "loglikelihoods")  # per-question floats, kept to 4 decimals
SCALE = 10_000


# --- paths --------------------------------------------------------------------------------------------------------


def relative_paths(text: str, root: str = ROOT) -> str:
    """`text` with the absolute paths of this machine made relative: in the repository `root`, relative to it (the
    folder beside it as `../NAME`); in the temporary folder, `$TMPDIR/...`; in the home folder, `~/...`."""
    places = {os.path.expanduser("~"): "~", os.path.dirname(root): "..", tempfile.gettempdir(): "$TMPDIR", root: "."}
    for folder in sorted(places, key=len, reverse=True):
        if folder.rstrip("/"):
            # only where a path starts (not inside another one, as /work inside /data/qb/work)
            pattern = r"(?<![^\s'\"=:])" + re.escape(folder.rstrip("/")) + r"(/|(?=[\s'\"]|$))"
            name = places[folder]
            text = re.sub(pattern, lambda match, name=name: "" if name == "." and match.group(1) else name + match.group(1), text)
    return text


def _strings(value: object, change) -> object:
    if isinstance(value, str):
        return change(value)
    if isinstance(value, dict):
        return {key: _strings(item, change) for key, item in value.items()}
    if isinstance(value, list):
        return [_strings(item, change) for item in value]
    return value


# --- packed answers -----------------------------------------------------------------------------------------------


def _pack_integers(values: Sequence[int | None]) -> str:
    """Base64 of the zlib-compressed variable-length integers (zigzag, 0 for `None`)."""
    data = bytearray()
    for value in values:
        code = 0 if value is None else ((value << 1) ^ (value >> 63)) + 1
        while code > 0x7F:
            data.append(code & 0x7F | 0x80)
            code >>= 7
        data.append(code)
    return base64.b64encode(zlib.compress(bytes(data), 9)).decode("ascii")


def _unpack_integers(text: str) -> list[int | None]:
    values: list[int | None] = []
    code = shift = 0
    for byte in zlib.decompress(base64.b64decode(text)):
        code |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            values.append(None if code == 0 else ((code - 1) >> 1) ^ -((code - 1) & 1))
            code = shift = 0
    return values


def _pack_bits(digits: str) -> str:
    """Base64 of a string of 0/1 digits, eight to a byte (the first digit the lowest bit)."""
    return base64.b64encode(int(digits[::-1] or "0", 2).to_bytes((len(digits) + 7) // 8, "little")).decode("ascii")


def _unpack_bits(text: str, count: int) -> str:
    return format(int.from_bytes(base64.b64decode(text), "little"), f"0{count}b")[::-1] if count else ""


def _ranges(ids: Sequence[int]) -> str:
    parts: list[str] = []
    for doc_id in ids:
        if parts and isinstance(parts[-1], list) and doc_id == parts[-1][1] + 1:
            parts[-1][1] = doc_id
        else:
            parts.append([doc_id, doc_id])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in parts)


def _unranges(text: str) -> list[int]:
    ids: list[int] = []
    for part in filter(None, text.split(",")):
        first, _, last = part.partition("-")
        ids += range(int(first), int(last or first) + 1)
    return ids


def _pack_task(kept: dict, question_ids: dict, task: str) -> dict:
    packed = {}
    ids = list(kept["doc_ids"])
    if question_ids.setdefault(task, ids) != ids:
        packed["doc_ids"] = _ranges(ids)  # other questions than the record's: kept with the row
    for key, value in kept.items():
        if key == "acc":
            packed[key] = _pack_bits(value)
        elif key == "loglikelihoods":
            packed["answers_per_question"] = _pack_integers([len(values) for values in value])
            packed[key] = _pack_integers([round(item * SCALE) for values in value for item in values])
        elif key in FLOATS:
            packed[key] = _pack_integers([None if item is None else round(item * SCALE) for item in value])
        elif key != "doc_ids":
            packed[key] = _pack_integers(value)
    return packed


def _unpack_task(packed: dict, question_ids: dict, task: str) -> dict:
    kept = {"doc_ids": _unranges(packed["doc_ids"]) if "doc_ids" in packed else list(question_ids[task])}
    widths = _unpack_integers(packed["answers_per_question"]) if "answers_per_question" in packed else []
    for key, value in packed.items():
        if key in ("doc_ids", "answers_per_question"):
            continue
        if key == "acc":
            kept[key] = _unpack_bits(value, len(kept["doc_ids"]))
            continue
        values = _unpack_integers(value)
        if key == "loglikelihoods":
            flat = iter(values)
            kept[key] = [[next(flat) / SCALE for _ in range(width)] for width in widths]
        elif key in FLOATS:
            kept[key] = [None if item is None else item / SCALE for item in values]
        else:
            kept[key] = values
    return kept


def _answers(value: object) -> Iterator[dict]:
    """Every `answers` mapping (task -> per-question arrays) in a record."""
    if isinstance(value, dict):
        for key, item in value.items():
            per_question = isinstance(item, dict) and all(isinstance(kept, dict) and "acc" in kept for kept in item.values())
            if key == "answers" and per_question:
                yield item
            else:
                yield from _answers(item)
    elif isinstance(value, list):
        for item in value:
            yield from _answers(item)


def pack(record: object) -> object:
    """A copy of `record` with its answers packed (see the module docstring); `unpack` gives it back."""
    record = json.loads(json.dumps(record))
    question_ids: dict[str, list[int]] = {}
    for answers in _answers(record):
        for task, kept in answers.items():
            answers[task] = _pack_task(kept, question_ids, task)
    if question_ids:
        record[QUESTION_IDS] = {task: _ranges(ids) for task, ids in question_ids.items()}
    return record


def unpack(record: object) -> object:
    """`record` (as read from its file) with its answers as they were before `pack`."""
    if not isinstance(record, dict) or QUESTION_IDS not in record:
        return record
    question_ids = {task: _unranges(text) for task, text in record.pop(QUESTION_IDS).items()}
    for answers in _answers(record):
        for task, packed in answers.items():
            answers[task] = _unpack_task(packed, question_ids, task)
    return record


# --- files --------------------------------------------------------------------------------------------------------


def dumps(value: object, level: int = 0) -> str:
    """JSON text of `value`: a container on one line where it fits in `WIDTH` characters, else one item a line."""
    flat = json.dumps(value, ensure_ascii=False)
    if not isinstance(value, (dict, list)) or not value or len(flat) + level <= WIDTH:
        return flat
    pad = " " * (level + 1)
    if isinstance(value, dict):
        items = [f"{pad}{json.dumps(key, ensure_ascii=False)}: {dumps(item, level + 1)}" for key, item in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + " " * level + "}"
    if not any(isinstance(item, (dict, list)) for item in value):
        return flat
    return "[\n" + ",\n".join(pad + dumps(item, level + 1) for item in value) + "\n" + " " * level + "]"


def write(path: str, record: object) -> None:
    """Writes `record` to `path`: its machine paths made relative, its answers packed (whole, then moved in place:
    an interrupted write leaves the previous record)."""
    text = dumps(pack(_strings(record, relative_paths))) + "\n"
    with open(path + ".tmp", "w", encoding="utf-8") as file:
        file.write(text)
    os.replace(path + ".tmp", path)


def read(path: str) -> object:
    """The record at `path`, its answers unpacked."""
    with open(path, encoding="utf-8") as file:
        return unpack(json.load(file))
