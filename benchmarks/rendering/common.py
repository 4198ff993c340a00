"""What every results table shares: records, provenance footnotes, marks for rows older than a change of the
library's behaviour, and the figures read from the records (benchmarks/render.py writes the tables)."""

from __future__ import annotations

import functools
import math
import os
import re
import shlex
import subprocess
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, field

import records

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
BOOLQ = "boolq"


@functools.cache
def load(name: str) -> dict:
    """The record `benchmarks/results/<name>.json`, its packed answers unpacked (benchmarks/records.py)."""
    return records.read(os.path.join(RESULTS, name + ".json"))


# --- what changed in the library's behaviour since a row was measured -------------------------------------------


@dataclass(frozen=True)
class Change:
    """A change of what the library computes. Rows of `kinds` measured at a commit that does not contain `commit`
    are marked with `summary`."""

    commit: str
    summary: str
    kinds: tuple[str, ...]


CHANGES = (
    Change(
        "8f30c0d",
        "Stage 2's outlier threshold is one median over the whole calibration set, not each batch's",
        ("stage2",),
    ),
    Change(
        "7ff3327",
        "the heal stage's teacher runs under bfloat16 autocast where native (the heal's seconds)",
        ("heal",),
    ),
    Change(
        "dbd89c9",
        "the dense model's text is drawn by inverting the cumulative distribution, not `torch.multinomial` (other draws, faster)",
        ("generation",),
    ),
    Change(
        "4875841",
        "the dense model writes 64 sequences at a time, not 32 (other draws, faster)",
        ("generation",),
    ),
)


@functools.cache
def _contains(commit: str, ancestor: str) -> bool | None:
    """Whether `commit` contains `ancestor` in its history (`None` when git cannot tell: an unknown commit)."""
    try:
        done = subprocess.run(["git", "merge-base", "--is-ancestor", ancestor, commit], cwd=ROOT, capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return {0: True, 1: False}.get(done.returncode)


def measured_commit(provenance: dict) -> str:
    """The commit a row was measured at (a lent machine's copy names the commit it was copied from)."""
    return provenance.get("commit_of_git_history") or provenance.get("commit", "")


def older_code(change: Change) -> str:
    """How a footnote says that its row was measured before `change`."""
    return f"older code: measured before `{change.commit}`, since which {change.summary}"


def older_than(provenance: dict, kinds: Sequence[str]) -> list[Change]:
    """The changes of `kinds` that the row's code did not have yet."""
    commit = measured_commit(provenance)
    if not commit:
        return []
    return [change for change in CHANGES if set(change.kinds) & set(kinds) and _contains(commit, change.commit) is False]


# --- tables and their footnotes -----------------------------------------------------------------------------------


@dataclass
class Table:
    """A markdown table whose rows carry provenance footnotes, numbered `[^PREFIX-N]`. With `cite=False` the rows
    carry none (the README's table, whose rows link to the pages that carry them): the notes are still collected in
    `notes`, and a row of older code is still marked. The `header` may be given as the table's first line reads,
    `"a | b | c"`."""

    prefix: str
    header: Sequence[str] | str
    align: Sequence[str] | None = None
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    cite: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.header, str):
            self.header = self.header.split(" | ")

    def add(
        self,
        cells: Sequence[str],
        provenance: dict | None,
        source: str,
        kinds: Sequence[str] = (),
        cell: int = 0,
        more: Sequence[tuple[int, dict, str]] = (),
    ) -> None:
        """Adds a row. Cell `cell` gets the footnote of `provenance` (a row of record `source`) and is marked when that
        row was measured by code older than a change of `kinds`; `more` adds footnotes to other cells, as
        `(cell, provenance, source)` (a figure taken from another record)."""
        cells = list(cells)
        for index, row_provenance, row_source, row_kinds in [(cell, provenance, source, kinds)] + [
            (index, row_provenance, row_source, ()) for index, row_provenance, row_source in more
        ]:
            if row_provenance is None:
                continue
            note = footnote(row_provenance, row_source, row_kinds)
            if note not in self.notes:  # one measurement shown on several rows: one footnote
                self.notes.append(note)
            if self.cite:
                cells[index] += f"[^{self.prefix}-{self.notes.index(note) + 1}]"
            if older_than(row_provenance, row_kinds):
                cells[index] += " (older code)"
        self.rows.append(cells)

    def markdown(self, notes: bool = True) -> str:
        """The table, and its footnotes unless `notes` is false (another table that shares them writes them)."""
        align = self.align or ["---"] * len(self.header)
        lines = ["| " + " | ".join(self.header) + " |", "|" + "|".join(align) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in self.rows]
        if notes and self.cite and self.notes:
            lines.append("")
            lines += [f"[^{self.prefix}-{i}]: {note}" for i, note in enumerate(self.notes, 1)]
        return "\n".join(lines) + "\n"


def older_record(note: str) -> dict:
    """The provenance of a row from a record written before rows carried theirs (benchmarks/provenance.py): `note`
    says what is known (the commit and date the text around the table gives, the machine)."""
    return {"older_record": note}


def footnote(provenance: dict, source: str, kinds: Sequence[str] = ()) -> str:
    """One row's provenance in one line."""
    if "older_record" in provenance:
        return f"`benchmarks/results/{source}.json`, an older record without per-row provenance: {provenance['older_record']}."
    machine = provenance.get("machine", {})
    where = machine.get("accelerator") or f"{machine.get('cpu_count', '?')}-core CPU"
    parts = [
        f"`benchmarks/results/{source}.json`",
        f"commit `{measured_commit(provenance)[:8]}`" + (" with local changes" if provenance.get("dirty") else ""),
        provenance.get("date", "?")[:16].replace("T", " ") + " UTC",
        f"`{provenance.get('command', '?')}`",
        where,
        "quiet" if provenance.get("quiet") else "not quiet",
    ]
    if provenance.get("copied_from"):
        parts.append(f"copied from {provenance['copied_from']}")
    for change in older_than(provenance, kinds):
        parts.append(older_code(change))
    if provenance.get("note"):
        parts.append(provenance["note"].replace("\n", " ").rstrip("."))
    return "; ".join(parts) + "."


def number(value: float | None, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:,.{digits}f}"


# --- figures read from the records --------------------------------------------------------------------------------


def perplexity(evaluation: dict, dataset: str) -> float | None:
    for entry in evaluation.get("perplexities", []):
        if entry["dataset"] == dataset:
            return entry["perplexity"]
    return None


def mean_accuracy(zero_shot: dict) -> tuple[float, float]:
    """The mean of the tasks' accuracies and its standard error (the tasks' errors combined)."""
    tasks = zero_shot["tasks"]
    mean = sum(task["acc"] for task in tasks) / len(tasks)
    stderr = math.sqrt(sum(task["acc_stderr"] ** 2 for task in tasks)) / len(tasks)
    return mean, stderr


def flips_without_boolq(against_dense: dict) -> float:
    """The share of questions whose right/wrong differs from the dense model's, BoolQ left out (from the paired
    comparison's discordant counts)."""
    tasks = [task for task in against_dense["tasks"] if task["task"] != BOOLQ]
    return sum(task["only_a"] + task["only_b"] for task in tasks) / sum(task["num_questions"] for task in tasks)


def stage1_share_of_sleb(record: dict, method: str) -> float:
    seconds = {row["method"]: row["stage1_seconds"] for row in record["rows"]}
    return seconds[method] / seconds["sleb_reference"]


@dataclass(frozen=True)
class Context:
    """Where a table is written: relative links are made from its folder."""

    page: str

    def link(self, target: str) -> str:
        """`target` (a path from the repository root, with an optional `#anchor`) relative to the page."""
        path, _, anchor = target.partition("#")
        relative = os.path.relpath(os.path.join(ROOT, path), os.path.dirname(os.path.join(ROOT, self.page)))
        return relative + (f"#{anchor}" if anchor else "")


def paired(comparison: dict | None, key: str = "pooled") -> str:
    if not comparison:
        return "-"
    return f"{100 * comparison[key]['difference']:+.2f} ± {100 * comparison[key]['stderr']:.2f}"


def paired_without_boolq(row: dict, reference: dict | None) -> str:
    """`row` against `reference` on every question both keep but BoolQ's (whose accuracy at this size follows a yes/no
    bias): the pooled paired difference of right answers, in points, with its standard error; `-` without answers."""
    answers = ((row.get("evaluation") or {}).get("zero_shot") or {}).get("answers")
    others = (((reference or {}).get("evaluation") or {}).get("zero_shot") or {}).get("answers")
    if not answers or not others:
        return "-"
    differences: list[int] = []
    for task, kept in answers.items():
        if task == BOOLQ or task not in others or others[task]["doc_ids"] != kept["doc_ids"]:
            continue
        differences += [int(mine) - int(theirs) for mine, theirs in zip(kept["acc"], others[task]["acc"])]
    if len(differences) < 2:
        return "-"
    mean = sum(differences) / len(differences)
    variance = sum((value - mean) ** 2 for value in differences) / (len(differences) - 1)
    return f"{100 * mean:+.2f} ± {100 * math.sqrt(variance / len(differences)):.2f}"


def option_values(command: str, option: str) -> list[str]:
    """The values given to `option` (`--name`) in a command line, up to the next option."""
    words = shlex.split(command)
    if option not in words:
        return []
    values = []
    for word in words[words.index(option) + 1 :]:
        if word.startswith("--"):
            break
        values.append(word)
    return values


def kl_cell(evaluation: dict, dataset: str) -> str:
    for entry in evaluation["perplexities"]:
        if entry["dataset"] == dataset and entry.get("kl_to_reference") is not None:
            return f"{entry['kl_to_reference']:.4f} ± {entry['kl_stderr']:.4f}"
    return "-"


def machine_text(machine: dict) -> str:
    """A record's top-level machine, as the footnotes say it."""
    where = machine.get("accelerator") or f"{machine.get('cpu_count') or machine.get('threads') or '?'}-core CPU"
    return where + (f", torch {machine['torch']}" if machine.get("torch") else "")


def scientific(value: float) -> str:
    """`2.6e-5` rather than Python's `2.6e-05`."""
    mantissa, exponent = f"{value:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


# --- figures in words: the answers the results pages open with -----------------------------------------------------

# The plain fractions an answer names a share by ("a quarter of SLEB's time").
FRACTIONS = (
    (1 / 10, "a tenth"),
    (1 / 8, "an eighth"),
    (1 / 6, "a sixth"),
    (1 / 5, "a fifth"),
    (1 / 4, "a quarter"),
    (1 / 3, "a third"),
    (3 / 8, "three eighths"),
    (2 / 5, "two fifths"),
    (1 / 2, "a half"),
    (3 / 5, "three fifths"),
    (2 / 3, "two thirds"),
    (3 / 4, "three quarters"),
)


def fraction(value: float) -> str:
    """A share (0 to 1) as the nearest plain fraction in words, `"a quarter"`; as a percentage where none is within a
    quarter of it."""
    share, words = min(FRACTIONS, key=lambda entry: abs(entry[0] - value))
    return words if abs(share - value) <= share / 4 else f"{100 * value:.0f}%"


def fraction_range(values: Sequence[float]) -> str:
    """The smallest and the largest of some shares in words, `"a quarter to two fifths"`; one fraction where both are
    nearest the same."""
    low, high = fraction(min(values)), fraction(max(values))
    return low if low == high else f"{low} to {high}"


def typical_fraction(values: Sequence[float]) -> str:
    """The mean of some shares in words (an answer's one figure for several settings)."""
    return fraction(sum(values) / len(values))


def multiple(value: float) -> str:
    """A ratio as an answer writes it: two significant figures below 10 (`1.5`, `6`), whole numbers above."""
    return f"{value:.2g}" if value < 10 else f"{value:,.0f}"


UNBROKEN = re.compile(r"`[^`]*`|\[[^\]]*\]\([^)]*\)")  # a code span, a link: never broken across lines


def paragraph(text: str) -> str:
    """Prose written by a function (an answer between render markers), wrapped at 120 characters as the pages are,
    never inside a code span or a link."""
    kept = UNBROKEN.sub(lambda match: match.group(0).replace(" ", "\0"), text)
    wrapped = textwrap.fill(kept, 120, break_long_words=False, break_on_hyphens=False)
    return wrapped.replace("\0", " ") + "\n"
