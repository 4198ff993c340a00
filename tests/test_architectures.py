"""Every supported family, on a tiny random model built from its config: exact Stage 1 scores, exact
folding, and prune -> generate -> save -> validate -> reload."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from optimum_gradmap import GradMAPPruner, InvalidCheckpointError, validate_checkpoint
from optimum_gradmap.adapters import get_adapter
from optimum_gradmap.compensation import apply_compensation
from optimum_gradmap.importance import gradient_importance
from optimum_gradmap.testing import naive_layer_scores

from .conftest import FAMILIES, layers_before_removed_runs, random_ids, small_config, tiny_model


@pytest.mark.parametrize("model_type", FAMILIES)
def test_stage1_scores_equal_the_naive_reference(model_type):
    model = tiny_model(model_type)
    adapter = get_adapter(model)
    layers = list(adapter.get_layers(model))
    ids = random_ids(num_samples=5, seq_len=12)
    units = [unit for layer in layers for unit in adapter.get_per_sample_units(layer)]
    fast = gradient_importance(model, layers, ids, batch_size=3, progress_bar=False, units=units)
    reference = naive_layer_scores(model, layers, ids)
    assert ((fast - reference).abs() / reference).max().item() < 1e-4, (fast, reference)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_folding_equals_applying_the_learned_map(model_type):
    """Folding W' into the down projection(s) turns the layer output X_F + c(Y) into X_F + c(W' Y),
    where Y is the MLP output and c the identity or the norm that follows the MLP."""
    model = tiny_model(model_type)
    adapter = get_adapter(model)
    layer = adapter.get_layers(model)[3]
    norm = adapter.get_mlp_output_norm(layer)
    captured = {}
    hooks = [
        adapter.get_mlp(layer).register_forward_hook(lambda m, a, o: captured.__setitem__("y", o)),
        (norm or adapter.get_mlp(layer)).register_forward_hook(lambda m, a, o: captured.__setitem__("c", o)),
        layer.register_forward_hook(lambda m, a, o: captured.__setitem__("h", o[0] if isinstance(o, tuple) else o)),
    ]
    ids = random_ids(num_samples=2, seq_len=10)
    generator = torch.Generator().manual_seed(1)
    matrix = torch.eye(32, dtype=torch.float64) + 0.1 * torch.randn(32, 32, generator=generator, dtype=torch.float64)
    with torch.no_grad():
        model(ids)
        h = captured["h"]
        residual, y = h - captured["c"].reshape(h.shape), captured["y"].reshape(h.shape)
        mapped = y @ matrix.T.float()
        expected = residual + (norm(mapped) if norm is not None else mapped)
        apply_compensation(adapter, layer, matrix)
        model(ids)
    for hook in hooks:
        hook.remove()
    torch.testing.assert_close(captured["h"], expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_prune_generate_save_validate_and_reload(model_type, tmp_path, byte_tokenizer):
    model = tiny_model(model_type)
    adapter = get_adapter(model)
    # the default Stage 2 target (span_end) with a fixed lambda, so that every family folds a W' here
    pruner = GradMAPPruner(small_config(adam_steps=200, reg_lambda=1e-3), tokenizer=byte_tokenizer, progress_bar=False)
    result = pruner.prune(model, random_ids(8, 16))
    text_config = model.config.get_text_config(decoder=True)
    assert adapter.num_layers(model) == 4 == getattr(text_config, adapter.layer_count_field)
    assert result.compensated_layers == layers_before_removed_runs(result.removed_layers) != []

    prompt = random_ids(num_samples=1, seq_len=6, seed=4)
    common = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(prompt, use_cache=True, **common), model.generate(prompt, use_cache=False, **common))

    pruner.save_pretrained(tmp_path)  # validates the checkpoint
    assert validate_checkpoint(tmp_path)["num_layers"] == 4
    reloaded, loading = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(loading[kind] for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")), loading
    reloaded.eval()
    ids = random_ids(2, 16, seed=5)
    with torch.no_grad():
        assert (model(ids).logits - reloaded(ids).logits).abs().max().item() < 1e-5
    reloaded_layers = get_adapter(reloaded).get_layers(reloaded)
    assert [type(adapter.get_mlp(layer)) for layer in reloaded_layers] == [
        type(adapter.get_mlp(layer)) for layer in adapter.get_layers(model)
    ]


def test_moe_dense_and_sparse_layers_survive_pruning(tmp_path):
    model = tiny_model("qwen2_moe")  # sparse at odd indices (decoder_sparse_step=2) except layer 4 (mlp_only_layers)
    adapter = get_adapter(model)
    kinds = [type(adapter.get_mlp(layer)).__name__ for layer in adapter.get_layers(model)]
    assert kinds[1] == kinds[3] == "Qwen2MoeSparseMoeBlock" and kinds[0] == kinds[4] == "Qwen2MoeMLP"
    from optimum_gradmap import remove_layers

    kept = remove_layers(model, [0, 2])
    assert model.config.decoder_sparse_step == 1
    assert model.config.mlp_only_layers == [position for position, index in enumerate(kept) if kinds[index] == "Qwen2MoeMLP"]
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert [type(adapter.get_mlp(layer)).__name__ for layer in reloaded.model.layers] == [kinds[i] for i in kept]


def test_validator_names_every_problem(tmp_path):
    model = tiny_model("llama", num_layers=4)
    model.save_pretrained(tmp_path)
    assert validate_checkpoint(tmp_path) == {"model_type": "llama", "num_layers": 4, "num_tensors": len(model.state_dict())}
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(num_hidden_layers=5, auto_map={"AutoModelForCausalLM": "modeling_custom.Custom"})
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidCheckpointError) as error:
        validate_checkpoint(tmp_path)
    message = str(error.value)
    assert "auto_map" in message
    assert "missing tensor model.layers.4.self_attn.q_proj.weight" in message
    assert "weight names number layers [0, 1, 2, 3], but num_hidden_layers=5" in message


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gemma2"])
def test_tied_embeddings_stay_tied(model_type, tmp_path):
    model = tiny_model(model_type, tie_word_embeddings=True)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    pruner = GradMAPPruner(small_config(adam_steps=50), progress_bar=False)
    pruner.prune(model, random_ids(8, 16))
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    pruner.save_pretrained(tmp_path)
    reloaded, loading = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not loading["missing_keys"] and not loading["unexpected_keys"]
    assert reloaded.get_output_embeddings().weight is reloaded.get_input_embeddings().weight
    ids = random_ids(2, 16, seed=5)
    with torch.no_grad():
        assert (model(ids).logits - reloaded.eval()(ids).logits).abs().max().item() < 1e-5


@pytest.mark.parametrize("model_type", FAMILIES)
def test_stage1_splits_every_family_at_its_head(model_type):
    """Stage 1 forms logits a few rows at a time only where decoder + head reproduce the model's logits."""
    from optimum_gradmap.streaming import split_at_lm_head

    model = tiny_model(model_type).eval()
    ids = random_ids(num_samples=2, seq_len=10)
    decoder, head, width = split_at_lm_head(model, get_adapter(model), ids)
    assert not isinstance(head, torch.nn.Identity)
    embeds = model.get_input_embeddings()(ids)
    with torch.no_grad():
        torch.testing.assert_close(head(decoder(embeds)), model(inputs_embeds=embeds).logits)
    assert width == model.config.get_text_config().vocab_size


def _layer_output(model, layer, ids):
    captured = {}
    hook = layer.register_forward_hook(lambda m, a, o: captured.__setitem__("h", (o[0] if isinstance(o, tuple) else o).double()))
    with torch.no_grad():
        model(ids, use_cache=False)
    hook.remove()
    return captured["h"]


@pytest.mark.parametrize("model_type", FAMILIES)
def test_span_end_stage2_lowers_the_error_it_reports_and_auto_lambda_leaves_alone_what_it_skips(model_type):
    """Layers 2 and 3 removed; layer 1 is fitted to the dense output of layer 3. The objective reported at
    W' = I is the measured error of the pruned layer's output; after the fold (through post-MLP norms,
    experts and Conv1D alike) the measured error is the fitted objective less its penalty: below the
    reported fitted objective and below the error before. With lambda chosen by cross-validation, the
    layer is either fitted with a lambda > 0 or, where nothing beats W' = I, left exactly as it was."""
    import copy

    model = tiny_model(model_type)
    ids = random_ids(16, 16)
    adapter = get_adapter(model)
    dense_end = _layer_output(model, adapter.get_layers(model)[3], copy.deepcopy(ids))
    config = small_config(
        num_layers_to_prune=None,
        layers_to_prune=[2, 3],
        compensation_target="span_end",
        reg_lambda=1e-3,
        adam_lr=1e-2,
        adam_steps=300,
        num_samples=16,
    )
    pruner = GradMAPPruner(config, progress_bar=False)
    result = pruner.select_layers(model, ids)
    layer = adapter.get_layers(model)[1]
    before = torch.nn.functional.mse_loss(_layer_output(model, layer, ids), dense_end).item()
    stage1_state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    pruner.compensate(result)
    assert result.compensation.targets == {1: 3} and result.compensated_layers == [1]
    objective = result.compensation.objective[1]
    assert objective["identity"] == pytest.approx(before, rel=1e-4)
    after = torch.nn.functional.mse_loss(_layer_output(model, layer, ids), dense_end).item()
    assert after < before and after <= objective["fitted"] * (1 + 1e-4)

    # undoes the first fold, then fits again, lambda by the hidden state's held-out error, every token in the fit
    pruner.compensate(result, reg_lambda="auto", compensation_selection="hidden_state", outlier_tokens="keep")
    if result.compensated_layers:
        assert result.compensation.reg_lambda[1] > 0 and result.compensation.objective[1]["identity"] == pytest.approx(
            before, rel=1e-4
        )
        assert torch.nn.functional.mse_loss(_layer_output(model, layer, ids), dense_end).item() < before
    else:
        assert "W' = I" in result.compensation.skipped_layers[1]
        assert all(torch.equal(tensor, stage1_state[name]) for name, tensor in model.state_dict().items())


@pytest.mark.parametrize("model_type", FAMILIES)
def test_the_rotated_diagonal_form_folds_exactly_identity_and_a_known_scaling(model_type):
    """LinearPatch's form, W' = Q^T diag(s) Q with Q the normalised Hadamard matrix, folds into the down
    projection(s) like any W': s = 1 leaves the logits as they were, and a known s gives the layer output
    X_F + c(Q^T diag(s) Q Y)."""
    from optimum_gradmap.compensation import rotation

    model = tiny_model(model_type)
    adapter = get_adapter(model)
    layer = adapter.get_layers(model)[3]
    norm = adapter.get_mlp_output_norm(layer)
    ids = random_ids(num_samples=2, seq_len=10)
    rotated = rotation(32)
    assert torch.allclose(rotated @ rotated.T, torch.eye(32, dtype=torch.float64), atol=1e-12)
    with torch.no_grad():
        before = model(ids).logits
        apply_compensation(adapter, layer, rotated.T @ rotated)  # s = 1
        torch.testing.assert_close(model(ids).logits, before, rtol=1e-5, atol=1e-5)
    scaling = torch.linspace(0.5, 1.5, 32, dtype=torch.float64)
    matrix = rotated.T @ torch.diag(scaling) @ rotated
    captured = {}
    hooks = [
        adapter.get_mlp(layer).register_forward_hook(lambda m, a, o: captured.__setitem__("y", o)),
        (norm or adapter.get_mlp(layer)).register_forward_hook(lambda m, a, o: captured.__setitem__("c", o)),
        layer.register_forward_hook(lambda m, a, o: captured.__setitem__("h", o[0] if isinstance(o, tuple) else o)),
    ]
    with torch.no_grad():
        model(ids)
        h = captured["h"]
        residual, y = h - captured["c"].reshape(h.shape), captured["y"].reshape(h.shape)
        rotated_y = y.double() @ rotated.T  # the MLP output in the rotated basis: each channel scaled by s
        mapped = ((rotated_y * scaling) @ rotated).float()
        expected = residual + (norm(mapped) if norm is not None else mapped)
        apply_compensation(adapter, layer, matrix)
        model(ids)
    for hook in hooks:
        hook.remove()
    torch.testing.assert_close(captured["h"], expected, rtol=1e-4, atol=1e-4)
