"""Stage 2: statistics, solvers and folding."""

import pytest
import torch

from optimum_gradmap.adapters import get_adapter
from optimum_gradmap.compensation import (
    CompensationStatistics,
    compensation_statistics,
    fold_into,
    record_layer_outputs,
    solve_adam,
    solve_closed_form,
)
from optimum_gradmap.surgery import remove_layers

from .conftest import ARCHITECTURES, random_ids, tiny_model


def random_statistics(size=6, tokens=50, seed=0):
    generator = torch.Generator().manual_seed(seed)
    y = torch.randn(tokens, size, generator=generator, dtype=torch.float64)
    mixing = torch.eye(size, dtype=torch.float64) + 0.3 * torch.randn(size, size, generator=generator, dtype=torch.float64)
    r = y @ mixing.T + 0.1 * torch.randn(tokens, size, generator=generator, dtype=torch.float64)
    return CompensationStatistics(y.T @ y, r.T @ y, float(r.pow(2).sum()), tokens), y, r


def test_objective_from_statistics_equals_the_direct_formula():
    statistics, y, r = random_statistics()
    matrix = torch.eye(6, dtype=torch.float64) + 0.05 * torch.randn(6, 6, dtype=torch.float64)
    direct = torch.nn.functional.mse_loss(y @ matrix.T, r) + 0.3 * (matrix - torch.eye(6, dtype=torch.float64)).pow(2).sum()
    torch.testing.assert_close(statistics.objective(matrix, 0.3), direct)


@pytest.mark.parametrize("reg_lambda", [0.0, 1e-3, 0.1])
def test_closed_form_is_the_minimiser_and_beats_identity(reg_lambda):
    statistics, _, _ = random_statistics()
    solution = solve_closed_form(statistics, reg_lambda)
    best = statistics.objective(solution, reg_lambda)
    assert best < statistics.objective(torch.eye(6, dtype=torch.float64), reg_lambda)
    generator = torch.Generator().manual_seed(1)
    for _ in range(20):  # a convex objective: every perturbation is worse
        perturbed = solution + 1e-3 * torch.randn(6, 6, generator=generator, dtype=torch.float64)
        assert statistics.objective(perturbed, reg_lambda) > best


def test_adam_decreases_the_objective_towards_the_closed_form():
    statistics, _, _ = random_statistics()
    identity = torch.eye(6, dtype=torch.float64)
    adam = solve_adam(statistics, 1e-3, learning_rate=1e-2, num_steps=3000, progress_bar=False)
    exact = solve_closed_form(statistics, 1e-3)
    start, reached, optimum = (statistics.objective(m, 1e-3).item() for m in (identity, adam, exact))
    assert reached < start
    assert reached - optimum < 1e-3 * (start - optimum)


@pytest.mark.parametrize("bias", [False, True])
def test_folding_equals_applying_the_matrix_after_the_linear_map(bias):
    torch.manual_seed(0)
    linear = torch.nn.Linear(12, 8, bias=bias).double()
    matrix = torch.eye(8, dtype=torch.float64) + 0.2 * torch.randn(8, 8, dtype=torch.float64)
    x = torch.randn(5, 12, dtype=torch.float64)
    expected = linear(x) @ matrix.T
    fold_into(linear, matrix)
    torch.testing.assert_close(linear(x), expected)


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_folded_layer_output_equals_residual_plus_compensated_mlp_output(model_type):
    """In a real decoder layer: folding W' into the down projection turns the layer output X_F + Y
    into X_F + W' Y, where X_F is the residual entering the MLP and Y the MLP output."""
    model = tiny_model(model_type, num_layers=4, mlp_bias=True) if model_type == "llama" else tiny_model(model_type, num_layers=4)
    adapter = get_adapter(model)
    layer = model.model.layers[2]
    captured = {}
    handles = [
        adapter.get_mlp(layer).register_forward_hook(lambda m, a, o: captured.__setitem__("y", o)),
        layer.register_forward_hook(lambda m, a, o: captured.__setitem__("h", o[0] if isinstance(o, tuple) else o)),
    ]
    ids = random_ids(num_samples=2, seq_len=10)
    with torch.no_grad():
        model(ids)
        residual, y = captured["h"] - captured["y"], captured["y"]
        matrix = torch.eye(32) + 0.1 * torch.randn(32, 32)
        for linear in adapter.get_down_projections(layer):
            fold_into(linear, matrix)
        model(ids)
    for handle in handles:
        handle.remove()
    torch.testing.assert_close(captured["h"], residual + y @ matrix.T, rtol=1e-4, atol=1e-4)


def test_statistics_on_a_model_match_captured_activations_and_fit_improves_the_layer():
    dense = tiny_model("llama", num_layers=5)
    ids = random_ids(num_samples=6, seq_len=12)
    target = dense.model.layers[3]
    (original,) = record_layer_outputs(dense, [target], ids, batch_size=4, progress_bar=False)
    remove_layers(dense, [1])  # now `target` is at position 2 and sees a drifted input
    adapter = get_adapter(dense)
    statistics = compensation_statistics(dense, adapter, target, original, ids, batch_size=4, progress_bar=False)
    (pruned_output,) = record_layer_outputs(dense, [target], ids, batch_size=6, progress_bar=False)
    # at W' = I the objective is the squared distance between pruned and original layer outputs
    identity = torch.eye(32, dtype=torch.float64)
    direct = torch.nn.functional.mse_loss(pruned_output.double(), original.double())
    torch.testing.assert_close(statistics.objective(identity, 0.0), direct, rtol=1e-6, atol=1e-6)
    matrix = solve_closed_form(statistics, 1e-3)
    for linear in adapter.get_down_projections(target):
        fold_into(linear, matrix)
    (fitted_output,) = record_layer_outputs(dense, [target], ids, batch_size=6, progress_bar=False)
    fitted = torch.nn.functional.mse_loss(fitted_output.double(), original.double())
    # the error measured after folding is the one the statistics predict, and it is lower
    torch.testing.assert_close(statistics.objective(matrix, 0.0), fitted, rtol=1e-5, atol=1e-7)
    assert fitted < direct


def test_fit_through_a_post_mlp_norm_lowers_its_objective_and_matches_a_direct_computation():
    """Gemma2: the layer adds norm(W' Y), so W' is fitted with the norm in the loop (Adam). The objective it
    reports is the one measured on the model: at W' = I, the error of the pruned layer output; at the
    fitted W', the error of the output of the layer with W' folded in, plus lambda ||W' - I||^2."""
    from optimum_gradmap import GradMAPConfig
    from optimum_gradmap.compensation import apply_compensation, learn_compensation

    model = tiny_model("gemma2", num_layers=5)
    ids = random_ids(num_samples=6, seq_len=12)
    adapter = get_adapter(model)
    target = model.model.layers[3]
    assert adapter.get_mlp_output_norm(target) is not None
    (original,) = record_layer_outputs(model, [target], ids, batch_size=4, progress_bar=False)
    remove_layers(model, [1])
    (pruned_output,) = record_layer_outputs(model, [target], ids, batch_size=6, progress_bar=False)
    config = GradMAPConfig(num_layers_to_prune=1, reg_lambda=1e-3, adam_lr=1e-2, adam_steps=300, batch_size=4)
    fit = learn_compensation(model, adapter, target, original, ids, config, progress_bar=False)

    mse = torch.nn.functional.mse_loss
    assert fit.objective_identity == pytest.approx(mse(pruned_output.double(), original.double()).item(), rel=1e-5)
    assert fit.objective_fitted < 0.9 * fit.objective_identity
    apply_compensation(adapter, target, fit.matrix)
    (fitted_output,) = record_layer_outputs(model, [target], ids, batch_size=6, progress_bar=False)
    penalty = 1e-3 * (fit.matrix - torch.eye(32, dtype=torch.float64)).pow(2).sum().item()
    assert mse(fitted_output.double(), original.double()).item() + penalty == pytest.approx(fit.objective_fitted, rel=1e-3)


def _changed_parameters(model, state):
    return {name for name, tensor in model.state_dict().items() if name in state and not torch.equal(tensor, state[name])}


def test_several_compensated_layers_are_the_most_drifted_fitted_in_forward_order():
    from optimum_gradmap import GradMAPPruner

    from .conftest import small_config

    model = tiny_model("llama", num_layers=8)
    ids = random_ids(16, 16)
    pruner = GradMAPPruner(small_config(num_layers_to_prune=2, num_compensated_layers=3), progress_bar=False)
    result = pruner.select_layers(model, ids)
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    pruner.compensate(result)
    most_drifted = sorted(sorted(result.drift, key=result.drift.get, reverse=True)[:3])
    assert result.compensated_layers == most_drifted
    assert all(result.compensation_objective[i]["fitted"] < result.compensation_objective[i]["identity"] for i in most_drifted)
    positions = [result.kept_layers.index(index) for index in most_drifted]
    assert _changed_parameters(model, state) == {f"model.layers.{p}.mlp.down_proj.weight" for p in positions}
    # forward order: the last target was fitted on the model that carries the first corrections, so its
    # drift after compensation is below its drift before
    assert result.drift_after_compensation[most_drifted[-1]] < result.drift[most_drifted[-1]]


def test_the_papers_adam_solver_through_the_pruner_approaches_the_exact_minimiser():
    from optimum_gradmap import GradMAPPruner

    from .conftest import small_config

    ids = random_ids(16, 16)
    exact = GradMAPPruner(small_config(), progress_bar=False).prune(tiny_model("qwen2", num_layers=6), ids)
    adam = GradMAPPruner(small_config(solver="adam", adam_lr=1e-2, adam_steps=1500), progress_bar=False).prune(
        tiny_model("qwen2", num_layers=6), ids
    )
    assert adam.compensated_layers == exact.compensated_layers and adam.config.solver == "adam"
    (layer,) = exact.compensated_layers
    start, optimum = exact.compensation_objective[layer]["identity"], exact.compensation_objective[layer]["fitted"]
    reached = adam.compensation_objective[layer]["fitted"]
    assert adam.compensation_objective[layer]["identity"] == pytest.approx(start)
    assert optimum <= reached + 1e-12 and reached - optimum < 0.02 * (start - optimum)


def test_stage2_on_a_model_in_train_mode_fits_without_dropout_and_restores_the_mode():
    """GPT-2 has dropout: a model passed in train mode must be fitted as in eval mode, then left in train mode."""
    from optimum_gradmap import GradMAPPruner

    from .conftest import small_config

    ids = random_ids(16, 16)
    in_train_mode = tiny_model("gpt2", num_layers=6, resid_pdrop=0.5, embd_pdrop=0.5, attn_pdrop=0.5).train()
    in_eval_mode = tiny_model("gpt2", num_layers=6, resid_pdrop=0.5, embd_pdrop=0.5, attn_pdrop=0.5).eval()
    trained = GradMAPPruner(small_config(), progress_bar=False).prune(in_train_mode, ids)
    reference = GradMAPPruner(small_config(), progress_bar=False).prune(in_eval_mode, ids)
    assert in_train_mode.training and all(module.training for module in in_train_mode.modules())
    assert trained.drift == pytest.approx(reference.drift) and trained.compensated_layers == reference.compensated_layers
    (layer,) = reference.compensated_layers
    assert trained.compensation_objective[layer] == pytest.approx(reference.compensation_objective[layer])
    in_train_mode.eval()
    with torch.no_grad():
        torch.testing.assert_close(in_train_mode(ids).logits, in_eval_mode(ids).logits)


def test_a_failure_during_stage2_leaves_the_model_as_stage1_left_it(monkeypatch):
    from optimum_gradmap import GradMAPPruner, compensation

    from .conftest import small_config

    model = tiny_model("llama", num_layers=8)
    ids = random_ids(16, 16)
    pruner = GradMAPPruner(small_config(num_layers_to_prune=2, num_compensated_layers=2), progress_bar=False)
    result = pruner.select_layers(model, ids)
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    real_learn = compensation.learn_compensation
    calls = []

    def fail_on_the_second_layer(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("out of memory (simulated)")
        return real_learn(*args, **kwargs)

    monkeypatch.setattr(compensation, "learn_compensation", fail_on_the_second_layer)
    with pytest.raises(RuntimeError, match="simulated"):
        pruner.compensate(result)
    assert len(calls) == 2  # the first layer was folded before the failure
    assert _changed_parameters(model, state) == set() and model.state_dict().keys() == state.keys()
    assert result.compensated_layers == [] and "stage2" not in result.timings
    monkeypatch.setattr(compensation, "learn_compensation", real_learn)
    pruner.compensate(result)  # the dense layers are still there: Stage 2 can run again
    assert len(result.compensated_layers) == 2
