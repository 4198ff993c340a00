"""Stage 2: statistics, solvers and folding."""

import pytest
import torch

from optimum_gradmap.adapters import get_adapter
from optimum_gradmap.compensation import (
    CompensationStatistics,
    FitData,
    compensation_statistics,
    record_layer_outputs,
    solve_adam,
    solve_closed_form,
)
from optimum_gradmap.configuration import PAPER_STAGE2, PREVIOUS_DEFAULT_STAGE2
from optimum_gradmap.surgery import remove_layers
from optimum_gradmap.weights import fold_into

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
    statistics = compensation_statistics(FitData(dense, adapter, target, original, ids), batch_size=4, progress_bar=False)
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
    fit = learn_compensation(FitData(model, adapter, target, original, ids), config, progress_bar=False)

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
    pruner = GradMAPPruner(
        small_config(num_layers_to_prune=2, **{**PAPER_STAGE2, "num_compensated_layers": 3}), progress_bar=False
    )
    result = pruner.select_layers(model, ids)
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    pruner.compensate(result)
    most_drifted = sorted(sorted(result.compensation.drift, key=result.compensation.drift.get, reverse=True)[:3])
    assert result.compensated_layers == most_drifted
    assert all(result.compensation.objective[i]["fitted"] < result.compensation.objective[i]["identity"] for i in most_drifted)
    positions = [result.kept_layers.index(index) for index in most_drifted]
    assert _changed_parameters(model, state) == {f"model.layers.{p}.mlp.down_proj.weight" for p in positions}
    # forward order: the last target was fitted on the model that carries the first corrections, so its
    # drift after compensation is below its drift before
    assert result.compensation.drift_after_compensation[most_drifted[-1]] < result.compensation.drift[most_drifted[-1]]


def test_the_papers_adam_solver_through_the_pruner_approaches_the_exact_minimiser():
    from optimum_gradmap import GradMAPPruner

    from .conftest import small_config

    ids = random_ids(16, 16)
    exact = GradMAPPruner(small_config(**PAPER_STAGE2), progress_bar=False).prune(tiny_model("qwen2", num_layers=6), ids)
    adam = GradMAPPruner(small_config(**PAPER_STAGE2, solver="adam", adam_lr=1e-2, adam_steps=1500), progress_bar=False).prune(
        tiny_model("qwen2", num_layers=6), ids
    )
    assert adam.compensated_layers == exact.compensated_layers and adam.config.solver == "adam"
    (layer,) = exact.compensated_layers
    start, optimum = exact.compensation.objective[layer]["identity"], exact.compensation.objective[layer]["fitted"]
    reached = adam.compensation.objective[layer]["fitted"]
    assert adam.compensation.objective[layer]["identity"] == pytest.approx(start)
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
    assert (
        trained.compensation.drift == pytest.approx(reference.compensation.drift)
        and trained.compensated_layers == reference.compensated_layers
    )
    (layer,) = reference.compensated_layers
    assert trained.compensation.objective[layer] == pytest.approx(reference.compensation.objective[layer])
    in_train_mode.eval()
    with torch.no_grad():
        torch.testing.assert_close(in_train_mode(ids).logits, in_eval_mode(ids).logits)


def test_a_failure_during_stage2_leaves_the_model_as_stage1_left_it(monkeypatch):
    from optimum_gradmap import GradMAPPruner, compensation

    from .conftest import small_config

    model = tiny_model("llama", num_layers=8)
    ids = random_ids(16, 16)
    pruner = GradMAPPruner(
        small_config(num_layers_to_prune=2, **{**PAPER_STAGE2, "num_compensated_layers": 2}), progress_bar=False
    )
    result = pruner.select_layers(model, ids)
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    real_learn = compensation.learn_compensation
    calls = []

    def fail_on_the_second_layer(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("out of memory (simulated)")
        return real_learn(*args, **kwargs)

    monkeypatch.setattr(compensation.fit, "learn_compensation", fail_on_the_second_layer)
    with pytest.raises(RuntimeError, match="simulated"):
        pruner.compensate(result)
    assert len(calls) == 2  # the first layer was folded before the failure
    assert _changed_parameters(model, state) == set() and model.state_dict().keys() == state.keys()
    assert result.compensated_layers == [] and "stage2" not in result.timings
    monkeypatch.setattr(compensation.fit, "learn_compensation", real_learn)
    pruner.compensate(result)  # the dense layers are still there: Stage 2 can run again
    assert len(result.compensated_layers) == 2


# --- reg_lambda="auto", compensation targets ------------------------------------------------------------


def _sequences(num_sequences, tokens, size, mixing, noise, seed):
    """Per sequence, MLP outputs Y and targets R = Y mixing^T + noise."""
    generator = torch.Generator().manual_seed(seed)
    y = torch.randn(num_sequences, tokens, size, generator=generator, dtype=torch.float64)
    r = y @ mixing.T + noise * torch.randn(num_sequences, tokens, size, generator=generator, dtype=torch.float64)
    return y, r


def _fold_statistics(y, r, num_folds):
    folds = []
    for fold in range(num_folds):
        fy, fr = y[fold::num_folds].reshape(-1, y.shape[-1]), r[fold::num_folds].reshape(-1, y.shape[-1])
        folds.append(CompensationStatistics(fy.T @ fy, fr.T @ fy, float(fr.pow(2).sum()), fy.shape[0]))
    return folds


def _brute_force_cross_validation(y, r, num_folds, grid):
    """Held-out squared error of each relative ridge strength, from the rows themselves: for each fold,
    W minimises ||R - Y W^T||^2 + rho ||W - I||^2 on the other folds (normal equations), with
    rho = alpha * tr(Y^T Y) / d; the error is summed over the held-out rows."""
    size = y.shape[-1]
    identity = torch.eye(size, dtype=torch.float64)
    errors = dict.fromkeys(grid, 0.0)
    identity_error = 0.0
    for fold in range(num_folds):
        held_out = torch.zeros(y.shape[0], dtype=torch.bool)
        held_out[fold::num_folds] = True
        train_y, train_r = y[~held_out].reshape(-1, size), r[~held_out].reshape(-1, size)
        test_y, test_r = y[held_out].reshape(-1, size), r[held_out].reshape(-1, size)
        for alpha in grid:
            rho = alpha * float((train_y * train_y).sum()) / size
            matrix = torch.linalg.solve(train_y.T @ train_y + rho * identity, train_y.T @ train_r + rho * identity).T
            errors[alpha] += float((test_r - test_y @ matrix.T).pow(2).sum())
        identity_error += float((test_r - test_y).pow(2).sum())
    return errors, identity_error


@pytest.mark.parametrize(
    "noise, tokens, expected",
    [
        (0.0, 8, "smallest"),  # exact data: the least regularisation recovers the map
        (1.5, 2, "interior"),  # few noisy tokens: the unregularised fit overfits, full shrinkage underfits
    ],
)
def test_cross_validation_picks_the_strength_with_the_least_held_out_error(noise, tokens, expected):
    from optimum_gradmap.compensation import AUTO_RIDGE_GRID, cross_validate_ridge

    size = 6
    generator = torch.Generator().manual_seed(3)
    mixing = torch.eye(size, dtype=torch.float64) + 0.4 * torch.randn(size, size, generator=generator, dtype=torch.float64)
    y, r = _sequences(16, tokens, size, mixing, noise, seed=4)
    choice = cross_validate_ridge(_fold_statistics(y, r, 4))
    errors, identity_error = _brute_force_cross_validation(y, r, 4, AUTO_RIDGE_GRID)
    for alpha in AUTO_RIDGE_GRID:
        assert choice.heldout_error[alpha] == pytest.approx(errors[alpha], rel=1e-8, abs=1e-12)
    assert choice.identity_error == pytest.approx(identity_error, rel=1e-10)
    best = min(AUTO_RIDGE_GRID, key=errors.get)
    assert choice.alpha == best and errors[best] < identity_error
    if expected == "smallest":
        assert best == AUTO_RIDGE_GRID[0]
    else:
        assert AUTO_RIDGE_GRID[0] < best < AUTO_RIDGE_GRID[-1]


def test_cross_validation_keeps_the_identity_where_the_fit_cannot_help():
    """Each fold's targets follow its own map I + D_j, with the D_j summing to zero and the same MLP outputs
    in every fold: the fit on the other folds is I - D_j / 3 (shrunk towards I by the ridge), which moves
    away from fold j's map, so on every held-out fold any fitted W' is worse than W' = I."""
    from optimum_gradmap.compensation import AUTO_RIDGE_GRID, cross_validate_ridge

    size, num_folds = 6, 4
    generator = torch.Generator().manual_seed(5)
    y = torch.randn(1, 5, size, generator=generator, dtype=torch.float64).repeat(num_folds, 1, 1)  # same Y per fold
    offsets = 0.5 * torch.randn(num_folds, size, size, generator=generator, dtype=torch.float64)
    offsets -= offsets.mean(dim=0)
    r = torch.stack([y[j] @ (torch.eye(size, dtype=torch.float64) + offsets[j]).T for j in range(num_folds)])
    choice = cross_validate_ridge(_fold_statistics(y, r, num_folds))
    errors, identity_error = _brute_force_cross_validation(y, r, num_folds, AUTO_RIDGE_GRID)
    assert min(errors.values()) > identity_error
    assert choice.alpha is None and choice.identity_error == pytest.approx(identity_error, rel=1e-10)


def test_auto_lambda_fit_uses_the_chosen_strength_on_all_folds():
    """learn_compensation with reg_lambda='auto' equals the closed form on every calibration token with the
    strength cross-validation chose, expressed as the lambda of Eq. 14."""
    from optimum_gradmap import GradMAPConfig
    from optimum_gradmap.compensation import (
        AUTO_NUM_FOLDS,
        cross_validate_ridge,
        learn_compensation,
        relative_ridge,
    )

    dense = tiny_model("llama", num_layers=5)
    ids = random_ids(num_samples=8, seq_len=12)
    target = dense.model.layers[3]
    (original,) = record_layer_outputs(dense, [target], ids, batch_size=4, progress_bar=False)
    remove_layers(dense, [1])
    adapter = get_adapter(dense)
    config = GradMAPConfig(num_layers_to_prune=1, reg_lambda="auto", batch_size=3)  # batches straddle the folds
    data = FitData(dense, adapter, target, original, ids)
    fit = learn_compensation(data, config, progress_bar=False)
    folds = compensation_statistics(data, 8, progress_bar=False, num_folds=AUTO_NUM_FOLDS)
    # fold j holds sequences j, j + 4: the same statistics as computing each fold on its own sequences
    for fold, statistics in enumerate(folds):
        alone = compensation_statistics(FitData(dense, adapter, target, original[fold::4], ids[fold::4]), 8, progress_bar=False)
        torch.testing.assert_close(statistics.gram, alone.gram, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(statistics.cross, alone.cross, rtol=1e-9, atol=1e-9)
    choice = cross_validate_ridge(folds)
    assert fit.cross_validation.alpha == choice.alpha is not None
    total = sum(folds[1:], folds[0])
    assert fit.reg_lambda == pytest.approx(relative_ridge(total, choice.alpha) / total.num_elements)
    torch.testing.assert_close(fit.matrix, solve_closed_form(total, fit.reg_lambda), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize(
    "removed, expected",
    [
        ([3, 4], [(2, 4)]),
        ([1, 3, 4, 7], [(0, 1), (2, 4), (6, 7)]),  # removed last layer: fitted to the final hidden state
        ([0, 1, 5], [(4, 5)]),  # a run from layer 0 has no layer before it
    ],
)
def test_span_end_targets_are_the_layer_before_each_removed_run(removed, expected):
    from optimum_gradmap.compensation import compensation_targets

    kept = [index for index in range(8) if index not in removed]
    assert compensation_targets(kept, {}, 8, "span_end", 1) == expected


def test_max_drift_targets_are_the_most_drifted_layers_each_fitted_to_itself():
    from optimum_gradmap.compensation import compensation_targets

    drift = {0: 0.5, 1: 3.0, 2: 1.0, 5: 2.0, 6: 0.0, 7: 0.0}
    assert compensation_targets(list(drift), drift, 8, "max_drift", 2) == [(1, 1), (5, 5)]
    assert compensation_targets(list(drift), drift, 8, "max_drift", 6) == [(0, 0), (1, 1), (2, 2), (5, 5)]  # never a zero drift


def test_num_compensated_layers_beyond_the_kept_layers_is_refused_only_where_it_is_read():
    """Z only matters to `max_drift`; `span_end` fits one layer per removed run whatever Z is."""
    from optimum_gradmap import GradMAPPruner
    from optimum_gradmap.compensation import check_num_compensated_layers

    from .conftest import small_config

    with pytest.raises(ValueError, match="num_compensated_layers=5 exceeds the 4 layers"):
        check_num_compensated_layers(5, 4)
    check_num_compensated_layers(5, 4, "span_end")

    ids = random_ids(8, 16)
    with pytest.raises(ValueError, match="num_compensated_layers=5 exceeds the 4 layers"):
        config = small_config(num_compensated_layers=5, compensation_target="max_drift")
        GradMAPPruner(config, progress_bar=False).prune(tiny_model("llama", num_layers=6), ids)
    config = small_config(num_compensated_layers=5, compensation_target="span_end")
    result = GradMAPPruner(config, progress_bar=False).prune(tiny_model("llama", num_layers=6), ids)
    assert result.compensation.targets and len(result.kept_layers) == 4  # fitted, or left alone with the reason given


def _outputs(model, layers, ids, mlp_of=None):
    """Output hidden states of `layers` (and the MLP output of `mlp_of`) on `ids`, float64."""
    adapter = get_adapter(model)
    captured = {}
    hooks = [
        layer.register_forward_hook(lambda m, a, o, i=i: captured.__setitem__(i, (o[0] if isinstance(o, tuple) else o).double()))
        for i, layer in enumerate(layers)
    ]
    if mlp_of is not None:
        hooks.append(adapter.get_mlp(mlp_of).register_forward_hook(lambda m, a, o: captured.__setitem__("y", o.double())))
    with torch.no_grad():
        model(ids, use_cache=False)
    for hook in hooks:
        hook.remove()
    return captured


def test_span_end_compensation_equals_a_direct_computation():
    """Removed layers 3, 4 and 7 of 8: layer 2 is fitted to the dense output of layer 4, then (on the model
    carrying that fold) layer 6 to the dense output of layer 7, the last hidden state before the final norm.
    Each W' is the ridge solution computed here from captured activations, folded into the down projection."""
    import copy

    from optimum_gradmap import GradMAPPruner

    from .conftest import small_config

    model = tiny_model("llama", num_layers=8)
    ids = random_ids(8, 16)
    dense = copy.deepcopy(model)
    dense_out = _outputs(dense, [dense.model.layers[4], dense.model.layers[7]], ids)
    reg_lambda = 1e-3
    pruner = GradMAPPruner(
        small_config(num_layers_to_prune=None, layers_to_prune=[3, 4, 7], compensation_target="span_end", reg_lambda=reg_lambda),
        progress_bar=False,
    )
    result = pruner.select_layers(model, ids)
    reference = copy.deepcopy(model)  # the Stage 1 model, compensated by hand below
    pruner.compensate(result)
    assert result.compensation.targets == {2: 4, 6: 7} and result.compensated_layers == [2, 6]

    identity = torch.eye(32, dtype=torch.float64)
    for position, end in ((2, 0), (4, 1)):  # kept positions of layers 2 and 6
        layer = reference.model.layers[position]
        captured = _outputs(reference, [layer], ids, mlp_of=layer)
        y = captured["y"].reshape(-1, 32)
        r = (dense_out[end] - captured[0]).reshape(-1, 32) + y  # R = X_O - X_F, X_F = layer output - Y
        ridge = y.numel() * reg_lambda
        matrix = torch.linalg.solve(y.T @ y + ridge * identity, y.T @ r + ridge * identity).T
        down = layer.mlp.down_proj
        with torch.no_grad():
            down.weight.copy_((matrix @ down.weight.double()).float())
        torch.testing.assert_close(model.model.layers[position].mlp.down_proj.weight, down.weight, rtol=1e-5, atol=1e-6)


def test_a_layer_cross_validation_leaves_alone_is_reported_and_untouched(monkeypatch, tmp_path, byte_tokenizer):
    from optimum_gradmap import GradMAPPruner, compensation
    from optimum_gradmap.compensation import RidgeChoice

    from .conftest import small_config

    model = tiny_model("llama", num_layers=6)
    ids = random_ids(8, 16)
    monkeypatch.setattr(compensation.fit, "cross_validate_ridge", lambda *args, **kwargs: RidgeChoice(None, {}, 1.0))
    config = small_config(reg_lambda="auto", compensation_selection="hidden_state")  # the selection patched above
    pruner = GradMAPPruner(config, tokenizer=byte_tokenizer, progress_bar=False)
    result = pruner.select_layers(model, ids)
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    pruner.compensate(result)
    assert result.compensated_layers == [] and list(result.compensation.skipped_layers) == list(result.compensation.targets)
    assert "W' = I" in next(iter(result.compensation.skipped_layers.values()))
    assert _changed_parameters(model, state) == set()
    assert result.to_dict()["compensation"]["skipped_layers"] == {
        str(k): v for k, v in result.compensation.skipped_layers.items()
    }
    pruner.save_pretrained(tmp_path)
    card = (tmp_path / "README.md").read_text()
    ((layer, why),) = result.compensation.skipped_layers.items()
    assert f"Stage 2 compensated no layer. Layer {layer} was left as it was: {why}." in card


@pytest.mark.parametrize("harmful", [False, True])
def test_validation_text_keeps_the_compensation_only_if_it_lowers_its_perplexity(monkeypatch, harmful):
    """With validation data, the fold is kept only if it lowers the validation perplexity. The fit made on the
    calibration sequences lowers their perplexity (kept); a W' = 3 I, which triples the layer's MLP output,
    raises it (undone: the model is the Stage 1 model, and the result says why)."""
    from optimum_gradmap import GradMAPPruner, compensation
    from optimum_gradmap.evaluation.perplexity import perplexity

    from .conftest import small_config

    ids = random_ids(8, 16)
    model = tiny_model("llama", num_layers=6)
    pruner = GradMAPPruner(small_config(compensation_selection="hidden_state"), progress_bar=False)  # patched below
    result = pruner.select_layers(model, ids)
    stage1_state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    stage1 = perplexity(model, ids, 4, progress_bar=False)
    if harmful:
        learn = compensation.learn_compensation

        def tripled(*args, **kwargs):
            fit = learn(*args, **kwargs)
            fit.matrix = 3 * torch.eye(fit.matrix.shape[0], dtype=torch.float64)
            return fit

        monkeypatch.setattr(compensation.fit, "learn_compensation", tripled)
    pruner.compensate(result, validation_data=ids)
    outcome = result.compensation.validation
    assert outcome["without"] == pytest.approx(stage1, rel=1e-6)
    assert outcome["kept"] is (not harmful) and (outcome["with"] < outcome["without"]) is (not harmful)
    assert perplexity(model, ids, 4, progress_bar=False) == pytest.approx(min(outcome["with"], outcome["without"]), rel=1e-6)
    if harmful:
        assert result.compensated_layers == [] and _changed_parameters(model, stage1_state) == set()
        assert "validation perplexity" in next(iter(result.compensation.skipped_layers.values()))
    else:
        assert result.compensated_layers and _changed_parameters(model, stage1_state)


def test_compensation_between_removals_repairs_each_run_before_the_next_round_scores():
    """compensate_each_round: after each removal, the kept layer before the removed run is fitted to the run's
    dense end, so the first round scores as without it and later rounds score the repaired model."""
    from optimum_gradmap import GradMAPPruner

    from .conftest import small_config

    ids = random_ids(8, 16)
    plain = GradMAPPruner(small_config(num_layers_to_prune=3, compensation=False), progress_bar=False)
    plain_result = plain.select_layers(tiny_model("llama", num_layers=8), ids)
    model = tiny_model("llama", num_layers=8)
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    # lambda by the hidden state's error: on random tokens the next-token loss leaves these fits out
    settings = dict(num_layers_to_prune=3, compensate_each_round=True, **PREVIOUS_DEFAULT_STAGE2)
    pruner = GradMAPPruner(small_config(**settings), progress_bar=False)
    result = pruner.select_layers(model, ids)
    assert result.scores[0] == plain_result.scores[0]
    assert result.scores[1] != plain_result.scores[1]
    done = result.compensated_during_stage1
    assert len(done) == 3
    removed_so_far = []
    for entry, removed in zip(done, result.removed_layers):
        removed_so_far.append(removed)
        run_end = removed
        while run_end + 1 in removed_so_far:
            run_end += 1
        run_start = removed
        while run_start - 1 in removed_so_far:
            run_start -= 1
        assert (entry["layer"], entry["target"]) == (run_start - 1, run_end)
    # the folds live in the down projections of the fitted layers that are still kept, and nowhere else
    fitted = {entry["layer"] for entry in done} & set(result.kept_layers)
    changed = {
        index
        for index, layer in zip(result.kept_layers, model.model.layers)
        if not torch.equal(layer.mlp.down_proj.weight, state[f"model.layers.{index}.mlp.down_proj.weight"])
    }
    assert changed == fitted and fitted


def test_the_retired_diagonal_form_is_refused_with_what_to_use():
    from optimum_gradmap.errors import InvalidInputError

    from .conftest import small_config

    with pytest.raises(InvalidInputError, match="compensation_form='diagonal'` was retired: .*'rotated_diagonal'"):
        small_config(compensation_form="diagonal")


def test_auto_lambda_with_too_few_sequences_is_refused_before_stage1_changes_the_model():
    from optimum_gradmap import GradMAPPruner

    from .conftest import small_config

    model = tiny_model("llama", num_layers=6)
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    pruner = GradMAPPruner(small_config(reg_lambda="auto"), progress_bar=False)
    with pytest.raises(ValueError, match="needs at least 4, got 3. Use more calibration sequences"):
        pruner.prune(model, random_ids(3, 16))
    assert len(model.model.layers) == 6 and _changed_parameters(model, state) == set()


def test_hadamard_matrices_of_the_orders_models_use():
    from optimum_gradmap.compensation import hadamard_matrix, rotation

    for order in (1, 2, 4, 12, 20, 32, 36, 576, 896, 1536, 3584, 4096):
        hadamard = hadamard_matrix(order)
        assert hadamard is not None and set(hadamard.unique().tolist()) <= {-1.0, 1.0}
        assert torch.equal(hadamard @ hadamard.T, order * torch.eye(order, dtype=torch.float64))
    assert hadamard_matrix(6) is None  # none exists
    fallback = rotation(6)  # a fixed orthogonal matrix instead
    assert torch.allclose(fallback @ fallback.T, torch.eye(6, dtype=torch.float64), atol=1e-12)
    assert torch.equal(fallback, rotation(6))


@pytest.mark.parametrize("reg_lambda", [0.0, 1e-3])
def test_the_rotated_diagonal_closed_form_is_the_best_scaling_in_the_rotated_basis(reg_lambda):
    from optimum_gradmap.compensation import rotation

    statistics, _, _ = random_statistics(size=12)
    solution = solve_closed_form(statistics, reg_lambda, "rotated_diagonal")
    rotated = rotation(12)
    scaling = (rotated @ solution @ rotated.T).diagonal()
    torch.testing.assert_close(rotated.T @ torch.diag(scaling) @ rotated, solution)  # of the form
    best = statistics.objective(solution, reg_lambda)
    generator = torch.Generator().manual_seed(3)
    for _ in range(20):
        other = scaling + 0.01 * torch.randn(12, generator=generator, dtype=torch.float64)
        assert statistics.objective(rotated.T @ torch.diag(other) @ rotated, reg_lambda) >= best
    adam = solve_adam(statistics, reg_lambda, 1e-2, 3000, progress_bar=False, form="rotated_diagonal")
    assert statistics.objective(adam, reg_lambda) == pytest.approx(float(best), rel=1e-4)


def test_the_cosine_objective_and_its_gradient_against_a_brute_force_computation():
    from optimum_gradmap.compensation import CompensationRows, cosine_distance

    generator = torch.Generator().manual_seed(0)
    y, x_f, x_o = (torch.randn(40, 6, generator=generator, dtype=torch.float64) for _ in range(3))
    rows = CompensationRows(y, x_f, x_o, torch.arange(40))
    matrix = torch.eye(6, dtype=torch.float64) + 0.1 * torch.randn(6, 6, generator=generator, dtype=torch.float64)
    by_hand = (
        sum(
            1 - float((x_f[t] + matrix @ y[t]) @ x_o[t]) / float((x_f[t] + matrix @ y[t]).norm() * x_o[t].norm())
            for t in range(40)
        )
        / 40
    )
    assert float(cosine_distance(rows, matrix)) == pytest.approx(by_hand, rel=1e-5)
    parameter = matrix.clone().requires_grad_(True)
    cosine_distance(rows, parameter).backward()
    step = 1e-3
    for i, j in [(0, 0), (2, 5), (4, 1)]:
        plus, minus = matrix.clone(), matrix.clone()
        plus[i, j] += step
        minus[i, j] -= step
        numerical = (float(cosine_distance(rows, plus)) - float(cosine_distance(rows, minus))) / (2 * step)
        assert float(parameter.grad[i, j]) == pytest.approx(numerical, rel=1e-2, abs=1e-5)


def test_outlier_tokens_are_the_first_of_each_sequence_and_the_massive_ones_and_excluding_weighs_them_zero():
    from optimum_gradmap.compensation import outlier_token_weights, outlier_tokens

    hidden = torch.ones(2, 6, 4, dtype=torch.float64)  # norm 2 everywhere: the median
    hidden[1, 3] *= 50  # a massive activation inside the sequence: norm 100 = 50 x the median
    hidden[0, 2] *= 4  # large (norm 8), but under 5 x the median
    expected = torch.zeros(2, 6, dtype=torch.bool)
    expected[:, 0] = True
    expected[1, 3] = True
    assert torch.equal(outlier_tokens(hidden), expected)
    assert outlier_token_weights(hidden, "keep") is None
    assert torch.equal(outlier_token_weights(hidden, "exclude"), (~expected).double())
    with pytest.raises(ValueError, match="'auto' is resolved first"):
        outlier_token_weights(hidden, "auto")


def test_auto_outlier_tokens_mean_what_the_fit_function_chooses_lambda_by():
    """Called directly, `learn_compensation` (lambda by the hidden state's error) reads `outlier_tokens="auto"` as
    "keep", and `learn_by_next_token_loss` as "exclude" (`resolve_selection`)."""
    from optimum_gradmap import GradMAPConfig
    from optimum_gradmap.compensation import learn_by_next_token_loss, learn_compensation

    dense = tiny_model("llama", num_layers=5)
    ids = random_ids(num_samples=8, seq_len=12)
    target = dense.model.layers[3]
    (original,) = record_layer_outputs(dense, [target], ids, batch_size=4, progress_bar=False)
    original = original.clone()
    original[:, 0] *= 100  # a massive first token, which excluding would leave out
    remove_layers(dense, [1])
    adapter = get_adapter(dense)

    def fitted(learn, **settings) -> torch.Tensor:
        config = GradMAPConfig(num_layers_to_prune=1, batch_size=4, **settings)
        return learn(FitData(dense, adapter, target, original, ids), config, progress_bar=False).matrix

    keep = fitted(learn_compensation, reg_lambda=1e-3, outlier_tokens="keep")
    torch.testing.assert_close(fitted(learn_compensation, reg_lambda=1e-3, outlier_tokens="auto"), keep)
    assert not torch.allclose(fitted(learn_compensation, reg_lambda=1e-3, outlier_tokens="exclude"), keep)
    torch.testing.assert_close(
        fitted(learn_by_next_token_loss, outlier_tokens="auto"), fitted(learn_by_next_token_loss, outlier_tokens="exclude")
    )


def _without_layer_three(batch_size: int, massive: bool = False) -> FitData:
    """A tiny Llama without its layer 3, its layer 2 to fit, and the dense output of layer 3 on 8 random sequences
    (with massive activations on some tokens if asked)."""
    model = tiny_model("llama", num_layers=6)
    adapter = get_adapter(model)
    ids = random_ids(8, 16)
    dense_layers = list(adapter.get_layers(model))
    with torch.no_grad():
        (original,) = record_layer_outputs(model, [dense_layers[3]], ids, batch_size, progress_bar=False)
    if massive:  # on the first tokens, as real models have, and one inside a sequence
        original[:, 0] *= 40
        original[2, 5] *= 40
    remove_layers(model, [3])
    return FitData(model, adapter, dense_layers[2], original, ids)


def test_statistics_without_outliers_count_only_the_kept_tokens():
    data = _without_layer_three(4)
    every = compensation_statistics(data, 4, progress_bar=False)
    kept = compensation_statistics(data, 4, progress_bar=False, outliers="exclude")
    assert every.num_tokens == 8 * 16
    assert kept.num_tokens <= 8 * 15  # the first token of each sequence at least
    assert not torch.equal(every.gram, kept.gram)


@pytest.mark.parametrize("handling, instead", [("clip", "'auto', the default, or 'exclude'"), ("preserve", "'keep' or 'auto'")])
def test_retired_outlier_handlings_are_refused_with_what_to_use_and_the_model_untouched(handling, instead):
    from optimum_gradmap import GradMAPPruner
    from optimum_gradmap.configuration import GradMAPConfig
    from optimum_gradmap.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match=f"outlier_tokens='{handling}'` was retired: .*{instead}"):
        GradMAPConfig(num_layers_to_prune=1, outlier_tokens=handling)
    model = tiny_model("llama", num_layers=6)
    config = GradMAPConfig(layers_to_prune=[3], num_samples=8, seq_len=16)
    pruner = GradMAPPruner(config, progress_bar=False)
    result = pruner.select_layers(model, random_ids(8, 16))
    state = {name: value.clone() for name, value in model.state_dict().items()}
    with pytest.raises(InvalidInputError, match="was retired"):
        pruner.compensate(result, outlier_tokens=handling)
    assert all(torch.equal(value, state[name]) for name, value in model.state_dict().items())


def test_lambda_chosen_by_the_held_out_next_token_loss_is_the_candidate_with_the_lowest_loss():
    from optimum_gradmap.compensation import AUTO_RIDGE_GRID, held_out_next_token_loss, learn_by_next_token_loss
    from optimum_gradmap.configuration import GradMAPConfig

    model = tiny_model("llama", num_layers=6)
    adapter = get_adapter(model)
    ids = random_ids(16, 16)
    dense_layers = list(adapter.get_layers(model))
    with torch.no_grad():
        (original,) = record_layer_outputs(model, [dense_layers[3]], ids, 4, progress_bar=False)
    remove_layers(model, [3])
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    config = GradMAPConfig(num_layers_to_prune=1, compensation_selection="next_token_loss", batch_size=4)
    fit = learn_by_next_token_loss(FitData(model, adapter, dense_layers[2], original, ids), config, progress_bar=False)
    assert all(torch.equal(tensor, state[name]) for name, tensor in model.state_dict().items())  # candidates undone
    losses = fit.cross_validation.heldout_error
    assert set(losses) <= set(AUTO_RIDGE_GRID) and len(losses) >= 3
    assert fit.cross_validation.identity_error == pytest.approx(held_out_next_token_loss(model, ids[3::4], 4, False))
    if fit.skipped:
        assert min(losses.values()) >= fit.cross_validation.identity_error
    else:
        assert losses[fit.cross_validation.alpha] == min(losses.values()) < fit.cross_validation.identity_error
        assert fit.reg_lambda > 0 and fit.objective_fitted < fit.objective_identity


@pytest.mark.parametrize(
    "model_type, selection, outliers",
    [("llama", "next_token_loss", "exclude"), ("gemma2", "hidden_state", "keep")],  # gemma2: a norm after the MLP
)
def test_the_default_stage2_chooses_lambda_by_the_next_token_loss_without_outliers_where_it_runs_and_as_before_elsewhere(
    model_type, selection, outliers, monkeypatch
):
    from optimum_gradmap import GradMAPPruner
    from optimum_gradmap.compensation import fit, resolve_selection
    from optimum_gradmap.compensation.next_token import check_next_token_selection
    from optimum_gradmap.configuration import GradMAPConfig

    adapter = get_adapter(tiny_model(model_type, num_layers=4))
    default = resolve_selection(GradMAPConfig(num_layers_to_prune=1), adapter)
    assert (default.compensation_selection, default.outlier_tokens) == (selection, outliers)
    for settings in ({"compensation_objective": "cosine"}, {"solver": "adam"}, {"compensation_selection": "hidden_state"}):
        resolved = resolve_selection(GradMAPConfig(num_layers_to_prune=1, **settings), adapter)
        assert (resolved.compensation_selection, resolved.outlier_tokens) == ("hidden_state", "keep")
    with pytest.raises(ValueError, match="it needs solver='closed_form'"):  # asked for by name: refused, not ignored
        check_next_token_selection(
            GradMAPConfig(num_layers_to_prune=1, compensation_selection="next_token_loss", solver="adam"), adapter
        )
    fixed = resolve_selection(GradMAPConfig(num_layers_to_prune=1, reg_lambda=1e-3), adapter)
    assert fixed.outlier_tokens == "keep"  # no selection to guard the fit: every token, as the paper
    named = resolve_selection(GradMAPConfig(num_layers_to_prune=1, outlier_tokens="keep"), adapter)
    assert (named.compensation_selection, named.outlier_tokens) == (selection, "keep")

    calls = []
    for name, learner in (("learn_by_next_token_loss", "next_token_loss"), ("learn_compensation", "hidden_state")):
        learn = getattr(fit, name)

        def spy(*args, learn=learn, learner=learner):
            calls.append((learner, args[1].outlier_tokens))  # args[1]: the config the fit reads
            return learn(*args)

        monkeypatch.setattr(fit, name, spy)
    config = GradMAPConfig(layers_to_prune=[3], num_samples=16, seq_len=16, batch_size=4)
    result = GradMAPPruner(config, progress_bar=False).prune(tiny_model(model_type, num_layers=6), random_ids(16, 16))
    assert calls == [(selection, outliers)] and set(result.compensation.targets) == {2}
    assert result.config.compensation_selection == "auto"  # what was asked for, as the user wrote it


def test_the_next_token_selection_is_refused_before_stage1_for_a_family_with_a_norm_after_the_mlp():
    from optimum_gradmap import GradMAPPruner
    from optimum_gradmap.configuration import GradMAPConfig

    model = tiny_model("gemma2", num_layers=6)
    config = GradMAPConfig(layers_to_prune=[3], num_samples=8, seq_len=16, compensation_selection="next_token_loss")
    layers = list(model.model.layers)
    with pytest.raises(ValueError, match="the mean-squared-error objective and a family whose MLP output"):
        GradMAPPruner(config, progress_bar=False).prune(model, random_ids(8, 16))
    assert list(model.model.layers) == layers  # refused before Stage 1


def test_the_distillation_loss_gradient_reaches_the_factor_as_brute_force_says_and_refinement_never_raises_the_held_out_loss():
    from optimum_gradmap import GradMAPPruner
    from optimum_gradmap.compensation import dense_top_k, refinement
    from optimum_gradmap.configuration import GradMAPConfig
    from optimum_gradmap.passes import forward_hooks
    from optimum_gradmap.surgery import snapshot

    # float64: the gradient checked here is ~1e-7, below what a float32 loss difference over 2 * step resolves
    model = tiny_model("llama", num_layers=6).double()
    ids = random_ids(8, 16)
    dense = snapshot(model)
    dense.keep([0, 1, 2, 4, 5])
    indices, probabilities = dense_top_k(dense, ids, 4, [])
    assert indices.shape == (8, 15, refinement.TOP_K) and torch.allclose(probabilities.sum(-1), torch.ones(8, 15))
    layer = model.model.layers[2]
    factor = torch.eye(32, dtype=torch.float64, requires_grad=True)
    hooks = [(layer.mlp, lambda module, args, output: refinement._scaled(output, factor))]
    with forward_hooks(hooks):
        loss = refinement._distillation_loss(model, ids[:2], indices[:2], probabilities[:2])
        loss.backward()
        step = 1e-2
        for i, j in [(0, 0), (3, 7)]:
            values = []
            for sign in (1, -1):
                with torch.no_grad():
                    factor[i, j] += sign * step
                    values.append(float(refinement._distillation_loss(model, ids[:2], indices[:2], probabilities[:2])))
                    factor[i, j] -= sign * step
            assert float(factor.grad[i, j]) == pytest.approx((values[0] - values[1]) / (2 * step), rel=0.05, abs=1e-6)
    dense.restore()

    config = GradMAPConfig(
        layers_to_prune=[3],
        num_samples=8,
        seq_len=16,
        batch_size=2,
        refinement_steps=20,
        refinement_lr=1e-2,
        **PREVIOUS_DEFAULT_STAGE2,
    )  # lambda by the hidden state's error: on random tokens the next-token loss leaves the fit out
    result = GradMAPPruner(config, progress_bar=False).prune(tiny_model("llama", num_layers=6), ids)
    refined = result.compensation.refinement
    assert refined["refined"] <= refined["start"] and 0 <= refined["step"] <= 20
    # OPT with word embeddings narrower than the residual stream (OPT-350m's projections): W' is hidden x hidden
    opt = tiny_model("opt", num_layers=6, word_embed_proj_dim=16)
    refined = GradMAPPruner(config, progress_bar=False).prune(opt, ids).compensation.refinement
    assert refined["refined"] <= refined["start"]


def test_compensation_data_fits_stage2_on_other_sequences_and_leaves_stage1_as_it_was():
    """`compensation_data`: Stage 1 scores the calibration sequences, Stage 2 fits on the other ones. With explicit
    layers (no scoring), the result is the model pruned with those other sequences as its calibration data; with
    scoring, the removed layers are those of the calibration sequences alone. The result says what Stage 2 used."""
    from optimum_gradmap import GradMAPPruner
    from optimum_gradmap.data import calibration_sha256

    from .conftest import small_config

    calibration, other = random_ids(8, 16, seed=0), random_ids(8, 16, seed=1)
    explicit = small_config(num_layers_to_prune=None, layers_to_prune=[2, 3])
    reference = tiny_model("llama", num_layers=6)
    GradMAPPruner(explicit, progress_bar=False).prune(reference, other)
    model = tiny_model("llama", num_layers=6)
    result = GradMAPPruner(explicit, progress_bar=False).prune(model, calibration, compensation_data=other)
    assert result.compensation.calibration_sha256 == calibration_sha256(other) != calibration_sha256(calibration)
    assert result.compensated_layers == [1]
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], tensor, rtol=0, atol=0, msg=name)
    plain = tiny_model("llama", num_layers=6)
    GradMAPPruner(explicit, progress_bar=False).prune(plain, calibration)
    assert _changed_parameters(model, plain.state_dict()) == {"model.layers.1.mlp.down_proj.weight"}

    scored = GradMAPPruner(small_config(), progress_bar=False)
    stage1_only = GradMAPPruner(small_config(compensation=False), progress_bar=False)
    removed = stage1_only.prune(tiny_model("llama", num_layers=6), calibration).removed_layers
    result = scored.prune(tiny_model("llama", num_layers=6), calibration, compensation_data=other)
    assert result.removed_layers == removed and result.compensation.calibration_sha256 == calibration_sha256(other)


@pytest.mark.parametrize(
    "compensation_data, message",
    [
        ("no-such-dataset", "no-such-dataset"),
        (random_ids(3, 16), "reg_lambda='auto' cross-validates over calibration sequences: it needs at least 4"),
        (random_ids(8, 16) + 10_000, "Calibration token ids must lie in"),
    ],
)
def test_bad_compensation_data_is_refused_before_stage1_changes_the_model(compensation_data, message, byte_tokenizer):
    from optimum_gradmap import GradMAPPruner
    from optimum_gradmap.errors import InvalidInputError

    from .conftest import small_config

    model = tiny_model("llama", num_layers=6)
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with pytest.raises(InvalidInputError, match=message):
        pruner = GradMAPPruner(small_config(), tokenizer=byte_tokenizer, progress_bar=False)
        pruner.prune(model, random_ids(8, 16), compensation_data=compensation_data)
    assert len(model.model.layers) == 6 and _changed_parameters(model, state) == set()


def test_compensation_data_without_stage2_is_refused_before_anything_changes():
    from optimum_gradmap import GradMAPPruner
    from optimum_gradmap.errors import InvalidInputError

    from .conftest import small_config

    model = tiny_model("llama", num_layers=6)
    for config, data in (
        (small_config(compensation=False), random_ids(8, 16, seed=1)),
        (small_config(compensation=False, compensation_dataset="offline:web_text"), None),
    ):
        with pytest.raises(InvalidInputError, match="but Stage 2 is off"):
            GradMAPPruner(config, progress_bar=False).prune(model, random_ids(8, 16), compensation_data=data)
        assert len(model.model.layers) == 6


def test_compensation_dataset_is_a_stage2_setting_that_compensate_can_change(tmp_path, byte_tokenizer):
    """`compensate(result, compensation_dataset=path)` refits Stage 2 on that text (drawn as calibration text is)
    and records it in the result's config; the next `compensate` without it fits on the calibration set again."""
    from optimum_gradmap import GradMAPPruner
    from optimum_gradmap.data import calibration_sha256, prepare_calibration_data
    from optimum_gradmap.report import format_report

    from .conftest import small_config

    text = tmp_path / "serving.txt"
    text.write_text(" ".join(f"request {i} asks for item {i * 7 % 13}." for i in range(400)), encoding="utf-8")
    config = small_config()
    pruner = GradMAPPruner(config, tokenizer=byte_tokenizer, progress_bar=False)
    result = pruner.select_layers(tiny_model("llama", num_layers=6), random_ids(8, 16))
    expected = prepare_calibration_data(str(text), byte_tokenizer, 8, 16, config.seed, config.dataset)
    pruner.compensate(result, compensation_dataset=str(text))
    assert result.compensation.calibration_sha256 == calibration_sha256(expected)
    assert result.config.compensation_dataset == str(text)
    report = format_report({**result.to_dict(), "gradmap_config": result.config.to_dict()})
    assert f"stage 2 fitted on:   {text} (SHA-256 {calibration_sha256(expected)[:12]})" in report
    pruner.compensate(result)
    assert "stage 2 fitted on" not in format_report({**result.to_dict(), "gradmap_config": result.config.to_dict()})
    assert result.compensation.calibration_sha256 == calibration_sha256(result.calibration_ids)
    assert result.config.compensation_dataset is None


def test_validation_after_refinement_keeps_exactly_the_model_it_validated(monkeypatch):
    """With `refinement_steps` and validation data, the compensation kept is the one validated: the fits' W' and the
    refinement's R together, not W' alone re-applied (issue 55, 4.2). The logits compared are the validated model's."""
    from optimum_gradmap import GradMAPPruner
    from optimum_gradmap.compensation import stage2

    from .conftest import small_config

    ids, probe = random_ids(8, 16), random_ids(2, 16, seed=1)
    model = tiny_model("llama", num_layers=6)
    config = small_config(batch_size=2, refinement_steps=20, refinement_lr=3e-3, **PREVIOUS_DEFAULT_STAGE2)
    pruner = GradMAPPruner(config, progress_bar=False)
    result = pruner.select_layers(model, ids)
    validated = {}
    keep_if_validated = stage2._Stage2Run.keep_if_validated

    def record_the_validated_model(run, *args, **kwargs):
        validated["state"] = {name: tensor.clone() for name, tensor in run.dense.model.state_dict().items()}
        with torch.no_grad():
            validated["logits"] = run.dense.model(probe).logits
        return keep_if_validated(run, *args, **kwargs)

    monkeypatch.setattr(stage2._Stage2Run, "keep_if_validated", record_the_validated_model)
    pruner.compensate(result, validation_data=ids)
    assert result.compensation.refinement["step"] > 0  # the refinement changed the fits: R is not the identity
    assert result.compensation.validation["kept"] and result.compensated_layers
    assert _changed_parameters(model, validated["state"]) == set()
    with torch.no_grad():
        torch.testing.assert_close(model(probe).logits, validated["logits"], rtol=0, atol=0)


@pytest.mark.parametrize("model_type", ["llama", "mixtral"])
def test_a_fit_between_removals_that_fails_mid_fold_leaves_the_weights_as_they_were(monkeypatch, model_type):
    """compensate_each_round: a fit that folds into one down projection and then fails is undone by its own backup,
    so the failed Stage 1 leaves the model exactly as it came (issue 55, 4.7). Mixtral: one expert of several."""
    from optimum_gradmap import GradMAPPruner
    from optimum_gradmap.compensation import each_round
    from optimum_gradmap.weights import fold_into

    from .conftest import small_config

    model = tiny_model(model_type, num_layers=6)
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    layers, config_before = list(model.model.layers), model.config.to_dict()
    folded = []

    def fold_one_then_fail(data, *args, **kwargs):
        target = data.adapter.get_down_projections(data.layer)[0]
        fold_into(target, 2 * torch.eye(data.model.config.hidden_size, dtype=torch.float64))
        folded.append(data.layer)
        raise RuntimeError("out of memory (simulated)")

    monkeypatch.setattr(each_round, "fit_and_fold", fold_one_then_fail)
    settings = dict(num_layers_to_prune=2, compensate_each_round=True, **PREVIOUS_DEFAULT_STAGE2)
    with pytest.raises(RuntimeError, match="simulated"):
        GradMAPPruner(small_config(**settings), progress_bar=False).prune(model, random_ids(8, 16))
    assert folded  # the fit did fold before it failed
    assert list(model.model.layers) == layers and model.config.to_dict() == config_before
    assert _changed_parameters(model, state) == set() and model.state_dict().keys() == state.keys()


def _next_token_families():
    """The families whose Stage 2 fits the next-token selection chooses among (no norm after the MLP)."""
    from .conftest import FAMILIES

    return [family for family in FAMILIES if get_adapter(tiny_model(family, num_layers=2)).mlp_output_norm_path is None]


@pytest.mark.parametrize("family", _next_token_families())
@pytest.mark.parametrize("removed, fitted", [(3, 2), (1, 0)])  # layer 0: no layer before it to skip
@pytest.mark.parametrize("search", ["grid", "golden"])
def test_the_next_token_selection_run_from_the_fitted_layer_chooses_as_the_whole_model_does(
    family, removed, fitted, search, monkeypatch
):
    """Each candidate scored from the fitted layer on (its input recorded once) gives the losses and the choice of
    a pass of the whole model per candidate (`optimum_gradmap.testing.reference_next_token_choice`), with every
    strength scored (`grid`), or those the golden-section search scores on the reference's losses (`golden`: on these
    random models the held-out loss is flat to 1e-5 and may have several minima, where golden may choose another
    strength than the grid; the real models' choices are compared on docs/benchmarks/stage1-cost.md)."""
    from optimum_gradmap.compensation import AUTO_RIDGE_GRID, learn_by_next_token_loss
    from optimum_gradmap.compensation.lambda_search import choose_strength, searched_losses
    from optimum_gradmap.configuration import GradMAPConfig
    from optimum_gradmap.testing import reference_next_token_choice

    model = tiny_model(family, num_layers=6)
    adapter = get_adapter(model)
    ids = random_ids(16, 16)
    dense_layers = list(adapter.get_layers(model))
    with torch.no_grad():
        (original,) = record_layer_outputs(model, [dense_layers[removed]], ids, 4, progress_bar=False)
    remove_layers(model, [removed])
    monkeypatch.setattr("optimum_gradmap.compensation.lambda_search.SEARCH", search)
    config = GradMAPConfig(num_layers_to_prune=1, batch_size=4)
    data = FitData(model, adapter, dense_layers[fitted], original, ids)
    fit = learn_by_next_token_loss(data, config, progress_bar=False)
    reference = reference_next_token_choice(data, config)
    if search == "golden":  # the search replayed on the reference's losses
        replayed = searched_losses(reference.heldout_error.__getitem__, AUTO_RIDGE_GRID, "golden")
        reference = choose_strength(replayed, reference.identity_error)
    assert fit.cross_validation.alpha == reference.alpha
    assert fit.cross_validation.identity_error == pytest.approx(reference.identity_error, rel=1e-6)
    scored = fit.cross_validation.heldout_error
    assert list(scored) == list(reference.heldout_error)  # the same strengths, in the same order
    assert len(scored) == len(AUTO_RIDGE_GRID) if search == "grid" else 3 <= len(scored) < len(AUTO_RIDGE_GRID)
    for alpha, loss in scored.items():
        assert loss == pytest.approx(reference.heldout_error[alpha], rel=1e-6)
    assert len(set(reference.heldout_error.values())) > 1  # the candidates differ: the comparison means something


def test_the_outlier_threshold_is_a_property_of_the_calibration_set_not_of_the_batch():
    """One median over every calibration token: the statistics do not depend on how the sequences are batched."""
    data = _without_layer_three(8, massive=True)
    data.original_outputs[6:] *= 10  # the last quarter of the sequences has larger norms: a per-batch median would differ
    whole = compensation_statistics(data, 8, progress_bar=False, outliers="exclude")
    for batch_size in (1, 3):
        batched = compensation_statistics(data, batch_size, progress_bar=False, outliers="exclude")
        assert batched.num_tokens == whole.num_tokens
        torch.testing.assert_close(batched.gram, whole.gram)
        torch.testing.assert_close(batched.cross, whole.cross)
        assert batched.target_energy == pytest.approx(whole.target_energy)


def test_a_held_out_loss_over_no_sequence_adds_nothing_instead_of_dividing_by_zero():
    from optimum_gradmap.objectives import next_token_loss_sum

    model = tiny_model("llama", num_layers=2)
    total, count = next_token_loss_sum(model, random_ids(0, 16), 4, progress_bar=False)
    assert float(total) == 0.0 and count == 0
    with pytest.raises(ValueError, match="at least one sequence"):
        from optimum_gradmap.objectives import mean_next_token_loss

        mean_next_token_loss(model, random_ids(0, 16), 4, progress_bar=False)


@pytest.mark.parametrize("minimum", range(9))
@pytest.mark.parametrize("plateau", [0, 2])  # strengths after the minimum whose loss ties it (up to rounding)
def test_the_golden_section_search_chooses_as_the_grid_does_with_fewer_passes(minimum, plateau):
    from optimum_gradmap.compensation.lambda_search import LOSS_TIE_TOLERANCE, choose_strength, searched_losses
    from optimum_gradmap.compensation.solvers import AUTO_RIDGE_GRID

    grid = AUTO_RIDGE_GRID
    generator = torch.Generator().manual_seed(minimum)
    steps = torch.rand(len(grid), generator=generator).tolist()
    curve = {}
    for index, alpha in enumerate(grid):  # one minimum: falling before it, rising after it (or tied just after it)
        if index <= minimum:
            curve[alpha] = 5.0 + sum(steps[index:minimum])
        elif index <= minimum + plateau:
            curve[alpha] = 5.0 + 0.1 * LOSS_TIE_TOLERANCE * 5.0 * (index - minimum)
        else:
            curve[alpha] = 5.0 + sum(steps[minimum:index])
    scored = []
    golden = searched_losses(lambda alpha: scored.append(alpha) or curve[alpha], grid, "golden")
    every = searched_losses(curve.__getitem__, grid, "grid")
    assert len(every) == len(grid) and len(scored) == len(set(scored)) == len(golden)  # each strength scored once at most
    for identity in (4.0, 6.0):  # W' = I better than every strength, or worse
        assert choose_strength(golden, identity).alpha == choose_strength(every, identity).alpha
    assert len(golden) <= 5 + plateau + 1


def test_the_retired_lambda_search_is_refused_and_an_unknown_search_too():
    from optimum_gradmap.compensation.lambda_search import searched_losses
    from optimum_gradmap.configuration import GradMAPConfig

    with pytest.raises(ValueError, match="The setting `lambda_search` was retired: .*remove the setting"):
        GradMAPConfig(num_layers_to_prune=1, lambda_search="grid")
    with pytest.raises(ValueError, match="search='bisect'"):
        searched_losses(float, [1.0, 2.0], "bisect")
