"""`benchmarks/accuracy.py` keeps a row's measurements as they come: a run stopped halfway resumes at the row's next
part, on the same weights and settings only, and the finished row carries every part's provenance."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))  # the scripts import `provenance` as a sibling module

import accuracy  # noqa: E402

SETTINGS = {"max_segments": 128, "batch_size": 8, "lm_eval": "0.4.13"}
TASKS = ["boolq", "piqa", "hellaswag"]


class Stopped(Exception):
    """Stands for the run being killed."""


def measure_tasks(measured: list[str], stop_after: int | None = None):
    """A stand-in for `accuracy.measure`: one task per part, saved as it ends, the run stopped after `stop_after`."""

    def measure_model(progress: dict, save) -> dict:
        tasks = progress.setdefault("tasks", {})
        for task in TASKS:
            if task in tasks:
                continue
            if stop_after is not None and len(tasks) == stop_after:
                raise Stopped
            tasks[task] = {"acc": len(task)}
            measured.append(task)
            save()
        return {"tasks": dict(tasks)}

    return measure_model


def test_a_stopped_row_resumes_at_its_next_part_and_keeps_both_parts_provenance():
    model, record, saves = torch.nn.Linear(3, 2), {"rows": []}, []
    measured = []
    with pytest.raises(Stopped):
        accuracy.measure_row(
            record, "gradmap", "stage1", model, SETTINGS, measure_tasks(measured, 2), lambda: saves.append(1), _started()
        )
    assert measured == ["boolq", "piqa"] and len(saves) == 2
    assert list(record["in_progress"]["gradmap + stage1"]["tasks"]) == ["boolq", "piqa"]

    evaluation, provenance = accuracy.measure_row(
        record, "gradmap", "stage1", model, SETTINGS, measure_tasks(measured), lambda: None, _started()
    )
    assert measured == ["boolq", "piqa", "hellaswag"]  # the first two were not measured again
    assert evaluation == {"tasks": {task: {"acc": len(task)} for task in TASKS}}
    assert len(provenance["parts"]) == 2
    assert provenance["seconds"] == pytest.approx(sum(part["seconds"] for part in provenance["parts"]))
    assert provenance["quiet"] == all(part["quiet"] for part in provenance["parts"])
    assert "in_progress" not in record


@pytest.mark.parametrize("change", ["weights", "settings"])
def test_a_saved_part_of_other_weights_or_settings_is_measured_again(change):
    model, record, measured = torch.nn.Linear(3, 2), {"rows": []}, []
    with pytest.raises(Stopped):
        accuracy.measure_row(record, "gradmap", "default", model, SETTINGS, measure_tasks(measured, 1), lambda: None, _started())
    settings = SETTINGS
    if change == "weights":
        with torch.no_grad():
            model.weight[0, 0] += 1e-3
    else:
        settings = {**SETTINGS, "batch_size": 16}
    evaluation, provenance = accuracy.measure_row(
        record, "gradmap", "default", model, settings, measure_tasks(measured), lambda: None, _started()
    )
    assert measured == ["boolq", *TASKS]  # boolq twice: the saved part was not used
    assert "parts" not in provenance


def test_parts_of_two_rows_are_kept_apart():
    model, record, measured = torch.nn.Linear(3, 2), {"rows": []}, []
    with pytest.raises(Stopped):
        accuracy.measure_row(record, "quality", "stage1", model, SETTINGS, measure_tasks(measured, 1), lambda: None, _started())
    accuracy.measure_row(record, "gradmap", "stage1", model, SETTINGS, measure_tasks(measured), lambda: None, _started())
    assert list(record["in_progress"]) == ["quality + stage1"]  # the other row's part is still there


def test_the_weights_fingerprint_sees_every_weight_and_dtype():
    model = torch.nn.Linear(3, 2)
    before = accuracy.model_sha256(model)
    assert accuracy.model_sha256(model) == before
    with torch.no_grad():
        model.bias[1] += 1e-6
    assert accuracy.model_sha256(model) != before
    assert accuracy.model_sha256(model.to(torch.bfloat16)) != accuracy.model_sha256(model.float())


def _started() -> dict:
    return accuracy.provenance()
