"""Every importance metric against a direct, unoptimised computation of its paper's formula, and
Stage 2 composed with every metric."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from optimum_gradmap import GradMAPConfig, GradMAPPruner, remove_layers
from optimum_gradmap.adapters import get_adapter
from optimum_gradmap.errors import InvalidInputError
from optimum_gradmap.importance import IMPORTANCE_METRICS, TaylorImportance, get_importance_metric
from optimum_gradmap.importance.metrics import removal_losses
from optimum_gradmap.importance.selection import halving_rungs, verify_shortlist
from optimum_gradmap.testing import naive_layer_scores

from .conftest import layers_before_removed_runs, random_ids, small_config, tiny_model

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
    assert len(layers) == 4 and all(type(layer).__name__ != "ReplayedHiddenStates" for layer in layers)  # every layer is back
    assert model.config.to_dict() == before


def test_gradmap_metric_is_eq5():
    model, ids = tiny_model("llama", num_layers=4), random_ids(5, 12)
    expected = naive_layer_scores(model, get_adapter(model).get_layers(model), ids)
    assert _score("gradmap", model, ids) == pytest.approx(expected.tolist(), rel=1e-5)


def test_random_is_seeded():
    import optimum_gradmap.experimental  # noqa: F401  the benchmarks' baseline, off the public surface

    model, ids = tiny_model("llama", num_layers=6), random_ids(2, 8)
    expected = torch.rand(6, generator=torch.Generator().manual_seed(3), dtype=torch.float64).tolist()
    assert _score("random", model, ids, seed=3) == expected
    assert _score("random", model, ids, seed=4) != expected


@pytest.mark.parametrize("name", ["gradmap_bound", "gradmap_bound_squared", "taylor_gate", "taylor_gate_abs"])
def test_a_retired_metric_says_what_retired_it_and_what_to_use_instead(name, capsys, tmp_path):
    from optimum_gradmap.cli import main
    from optimum_gradmap.metric_registry import BUILTIN_METRIC_NAMES, importance_metric_names

    assert name not in importance_metric_names() and len(BUILTIN_METRIC_NAMES) == 6
    for make in (lambda: GradMAPConfig(num_layers_to_prune=2, importance=name), lambda: get_importance_metric(name)):
        with pytest.raises(InvalidInputError, match=rf"{name!r} was retired .*Spearman .*Use gradmap_bound_token"):
            make()
    output = str(tmp_path / "out")
    assert main(["prune", "offline:smollm2-135m", "--num-layers-to-prune", "1", "--importance", name, "-o", output]) == 2
    assert "was retired from the public metrics" in capsys.readouterr().err and not os.path.exists(output)


def test_sleb_rescores_the_pruned_model_every_round():
    model, ids = tiny_model("llama", num_layers=5), random_ids(6, 12)
    result = GradMAPPruner(small_config(importance="sleb", num_layers_to_prune=2, compensation=False), progress_bar=False).prune(
        copy.deepcopy(model), ids
    )
    first = result.removed_layers[0]
    assert first == min(result.scores[0], key=result.scores[0].get)
    assert set(result.scores[0]) == {1, 2, 3}  # as SLEB's code: the first and last layer are never candidates
    after_first = copy.deepcopy(model)
    remove_layers(after_first, [first])
    expected = _score("sleb", after_first, ids)
    kept = [index for index in range(5) if index != first]
    candidates = [index for index in kept if index not in (0, 4)]
    assert set(result.scores[1]) == set(candidates)
    assert [result.scores[1][index] for index in candidates] == pytest.approx(
        [expected[kept.index(index)] for index in candidates], rel=1e-6
    )


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
    config = small_config(importance=importance, num_layers_to_prune=3, reg_lambda=1e-3)  # fixed: every run is fitted
    result = GradMAPPruner(config, progress_bar=False).prune(model, ids)
    assert result.compensated_layers == layers_before_removed_runs(result.removed_layers)
    for layer in result.compensated_layers:
        objective = result.compensation.objective[layer]
        assert objective["fitted"] < objective["identity"]


def test_unknown_metric_is_refused_with_the_list():
    with pytest.raises(ValueError, match="`importance` must be the name of a registered metric .*gradmap.*sleb"):
        GradMAPConfig(pruning_ratio=0.25, importance="magnitude")


# ------------------------------------------------------------------ scores from the residual branch
def _direct_branch_quantities(model, sample: torch.LongTensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """For one sample alone, by plain autograd: each layer's contribution f = output - input and the
    gradient of the sample's mean next-token loss at the layer's output."""
    layers = get_adapter(model).get_layers(model)
    captured: list[dict] = [dict() for _ in layers]

    def keep_input(position, module, args, kwargs):
        captured[position]["in"] = (args[0] if args else kwargs["hidden_states"]).detach()

    def keep_output(position, module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        hidden.retain_grad()
        captured[position]["out"] = hidden

    handles = [
        layer.register_forward_pre_hook(lambda m, a, k, p=p: keep_input(p, m, a, k), with_kwargs=True)
        for p, layer in enumerate(layers)
    ]
    handles += [layer.register_forward_hook(lambda m, a, o, p=p: keep_output(p, m, a, o)) for p, layer in enumerate(layers)]
    model.zero_grad(set_to_none=True)
    batch = sample.unsqueeze(0)
    model(batch, labels=batch, use_cache=False).loss.backward()
    for handle in handles:
        handle.remove()
    model.zero_grad(set_to_none=True)
    return [(entry["out"].grad[0].double(), (entry["out"].detach() - entry["in"])[0].double()) for entry in captured]


DIRECT_BRANCH_STATISTICS = {
    "gradmap_bound_token": lambda g, f: (g.norm(dim=-1) * f.norm(dim=-1)).sum(),
}


@pytest.mark.parametrize("model_type", [*FAMILIES, "mixtral"])
@pytest.mark.parametrize("name", sorted(DIRECT_BRANCH_STATISTICS))
def test_residual_branch_scores_equal_a_per_sample_autograd_computation(model_type, name):
    model, ids = tiny_model(model_type, num_layers=4), random_ids(5, 12)
    per_sample = [_direct_branch_quantities(model, sample) for sample in ids]
    statistic = DIRECT_BRANCH_STATISTICS[name]
    expected = [sum(statistic(*sample[position]).item() for sample in per_sample) / len(ids) for position in range(4)]
    assert _score(name, model, ids) == pytest.approx(expected, rel=1e-4, abs=1e-9)
    assert get_importance_metric(name).iterative


# ------------------------------------------------------------------ verified shortlists, protected layers
@pytest.mark.parametrize("metric", ["gradmap", "gradmap_bound_token", "block_influence"])
def test_a_shortlist_of_every_remaining_layer_selects_exactly_slebs_layers(metric):
    model, ids = tiny_model("llama", num_layers=7), random_ids(6, 12)
    sleb = GradMAPPruner(small_config(importance="sleb", num_layers_to_prune=3, compensation=False), progress_bar=False)
    reference = sleb.prune(copy.deepcopy(model), ids)
    config = small_config(importance=metric, num_layers_to_prune=3, compensation=False, verify_top_k=7, protected_layers=[0, -1])
    result = GradMAPPruner(config, progress_bar=False).prune(copy.deepcopy(model), ids)
    assert result.removed_layers == reference.removed_layers
    assert len(result.verified) == 3
    for verified, sleb_scores in zip(result.verified, reference.scores):
        assert verified == pytest.approx(sleb_scores, rel=1e-6)  # the losses SLEB measured, layer by layer


def test_a_short_shortlist_verifies_only_the_lowest_scored_layers_each_round():
    model, ids = tiny_model("llama", num_layers=8), random_ids(6, 12)
    config = small_config(importance="gradmap_bound_token", num_layers_to_prune=3, compensation=False, verify_top_k=2)
    result = GradMAPPruner(config, progress_bar=False).prune(model, ids)
    for round_scores, verified, removed in zip(result.scores, result.verified, result.removed_layers):
        assert set(verified) == set(sorted(round_scores, key=lambda index: (round_scores[index], index))[:2])
        assert removed == min(verified, key=verified.get)
    assert result.to_dict()["verified"][0] == {str(index): loss for index, loss in result.verified[0].items()}


def test_successive_halving_races_the_shortlist_over_rungs_and_compares_the_finalists_on_every_sequence():
    model, ids = tiny_model("llama", num_layers=9), random_ids(13, 12)
    adapter = get_adapter(model)
    positions = [1, 2, 3, 4, 5, 6, 7]  # 7 candidates: ceil(log2 7) = 3 rungs, of 5, 4 and 4 sequences
    raced, best, _ = verify_shortlist(model, adapter, ids, 5, positions, halving=True, progress_bar=False)
    on_first_rung = removal_losses(model, adapter, ids[:5], 5, positions, progress_bar=False)
    on_two_rungs = removal_losses(model, adapter, ids[:9], 5, positions, progress_bar=False)  # weighted 5 : 4
    on_all = removal_losses(model, adapter, ids, 5, positions, progress_bar=False)
    after_first = sorted(positions, key=lambda p: (on_first_rung[p], p))[:4]
    finalists = sorted(after_first, key=lambda p: (on_two_rungs[p], p))[:2]
    for position in positions:
        expected = on_all if position in finalists else on_two_rungs if position in after_first else on_first_rung
        assert raced[position] == pytest.approx(expected[position], rel=1e-6)
    assert best == min(finalists, key=lambda p: (on_all[p], p))
    plain, plain_best, _ = verify_shortlist(model, adapter, ids, 5, positions, halving=False, progress_bar=False)
    assert plain == on_all and plain_best == min(positions, key=lambda p: (on_all[p], p))  # exactly as measured


def test_successive_halving_never_removes_a_candidate_dropped_on_an_easier_rung(monkeypatch):
    """The first rung's text is easy: every loss on it is lower than any on the others, so a candidate dropped
    after it has a lower mean than the finalists have over every sequence; it must not be the one removed."""
    ids = torch.arange(12).view(12, 1).repeat(1, 4)  # sequence j is all j: its rung is j // 4

    def fake_removal_losses(model, adapter, input_ids, batch_size, positions, progress_bar=True, description=""):
        rung = int(input_ids[0, 0]) // 4
        return {position: 1.0 + 0.01 * position if rung == 0 else 3.0 - 0.03 * position for position in positions}

    monkeypatch.setattr("optimum_gradmap.importance.shortlist.removal_losses", fake_removal_losses)
    losses, best, _ = verify_shortlist(None, None, ids, 4, list(range(8)), halving=True, progress_bar=False)
    # rung 1 keeps 0-3 (lowest there), rung 2 keeps 2 and 3, the finalists; 7 was dropped at 1.07
    assert best == 3 and losses[3] == pytest.approx((1.03 + 2 * 2.91) / 3)
    assert losses[7] == pytest.approx(1.07) and losses[7] < losses[best]


@pytest.mark.parametrize(
    "num_candidates, num_samples, expected",
    [(1, 128, 1), (2, 128, 1), (3, 128, 2), (4, 128, 2), (8, 128, 3), (17, 128, 5), (8, 2, 2)],
)
def test_halving_uses_ceil_log2_k_rungs_and_never_more_than_the_sequences(num_candidates, num_samples, expected):
    assert halving_rungs(num_candidates, num_samples) == expected


def test_a_halving_shortlist_removes_the_finalist_with_the_lower_loss_and_resumes_only_with_the_same_setting(tmp_path):
    model, ids = tiny_model("llama", num_layers=8), random_ids(9, 12)
    settings = dict(importance="gradmap_bound_token", num_layers_to_prune=2, compensation=False, verify_top_k=4)
    config = small_config(**settings, verify_halving=True)
    checkpoint = str(tmp_path / "stage1.json")
    result = GradMAPPruner(config, progress_bar=False).prune(copy.deepcopy(model), ids, stage1_checkpoint=checkpoint)
    first_removed = result.removed_layers[0]
    on_all = removal_losses(model, get_adapter(model), ids, 5, list(result.verified[0]), progress_bar=False)
    assert [len(verified) for verified in result.verified] == [4, 4]
    assert result.verified[0][first_removed] == pytest.approx(on_all[first_removed], rel=1e-6)  # a finalist
    resumed = GradMAPPruner(config, progress_bar=False).prune(copy.deepcopy(model), ids, stage1_checkpoint=checkpoint)
    assert resumed.removed_layers == result.removed_layers and resumed.verified == result.verified
    plain = small_config(**settings)
    with pytest.raises(ValueError, match="verify_halving"):
        GradMAPPruner(plain, progress_bar=False).prune(copy.deepcopy(model), ids, stage1_checkpoint=checkpoint)


def test_a_one_shot_metric_with_a_shortlist_is_scored_once_and_verified_every_round():
    model, ids = tiny_model("llama", num_layers=8), random_ids(6, 12)
    config = small_config(importance="block_influence", num_layers_to_prune=3, compensation=False, verify_top_k=3)
    result = GradMAPPruner(config, progress_bar=False).prune(model, ids)
    assert len(result.verified) == 3 and len(result.removed_layers) == 3
    first = result.scores[0]
    for round_scores in result.scores[1:]:  # the first round's scores of the layers that remain
        assert round_scores == {index: first[index] for index in round_scores}


def test_protected_layers_override_the_metrics_own_choice():
    model, ids = tiny_model("llama", num_layers=8), random_ids(6, 12)
    config = small_config(importance="gradmap", num_layers_to_prune=5, compensation=False, protected_layers=[0, 1, -1])
    result = GradMAPPruner(config, progress_bar=False).prune(model, ids)
    assert not {0, 1, 7} & set(result.removed_layers)
    taylor_without_protection = small_config(importance="taylor", num_layers_to_prune=5, compensation=False, protected_layers=[])
    assert (
        len(
            GradMAPPruner(taylor_without_protection, progress_bar=False)
            .prune(tiny_model("llama", num_layers=8), ids)
            .removed_layers
        )
        == 5
    )
    untouched = tiny_model("llama", num_layers=8)
    with pytest.raises(ValueError, match=r"protected_layers=\[0, 8\] names layers the model does not have"):
        GradMAPPruner(small_config(protected_layers=[0, 8]), progress_bar=False).prune(untouched, ids)
    assert len(untouched.model.layers) == 8
    with pytest.raises(ValueError, match="leaves 2 candidates for 5 removals.*protected_layers"):
        GradMAPPruner(small_config(num_layers_to_prune=5, protected_layers=list(range(6))), progress_bar=False).prune(
            untouched, ids
        )


@pytest.mark.parametrize("model_type", FAMILIES)
def test_our_sleb_losses_equal_the_reference_cost_ones_on_every_family(model_type):
    """`removal_losses` starts each candidate from its recorded input; SLEB's own code runs the whole model once
    per candidate. The same losses, for less work."""
    from optimum_gradmap.importance.metrics import removal_losses
    from optimum_gradmap.testing import reference_removal_losses

    model = tiny_model(model_type)
    adapter = get_adapter(model)
    ids = random_ids(6, 12)
    positions = [1, 2, 4]
    ours = removal_losses(model, adapter, ids, 3, positions, progress_bar=False)
    reference = reference_removal_losses(model, ids, 3, positions)
    assert ours == pytest.approx(reference, rel=1e-5)


def test_recorded_inputs_are_refused_when_the_passes_did_not_cover_the_calibration_set():
    from optimum_gradmap.passes import RecordedLayerInputs

    model, ids = tiny_model("llama", num_layers=4), random_ids(6, 12)
    layers = get_adapter(model).get_layers(model)
    with RecordedLayerInputs(model, {1: layers[1]}, ids) as recorder, torch.no_grad():
        model(input_ids=ids[:3])  # half the sequences
    assert recorder.inputs() is None
    with RecordedLayerInputs(model, {1: layers[1]}, ids) as recorder, torch.no_grad():
        model(input_ids=ids[3:])  # the other half first: out of order
        model(input_ids=ids[:3])
    assert recorder.inputs() is None
    seen = []
    handle = layers[1].register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(args[0] if args else kwargs["hidden_states"]), with_kwargs=True
    )
    with RecordedLayerInputs(model, {1: layers[1]}, ids) as recorder, torch.no_grad():
        model(input_ids=ids[:1, :5])  # a check on a few tokens, ignored
        model(input_ids=ids[:3])
        model(input_ids=ids[3:])
    handle.remove()
    recorded = recorder.inputs()
    assert recorded is not None and torch.equal(recorded[1], torch.cat(seen[1:]))


def test_a_retired_setting_says_what_retired_it_and_a_checkpoint_that_holds_it_still_loads(capsys, tmp_path):
    from optimum_gradmap.cli import main

    for value in (True, False):
        with pytest.raises(InvalidInputError, match=r"`verify_from_scoring_pass` was retired: .*221.9 s"):
            GradMAPConfig(num_layers_to_prune=2, verify_top_k=4, verify_from_scoring_pass=value)
    saved = {**GradMAPConfig(num_layers_to_prune=2).to_dict(), "verify_from_scoring_pass": False}
    assert GradMAPConfig.from_dict(saved) == GradMAPConfig(num_layers_to_prune=2)
    with pytest.raises(InvalidInputError, match="verify_from_scoring_pass"):
        GradMAPConfig.from_dict({**saved, "verify_from_scoring_pass": True})
    output = str(tmp_path / "out")
    with pytest.raises(SystemExit) as exit_info:
        main(["prune", "MODEL", "--num-layers-to-prune", "2", "--verify-from-scoring-pass", "-o", output])
    assert exit_info.value.code == 2 and "was retired" in capsys.readouterr().err and not os.path.exists(output)
