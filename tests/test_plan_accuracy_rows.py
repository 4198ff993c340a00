"""The plan-against-run rows (benchmarks/plan_accuracy.py, docs/benchmarks/scale.md): a row measured by the command
line's own `prune` (benchmarks/memory.py prune) names the command of its plan's settings, and the rendered table
reads that record's stage seconds and peak, says which run it compares with, and shows the command it ran."""

from __future__ import annotations

import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))  # the benchmarks import each other as scripts do

import plan_accuracy  # noqa: E402
from memory import prune_key, shown_command  # noqa: E402
from rendering import common  # noqa: E402
from rendering import scale as scale_rendering  # noqa: E402


def test_a_row_measured_by_the_command_line_names_the_command_of_its_plans_settings():
    measured_by_cli = {name: spec for name, spec in plan_accuracy.ROWS.items() if spec["measured"][0] == "cli_prune_memory"}
    assert set(measured_by_cli) == {"smollm2-135m-0.25", "qwen2.5-coder-0.5b-0.25"}
    for name, spec in measured_by_cli.items():
        key = spec["measured"][1]
        assert key[0] == spec["model"], name
        options = dict(zip(key[1::2], key[2::2]))
        assert float(options["--pruning-ratio"]) == spec["settings"]["pruning_ratio"], name
        assert options["--dtype"] == spec["dtype"] == "float32", name
        assert int(options.get("--num-samples", 128)) == spec["settings"].get("num_samples", 128), name
        assert spec["evaluation_tokens"] == 0, f"{name}: the command line's run evaluates nothing"
    for name, spec in plan_accuracy.ROWS.items():  # the main job's rows keep their comparison, counting its evaluations
        if spec["measured"][0] == "main_job_memory":
            assert name.endswith("-main-job") and spec["evaluation_tokens"] == plan_accuracy.EVALUATION_TOKENS


def test_the_table_reads_a_command_line_row_and_shows_its_run_and_command(tmp_path, monkeypatch):
    key = prune_key("smollm2-135m", 0.25, "float32", [])
    row = {
        "key": key,
        "command": shown_command(key),
        "exit_code": 0,
        "timings": {"stage1": 480.0, "stage2": 120.0},
        "memory": {"peak_resident_gib": 2.0},
        "provenance": {"commit": "0123456789abcdef", "date": "2026-11-29T17:00:00+00:00", "command": "benchmarks/x.py"},
    }
    (tmp_path / "cli_prune_memory.json").write_text(json.dumps([row]))
    monkeypatch.setattr(common, "RESULTS", str(tmp_path))
    monkeypatch.setattr(scale_rendering, "RESULTS", str(tmp_path))
    common.load.cache_clear()
    try:
        seconds, peak, provenance, source = scale_rendering._measured("cli_prune_memory", key)
        assert scale_rendering._measured("cli_prune_memory", [*key, "--num-samples", "32"]) is None
    finally:
        common.load.cache_clear()
    assert seconds == {"Stage 1": 480.0, "Stage 2": 120.0} and peak == 2.0 * 2**30 and source == "cli_prune_memory"
    note = common.footnote(provenance, source)
    assert "`optimum-gradmap prune offline:smollm2-135m --pruning-ratio 0.25 --dtype float32" in note
    assert scale_rendering.measured_run(source) == "`optimum-gradmap prune`"
    assert scale_rendering.measured_run("main_job_memory").startswith("main job")
    assert scale_rendering.measured_run("scale-llama-3.1-8b-bfloat16").startswith("`optimum-gradmap prune`")
