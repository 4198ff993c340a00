"""Stage 2: statistics, solvers and folding."""

import pytest
import torch

from optimum_gradmap.adapters import get_adapter, remove_layers
from optimum_gradmap.compensation import (
    CompensationStatistics,
    compensation_statistics,
    fold_into,
    record_layer_outputs,
    solve_adam,
    solve_closed_form,
)

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
