"""Every benchmark figure carries where it comes from: `benchmarks/provenance.py` gives the fields (commit, date,
command, machine, the load and the other busy processes before and after, seconds, quiet), and every benchmark
script that writes JSON takes a `provenance()` when a measurement starts and `finish(...)`es it when it ends."""

from __future__ import annotations

import ast
import datetime
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))  # imported as the scripts import it: a sibling module

import provenance as provenance_module  # noqa: E402
from provenance import finish, provenance  # noqa: E402

BENCHMARKS = ROOT / "benchmarks"
FIELDS = {
    "commit": str,
    "dirty": bool,
    "date": str,
    "command": str,
    "machine": dict,
    "load_before": list,
    "load_after": list,
    "others_running_before": list,
    "others_running_after": list,
    "others_stopped_before": list,
    "others_stopped_after": list,
    "seconds": float,
    "quiet": bool,
}


def test_a_finished_provenance_has_every_field_with_its_type_and_the_time_the_measurement_took():
    started = provenance()
    assert "started" in started
    time.sleep(0.05)
    record = finish(started)

    assert set(record) == set(FIELDS), f"fields: {sorted(record)}"
    for field, kind in FIELDS.items():
        assert isinstance(record[field], kind), f"{field}: {record[field]!r} is not a {kind.__name__}"
    assert "started" in started, "finish must not change the provenance it completes"

    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    assert re.fullmatch(r"[0-9a-f]{40}", record["commit"]) and record["commit"] == head
    date = datetime.datetime.fromisoformat(record["date"])
    assert date.utcoffset() == datetime.timedelta(0)
    assert abs((datetime.datetime.now(datetime.timezone.utc) - date).total_seconds()) < 60
    assert record["command"]
    assert set(record["machine"]) == {"cpu_count", "platform", "torch", "transformers", "accelerator"}
    assert record["machine"]["accelerator"] == (torch.cuda.get_device_name() if torch.cuda.is_available() else None)
    assert record["machine"]["cpu_count"] == os.cpu_count()
    for field in ("load_before", "load_after"):
        assert len(record[field]) == 3 and all(isinstance(value, float) and value >= 0 for value in record[field])
    for field in ("others_running_before", "others_running_after", "others_stopped_before", "others_stopped_after"):
        assert all(isinstance(process, str) for process in record[field])
    assert record["seconds"] >= 0.05
    assert record["quiet"] == (
        not record["others_running_before"] and not record["others_running_after"] and record["load_before"][0] < 1.0
    )


def test_the_commit_is_the_one_the_process_started_with_however_head_moves(monkeypatch):
    started_with = provenance()["commit"]
    assert started_with == provenance_module.PROCESS_COMMIT
    monkeypatch.setattr(provenance_module, "_git", lambda *arguments: "another commit, checked out later")
    assert provenance()["commit"] == started_with


def test_a_busy_process_stopped_with_sigstop_is_listed_as_stopped_and_not_as_running():
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        deadline = time.time() + 30
        # threshold 0 throughout: on a loaded machine the spinning process may get little of a CPU
        running: list[str] = []
        while str(busy.pid) not in running and time.time() < deadline:
            time.sleep(0.2)
            running = [line.split()[0] for line in provenance_module.other_busy_processes(threshold=0.0)]
        assert str(busy.pid) in running, "a process spinning on a CPU must be listed as busy"

        busy.send_signal(signal.SIGSTOP)
        time.sleep(0.3)
        running = [line.split()[0] for line in provenance_module.other_busy_processes(threshold=0.0)]
        stopped = [line.split()[0] for line in provenance_module.other_stopped_processes(threshold=0.0)]
        assert str(busy.pid) not in running and str(busy.pid) in stopped
        entry = next(line for line in provenance_module.other_stopped_processes(threshold=0.0) if line.startswith(f"{busy.pid} "))
        assert entry.split()[2:] == ["python"], f"another process is kept by its program's name only: {entry!r}"
    finally:
        busy.kill()
        busy.wait()


def _calls(source: str) -> set[str]:
    """The names of the functions `source` calls: `json.dump(...)` gives "json.dump", `finish(...)` "finish"."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            function = node.func
            if isinstance(function, ast.Name):
                names.add(function.id)
            elif isinstance(function, ast.Attribute):
                owner = function.value.id if isinstance(function.value, ast.Name) else ""
                names.add(f"{owner}.{function.attr}" if owner else function.attr)
    return names


def without_provenance(source: str) -> bool:
    """Whether a benchmark's source writes JSON (`json.dump`, `json.dumps` or a record with `records.write`) without
    calling both `provenance()` and `finish(...)`."""
    calls = _calls(source)
    writes_json = bool(calls & {"json.dump", "json.dumps", "records.write", "write"})
    return writes_json and not {"provenance", "finish"} <= calls


def test_the_check_finds_a_benchmark_that_writes_json_without_provenance():
    assert without_provenance("import json\njson.dump({}, open('a.json', 'w'))\n")
    assert without_provenance("import json\nstarted = provenance()\nprint(json.dumps({'provenance': started}))\n")
    assert not without_provenance("import json\nstarted = provenance()\njson.dump({'provenance': finish(started)}, file)\n")
    assert not without_provenance("print('no JSON written')\n")
    assert without_provenance("import records\nrecords.write('a.json', {})\n")


def test_every_benchmark_that_writes_json_records_provenance():
    # vllm_speed.py runs in vLLM's environment for deploy.py, which records its figures with their provenance
    exempt = ("provenance.py", "records.py", "render.py", "vllm_speed.py")
    scripts = sorted(path for path in BENCHMARKS.glob("*.py") if path.name not in exempt)
    assert scripts, f"no benchmark scripts found in {BENCHMARKS}"
    missing = [path.name for path in scripts if without_provenance(path.read_text(encoding="utf-8"))]
    assert not missing, (
        f"these benchmarks write JSON but never call provenance() and finish(...) (benchmarks/provenance.py): {missing}"
    )


@pytest.mark.parametrize(
    "command, name",
    [
        ("/opt/venv/bin/python3 /opt/venv/bin/optimum-gradmap prune offline:smollm2-135m --output /srv/x", "optimum-gradmap"),
        ("/opt/venv/bin/python -u /srv/someone/probe.py --flag", "probe.py"),
        ("python -m pytest -q tests", "pytest"),
        ("python3 -c while True: pass", "python3"),
        ("/usr/bin/ps -eo pid", "ps"),
        ("", ""),
    ],
)
def test_another_process_is_named_by_its_program_without_folders_or_arguments(command, name):
    assert provenance_module.program(command) == name


def test_the_command_of_a_provenance_holds_paths_relative_to_the_repository(monkeypatch):
    monkeypatch.setattr(sys, "argv", [str(BENCHMARKS / "heal.py"), "--output", str(ROOT / "out" / "x"), "--model", "m"])
    assert provenance()["command"] == "benchmarks/heal.py --output out/x --model m"


def test_mark_copy_adds_where_the_row_was_copied_from_and_keeps_the_rest():
    row = {"method": "gradmap", "removed_layers": [3, 5], "evaluation": {"perplexities": []}}
    copied = provenance_module.mark_copy(row, "COPY of compare-smollm2-135m-0.25.json (gradmap, Stage 1 only)")
    assert copied == {**row, "copied_from": "COPY of compare-smollm2-135m-0.25.json (gradmap, Stage 1 only)"}
    assert "copied_from" not in row, "mark_copy must not change the row it copies"
