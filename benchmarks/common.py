"""What the benchmark scripts share: where the records live, the calibration set and the held-out protocol, the
removed layers of a selection (benchmarks/compare.py's), a record read back with `--resume`, and a child process run
with its memory sampled (benchmarks/memory.py and benchmarks/scale.py)."""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import threading
import time

import records

import optimum_gradmap.experimental  # noqa: F401  registers `random`, the tables' baseline

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
sys.path.insert(1, ROOT)  # `optimum_gradmap` from this checkout, installed or not
CALIBRATION = "offline:wikipedia"  # the benchmarks' calibration articles, 128-token sequences, seed 0
HELD_OUT = ("offline:wikipedia", "offline:web_text")
# selection -> the method of benchmarks/compare.py whose removed layers it takes
SELECTIONS = {
    "gradmap": "gradmap",
    "sleb": "sleb",
    "block_influence": "block_influence",
    "quality": "gradmap_bound_token+top8+halving",  # the quality preset
    "fast": "relative_magnitude",  # the fast preset
}


def parser(doc: str) -> argparse.ArgumentParser:
    """A script's argument parser, its `--help` the script's docstring."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def log_rounds() -> None:
    """Logs the library's progress (one line per Stage 1 round), with the time."""
    logging.basicConfig(format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("optimum_gradmap").setLevel(logging.INFO)


def calibration(tokenizer, num_samples: int, seed: int = 0):
    """`num_samples` sequences of 128 tokens of `CALIBRATION` (the same set for every script, by its SHA-256)."""
    from optimum_gradmap.data import prepare_calibration_data

    return prepare_calibration_data(CALIBRATION, tokenizer, num_samples, 128, seed, CALIBRATION)


def held_out(model, tokenizer, label: str, max_segments: int, task_limit: int = 0) -> dict:
    """The comparisons' evaluation: perplexity on the first `max_segments` held-out 128-token segments of Wikipedia and
    of web text, and the seven zero-shot tasks with `task_limit` questions each (none with 0), offline; with the
    seconds it took."""
    from optimum_gradmap.evaluation import PAPER_TASKS, evaluate

    started = time.perf_counter()
    evaluation = evaluate(
        model,
        tokenizer,
        HELD_OUT,
        segment_length=128,
        max_segments=max_segments,
        tasks=PAPER_TASKS if task_limit > 0 else (),
        task_limit=task_limit or None,
        task_data="offline",
        model_name=label,
        progress_bar=False,
    ).to_dict()
    evaluation["seconds"] = time.perf_counter() - started
    return evaluation


def perplexities(model, tokenizer, max_segments: int) -> dict[str, float]:
    """[`held_out`]'s perplexities alone, by dataset."""
    return {entry["dataset"]: entry["perplexity"] for entry in held_out(model, tokenizer, "", max_segments)["perplexities"]}


def layers_of(model: str, ratio: float, selection: str) -> tuple[list[int], str]:
    """The layers benchmarks/compare.py's Stage 1 row of `selection` removed, and where that is recorded."""
    path = os.path.join(RESULTS, f"compare-{model}-{ratio:g}.json")
    row = next(row for row in records.read(path)["rows"] if row["method"] == SELECTIONS[selection] and not row["stage2"])
    return row["removed_layers"], f"{os.path.relpath(path, os.path.dirname(RESULTS))}, row {SELECTIONS[selection]!r}"


def expand(answers: dict[str, dict], skip: tuple[str, ...] = ()):
    """A `ZeroShotResult` holding a record's per-question answers (`doc_ids`, `acc`, and where kept `choice` and
    `margin`), for the library's paired comparison and flips; the tasks of `skip` left out. A question kept with its
    margin gets stand-in log-likelihoods that give back its choice and margin: 0 for the chosen answer, -margin for
    the others."""
    from optimum_gradmap.evaluation import QuestionRecord, TaskResult, ZeroShotResult

    tasks = []
    for task, kept in answers.items():
        if task in skip:
            continue
        count = len(kept["doc_ids"])
        questions = [
            QuestionRecord(
                doc_id,
                [] if margin is None else [0.0 if i == choice else -margin for i in range(max(2, choice + 1))],
                choice,
                None,
                0,
                int(acc),
            )
            for doc_id, acc, choice, margin in zip(
                kept["doc_ids"], kept["acc"], kept.get("choice") or [0] * count, kept.get("margin") or [None] * count
            )
        ]
        accuracy = sum(q.acc for q in questions) / len(questions)
        tasks.append(TaskResult(task, "validation", "", len(questions), accuracy, questions=questions))
    return ZeroShotResult(tasks=tasks)


def resumed(path: str, resume: bool, new: dict, settings: dict | None = None) -> dict:
    """The record at `path` when resuming (its `settings`, where given, must be these), else `new`."""
    if not (resume and os.path.exists(path)):
        return new
    record = records.read(path)
    if settings is not None and record["settings"] != settings:
        raise SystemExit(f"--resume: {path} has settings {record['settings']}, not {settings}")
    return record


def comparison_settings(args: argparse.Namespace) -> dict:
    """The settings benchmarks/compare.py and benchmarks/stage2.py record, and check on `--resume`."""
    keys = ("model", "ratio", "task_limit", "max_eval_segments", "num_samples")
    return {key: getattr(args, key) for key in keys}


def commanded_record(path: str, resume: bool, command: str, settings: dict, fields: dict) -> dict:
    """A record that keeps every command that wrote it: with `resume`, the one at `path` (the same `settings`), this
    command added; else a new one with the machine and `fields`."""
    if resume and os.path.exists(path):
        record = resumed(path, resume, {}, settings)
        record["commands"].append(command + " --resume")
        return record
    import platform

    import torch

    machine = {"platform": platform.platform(), "cpu_count": os.cpu_count(), "torch": torch.__version__}
    return {"commands": [command], "settings": settings, "machine": machine, **fields, "rows": []}


def replaced(rows: list[dict], row: dict, field: str) -> list[dict]:
    """`rows` with `row` in place of the rows of the same `field` (at the end)."""
    return [existing for existing in rows if existing.get(field) != row[field]] + [row]


# --- a child process, its memory sampled -----------------------------------------------------------------------------


def gib(value: float) -> float:
    return round(value / 2**30, 3)


def folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(folder, name)) for folder, _, names in os.walk(path) for name in names)


def printed_tail(path: str, lines: int = 40) -> list[str]:
    """The last `lines` lines a run printed into the log at `path`, progress bars left out."""
    with open(path, encoding="utf-8", errors="replace") as file:
        kept = [line.rstrip() for line in file.read().replace("\r", "\n").splitlines()]
    return [line for line in kept if line and "it/s]" not in line and "s/it]" not in line][-lines:]


def stop_at_exit() -> None:
    """In a child: stop at exit (SIGSTOP), so that the parent reads its final peak and disk reads, then continues it."""
    import atexit
    import signal

    atexit.register(lambda: os.kill(os.getpid(), signal.SIGSTOP))


class ProcessMonitor:
    """Samples a child process's memory every `interval` seconds (`/proc/PID/status`: RssAnon, the process's own
    memory; RssFile, the files it has mapped; `VmHWM`, its peak resident), and its disk reads (`/proc/PID/io`)."""

    def __init__(self, pid: int, interval: float = 0.5):
        self.pid, self.interval = pid, interval
        self.peak_anon = self.peak_file = self.peak_rss = 0
        self.last = {}
        self._running = True
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def read(self) -> None:
        values = {}
        with open(f"/proc/{self.pid}/status") as file:
            for line in file:
                key, _, rest = line.partition(":")
                if key in ("RssAnon", "RssFile", "VmRSS", "VmHWM"):
                    values[key] = int(rest.split()[0]) * 1024
        with open(f"/proc/{self.pid}/io") as file:
            for line in file:
                key, _, rest = line.partition(":")
                values[key] = int(rest)
        self.last = values
        self.peak_anon = max(self.peak_anon, values.get("RssAnon", 0))
        self.peak_file = max(self.peak_file, values.get("RssFile", 0))
        self.peak_rss = max(self.peak_rss, values.get("VmHWM", 0), values.get("VmRSS", 0))

    def _sample(self) -> None:
        while self._running:
            try:
                self.read()
            except (FileNotFoundError, ProcessLookupError):
                return
            time.sleep(self.interval)

    def stop(self) -> dict:
        self._running = False
        self._thread.join()
        return {
            "peak_resident_gib": gib(self.peak_rss),
            "peak_anonymous_gib": gib(self.peak_anon),
            "peak_file_mapped_gib": gib(self.peak_file),
            "read_bytes_gib": gib(self.last.get("read_bytes", 0)),
            "read_chars_gib": gib(self.last.get("rchar", 0)),
            "written_bytes_gib": gib(self.last.get("write_bytes", 0)),
        }


def run_monitored(command: list[str], log_path: str, env: dict | None = None) -> tuple[int, float, dict]:
    """Runs `command`, its output to `log_path`; returns its exit code, seconds and what [`ProcessMonitor`] saw. A child
    that stops itself at exit ([`stop_at_exit`]) has its final figures read, then is continued."""
    started = time.time()
    with open(log_path, "w") as log:
        child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        monitor = ProcessMonitor(child.pid)
        while child.poll() is None:
            try:
                with open(f"/proc/{child.pid}/stat") as file:
                    state = file.read().rsplit(")", 1)[1].split()[0]
            except FileNotFoundError:
                break
            if state == "T":  # stopped itself at exit: read its last figures, then let it go
                monitor.read()
                os.kill(child.pid, 18)  # SIGCONT
                break
            time.sleep(0.5)
        code = child.wait()
    return code, time.time() - started, monitor.stop()


def shown(row: dict) -> dict:
    """A measured child's row as a script prints it: without its provenance, argv and printed lines."""
    return {key: value for key, value in row.items() if key not in ("provenance", "argv", "printed")}
