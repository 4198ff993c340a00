import json

import pytest

from optimum_gradmap import GradMAPConfig
from optimum_gradmap.configuration import CONFIG_NAME, PAPER_STAGE2, PREVIOUS_DEFAULT_STAGE2

from .conftest import tiny_model


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "exactly one of `pruning_ratio`"),
        ({"pruning_ratio": 0.25, "num_layers_to_prune": 8}, "exactly one of `pruning_ratio`"),
        ({"pruning_ratio": 0.25, "layers_to_prune": [3]}, "exactly one of `pruning_ratio`"),
        ({"layers_to_prune": []}, "non-empty list of distinct layer indices"),
        ({"layers_to_prune": [2, 2]}, "non-empty list of distinct layer indices"),
        ({"layers_to_prune": [-1]}, "non-empty list of distinct layer indices"),
        ({"pruning_ratio": 0.0}, "strictly between 0 and 1"),
        ({"pruning_ratio": 1.0}, "strictly between 0 and 1"),
        ({"pruning_ratio": 1.5}, "strictly between 0 and 1"),
        ({"pruning_ratio": -0.1}, "strictly between 0 and 1"),
        ({"pruning_ratio": "0.25"}, "must be a number"),
        ({"num_layers_to_prune": 0}, "`num_layers_to_prune` must be an integer >= 1"),
        ({"num_layers_to_prune": 2.5}, "`num_layers_to_prune` must be an integer >= 1"),
        ({"pruning_ratio": 0.25, "reg_lambda": -1e-3}, "`reg_lambda` must be a finite number >= 0"),
        ({"pruning_ratio": 0.25, "reg_lambda": float("nan")}, "`reg_lambda` must be a finite number >= 0"),
        ({"pruning_ratio": 0.25, "solver": "sgd"}, "`solver` must be one of"),
        ({"pruning_ratio": 0.25, "num_compensated_layers": 0}, "`num_compensated_layers` must be an integer >= 1"),
        ({"pruning_ratio": 0.25, "seq_len": 1}, "`seq_len` must be an integer >= 2"),
        ({"pruning_ratio": 0.25, "batch_size": 0}, "`batch_size` must be an integer >= 1"),
        ({"pruning_ratio": 0.25, "adam_lr": 0}, "`adam_lr` must be a finite number > 0"),
        ({"pruning_ratio": 0.25, "dataset": ""}, "`dataset` must be a non-empty string such as 'wikipedia'"),
        ({"pruning_ratio": 0.25, "text_column": ""}, "`text_column` must be a non-empty string such as 'text'"),
        ({"pruning_ratio": 0.25, "compensation_dataset": ""}, "`compensation_dataset` must be a dataset name or path"),
        ({"pruning_ratio": 0.25, "compensation_dataset": 3}, "`compensation_dataset` must be a dataset name or path"),
        ({"pruning_ratio": 0.25, "importance": "nope"}, "`importance` must be the name of a registered metric"),
        ({"pruning_ratio": 0.25, "execution": "fast"}, "`execution` must be one of ('auto', 'in_memory', 'layer_streamed')"),
        ({"pruning_ratio": 0.25, "compensation": "yes"}, "`compensation` must be True or False"),
        ({"pruning_ratio": 0.25, "verify_halving": True}, "set `verify_top_k` too"),
        ({"pruning_ratio": 0.25, "verify_top_k": 4, "verify_halving": "yes"}, "`verify_halving` must be True or False"),
    ],
)
def test_invalid_values_are_refused_with_a_clear_message(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        GradMAPConfig(**kwargs)


def test_stage1_defaults_follow_the_paper_and_stage2_defaults_are_span_end_with_lambda_by_cross_validation():
    config = GradMAPConfig(pruning_ratio=0.25)
    assert (config.num_samples, config.seq_len, config.adam_lr) == (128, 128, 1e-3)
    assert config.importance == "gradmap" and config.iterative is None  # None: the metric's own choice (GradMAP: iterative)
    assert config.compensation and (config.compensation_target, config.reg_lambda) == ("span_end", "auto")
    assert (config.compensation_selection, config.outlier_tokens) == ("auto", "auto")
    assert config.dataset == "wikipedia"
    # the paper's Stage 2 (Eq. 10-15), pinned by the "paper" preset and the benchmarks, whatever the defaults
    assert PAPER_STAGE2 == {
        "compensation_target": "max_drift",
        "compensation_form": "full",
        "num_compensated_layers": 1,
        "reg_lambda": 1e-3,
        "compensation_selection": "hidden_state",
        "outlier_tokens": "keep",
    }
    assert PREVIOUS_DEFAULT_STAGE2 == {"compensation_selection": "hidden_state", "outlier_tokens": "keep"}


@pytest.mark.parametrize(
    "ratio, num_layers, expected",
    [(0.25, 30, 8), (0.25, 32, 8), (0.25, 24, 6), (0.25, 10, 3), (0.125, 4, 1), (0.1, 4, 0), (0.4063, 32, 13)],
)
def test_ratio_rounds_to_nearest_with_halves_up(ratio, num_layers, expected):
    assert GradMAPConfig(pruning_ratio=ratio).num_layers_to_remove(num_layers) == expected


def test_explicit_count_is_used_as_is():
    assert GradMAPConfig(num_layers_to_prune=5).num_layers_to_remove(30) == 5
    assert GradMAPConfig(layers_to_prune=[4, 9]).num_layers_to_remove(30) == 2


def test_json_round_trip(tmp_path):
    config = GradMAPConfig(num_layers_to_prune=3, iterative=False, solver="adam", reg_lambda=0.5, seed=7, dataset="c4")
    assert GradMAPConfig.from_dict(json.loads(config.to_json_string())) == config
    path = config.save_pretrained(tmp_path)
    assert path.endswith(CONFIG_NAME)
    assert GradMAPConfig.from_pretrained(tmp_path) == config


def test_unknown_keys_and_missing_file_are_reported(tmp_path):
    with pytest.raises(ValueError, match="Unknown GradMAPConfig fields: \\['ratio'\\]"):
        GradMAPConfig.from_dict({"ratio": 0.25})
    with pytest.raises(FileNotFoundError, match=CONFIG_NAME):
        GradMAPConfig.from_pretrained(tmp_path)


def test_from_pretrained_reads_a_hub_repository(tmp_path, monkeypatch):
    import huggingface_hub

    config = GradMAPConfig(num_layers_to_prune=3, importance="sleb")
    config.save_pretrained(tmp_path)
    calls = []

    def hf_hub_download(repo_id, filename, **kwargs):
        calls.append((repo_id, filename, kwargs))
        if repo_id == "me/not-pruned":
            raise huggingface_hub.errors.EntryNotFoundError("404")
        return str(tmp_path / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    assert GradMAPConfig.from_pretrained("me/tiny-gradmap", revision="v2", token="hf_x") == config
    assert calls == [
        ("me/tiny-gradmap", CONFIG_NAME, {"revision": "v2", "token": "hf_x", "cache_dir": None, "local_files_only": False})
    ]
    with pytest.raises(FileNotFoundError, match="me/not-pruned has no gradmap_config.json"):
        GradMAPConfig.from_pretrained("me/not-pruned")


def test_the_configuration_module_reads_no_file_a_dataset_name_is_checked_when_pruning(byte_tokenizer):
    """`GradMAPConfig` checks what it can know alone; a dataset name (which may be a folder) is checked by
    the pruner before the model changes."""
    from optimum_gradmap import GradMAPPruner

    model = tiny_model("llama")
    config = GradMAPConfig(num_layers_to_prune=1, dataset="offline:wikipedia+nope", num_samples=4, seq_len=8)
    before = list(model.model.layers)
    with pytest.raises(ValueError, match="Unknown calibration dataset 'nope'"):
        GradMAPPruner(config, model=model, tokenizer=byte_tokenizer, progress_bar=False).prune()
    assert list(model.model.layers) == before


def test_the_docstring_is_generated_from_every_fields_help():
    from dataclasses import fields

    for setting in fields(GradMAPConfig):
        assert f"    {setting.name} (`" in GradMAPConfig.__doc__
        assert setting.metadata["help"].split()[0] in GradMAPConfig.__doc__
