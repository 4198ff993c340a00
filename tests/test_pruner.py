"""GradMAPPruner end to end on tiny models: both stages, results, errors, checkpoints."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, BloomConfig, BloomForCausalLM

from optimum_gradmap import GradMAPConfig, GradMAPPruner, UnsupportedArchitectureError, load_report, supported_model_types
from optimum_gradmap.configuration import PAPER_STAGE2
from optimum_gradmap.importance import get_importance_metric, gradient_importance

from .conftest import ARCHITECTURES, random_ids, small_config, tiny_model


def state_copy(model):
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def dense_name(result, name):
    """The dense model's state-dict key of a pruned model's key."""
    parts = name.split(".")
    if name.startswith("model.layers."):
        parts[2] = str(result.kept_layers[int(parts[2])])
    return ".".join(parts)


def assert_untouched(model, state, num_layers):
    assert len(model.model.layers) == num_layers and model.config.num_hidden_layers == num_layers
    assert state.keys() == model.state_dict().keys()
    assert all(torch.equal(state[name], tensor) for name, tensor in model.state_dict().items())


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_prune_runs_both_stages_and_reports_original_indices(model_type):
    model = tiny_model(model_type, num_layers=6)
    original_layers = list(model.model.layers)
    ids = random_ids(8, 16)
    result = GradMAPPruner(small_config(**PAPER_STAGE2), progress_bar=False).prune(model, ids)  # GradMAP as published

    assert result.model is model
    assert result.num_layers_to_prune == 2 and len(result.removed_layers) == 2
    assert sorted(result.removed_layers + result.kept_layers) == list(range(6))
    assert [id(layer) for layer in model.model.layers] == [id(original_layers[i]) for i in result.kept_layers]
    assert model.config.num_hidden_layers == 4
    # Algorithm 1: each round removes the lowest-scoring layer present in that round
    assert len(result.scores) == 2
    assert set(result.scores[0]) == set(range(6))
    assert set(result.scores[1]) == set(range(6)) - {result.removed_layers[0]}
    for round_scores, removed in zip(result.scores, result.removed_layers):
        assert removed == min(round_scores, key=round_scores.get)
    # Stage 2: the most drifted kept layer got W', which lowered its objective
    assert set(result.compensation.drift) == set(result.kept_layers)
    assert result.compensated_layers == [max(result.compensation.drift, key=result.compensation.drift.get)]
    objective = result.compensation.objective[result.compensated_layers[0]]
    assert objective["fitted"] < objective["identity"]
    assert set(result.timings) == {"stage1", "stage2"}


def test_iterative_rescoring_matches_scores_of_the_pruned_model():
    model = tiny_model("llama", num_layers=6)
    ids = random_ids(8, 16)
    result = GradMAPPruner(small_config(compensation=False), progress_bar=False).prune(model, ids)
    # the final round's scores are those of the model with the first removed layer gone: recompute them
    check = tiny_model("llama", num_layers=6)
    from optimum_gradmap import remove_layers

    remove_layers(check, [result.removed_layers[0]])
    rescored = gradient_importance(check, list(check.model.layers), ids, batch_size=4, progress_bar=False)
    expected = dict(zip([i for i in range(6) if i != result.removed_layers[0]], rescored.tolist()))
    assert result.scores[1] == pytest.approx(expected, rel=1e-6)


def test_one_shot_removes_the_k_lowest_first_round_scores():
    model = tiny_model("qwen2", num_layers=6)
    result = GradMAPPruner(small_config(iterative=False, num_layers_to_prune=3, compensation=False), progress_bar=False).prune(
        model, random_ids(8, 16)
    )
    assert len(result.scores) == 1
    assert result.removed_layers == sorted(result.scores[0], key=result.scores[0].get)[:3]
    assert result.compensated_layers == [] and "stage2" not in result.timings


def test_stage1_never_changes_the_weights_of_kept_layers_and_keeps_mode_and_flags():
    model = tiny_model("llama", num_layers=6)
    model.train()
    model.lm_head.weight.requires_grad_(False)
    state = state_copy(model)
    result = GradMAPPruner(small_config(compensation=False), progress_bar=False).prune(model, random_ids(8, 16))
    assert model.training and not model.lm_head.weight.requires_grad
    assert all(p.requires_grad for n, p in model.named_parameters() if n != "lm_head.weight")
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(tensor, state[dense_name(result, name)]) for name, tensor in model.state_dict().items())


def test_stage2_only_changes_the_down_projection_of_the_compensated_layer():
    model = tiny_model("qwen2", num_layers=6)
    state = state_copy(model)
    result = GradMAPPruner(small_config(), progress_bar=False).prune(model, random_ids(8, 16))
    (target,) = result.compensated_layers
    changed = {
        dense_name(result, name)
        for name, tensor in model.state_dict().items()
        if not torch.equal(tensor, state[dense_name(result, name)])
    }
    assert changed == {f"model.layers.{target}.mlp.down_proj.weight"}


def test_stage2_lowers_the_calibration_loss_gap_and_select_then_compensate_equals_prune():
    ids = random_ids(8, 16)
    first = tiny_model("llama", num_layers=6)
    pruner = GradMAPPruner(small_config(), progress_bar=False)
    result = pruner.select_layers(first, ids)
    assert result.compensated_layers == [] and "stage2" not in result.timings
    pruner.compensate(result)
    second = tiny_model("llama", num_layers=6)
    other_pruner = GradMAPPruner(small_config(), progress_bar=False)
    other = other_pruner.prune(second, ids)
    assert (result.removed_layers, result.compensated_layers) == (other.removed_layers, other.compensated_layers)
    with torch.no_grad():
        torch.testing.assert_close(first(ids).logits, second(ids).logits)
    with pytest.raises(ValueError, match="no longer holds the dense layers"):
        other_pruner.compensate(other)  # prune released the removed layers
    assert "snapshot" not in vars(result)  # the public result is pure data


def test_stage2_rerun_with_other_settings_replaces_the_first_fit():
    ids = random_ids(8, 16)
    model = tiny_model("qwen2", num_layers=6)
    pruner = GradMAPPruner(small_config(num_compensated_layers=2), progress_bar=False)
    result = pruner.select_layers(model, ids)
    with torch.no_grad():
        stage1_logits = model(ids).logits
    pruner.compensate(result)
    first_fit = dict(result.compensation.objective)
    pruner.compensate(result, reg_lambda=0.5, num_compensated_layers=1)
    assert result.config.reg_lambda == 0.5 and result.config.num_compensated_layers == 1
    assert len(result.compensated_layers) == 1 and result.compensation.objective != first_fit

    fresh = tiny_model("qwen2", num_layers=6)
    reference = GradMAPPruner(small_config(reg_lambda=0.5), progress_bar=False).prune(fresh, ids)
    assert (reference.removed_layers, reference.compensated_layers) == (result.removed_layers, result.compensated_layers)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, fresh(ids).logits)
        pruner.compensate(result, solver="closed_form", reg_lambda=1e9)  # a huge lambda keeps W' = I
        torch.testing.assert_close(model(ids).logits, stage1_logits, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="not Stage 2 settings"):
        pruner.compensate(result, importance="sleb")
    with pytest.raises(ValueError, match="num_compensated_layers=5 exceeds the 4 layers"):
        pruner.compensate(result, num_compensated_layers=5, compensation_target="max_drift")
    assert result.compensated_layers  # a refused re-run changes nothing
    with pytest.raises(ValueError, match="`reg_lambda` must be a finite number"):
        pruner.compensate(result, reg_lambda=-1.0)
    fitted = result.compensation
    with torch.no_grad():
        compensated_logits = model(ids).logits
    with pytest.raises(ValueError, match="compensation_selection='next_token_loss' chooses among closed-form fits"):
        pruner.compensate(result, compensation_selection="next_token_loss", compensation_objective="cosine")
    assert result.compensation is fitted  # refused before the fit was undone: the model is as it was
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, compensated_logits, rtol=0, atol=0)
    pruner.release()
    with pytest.raises(ValueError, match="no longer holds the dense layers"):
        pruner.compensate(result)


def test_explicit_layers_skip_scoring_and_are_still_compensated():
    model = tiny_model("qwen2", num_layers=6)
    result = GradMAPPruner(small_config(num_layers_to_prune=None, layers_to_prune=[4, 1]), progress_bar=False).prune(
        model, random_ids(8, 16)
    )
    assert result.removed_layers == [4, 1] and result.kept_layers == [0, 2, 3, 5]
    # the default Stage 2: the layer before each removed run, fitted or left alone with the reason given
    assert result.scores == [] and sorted(result.compensation.targets) == [0, 3]
    assert sorted([*result.compensated_layers, *result.compensation.skipped_layers]) == [0, 3]
    assert model.config.num_hidden_layers == 4


def test_explicit_layers_say_which_stage1_settings_they_leave_unused_and_refuse_contradictions(caplog):
    ids = random_ids(8, 16)
    model = tiny_model("llama", num_layers=6)
    explicit = dict(num_layers_to_prune=None, layers_to_prune=[4, 1])
    with caplog.at_level("WARNING"):
        result = GradMAPPruner(small_config(**explicit, importance="sleb", verify_top_k=2), progress_bar=False).prune(model, ids)
    assert result.removed_layers == [4, 1] and "importance, verify_top_k are not used" in caplog.text
    assert GradMAPConfig(**explicit).unused_stage1_settings() == []

    model = tiny_model("llama", num_layers=6)
    state = state_copy(model)
    with pytest.raises(ValueError, match=r"names the protected layer\(s\) \[1\]"):
        GradMAPPruner(small_config(**explicit, protected_layers=[0, 1]), progress_bar=False).prune(model, ids)
    assert_untouched(model, state, 6)
    for rounds in ({"loss_curve": True}, {"compensate_each_round": True}):
        with pytest.raises(ValueError, match="have no rounds to act on"):
            GradMAPConfig(**explicit, **rounds)


def test_ratio_is_turned_into_a_layer_count():
    model = tiny_model("llama", num_layers=6)
    result = GradMAPPruner(
        small_config(num_layers_to_prune=None, pruning_ratio=0.25, compensation=False), progress_bar=False
    ).prune(model, random_ids(8, 16))
    assert result.num_layers_to_prune == 2  # 6 x 0.25 = 1.5 rounds half up


@pytest.mark.parametrize(
    "config_kwargs, data, message",
    [
        ({"num_layers_to_prune": 6}, None, "Cannot remove 6 of the model's 6 decoder layers"),
        ({"num_layers_to_prune": 9}, None, "Cannot remove 9 of the model's 6 decoder layers"),
        ({"num_layers_to_prune": None, "pruning_ratio": 0.05}, None, "rounds to 0 layers"),
        (
            {"num_layers_to_prune": 3, "num_compensated_layers": 4, "compensation_target": "max_drift"},
            None,
            "exceeds the 3 layers that remain",
        ),
        ({"num_layers_to_prune": None, "layers_to_prune": [2, 6]}, None, "names layers the model does not have"),
        ({}, [""], "calibration text is empty"),
        ({}, [], "`calibration_data` must be"),
        ({}, [[1, 2, 3], [4, 5]], "same length"),
        ({}, torch.full((2, 8), 999), "vocabulary"),
        ({}, torch.zeros(8, dtype=torch.long), "shape \\(N, T\\)"),
    ],
)
def test_bad_input_raises_before_the_model_is_changed(config_kwargs, data, message, byte_tokenizer):
    model = tiny_model("llama", num_layers=6)
    state = state_copy(model)
    data = random_ids(8, 16) if data is None else data
    with pytest.raises(ValueError, match=message):
        GradMAPPruner(small_config(**config_kwargs), tokenizer=byte_tokenizer, progress_bar=False).prune(model, data)
    assert_untouched(model, state, 6)


def test_unsupported_architecture_is_refused_before_anything_changes():
    model = BloomForCausalLM(BloomConfig(vocab_size=256, hidden_size=16, n_layer=4, n_head=2))
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with pytest.raises(UnsupportedArchitectureError, match="Supported model types: ") as error:
        GradMAPPruner(small_config(), progress_bar=False).prune(model, random_ids(8, 16))
    assert all(model_type in str(error.value) for model_type in supported_model_types())
    assert len(model.transformer.h) == 4 and model.config.n_layer == 4
    assert all(torch.equal(state[name], tensor) for name, tensor in model.state_dict().items())


def test_a_failure_during_stage1_restores_the_dense_model():
    model = tiny_model("llama", num_layers=6)
    state = state_copy(model)
    pruner = GradMAPPruner(small_config(num_layers_to_prune=3), progress_bar=False)
    original_forward = model.model.forward

    def failing_forward(*args, **kwargs):
        if len(model.model.layers) < 6:  # fail in the second round, after one layer was removed
            raise RuntimeError("out of memory (simulated)")
        return original_forward(*args, **kwargs)

    model.model.forward = failing_forward
    with pytest.raises(RuntimeError, match="simulated"):
        pruner.prune(model, random_ids(8, 16))
    assert_untouched(model, state, 6)
    assert [layer.self_attn.layer_idx for layer in model.model.layers] == list(range(6))


@pytest.mark.parametrize("importance", ["gradmap", "sleb"])
def test_stage1_checkpoint_resumes_an_interrupted_run_with_the_same_result(tmp_path, monkeypatch, importance):
    ids = random_ids(8, 16)
    config = small_config(num_layers_to_prune=3, importance=importance, compensation=False)
    uninterrupted = GradMAPPruner(config, progress_bar=False).select_layers(tiny_model("llama", num_layers=6), ids)

    metric_class = type(get_importance_metric(importance))
    real_score = metric_class.score_layers
    calls = []

    def interrupted_score(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # the third round is cut short
        return real_score(self, *args, **kwargs)

    monkeypatch.setattr(metric_class, "score_layers", interrupted_score)
    model = tiny_model("llama", num_layers=6)
    state = state_copy(model)
    path = tmp_path / "stage1.json"
    with pytest.raises(KeyboardInterrupt):
        GradMAPPruner(config, progress_bar=False).select_layers(model, ids, stage1_checkpoint=path)
    assert_untouched(model, state, 6)
    saved = json.loads(path.read_text())
    assert [saved_round["removed"] for saved_round in saved["rounds"]] == [[index] for index in uninterrupted.removed_layers[:2]]

    calls.clear()
    resumed = GradMAPPruner(config, progress_bar=False).select_layers(model, ids, stage1_checkpoint=path)
    assert len(calls) == 1  # only the unfinished round is scored
    assert resumed.removed_layers == uninterrupted.removed_layers
    assert resumed.kept_layers == uninterrupted.kept_layers == [i for i in range(6) if i not in resumed.removed_layers]
    assert len(model.model.layers) == 3
    assert len(resumed.scores) == len(uninterrupted.scores) == 3
    for resumed_round, uninterrupted_round in zip(resumed.scores, uninterrupted.scores):
        assert resumed_round == pytest.approx(uninterrupted_round)
    saved_seconds = sum(saved_round["seconds"] for saved_round in saved["rounds"])
    assert resumed.timings["stage1_resumed"] == pytest.approx(saved_seconds)
    assert resumed.timings["stage1"] > saved_seconds
    assert len(json.loads(path.read_text())["rounds"]) == 3


def test_a_stage1_checkpoint_from_another_run_is_refused_before_the_model_changes(tmp_path):
    path = tmp_path / "stage1.json"
    GradMAPPruner(small_config(compensation=False), progress_bar=False).select_layers(
        tiny_model("llama", num_layers=6), random_ids(8, 16), stage1_checkpoint=path
    )
    model = tiny_model("llama", num_layers=6)
    state = state_copy(model)
    with pytest.raises(ValueError, match="calibration_sha256: saved '[0-9a-f]+', now '[0-9a-f]+'"):
        GradMAPPruner(small_config(), progress_bar=False).prune(model, random_ids(8, 16, seed=1), stage1_checkpoint=path)
    with pytest.raises(ValueError, match="importance: saved 'gradmap', now 'block_influence'"):
        GradMAPPruner(small_config(importance="block_influence"), progress_bar=False).prune(
            model, random_ids(8, 16), stage1_checkpoint=path
        )
    for garbage in ("not json", '{"fingerprint": [1, 2], "rounds": []}'):
        path.write_text(garbage)
        with pytest.raises(ValueError, match="is not a Stage 1 checkpoint"):
            GradMAPPruner(small_config(), progress_bar=False).prune(model, random_ids(8, 16), stage1_checkpoint=path)
    with pytest.raises(ValueError, match="nothing to save"):
        GradMAPPruner(GradMAPConfig(layers_to_prune=[2]), progress_bar=False).prune(
            model, random_ids(8, 16), stage1_checkpoint=tmp_path / "other.json"
        )
    assert_untouched(model, state, 6)


def test_calibration_text_uses_the_given_tokenizer(byte_tokenizer):
    model = tiny_model("mistral", num_layers=4)
    text = ["GradMAP removes whole decoder layers. " * 20, "It repairs what the removal breaks. " * 20]
    config = small_config(num_layers_to_prune=1, num_samples=4, seq_len=32)
    result = GradMAPPruner(config, tokenizer=byte_tokenizer, progress_bar=False).prune(model, text)
    assert tuple(result.calibration_ids.shape) == (4, 32)
    joined = byte_tokenizer("\n\n".join(text), add_special_tokens=False)["input_ids"]
    windows = {tuple(joined[i : i + 32]) for i in range(len(joined) - 31)}
    assert all(tuple(row.tolist()) in windows for row in result.calibration_ids)


def test_token_id_lists_are_used_as_given():
    model = tiny_model("llama", num_layers=4)
    ids = random_ids(4, 10).tolist()
    result = GradMAPPruner(small_config(num_layers_to_prune=1), progress_bar=False).prune(model, ids)
    assert result.calibration_ids.tolist() == ids


def test_save_pretrained_writes_a_plain_checkpoint_with_config_and_report(tmp_path, byte_tokenizer):
    model = tiny_model("qwen2", num_layers=6)
    config = small_config()
    pruner = GradMAPPruner(config, tokenizer=byte_tokenizer, progress_bar=False)
    result = pruner.prune(model, random_ids(8, 16))
    pruner.save_pretrained(tmp_path)

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = random_ids(2, 16, seed=5)
    with torch.no_grad():
        assert (model(ids).logits - reloaded(ids).logits).abs().max().item() < 1e-5
    assert reloaded.config.num_hidden_layers == 4 and reloaded.config.layer_types == model.config.layer_types
    assert GradMAPConfig.from_pretrained(tmp_path) == config
    report = load_report(tmp_path)
    assert (
        report["removed_layers"] == result.removed_layers
        and report["compensation"]["compensated_layers"] == result.compensated_layers
    )
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())


def test_push_to_hub_uploads_the_saved_folder(monkeypatch, byte_tokenizer):
    calls = []

    class FakeApi:
        def __init__(self, token=None):
            calls.append(("init", token))

        def create_repo(self, repo_id, private=None, repo_type=None, exist_ok=False):
            calls.append(("create_repo", repo_id, private, exist_ok))

        def upload_folder(self, repo_id, folder_path, repo_type, commit_message):
            import os

            calls.append(("upload_folder", repo_id, sorted(os.listdir(folder_path)), commit_message))
            return type("Commit", (), {"commit_url": f"https://huggingface.co/{repo_id}/commit/abc"})()

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    model = tiny_model("llama", num_layers=4)
    pruner = GradMAPPruner(small_config(num_layers_to_prune=1), tokenizer=byte_tokenizer, progress_bar=False)
    result = pruner.prune(model, random_ids(8, 16))
    url = pruner.push_to_hub("user/tiny-gradmap", private=True, token="hf_secret")
    assert url == "https://huggingface.co/user/tiny-gradmap/commit/abc"
    assert calls[0] == ("init", "hf_secret")
    assert calls[1] == ("create_repo", "user/tiny-gradmap", True, True)
    _, repo, files, message = calls[2]
    assert {"config.json", "model.safetensors", "gradmap_config.json", "pruning_report.json", "tokenizer.json"} <= set(files)
    assert f"remove 1 of 4 layers {result.removed_layers}" in message


def test_from_pretrained_loads_model_and_tokenizer_from_a_local_folder_with_the_same_location(
    tmp_path, byte_tokenizer, monkeypatch
):
    from transformers import AutoTokenizer

    tiny_model("llama", num_layers=4).save_pretrained(tmp_path)
    byte_tokenizer.save_pretrained(tmp_path)
    pruner = GradMAPPruner.from_pretrained(tmp_path, small_config(num_layers_to_prune=1), dtype=torch.float32)
    assert pruner.model.config.num_hidden_layers == 4 and pruner.tokenizer("ab")["input_ids"] == byte_tokenizer("ab")["input_ids"]
    result = pruner.prune(calibration_data=["GradMAP prunes a model loaded from a folder. " * 4])
    assert result.model is pruner.model and pruner.model.config.num_hidden_layers == 3

    seen = {}
    real_from_pretrained = AutoTokenizer.from_pretrained

    def recording(name, **kwargs):
        seen.update(kwargs)
        return real_from_pretrained(name)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", recording)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda name, **kwargs: tiny_model("llama", num_layers=4))
    GradMAPPruner.from_pretrained(tmp_path, small_config(), revision="v1", token="hf_x", cache_dir="/c", dtype=torch.float32)
    assert seen == {"revision": "v1", "token": "hf_x", "cache_dir": "/c"}  # the tokenizer comes from where the model came from


def test_a_metric_of_your_own_by_instance_or_by_registered_name():
    from optimum_gradmap import ImportanceMetric, register_importance_metric
    from optimum_gradmap.importance import IMPORTANCE_METRICS, importance_metric_names

    class KeepTheEnds(ImportanceMetric):
        """Scores layers by their distance from the middle of the stack: the middle goes first."""

        name = "keep_the_ends"

        def score(self, model, adapter, input_ids, batch_size, progress_bar=True, description="Scoring layers"):
            count = adapter.num_layers(model)
            return [abs(position - (count - 1) / 2) for position in range(count)]

    by_instance = GradMAPPruner(small_config(importance=KeepTheEnds(), compensation=False), progress_bar=False)
    result = by_instance.prune(tiny_model("llama", num_layers=6), random_ids(4, 8))
    assert sorted(result.removed_layers) == [2, 3] and result.config.to_dict()["importance"] == "keep_the_ends"
    with pytest.raises(ValueError, match="registered metric"):
        GradMAPConfig(num_layers_to_prune=2, importance="keep_the_ends")
    try:
        register_importance_metric(KeepTheEnds)
        assert "keep_the_ends" in importance_metric_names()
        config = GradMAPConfig(num_layers_to_prune=2, importance="keep_the_ends", compensation=False)
        assert GradMAPConfig.from_dict(config.to_dict()) == config
        again = GradMAPPruner(config, progress_bar=False).prune(tiny_model("llama", num_layers=6), random_ids(4, 8))
        assert again.removed_layers == result.removed_layers
    finally:
        IMPORTANCE_METRICS.pop("keep_the_ends")


def test_a_failed_stage2_rerun_leaves_a_result_that_describes_the_stage1_model(monkeypatch):
    from optimum_gradmap import compensation

    ids = random_ids(8, 16)
    model = tiny_model("llama", num_layers=6)
    pruner = GradMAPPruner(small_config(), progress_bar=False)
    result = pruner.select_layers(model, ids)
    with torch.no_grad():
        stage1_logits = model(ids).logits
    pruner.compensate(result)
    assert result.compensated_layers and "stage2" in result.timings

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("out of memory (simulated)")

    monkeypatch.setattr(compensation.fit, "learn_compensation", out_of_memory)
    with pytest.raises(RuntimeError, match="simulated"):
        pruner.compensate(result, reg_lambda=0.1)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, stage1_logits)  # the first fit was undone, the second not made
    assert result.compensated_layers == [] and result.compensation is None and "stage2" not in result.timings


def test_stage2_refuses_a_configuration_the_adapter_cannot_compensate_even_when_called_alone():
    model = tiny_model("opt", num_layers=6, do_layer_norm_before=False)
    pruner = GradMAPPruner(small_config(compensation=False), progress_bar=False)
    result = pruner.select_layers(model, random_ids(8, 16))  # pruning alone is fine
    state = state_copy(model)
    with pytest.raises(UnsupportedArchitectureError, match="do_layer_norm_before=False"):
        pruner.compensate(result)
    assert state.keys() == model.state_dict().keys()
    assert all(torch.equal(state[name], tensor) for name, tensor in model.state_dict().items())

    # fits between Stage 1's removals: refused, the model left as it was
    fresh = tiny_model("opt", num_layers=6, do_layer_norm_before=False)
    fresh_state = state_copy(fresh)
    each_round = GradMAPPruner(small_config(compensation=False, compensate_each_round=True), progress_bar=False)
    with pytest.raises(UnsupportedArchitectureError, match="do_layer_norm_before=False"):
        each_round.select_layers(fresh, random_ids(8, 16))
    assert fresh_state.keys() == fresh.state_dict().keys()
    assert all(torch.equal(fresh_state[name], tensor) for name, tensor in fresh.state_dict().items())


def test_push_to_hub_uploads_a_model_the_pruner_did_not_prune_too(monkeypatch, byte_tokenizer):
    import os

    import huggingface_hub

    uploaded = []

    class FakeApi:
        def __init__(self, token=None):
            pass

        def create_repo(self, repo_id, private=None, repo_type=None, exist_ok=False):
            pass

        def upload_folder(self, repo_id, folder_path, repo_type, commit_message):
            uploaded.append((repo_id, sorted(os.listdir(folder_path)), commit_message))
            return type("Commit", (), {"commit_url": f"https://huggingface.co/{repo_id}/commit/1"})()

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    pruner = GradMAPPruner(small_config(), tokenizer=byte_tokenizer, progress_bar=False)
    assert pruner.push_to_hub("me/dense", model=tiny_model("llama", num_layers=4)).endswith("/commit/1")
    ((repo, files, message),) = uploaded
    assert repo == "me/dense" and {"config.json", "model.safetensors", "gradmap_config.json"} <= set(files)
    assert "pruning_report.json" not in files and message == "Upload model pruned with GradMAP"
