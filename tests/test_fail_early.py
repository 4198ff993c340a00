"""Bad input fails before any compute, with exit code 2, a one-line message and nothing written; saving is
atomic; calibration text comes from files; an interrupted Stage 1 resumes; the default output is quiet."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch

from optimum_gradmap import GradMAPPruner, load_report, validate_checkpoint
from optimum_gradmap.cli import default_stage1_checkpoint, main

from .conftest import random_ids, small_config, tiny_model

TEXT = "Layer pruning removes whole decoder layers, and Stage 2 repairs what the removal breaks. " * 6


def _prune(model: str, output: str, *extra: str) -> list[str]:
    return [
        "prune", model, "--num-layers-to-prune", "2", "--num-samples", "8", "--seq-len", "16", "--dataset", "offline:wikipedia",
        "--output", output, "-q", *extra,
    ]  # fmt: skip


def _folder_digest(folder) -> dict[str, str]:
    return {
        name: hashlib.sha256(open(os.path.join(folder, name), "rb").read()).hexdigest() for name in sorted(os.listdir(folder))
    }


@pytest.fixture
def no_loading(monkeypatch):
    """Fails the test if a model is loaded: the checks must come first."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", refuse)


def test_cuda_on_a_machine_without_it_is_refused_before_loading(tiny_checkpoint, tmp_path, capsys, monkeypatch, no_loading):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(_prune(tiny_checkpoint, str(tmp_path / "out"), "--device", "cuda")) == 2
    error = capsys.readouterr().err
    assert "--device cuda: CUDA is not available here" in error and "Use --device cpu" in error
    assert len(error.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
    assert main(_prune(tiny_checkpoint, str(tmp_path / "out"), "--device", "gpu0")) == 2
    assert "is not a device name" in capsys.readouterr().err


def test_the_input_models_folder_is_never_the_output(tiny_checkpoint, capsys, no_loading):
    before = _folder_digest(tiny_checkpoint)
    for extra in ((), ("--overwrite",)):
        assert main(_prune(tiny_checkpoint, tiny_checkpoint, *extra)) == 2
        assert "is the folder of the model being pruned" in capsys.readouterr().err
    assert _folder_digest(tiny_checkpoint) == before


def test_an_existing_file_or_non_empty_folder_is_refused_before_pruning(tiny_checkpoint, tmp_path, capsys, no_loading):
    (tmp_path / "a_file").write_text("mine")
    assert main(_prune(tiny_checkpoint, str(tmp_path / "a_file"))) == 2
    assert "is a file, not a folder" in capsys.readouterr().err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    assert main(_prune(tiny_checkpoint, str(tmp_path / "full"))) == 2
    assert "already holds 1 file(s) (notes.txt): give a new folder, or pass" in capsys.readouterr().err
    assert (tmp_path / "a_file").read_text() == "mine" and os.listdir(tmp_path / "full") == ["notes.txt"]


def test_overwrite_replaces_an_earlier_sharded_checkpoint_without_mixing_files(tiny_checkpoint, tmp_path, capsys):
    output = tmp_path / "out"
    model = tiny_model("llama", num_layers=6)
    model.save_pretrained(output, max_shard_size="20KB")  # an earlier, sharded checkpoint
    assert (output / "model.safetensors.index.json").exists()
    assert main(_prune(tiny_checkpoint, str(output))) == 2  # not without --overwrite
    assert "already holds" in capsys.readouterr().err
    assert main(_prune(tiny_checkpoint, str(output), "--overwrite")) == 0
    names = set(os.listdir(output))
    assert "model.safetensors" in names and not any(name.startswith("model-0") or name.endswith("index.json") for name in names)
    assert validate_checkpoint(output)["num_layers"] == 4
    assert not [name for name in os.listdir(tmp_path) if name.startswith(".out.")]  # no staging or backup left


def test_a_failed_save_leaves_the_old_folder_untouched_or_no_folder(tmp_path, monkeypatch):
    pruner = GradMAPPruner(small_config(), progress_bar=False)
    pruner.prune(tiny_model("llama", num_layers=6), random_ids(8, 16))
    pruner.save_pretrained(tmp_path / "old")
    before = _folder_digest(tmp_path / "old")

    def broken(path):
        raise RuntimeError("disk full")

    monkeypatch.setattr("optimum_gradmap.checkpoint.validate_checkpoint", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        pruner.save_pretrained(tmp_path / "old", overwrite=True)
    assert _folder_digest(tmp_path / "old") == before
    with pytest.raises(RuntimeError, match="disk full"):
        pruner.save_pretrained(tmp_path / "new")
    assert sorted(os.listdir(tmp_path)) == ["old"]  # no new folder, no staging folder
    monkeypatch.undo()
    with pytest.raises(FileExistsError, match="already holds"):
        pruner.save_pretrained(tmp_path / "old")
    pruner.save_pretrained(tmp_path / "old", overwrite=True)
    assert validate_checkpoint(tmp_path / "old")["num_layers"] == 4


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_saved_files_and_folders_have_the_umasks_modes_like_any_other_file(tmp_path, umask):
    from optimum_gradmap.files import write_atomically

    pruner = GradMAPPruner(small_config(num_layers_to_prune=1, compensation=False), progress_bar=False)
    pruner.prune(tiny_model("llama", num_layers=4), random_ids(8, 16))
    previous = os.umask(umask)
    try:
        pruner.save_pretrained(tmp_path / "checkpoint")
        write_atomically(tmp_path / "stage1.json", "{}")
    finally:
        os.umask(previous)
    mode = lambda path: os.stat(path).st_mode & 0o777  # noqa: E731
    assert mode(tmp_path / "checkpoint") == 0o777 & ~umask  # readable by the group (and others, with 022)
    assert {name: mode(tmp_path / "checkpoint" / name) for name in os.listdir(tmp_path / "checkpoint")} == {
        name: 0o666 & ~umask for name in os.listdir(tmp_path / "checkpoint")
    }
    assert mode(tmp_path / "stage1.json") == 0o666 & ~umask


def test_a_model_name_that_is_neither_a_folder_nor_on_the_hub_says_so(tmp_path, capsys, monkeypatch):
    def offline(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files, and couldn't find them in the cache.")

    monkeypatch.setattr("transformers.AutoConfig.from_pretrained", offline)
    assert main(_prune("models/smollm2", str(tmp_path / "out"))) == 2
    error = capsys.readouterr().err
    assert "models/smollm2: there is no local folder of that name (looked in" in error
    assert "as a Hub model id it could not be loaded: We couldn't connect" in error
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", ["unreadable calibration file", "unreachable Hub dataset", "unknown dataset", "no model"])
def test_a_dry_run_fails_with_the_runs_own_error_where_the_run_could_not_start(
    case, tiny_checkpoint, tmp_path, capsys, monkeypatch
):
    model, dataset = tiny_checkpoint, "offline:wikipedia"
    if case == "unreadable calibration file":  # read only by the run's loader: no `text` field in its records
        dataset = str(tmp_path / "records.jsonl")
        (tmp_path / "records.jsonl").write_text(json.dumps({"content": TEXT}))
    elif case == "unreachable Hub dataset":

        def offline(*args, **kwargs):
            raise ConnectionError("Couldn't reach 'Salesforce/wikitext' on the Hub (LocalEntryNotFoundError)")

        monkeypatch.setattr("optimum_gradmap.data._load_dataset", offline)
        dataset = "wikitext2"
    elif case == "unknown dataset":
        dataset = "wikitext3"
    else:
        model = str(tmp_path / "no-such-model")
    argv = _prune(model, str(tmp_path / "out"), "--dataset", dataset)
    run_code, run_error = main(argv), capsys.readouterr().err
    dry_code, dry_error = main([*argv, "--dry-run"]), capsys.readouterr()
    assert run_code != 0 and run_error.strip()
    assert (dry_code, dry_error.err) == (run_code, run_error) and "GradMAP plan" not in dry_error.out
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("form", ["text", "jsonl", "folder"])
def test_calibration_from_a_text_file_json_lines_or_a_folder(tiny_checkpoint, tmp_path, form):
    if form == "text":
        path = tmp_path / "calibration.txt"
        path.write_text(TEXT)
    elif form == "jsonl":
        path = tmp_path / "calibration.jsonl"
        path.write_text("\n".join(json.dumps({"body": TEXT, "id": i}) for i in range(3)))
    else:
        path = tmp_path / "texts"
        path.mkdir()
        (path / "a.txt").write_text(TEXT)
        (path / "b.md").write_text(TEXT.upper())
        (path / "ignored.bin").write_bytes(b"\x00\x01")
    extra = ["--text-column", "body"] if form == "jsonl" else []
    output = str(tmp_path / "out")
    argv = _prune(tiny_checkpoint, output, "--dataset", str(path), *extra)
    assert main(argv) == 0
    report = load_report(output)
    assert report["calibration_source"] == f"the text in {str(path)!r}"
    assert report["gradmap_config"]["dataset"] == str(path)


def test_calibration_file_errors_name_the_file_and_what_to_fix(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    assert main(_prune(tiny_checkpoint, str(tmp_path / "out"), "--dataset", "nothing.txt")) == 2
    assert "No calibration file or folder 'nothing.txt'" in capsys.readouterr().err
    records = tmp_path / "records.jsonl"
    records.write_text(json.dumps({"content": TEXT}))
    assert main(_prune(tiny_checkpoint, str(tmp_path / "out"), "--dataset", str(records))) == 2
    assert "record 1, has no text field 'text' (its keys: content): set `text_column`" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    # the Python API takes the same paths
    from transformers import AutoTokenizer

    pruner = GradMAPPruner(
        small_config(num_samples=4), tokenizer=AutoTokenizer.from_pretrained(tiny_checkpoint), progress_bar=False
    )
    text = tmp_path / "own.txt"
    text.write_text(TEXT)
    result = pruner.prune(tiny_model("llama", num_layers=6), str(text))
    assert result.calibration_source == f"the text in {str(text)!r}" and result.calibration_ids.shape == (4, 16)


def test_ctrl_c_in_stage1_keeps_the_finished_rounds_and_prints_the_command_that_resumes(
    tiny_checkpoint, tmp_path, capsys, monkeypatch
):
    from optimum_gradmap.importance import selection

    output = str(tmp_path / "out")
    argv = _prune(tiny_checkpoint, output, "--importance", "block_influence", "--iterative")
    original = selection.Stage1Checkpoint.save_round

    def interrupt_after_first_round(self, *args, **kwargs):
        original(self, *args, **kwargs)
        raise KeyboardInterrupt  # Ctrl-C, just after the first round was saved

    monkeypatch.setattr(selection.Stage1Checkpoint, "save_round", interrupt_after_first_round)
    assert main(argv) == 130
    error = capsys.readouterr().err
    progress = default_stage1_checkpoint(output)
    assert f"Stage 1's finished rounds are saved in {progress}" in error
    assert "optimum-gradmap prune " + tiny_checkpoint in error and "--output " + output in error
    assert len(json.loads(open(progress).read())["rounds"]) == 1 and not os.path.exists(output)
    monkeypatch.setattr(selection.Stage1Checkpoint, "save_round", original)
    assert main(argv) == 0  # the same command resumes
    report = load_report(output)
    assert report["timings"]["stage1_resumed"] > 0 and len(report["removed_layers"]) == 2
    assert not os.path.exists(progress)  # the default progress file goes once its work is saved


def test_the_default_output_is_results_as_they_come_without_library_info_dumps(tiny_checkpoint, tmp_path, capfd):
    argv = [arg for arg in _prune(tiny_checkpoint, str(tmp_path / "out")) if arg != "-q"]
    assert main([*argv, "--evaluate", "offline:wikipedia", "--max-segments", "2"]) == 0
    out, err = capfd.readouterr()
    assert "Round 1/2: removed layer" in out and "Round 2/2: removed layer" in out
    assert out.index("dense model: offline:wikipedia perplexity") < out.index("Round 1/2")
    assert "loading configuration file" not in err + out and "Model config" not in err + out
    card = (tmp_path / "out" / "README.md").read_text()
    report = load_report(tmp_path / "out")
    dense, pruned = report["dense_evaluation"]["perplexities"][0], report["evaluation"]["perplexities"][0]
    assert f"| {dense['perplexity']:.3f} | {pruned['perplexity']:.3f} |" in card


def test_push_to_hub_uploads_nothing_when_its_staged_checkpoint_fails_validation(monkeypatch):
    uploads = []
    monkeypatch.setattr("optimum_gradmap.hub.upload_checkpoint", lambda folder, *args, **kwargs: uploads.append(folder))
    pruner = GradMAPPruner(small_config(), progress_bar=False)
    result = pruner.prune(tiny_model("llama", num_layers=6), random_ids(8, 16))

    def broken(path):
        raise RuntimeError("invalid")

    monkeypatch.setattr("optimum_gradmap.checkpoint.validate_checkpoint", broken)
    with pytest.raises(RuntimeError, match="invalid"):
        result.push_to_hub("someone/model")
    assert uploads == []
    monkeypatch.setattr("optimum_gradmap.checkpoint.validate_checkpoint", lambda path: {})
    result.push_to_hub("someone/model")
    assert len(uploads) == 1 and not os.path.exists(uploads[0])  # staged in a temporary folder, uploaded, removed


# --- prune leaves the model as it came on any error -------------------------------------------------------------------


def _as_it_came(model) -> tuple:
    """What `prune` must leave as it was on an error: the layer objects, their indices, the config and every weight."""
    layers = list(model.model.layers)
    return (
        layers,
        [layer.self_attn.layer_idx for layer in layers],
        model.config.to_dict(),
        {name: tensor.clone() for name, tensor in model.state_dict().items()},
    )


def _assert_as_it_came(model, before: tuple) -> None:
    layers, indices, config, state = before
    assert list(model.model.layers) == layers and [layer.self_attn.layer_idx for layer in layers] == indices
    assert model.config.to_dict() == config
    assert model.state_dict().keys() == state.keys()
    assert [name for name, tensor in model.state_dict().items() if not torch.equal(tensor, state[name])] == []


@pytest.fixture
def no_stage1(monkeypatch):
    """Fails the test if Stage 1 starts: the checks must come first."""

    def refuse(*args, **kwargs):
        raise AssertionError("Stage 1 started before the input was checked")

    monkeypatch.setattr("optimum_gradmap.pipeline.stage1.remove_by_importance", refuse)
    monkeypatch.setattr("optimum_gradmap.pipeline.stage1.remove_explicit_layers", refuse)


@pytest.mark.parametrize(
    "settings, inputs, message",
    [
        ({}, dict(validation_data=random_ids(8, 16) + 10_000), "Calibration token ids must lie in"),
        ({}, dict(validation_data=[TEXT]), "needs a tokenizer"),  # no tokenizer anywhere, and a model without a name
        (dict(compensation=False), dict(validation_data=random_ids(8, 16)), "`validation_data` was given, but Stage 2 is off"),
        (dict(reg_lambda=1e-3, refinement_steps=5), dict(calibration_data=random_ids(3, 16)), "refinement_steps"),
        (
            dict(num_layers_to_prune=None, max_loss_increase=10.0, compensation_target="max_drift", num_compensated_layers=7),
            {},
            "num_compensated_layers=7 exceeds the 6 layers",
        ),
    ],
    ids=[
        "validation-out-of-vocabulary",
        "validation-text-without-tokenizer",
        "validation-without-stage2",
        "refinement-without-held-out-fold",
        "budget-z-beyond-every-layer",
    ],  # fmt: skip
)
def test_stage2_input_is_checked_before_stage1_and_the_model_left_as_it_came(settings, inputs, message, no_stage1):
    from optimum_gradmap.errors import InvalidInputError

    model = tiny_model("llama", num_layers=6)
    before = _as_it_came(model)
    inputs = {"calibration_data": random_ids(8, 16), **inputs}
    with pytest.raises(InvalidInputError, match=message):
        GradMAPPruner(small_config(**settings), progress_bar=False).prune(model, **inputs)
    _assert_as_it_came(model, before)


def test_validation_text_is_tokenized_with_the_tokenizer_given_to_prune(byte_tokenizer):
    model = tiny_model("llama", num_layers=6)  # no name to load a tokenizer from, and the pruner has none
    pruner = GradMAPPruner(small_config(), progress_bar=False)
    result = pruner.prune(model, random_ids(8, 16), tokenizer=byte_tokenizer, validation_data=[TEXT])
    assert result.compensation.validation is not None and len(model.model.layers) == 4


def test_a_budget_that_leaves_fewer_layers_than_num_compensated_layers_stops_stage1_and_rolls_it_back(monkeypatch):
    """With a budget, K is known only as Stage 1 goes: the removal that leaves fewer layers than Stage 2 fits stops it
    (not Stage 2 after it), and every removal is undone."""
    from optimum_gradmap.errors import InvalidInputError

    def refuse(*args, **kwargs):
        raise AssertionError("Stage 2 started")

    monkeypatch.setattr("optimum_gradmap.pipeline.stage2.compensate", refuse)
    model = tiny_model("llama", num_layers=6)
    before = _as_it_came(model)
    settings = dict(num_layers_to_prune=3, max_loss_increase=100.0, compensation_target="max_drift", num_compensated_layers=5)
    with pytest.raises(InvalidInputError, match="num_compensated_layers=5 exceeds the 4 layers"):
        GradMAPPruner(small_config(**settings), progress_bar=False).prune(model, random_ids(8, 16))
    _assert_as_it_came(model, before)


@pytest.mark.parametrize("compensate_each_round", [False, True])
def test_a_failure_in_stage2_under_prune_rolls_back_stage1(monkeypatch, compensate_each_round):
    """`prune` is one operation: when Stage 2 fails, Stage 1's removals (and, with `compensate_each_round`, its fits)
    are undone too, and the pruner can prune again."""
    from optimum_gradmap.compensation import each_round, stage2
    from optimum_gradmap.configuration import PREVIOUS_DEFAULT_STAGE2

    fits_between_removals = []
    fit_and_fold = each_round.fit_and_fold

    def counted(*args, **kwargs):
        fits_between_removals.append(1)
        return fit_and_fold(*args, **kwargs)

    def fail(*args, **kwargs):
        raise RuntimeError("out of memory (simulated)")

    monkeypatch.setattr(each_round, "fit_and_fold", counted)
    monkeypatch.setattr(stage2, "fit_and_fold", fail)
    model = tiny_model("llama", num_layers=6)
    before = _as_it_came(model)
    pruner = GradMAPPruner(
        small_config(compensate_each_round=compensate_each_round, **PREVIOUS_DEFAULT_STAGE2), progress_bar=False
    )
    with pytest.raises(RuntimeError, match="simulated"):
        pruner.prune(model, random_ids(8, 16))
    assert bool(fits_between_removals) is compensate_each_round
    _assert_as_it_came(model, before)
    assert pruner.result is None
    monkeypatch.setattr(stage2, "fit_and_fold", fit_and_fold)
    assert len(pruner.prune(model, random_ids(8, 16)).kept_layers) == 4
