"""Every importance metric against a direct, unoptimised computation of its paper's formula, and
Stage 2 composed with every metric."""

from __future__ import annotations

import copy

import pytest
import torch

from optimum_gradmap import GradMAPConfig, GradMAPPruner, remove_layers
from optimum_gradmap.adapters import get_adapter
from optimum_gradmap.importance import IMPORTANCE_METRICS, TaylorImportance, get_importance_metric
from optimum_gradmap.testing import naive_layer_scores

from .conftest import random_ids, small_config, tiny_model

FAMILIES = ["llama", "qwen2", "gpt2"]  # pre-norm with RMSNorm, sliding-window layers, Conv1D weights


def _score(name: str, model, ids, seed: int = 0) -> list[float]:
    return get_importance_metric(name, seed=seed).score(model, get_adapter(model), ids, batch_size=3, progress_bar=False)


def _layer_inputs_and_outputs(model, sample: torch.LongTensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Runs one sample alone and captures each layer's input and output hidden states."""
    layers = get_adapter(model).get_layers(model)
    captured = [dict() for _ in layers]
    handles = []
    for position, layer in enumerate(layers):
        handles.append(
            layer.register_forward_pre_hook(
                lambda m, a, k, p=position: captured[p].__setitem__("in", (a[0] if a else k["hidden_states"])[0]),
                with_kwargs=True,
            )
        )
        handles.append(
            layer.register_forward_hook(
                lambda m, a, o, p=position: captured[p].__setitem__("out", (o[0] if isinstance(o, tuple) else o)[0])
            )
        )
    with torch.no_grad():
        model(sample.unsqueeze(0), use_cache=False)
    for handle in handles:
        handle.remove()
    return [(entry["in"].double(), entry["out"].double()) for entry in captured]


def _per_token_mean(model, ids, formula) -> list[float]:
    """Mean of `formula(x_in_t, x_out_t)` over every token of every sample, one token at a time."""
    num_layers = get_adapter(model).num_layers(model)
    totals = [0.0] * num_layers
    for sample in ids:
        for position, (hidden_in, hidden_out) in enumerate(_layer_inputs_and_outputs(model, sample)):
            for token in range(hidden_in.shape[0]):
                totals[position] += formula(hidden_in[token], hidden_out[token])
    return [total / ids.numel() for total in totals]


@pytest.mark.parametrize("model_type", FAMILIES)
def test_block_influence_is_one_minus_the_mean_cosine_of_layer_input_and_output(model_type):
    model, ids = tiny_model(model_type, num_layers=4), random_ids(5, 12)

    def influence(x, y):
        return 1.0 - (x @ y / (x.norm() * y.norm())).item()

    assert _score("block_influence", model, ids) == pytest.approx(_per_token_mean(model, ids, influence), rel=1e-6)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_relative_magnitude_is_the_mean_norm_ratio_of_the_update_to_the_output(model_type):
    model, ids = tiny_model(model_type, num_layers=4), random_ids(5, 12)

    def magnitude(x, y):
        return ((y - x).norm() / y.norm()).item()

    assert _score("relative_magnitude", model, ids) == pytest.approx(_per_token_mean(model, ids, magnitude), rel=1e-6)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_taylor_is_the_sum_of_abs_weight_times_gradient_of_the_calibration_loss(model_type):
    model, ids = tiny_model(model_type, num_layers=4), random_ids(5, 12)
    reference = copy.deepcopy(model).eval()
    reference(ids, labels=ids, use_cache=False).loss.backward()  # one batch: the mean loss over all tokens
    layers = get_adapter(reference).get_layers(reference)
    expected = [sum((p * p.grad).abs().sum().item() for p in layer.parameters()) for layer in layers]
    assert _score("taylor", model, ids) == pytest.approx(expected, rel=1e-5)
    assert all(p.grad is None and p.requires_grad for p in model.parameters())  # nothing left behind


@pytest.mark.parametrize("model_type", FAMILIES + ["gemma2", "opt", "qwen2_moe"])
def test_sleb_is_the_calibration_loss_without_each_layer(model_type):
    model, ids = tiny_model(model_type, num_layers=4), random_ids(5, 12)
    expected = []
    for layer in range(4):
        without = copy.deepcopy(model).eval()
        remove_layers(without, [layer])
        with torch.no_grad():
            expected.append(without(ids, labels=ids, use_cache=False).loss.item())
    before = copy.deepcopy(model.config.to_dict())
    assert _score("sleb", model, ids) == pytest.approx(expected, rel=1e-5)
    layers = get_adapter(model).get_layers(model)
    assert len(layers) == 4 and all(type(layer).__name__ != "_ReplayedPrefix" for layer in layers)  # every layer is back
    assert model.config.to_dict() == before


def test_gradmap_metric_is_eq5():
    model, ids = tiny_model("llama", num_layers=4), random_ids(5, 12)
    expected = naive_layer_scores(model, get_adapter(model).get_layers(model), ids)
    assert _score("gradmap", model, ids) == pytest.approx(expected.tolist(), rel=1e-5)


def test_random_is_seeded():
    model, ids = tiny_model("llama", num_layers=6), random_ids(2, 8)
    expected = torch.rand(6, generator=torch.Generator().manual_seed(3), dtype=torch.float64).tolist()
    assert _score("random", model, ids, seed=3) == expected
    assert _score("random", model, ids, seed=4) != expected


def test_sleb_rescores_the_pruned_model_every_round():
    model, ids = tiny_model("llama", num_layers=5), random_ids(6, 12)
    result = GradMAPPruner(small_config(importance="sleb", num_layers_to_prune=2, compensation=False), progress_bar=False).prune(
        copy.deepcopy(model), ids
    )
    first = result.removed_layers[0]
    assert first == min(result.scores[0], key=result.scores[0].get)
    after_first = copy.deepcopy(model)
    remove_layers(after_first, [first])
    expected = _score("sleb", after_first, ids)
    kept = [index for index in range(5) if index != first]
    assert [result.scores[1][index] for index in kept] == pytest.approx(expected, rel=1e-6)


def test_taylor_plus_never_removes_the_first_four_and_last_two_layers():
    model, ids = tiny_model("llama", num_layers=10), random_ids(6, 12)
    config = small_config(importance="taylor", num_layers_to_prune=3, compensation=False)
    result = GradMAPPruner(config, progress_bar=False).prune(model, ids)
    assert set(result.removed_layers) <= {4, 5, 6, 7}
    candidates = {index: result.scores[0][index] for index in (4, 5, 6, 7)}
    assert sorted(result.removed_layers) == sorted(sorted(candidates, key=candidates.get)[:3])
    assert TaylorImportance().protected_layers(10) == {0, 1, 2, 3, 8, 9}


def test_too_few_candidates_is_a_clear_error_and_the_model_is_untouched():
    model, ids = tiny_model("llama", num_layers=7), random_ids(4, 8)
    with pytest.raises(ValueError, match=r"never removes layers \[0, 1, 2, 3, 5, 6\].*1 candidates for 2 removals"):
        GradMAPPruner(small_config(importance="taylor", compensation=False), progress_bar=False).prune(model, ids)
    assert get_adapter(model).num_layers(model) == 7


def test_one_shot_metrics_score_once_and_iterative_ones_every_round():
    ids = random_ids(4, 8)
    for name, metric in IMPORTANCE_METRICS.items():
        model = tiny_model("llama", num_layers=8)  # Taylor+ candidates: layers 4 and 5
        result = GradMAPPruner(small_config(importance=name, compensation=False), progress_bar=False).prune(model, ids)
        assert len(result.scores) == (2 if metric.iterative else 1), name
        forced = GradMAPPruner(small_config(importance=name, iterative=True, compensation=False), progress_bar=False)
        assert len(forced.prune(tiny_model("llama", num_layers=8), ids).scores) == 2, name


@pytest.mark.parametrize("importance", sorted(IMPORTANCE_METRICS))
def test_stage2_composes_with_every_metric(importance):
    model, ids = tiny_model("llama", num_layers=10), random_ids(16, 16)  # Taylor+ keeps 6 of 10 out of reach
    config = small_config(importance=importance, num_layers_to_prune=3)
    result = GradMAPPruner(config, progress_bar=False).prune(model, ids)
    assert len(result.compensated_layers) == 1 and result.compensated_layers[0] in result.kept_layers
    objective = result.compensation_objective[result.compensated_layers[0]]
    assert objective["fitted"] < objective["identity"]


def test_unknown_metric_is_refused_with_the_list():
    with pytest.raises(ValueError, match="`importance` must be the name of a registered metric .*gradmap.*sleb"):
        GradMAPConfig(pruning_ratio=0.25, importance="magnitude")
