"""The examples: every script under examples/ imports and parses its options (`--help` exits 0, through a subprocess)
and its docstring gives its own path, every use case has a README that says what it does, the command and the expected
result, and examples/README.md links every folder. One subprocess runs every script's `--help`, so torch and
transformers are imported once: a few seconds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")

# Runs `SCRIPT --help` for each script given, as `python SCRIPT --help` would (as `__main__`, with that argv), and writes
# each one's exit code (or the error it raised instead) and help text, as JSON, into the file named first.
HELP_RUNNER = textwrap.dedent(
    """
    import contextlib, io, json, runpy, sys, traceback

    output, results = sys.argv[1], {}
    for path in sys.argv[2:]:
        text = io.StringIO()
        sys.argv = [path, "--help"]
        try:
            with contextlib.redirect_stdout(text):
                runpy.run_path(path, run_name="__main__")
            code = "returned without exiting"
        except SystemExit as exit:
            code = exit.code or 0
        except BaseException:
            code = traceback.format_exc()
        results[path] = {"code": code, "help": text.getvalue()}
    with open(output, "w", encoding="utf-8") as file:
        json.dump(results, file)
    """
)


def example_scripts() -> list[str]:
    """Every Python script under examples/, relative to the repository."""
    scripts = []
    for folder, _, names in os.walk(EXAMPLES):
        scripts += [os.path.relpath(os.path.join(folder, name), ROOT) for name in names if name.endswith(".py")]
    return sorted(scripts)


def use_cases() -> list[str]:
    """The folders of examples/, one per use case."""
    return sorted(name for name in os.listdir(EXAMPLES) if os.path.isdir(os.path.join(EXAMPLES, name)) and name[0] not in "._")


@pytest.fixture(scope="module")
def help_runs(tmp_path_factory) -> dict[str, dict]:
    output = tmp_path_factory.mktemp("examples") / "help.json"
    completed = subprocess.run(
        [sys.executable, "-c", HELP_RUNNER, str(output), *example_scripts()],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(output.read_text(encoding="utf-8"))


def test_there_are_examples():
    assert "examples/main_job/prune_smollm2.py" in example_scripts()
    assert {"main_job", "budget", "big_model_offload", "torchrun", "heal", "serve_vllm"} <= set(use_cases())


@pytest.mark.parametrize("script", example_scripts())
def test_example_help_exits_0(help_runs, script):
    run = help_runs[script]
    assert run["code"] == 0, f"{script} --help: {run['code']}"
    assert run["help"].startswith("usage: "), run["help"][:500]
    assert f"examples/{os.path.relpath(script, 'examples')}" in run["help"], (
        f"{script}: its docstring (the --help description) should give the command with its own path"
    )


@pytest.mark.parametrize("folder", use_cases())
def test_every_use_case_has_a_readme_with_its_command_and_result(folder):
    path = os.path.join(EXAMPLES, folder, "README.md")
    assert os.path.isfile(path), f"examples/{folder} has no README.md"
    with open(path, encoding="utf-8") as file:
        text = file.read()
    for part in ("**What it does.**", "**The command", "**The expected result.**"):
        assert part in text, f"examples/{folder}/README.md lacks {part!r}"
    for name in sorted(os.listdir(os.path.join(EXAMPLES, folder))):
        if name.endswith(".py"):
            assert f"examples/{folder}/{name}" in text, f"examples/{folder}/README.md never gives the command of {name}"
    with open(os.path.join(EXAMPLES, "README.md"), encoding="utf-8") as file:
        assert f"]({folder}/README.md)" in file.read(), f"examples/README.md does not link examples/{folder}"
