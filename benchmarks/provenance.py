"""Where a benchmark figure comes from: every row a benchmark writes carries `provenance()`, taken when the
row's measurement starts and finished when it ends (`finish(...)`):

- `commit` (and `dirty`: uncommitted changes to tracked files other than the records of benchmarks/results/, which
  a benchmark writes itself), both taken when this module is first imported, at the
  start of the benchmark's process: the code it runs is that commit's, however HEAD moves during a long run (a row
  measured hours later still ran the code loaded then); `date` (UTC), this process's `command`, its paths relative
  (`records.relative_paths`);
- the machine: CPU count, platform, torch and transformers versions, the GPU if one is visible (`accelerator`);
  `$PROVENANCE_COMMIT`, where set, is the `commit` (a copy of the repository whose git history is not that of its
  files, as on the lent GPU machine, names the commit it was copied from that way);
- `load_before` / `load_after`: the 1-, 5- and 15-minute load averages when the row started and ended;
- `others_running`: the other processes that used more than 10% of a CPU when the row started or ended, each as its
  id, CPU share and program name (`program`: no command line of another process is kept; none means the machine was
  quiet, as far as two looks can tell; a stopped process, `kill -STOP`, uses none and is listed in `others_stopped`
  instead), and `quiet`: no such process at
  either end and a 1-minute load below 1 before the row started (the load at its end counts the row itself).

A row copied from another measurement carries `copied_from` (what it was copied from) instead of being
measured again; `mark_copy` adds it, and every table that shows the row says so.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
import time

import torch
import transformers
from records import relative_paths

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _git(*arguments: str) -> str:
    try:
        return subprocess.run(["git", *arguments], cwd=_ROOT, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def program(command: str) -> str:
    """The program a command line runs, without its folder or arguments: for a Python interpreter, the script or
    module it runs (`python -m pytest ...` is `pytest`, `.venv/bin/python benchmarks/heal.py ...` is `heal.py`;
    `python -c CODE` is `python`)."""
    words = command.split()
    name = os.path.basename(words[0]) if words else ""
    if not name.startswith("python"):
        return name
    for index, word in enumerate(words[1:], 1):
        if word == "-c":
            return name
        if word == "-m":
            return words[index + 1] if index + 1 < len(words) else name
        if not word.startswith("-"):
            return os.path.basename(word)
    return name


def other_busy_processes(threshold: float = 10.0) -> list[str]:
    """The other processes using more than `threshold` percent of a CPU (from `ps`), not counting stopped ones."""
    return other_processes(threshold)[0]


def other_stopped_processes(threshold: float = 10.0) -> list[str]:
    """The other processes that used more than `threshold` percent of a CPU but are stopped now (`kill -STOP`)."""
    return other_processes(threshold)[1]


def other_processes(threshold: float = 10.0) -> tuple[list[str], list[str]]:
    """The other processes that used more than `threshold` percent of a CPU, from one look with `ps`: those
    running, and those stopped now."""
    arguments = ["ps", "-eo", "pid,stat,pcpu,args", "--no-headers"]
    try:
        lines = subprocess.run(arguments, capture_output=True, text=True, timeout=30).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return ["(ps failed)"], []
    running, stopped = [], []
    for line in lines:
        pid, state, cpu, *command = line.split(maxsplit=3)
        is_this_look = command and command[0] == " ".join(arguments)  # `ps` itself, often at 100% as it starts
        if int(pid) != os.getpid() and not is_this_look and float(cpu) > threshold:
            (stopped if state.startswith("T") else running).append(f"{pid} {cpu}% {program(command[0]) if command else ''}")
    return running, stopped


def wait_until_quiet(max_seconds: float = 300.0, poll: float = 5.0) -> float:
    """Waits, at most `max_seconds`, until the 1-minute load average falls below 1 and no other process uses more
    than 10% of a CPU: a row measured right after the previous one (in the same process) then starts on a machine
    that its own predecessor no longer loads, and `quiet` can say so. Returns the seconds waited."""
    started = time.time()
    while time.time() - started < max_seconds:
        if os.getloadavg()[0] < 1.0 and not other_busy_processes():
            break
        time.sleep(poll)
    return time.time() - started


# The commit and local changes of the code this process loaded (see the module docstring).
PROCESS_COMMIT = os.environ.get("PROVENANCE_COMMIT") or _git("rev-parse", "HEAD")
PROCESS_DIRTY = bool(_git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!benchmarks/results"))


def provenance() -> dict:
    """The provenance of a measurement that starts now (see the module docstring); `finish` completes it."""
    running, stopped = other_processes()
    return {
        "commit": PROCESS_COMMIT,
        "dirty": PROCESS_DIRTY,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": relative_paths(shlex.join([os.path.relpath(sys.argv[0], _ROOT), *sys.argv[1:]])),
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "accelerator": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        },
        "load_before": list(os.getloadavg()),
        "others_running_before": running,
        "others_stopped_before": stopped,
        "started": time.time(),
    }


def finish(record: dict) -> dict:
    """Completes a provenance started by [`provenance`] when the measurement ends."""
    record = dict(record)
    record["load_after"] = list(os.getloadavg())
    record["others_running_after"], record["others_stopped_after"] = other_processes()
    record["seconds"] = time.time() - record.pop("started")
    # the load at the end counts this measurement itself: only the load before it, and the others, tell
    record["quiet"] = (
        not record["others_running_before"] and not record["others_running_after"] and record["load_before"][0] < 1.0
    )
    return record


def mark_copy(row: dict, source: str) -> dict:
    """`row`, marked as a copy of `source` (a row of another measurement): shown as such wherever it appears."""
    return {**row, "copied_from": source}
