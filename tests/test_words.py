"""Words for users. No tracked file holds an absolute path of a machine (a record keeps paths relative to the
repository), and nothing a user reads cites an issue number of this project's tracker: the README, docs/ (but
docs/changelog.md, where the history goes), the examples, the `--help` of every command (`optimum-gradmap`'s, the
examples' and the benchmarks' scripts) and the library's strings and comments. Each failure lists every `file:line`
it found, with the text there."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterable, Iterator

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Folders where a machine keeps its users', jobs' and mounted files (and the names `tempfile.mkdtemp` and pytest
# give a temporary folder): a path under one is a file of one machine, which no reader has. Not matched: a relative
# path (`out/x`, `~/.cache/...`), a URL's path, the system's programs (`/usr/bin/time`), and an example a user may
# copy (`--output /tmp/before.json`).
MACHINE_PATH = re.compile(
    r"(?<![\w.~/:$-])/(?:work|root|mnt|scratch|home/[\w.-]+|Users/[\w.-]+)/"
    r"|(?<![\w.~/:$-])/tmp/(?:tmp[a-z0-9_]{8}(?![\w.-])|pytest-of-)"
    r"|\b[A-Za-z]:\\(?:Users|home)\\"
)
# A record is written by a machine as it runs: every absolute path in one is that machine's, but for the system's
# programs (`/usr/bin/time`).
RECORDS = "benchmarks/results/"
RECORD_PATH = re.compile(r"(?<![\w.~/:$-])/(?!usr/bin/|bin/)[A-Za-z][\w.+-]*/")
# An issue of this project's tracker: `issue 65`, `issues 38/55`, `Issue #4`, `#65` (not an anchor such as `#40-at`,
# an HTML entity `&#39;` or a colour `#1f77b4`).
ISSUE_REFERENCE = re.compile(r"\bissues?\s+#?\d+|(?<![\w/&#])#\d+(?![\w-])", re.IGNORECASE)
CHANGELOG = "docs/changelog.md"
THIS_FILE = os.path.relpath(os.path.abspath(__file__), ROOT)


def tracked_files() -> list[str]:
    """Every file git tracks here, relative to the repository, but those deleted in the work tree."""
    listing = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [name for name in listing.decode("utf-8").split("\0") if name and os.path.isfile(os.path.join(ROOT, name))]


def text_of(name: str) -> str | None:
    """A tracked file's text, or `None` for a binary file (a picture)."""
    with open(os.path.join(ROOT, name), "rb") as file:
        data = file.read()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def findings(where: str, text: str, pattern: re.Pattern) -> Iterator[str]:
    """`where:line: the line` for every line of `text` that matches `pattern` (cut to 160 characters around the
    first match)."""
    reported = set()
    for match in pattern.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        if line in reported:
            continue
        reported.add(line)
        start = text.rfind("\n", 0, match.start()) + 1
        end = text.find("\n", match.end())
        around = text[start : end if end != -1 else len(text)].strip()
        if len(around) > 160:
            offset = max(0, match.start() - start - 60)
            around = "..." + around[offset : offset + 160] + "..."
        yield f"{where}:{line}: {around}"


def fail_on(found: list[str], what: str) -> None:
    """Fails the test with every finding, one `file:line: text` a line, where there are any."""
    if found:
        pytest.fail(f"{len(found)} {what}:\n" + "\n".join(found), pytrace=False)


def user_text_files(files: Iterable[str]) -> list[str]:
    """The tracked files users read as text: the README, the docs but their changelog, the site's configuration,
    the examples, and the library (its error messages and help texts, and its comments with them)."""
    chosen = []
    for name in files:
        if name in ("README.md", "mkdocs.yml", "mkdocs_hooks.py") or name.startswith("examples/"):
            chosen.append(name)
        elif name.startswith("docs/") and name.endswith(".md") and name != CHANGELOG:
            chosen.append(name)
        elif name.startswith(("optimum_gradmap/", "optimum/")) and name.endswith(".py"):
            chosen.append(name)
    return chosen


# --------------------------------------------------------------------------------------------- machine paths
def absolute(*parts: str) -> str:
    """An absolute path made of `parts`: this file's examples of machine paths are built, so that no search of the
    repository for machine paths (`git grep`) finds them here."""
    return "/" + "/".join(parts)


def test_the_patterns_tell_a_machines_paths_from_a_users():
    machine = [
        f"--weights {absolute('work', 'scale', 'llama-3.1-8b-bf16')}",
        f"checkpoint: {absolute('root', '.cache', 'optimum_gradmap', 'checkpoints', 'x')}",
        f"see {absolute('home', 'alice', 'gradmap', 'out')}",
        f"open {absolute('Users', 'bob', 'models', 'x')}",
        f"data on {absolute('mnt', 'disk1', 'c4')}",
        "Saved pruned checkpoint to /tmp/tmpnuc9h92r/out",
        "inspect /tmp/pytest-of-root/pytest-98/test_x",
        r"C:\Users\carol\gradmap",
    ]
    user = [
        "--output out/smollm2-gradmap",
        "caches it in `~/.cache/optimum_gradmap`",
        "https://huggingface.co/docs/work/x and https://example.com/home/user/",
        "/usr/bin/time -v .venv/bin/python examples/main_job/prune_smollm2.py",
        "python benchmarks/equivalence.py --output /tmp/before.json",
        "benchmarks/results/work/x.json, $HOME/work/x",
    ]
    assert [line for line in machine if not MACHINE_PATH.search(line)] == []
    assert [line for line in user if MACHINE_PATH.search(line)] == []
    # in a record, any absolute path but a system program's
    assert RECORD_PATH.search("12864 67.0% /tmp/ciA/.venv-vllm/bin/python3") and RECORD_PATH.search("/opt/x/y")
    assert not RECORD_PATH.search("/usr/bin/time -v .venv/bin/python; HuggingFaceTB/SmolLM2-135M; 1/2/3; tokens/s")


# A record's per-question answers packed as base64 (benchmarks/records.py): characters, not paths
PACKED_KEYS = {"acc", "choice", "margin", "loglikelihoods"}


def record_text(text: str) -> str:
    """A JSON record's text with its packed answers left out, one value a line (other files as they are)."""

    def unpacked(value: object) -> object:
        if isinstance(value, dict):
            packed = {key for key, item in value.items() if key in PACKED_KEYS and isinstance(item, str)}
            return {key: "<packed>" if key in packed else unpacked(item) for key, item in value.items()}
        if isinstance(value, list):
            return [unpacked(item) for item in value]
        return value

    try:
        return json.dumps(unpacked(json.loads(text)), indent=1)
    except json.JSONDecodeError:
        return text


def test_a_records_packed_answers_are_not_read_as_paths():
    command = f"python {absolute('work', 'x', 'y.py')}"
    record = json.dumps({"acc": "/x3vUsyO3Tj/FF+bX78+/mW2o9d/9Vv7", "command": command})
    found = [line for line in record_text(record).splitlines() if RECORD_PATH.search(line)]
    assert found == [f' "command": "{command}"']


def test_no_tracked_file_holds_a_machines_absolute_path():
    found = []
    for name in tracked_files():
        text = text_of(name)
        if text is None or name == THIS_FILE:  # this file's examples of what the patterns find are no one's files
            continue
        if name.startswith(RECORDS):
            found += findings(name + " (packed answers left out)", record_text(text), RECORD_PATH)
        else:
            found += findings(name, text, MACHINE_PATH)
    fail_on(found, "absolute paths of a machine (a record keeps paths relative to the repository)")


# ------------------------------------------------------------------------------------------- issue numbers
def test_the_pattern_finds_an_issue_number_and_nothing_else():
    references = ["the fidelity goals of issue 65", "issues 38/55", "(Issue #4)", "see #65.", "the default since issue\n38"]
    others = [
        "[its own](#40-at-15x-and-3x-stage)",
        "&#39;",
        'color="#1f77b4"',
        "# 0 is the first layer",
        "transformers#1234",
        "an issue the heal fixes",
        "https://github.com/huggingface/transformers/issues/123",
    ]
    assert [text for text in references if not ISSUE_REFERENCE.search(text)] == []
    assert [text for text in others if ISSUE_REFERENCE.search(text)] == []


def test_no_user_facing_text_cites_an_issue_number():
    found = []
    for name in user_text_files(tracked_files()):
        text = text_of(name)
        if text is not None:
            found += findings(name, text, ISSUE_REFERENCE)
    fail_on(found, "internal issue numbers in user-facing files (history goes to docs/changelog.md)")


def parser_helps(parser: argparse.ArgumentParser) -> Iterator[tuple[str, str]]:
    """(program, `format_help()`) of a parser and, depth first, of each of its subcommands."""
    yield parser.prog, parser.format_help()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in dict.fromkeys(action.choices.values()):  # an alias repeats its parser
                yield from parser_helps(subparser)


def test_no_commands_help_cites_an_issue_number():
    from optimum_gradmap.cli import build_parser

    helps = list(parser_helps(build_parser()))
    assert len(helps) > 1 and any("--pruning-ratio" in text for _, text in helps)  # the subcommands are there
    found = [line for program, text in helps for line in findings(f"{program} --help", text, ISSUE_REFERENCE)]
    fail_on(found, "internal issue numbers in `optimum-gradmap --help` texts")


# Runs each script as `python SCRIPT --help` would (as `__main__`), stops it where it first parses its options, and
# writes, as JSON into the file named first, the `format_help()` of that parser and of its subcommands (or the error
# raised before): nothing of the script runs past the parse.
HELP_COLLECTOR = textwrap.dedent(
    """
    import argparse, contextlib, io, json, os, runpy, sys, traceback

    class Collected(BaseException):
        pass

    def helps(parser):
        texts = [parser.prog + "\\0" + parser.format_help()]
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for subparser in dict.fromkeys(action.choices.values()):
                    texts += helps(subparser)
        return texts

    def collect(self, args=None, namespace=None):
        raise Collected(helps(self))

    argparse.ArgumentParser.parse_known_args = collect
    output, results = sys.argv[1], {}
    for path in sys.argv[2:]:
        sys.argv = [path, "--help"]
        sys.path.insert(0, os.path.dirname(os.path.abspath(path)))  # as `python SCRIPT` does
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                runpy.run_path(path, run_name="__main__")
            results[path] = {"error": "it ran to its end without parsing its options"}
        except Collected as collected:
            results[path] = {"helps": collected.args[0]}
        except BaseException:
            results[path] = {"error": traceback.format_exc()}
        finally:
            sys.path.pop(0)
    with open(output, "w", encoding="utf-8") as file:
        json.dump(results, file)
    """
)


def scripts_with_options() -> list[str]:
    """The examples' and the benchmarks' scripts that parse options with argparse (the benchmarks' through
    `common.parser`)."""
    scripts = []
    for name in tracked_files():
        if name.endswith(".py") and (name.startswith("examples/") or name.count("/") == 1 and name.startswith("benchmarks/")):
            with open(os.path.join(ROOT, name), encoding="utf-8") as file:
                text = file.read()
            if '__name__ == "__main__"' in text and ("ArgumentParser(" in text or "parser(__doc__)" in text):
                scripts.append(name)
    return scripts


def source_lines(script: str, source: str, reference: str) -> str:
    """Where a help text's issue reference stands in the script's source: `script:line` of each occurrence of the
    same words (the help wraps lines; the source's may differ)."""
    words = re.compile(r"\s+".join(map(re.escape, reference.split())), re.IGNORECASE)
    lines = [str(source.count("\n", 0, match.start()) + 1) for match in words.finditer(source)]
    return f"{script}:{','.join(lines)}" if lines else "not found in the script's own text"


def test_no_scripts_help_cites_an_issue_number(tmp_path):
    scripts = scripts_with_options()
    assert "examples/main_job/prune_smollm2.py" in scripts
    output = tmp_path / "helps.json"
    completed = subprocess.run(
        [sys.executable, "-c", HELP_COLLECTOR, str(output), *scripts],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    results = json.loads(output.read_text(encoding="utf-8"))
    errors = {script: result["error"][-1500:] for script, result in results.items() if "error" in result}
    assert errors == {}, "scripts whose --help could not be built:\n" + "\n".join(f"{s}: {e}" for s, e in errors.items())
    found = []
    for script, result in results.items():
        with open(os.path.join(ROOT, script), encoding="utf-8") as file:
            source = file.read()
        for entry in result["helps"]:
            program, text = entry.split("\0", 1)
            where = script if program == os.path.basename(script) else f"{script} ({program})"
            for finding in findings(f"{where} --help", text, ISSUE_REFERENCE):
                reference = ISSUE_REFERENCE.search(finding.split(": ", 1)[1]).group()
                found.append(f"{finding}  [{source_lines(script, source, reference)}]")
    fail_on(found, "internal issue numbers in the scripts' --help texts")
