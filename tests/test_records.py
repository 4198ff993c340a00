"""`benchmarks/records.py` writes the benchmarks' records compactly (per-question answers packed, question ids once per
record) and reads back exactly what was written, with the machine's paths made relative."""

from __future__ import annotations

import json
import os
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))  # imported as the scripts import it: a sibling module

import records  # noqa: E402


def answers(doc_ids, acc, **more):
    return {"doc_ids": list(doc_ids), "acc": acc, **more}


def test_a_record_reads_back_exactly_as_written_and_its_answers_are_packed(tmp_path):
    dense = {
        "boolq": answers([9, 12, 13, 14, 40], "10110", choice=[0, 1, 1, 0, 1], margin=[0.5, None, 12.3456, 0.0, 3.1]),
        "hellaswag": answers(
            range(4), "0101", choice=[3, 0, 2, 1], loglikelihoods=[[-1.25, -2.5], [-0.0001, -7.0, -3.0], [-4.5, -4.5], [0, -1]]
        ),
    }
    other = {"boolq": answers([9, 12, 13, 14, 40], "00111", choice=[1, 1, 1, 0, 0]), "hellaswag": answers([0, 5], "11")}
    record = {
        "model": "m",
        "rows": [
            {"variant": "dense", "evaluation": {"zero_shot": {"answers": dense, "tasks": [{"task": "boolq", "acc": 0.6}]}}},
            {"variant": "stage1", "evaluation": {"zero_shot": {"answers": other}}},
        ],
    }
    expected = json.loads(json.dumps(record))
    expected["rows"][0]["evaluation"]["zero_shot"]["answers"]["hellaswag"]["loglikelihoods"][3] = [0.0, -1.0]
    path = str(tmp_path / "r.json")
    records.write(path, record)
    assert records.read(path) == expected
    stored = json.loads(pathlib.Path(path).read_text())
    assert stored["question_ids"] == {"boolq": "9,12-14,40", "hellaswag": "0-3"}
    kept = stored["rows"][1]["evaluation"]["zero_shot"]["answers"]
    assert "doc_ids" not in kept["boolq"] and kept["hellaswag"]["doc_ids"] == "0,5"  # other questions than the record's
    assert all(isinstance(value, str) for value in kept["boolq"].values())


def test_a_record_without_answers_is_plain_json_and_long_containers_go_one_item_a_line(tmp_path):
    record = [{"key": ["prune", "x"], "numbers": list(range(60)), "printed": ["a line"] * 3}]
    path = str(tmp_path / "rows.json")
    records.write(path, record)
    assert records.read(path) == record and json.loads(pathlib.Path(path).read_text()) == record
    assert all(len(line) <= records.WIDTH for line in pathlib.Path(path).read_text().splitlines() if "numbers" not in line)


def test_paths_of_this_machine_are_written_relative():
    # a checkout outside the temporary folder and the home folder (a clone in /tmp has the temporary folder beside it)
    root = "/srv/checkouts/optimum-gradmap"
    temporary = tempfile.gettempdir()
    home = os.path.expanduser("~")
    text = (
        f"--weights {os.path.dirname(root)}/models/llama --output {root}/out/x --cache {home}/.cache/hub "
        f"saved to {temporary}/cli-prune-1/pruned; cd {root} && /usr/bin/time -v python "
        f"--work={os.path.dirname(root)}/runs/srv/checkouts"
    )
    assert records.relative_paths(text, root) == (
        "--weights ../models/llama --output out/x --cache ~/.cache/hub saved to $TMPDIR/cli-prune-1/pruned; "
        "cd . && /usr/bin/time -v python --work=../runs/srv/checkouts"
    )


def test_written_records_hold_no_absolute_path_of_the_machine(tmp_path):
    path = str(tmp_path / "r.json")
    records.write(path, {"command": f"benchmarks/scale.py --work {ROOT}/work", "output_dir": f"{ROOT}/benchmarks/results"})
    assert records.read(path) == {"command": "benchmarks/scale.py --work work", "output_dir": "benchmarks/results"}
