"""Layer surgery through the adapters: the pruned model is a correct, self-describing model."""

import pytest
import torch
from transformers import AutoModelForCausalLM, BloomConfig, BloomForCausalLM

from optimum_gradmap import GradMAPPruner, UnsupportedArchitectureError, remove_layers, supported_model_types, surgery

from .conftest import ARCHITECTURES, random_ids, small_config, tiny_model


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_surgery_keeps_exactly_the_kept_layers_and_fixes_the_config(model_type):
    model = tiny_model(model_type, num_layers=6)
    original_layers = list(model.model.layers)
    original_types = list(model.config.layer_types) if getattr(model.config, "layer_types", None) else None

    kept = remove_layers(model, [1, 4])

    assert kept == [0, 2, 3, 5]
    assert [id(layer) for layer in model.model.layers] == [id(original_layers[i]) for i in kept]
    assert model.config.num_hidden_layers == 4
    assert [layer.self_attn.layer_idx for layer in model.model.layers] == [0, 1, 2, 3]
    if original_types is not None:
        assert model.config.layer_types == [original_types[i] for i in kept]


def test_qwen2_sliding_window_split_is_preserved():
    model = tiny_model("qwen2", num_layers=6)  # max_window_layers=3: layers 3, 4, 5 slide
    assert model.config.layer_types == ["full_attention"] * 3 + ["sliding_attention"] * 3
    remove_layers(model, [1, 4])
    assert model.config.layer_types == ["full_attention", "full_attention", "sliding_attention", "sliding_attention"]
    assert model.config.max_window_layers == 2
    # a config rebuilt from the saved dict re-derives the same pattern
    rebuilt = type(model.config).from_dict({**model.config.to_dict(), "layer_types": None})
    assert rebuilt.layer_types == model.config.layer_types


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_generation_with_cache_equals_without(model_type):
    model = tiny_model(model_type, num_layers=6)
    remove_layers(model, [0, 3])
    prompt = random_ids(num_samples=1, seq_len=12, seed=3)  # longer than qwen2's sliding window of 8 with the new tokens
    common = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    with_cache = model.generate(prompt, use_cache=True, **common)
    without_cache = model.generate(prompt, use_cache=False, **common)
    assert torch.equal(with_cache, without_cache)


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_save_and_plain_reload_give_identical_logits(model_type, tmp_path):
    model = tiny_model(model_type, num_layers=6)
    remove_layers(model, [2, 5])
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert reloaded.config.num_hidden_layers == 4
    ids = random_ids(num_samples=2, seq_len=16)
    with torch.no_grad():
        difference = (model(ids).logits - reloaded(ids).logits).abs().max().item()
    assert difference < 1e-5


def test_surgery_is_reversible_from_the_snapshot():
    model = tiny_model("llama", num_layers=5)
    ids = random_ids(num_samples=2, seq_len=10)
    with torch.no_grad():
        dense_logits = model(ids).logits
    snapshot = surgery.snapshot(model)
    snapshot.keep([0, 2, 4])
    snapshot.keep([0, 1, 2, 3, 4])
    assert [layer.self_attn.layer_idx for layer in model.model.layers] == [0, 1, 2, 3, 4]
    with torch.no_grad():
        assert torch.equal(model(ids).logits, dense_logits)


def test_unsupported_architecture_is_refused_and_untouched():
    model = BloomForCausalLM(BloomConfig(vocab_size=64, hidden_size=16, n_layer=3, n_head=2))
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with pytest.raises(UnsupportedArchitectureError) as error:
        remove_layers(model, [1])
    message = str(error.value)
    assert "'bloom'" in message and all(t in message for t in supported_model_types()) and "register_adapter" in message
    assert model.config.n_layer == 3 and len(model.transformer.h) == 3
    assert all(torch.equal(state[name], tensor) for name, tensor in model.state_dict().items())


def test_bad_layer_indices_are_refused():
    model = tiny_model("llama", num_layers=4)
    with pytest.raises(ValueError, match=r"Layer indices must lie in \[0, 4\)"):
        remove_layers(model, [4])
    with pytest.raises(ValueError, match="At least one decoder layer must be kept"):
        remove_layers(model, [0, 1, 2, 3])
    assert len(model.model.layers) == 4 and model.config.num_hidden_layers == 4


def test_temporarily_runs_other_layers_and_puts_back_the_stack_and_exact_config_even_on_error():
    model = tiny_model("qwen2", num_layers=6, max_window_layers=9)  # a threshold above the layer count
    dense = surgery.snapshot(model)
    dense.keep([0, 2, 3, 5])
    pruned = (list(model.model.layers), model.config.to_dict())
    with dense.temporarily(range(6)):
        assert dense.kept_layers() == list(range(6)) and model.config.num_hidden_layers == 6
        assert model.config.max_window_layers == 6  # recounted for the stack inside the block
    assert (list(model.model.layers), model.config.to_dict()) == pruned
    with pytest.raises(RuntimeError, match="inside"), dense.temporarily([1]):
        raise RuntimeError("inside the block")
    assert (list(model.model.layers), model.config.to_dict()) == pruned
    assert [layer.self_attn.layer_idx for layer in model.model.layers] == [0, 1, 2, 3]
    dense.restore()
    assert model.config.max_window_layers == 9  # restore puts back the exact value, not a recount


def test_replace_puts_a_stand_in_at_a_position_until_the_next_keep():
    model = tiny_model("llama", num_layers=4)
    dense = surgery.snapshot(model)
    stand_in = torch.nn.Identity()
    replaced = dense.replace(1, stand_in)
    assert replaced is dense.layers[1] and model.model.layers[1] is stand_in
    with pytest.raises(ValueError, match="not in the snapshot"):
        dense.kept_layers()
    dense.keep(range(4))
    assert list(model.model.layers) == dense.layers


def test_validate_checkpoint_uses_the_surgerys_per_layer_fields_and_catches_a_stale_one(tmp_path):
    import json

    from optimum_gradmap import InvalidCheckpointError, validate_checkpoint

    model = tiny_model("gemma3_text", num_layers=6)
    dense_types = list(model.config.layer_types)
    remove_layers(model, [1, 4])
    model.save_pretrained(tmp_path)
    assert validate_checkpoint(tmp_path)["num_layers"] == 4
    config = json.loads((tmp_path / "config.json").read_text())
    config["layer_types"] = dense_types  # left as the dense model's: 6 entries for 4 layers
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidCheckpointError, match="(?s)config.json does not load.*layer_types"):
        validate_checkpoint(tmp_path)  # transformers refuses the config itself
    # where transformers does not look, the adapter's notion (the one surgery slices by) does
    from optimum_gradmap.adapters import PostNormAdapter

    config["layer_types"] = model.config.layer_types
    config["per_layer_widths"] = [64] * 6
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert validate_checkpoint(tmp_path)["num_layers"] == 4  # not known to be per-layer: no length to check
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(PostNormAdapter, "known_per_layer_config_fields", ("layer_types", "per_layer_widths"))
        with pytest.raises(InvalidCheckpointError, match="config per_layer_widths has 6 entries for 4 layers"):
            validate_checkpoint(tmp_path)


def test_temporarily_puts_back_the_stack_when_entering_it_fails(monkeypatch):
    from optimum_gradmap.adapters import Qwen2Adapter

    model = tiny_model("qwen2", num_layers=6)
    dense = surgery.snapshot(model)
    dense.keep([0, 2, 3, 5])
    before = (list(model.model.layers), model.config.to_dict())

    calls = []

    def broken(self, config, original_values, kept):
        calls.append(list(kept))
        if len(calls) == 1:  # entering fails (an interrupt, say); putting back works
            raise RuntimeError("a broken adapter")
        return {}

    monkeypatch.setattr(Qwen2Adapter, "rewrite_index_fields", broken)
    with pytest.raises(RuntimeError, match="broken"), dense.temporarily(range(6)):
        pass  # never reached: keeping the layers fails half-way, after the layer list was swapped
    assert calls == [list(range(6)), [0, 2, 3, 5]]
    assert (list(model.model.layers), model.config.to_dict()) == before


def test_validate_checkpoint_catches_per_layer_fields_cut_to_length_instead_of_sliced(tmp_path):
    """A config of the right length that describes other layers (`layer_types[:n]`, `max_window_layers` left
    as the dense model's) loads everywhere: only the report's record of the dense values tells it is stale."""
    import json

    from optimum_gradmap import InvalidCheckpointError, validate_checkpoint

    for model_type, field_name, stale in (
        ("gemma3_text", "layer_types", lambda dense: dense["layer_types"][:4]),
        ("qwen2", "max_window_layers", lambda dense: dense["max_window_layers"]),
    ):
        folder = tmp_path / model_type
        model = tiny_model(model_type, num_layers=6)
        pruner = GradMAPPruner(
            small_config(num_layers_to_prune=None, layers_to_prune=[0, 2], compensation=False), progress_bar=False
        )
        result = pruner.prune(model, random_ids(8, 16))
        assert result.dense_layer_config[field_name] is not None
        pruner.save_pretrained(folder)  # validates: the surgery's own config passes
        config = json.loads((folder / "config.json").read_text())
        config[field_name] = stale(result.dense_layer_config)
        if model_type == "qwen2":
            config.pop("layer_types")  # rebuilt from max_window_layers on load, as transformers does
        assert config[field_name] != getattr(model.config, field_name)
        (folder / "config.json").write_text(json.dumps(config))
        with pytest.raises(InvalidCheckpointError, match=f"config {field_name}=.* is stale"):
            validate_checkpoint(folder)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3_text", "opt", "qwen2_moe"])
def test_a_pass_started_at_a_layer_from_its_recorded_inputs_gives_the_whole_models_logits(family):
    """`LayerSnapshot.starting_at`: the stand-in returns each sequence's recorded input (looked up by its ids, in
    any order and any subset), the model's own masks and position embeddings do the rest."""
    from optimum_gradmap.passes import RecordedLayerInputs, calibration_batches

    model = tiny_model(family, num_layers=6).eval()
    ids = random_ids(8, 16)
    stack = surgery.snapshot(model)
    with torch.no_grad():
        expected = model(ids).logits
        with RecordedLayerInputs(model, {3: stack.layers[3]}, ids) as recorder:
            with calibration_batches(model, ids, 4, progress_bar=False) as batches:
                for batch in batches:
                    model(input_ids=batch, use_cache=False)
        recorded = recorder.inputs()[3]
        order = torch.tensor([5, 2, 7])
        with stack.starting_at(3, ids, recorded, recorder.returns_tuple):
            assert len(list(surgery.get_adapter(model).get_layers(model))) == 4  # a stand-in and layers 3, 4, 5
            started = model(ids[order]).logits
        assert stack.kept_layers() == list(range(6))
    torch.testing.assert_close(started, expected[order], rtol=1e-5, atol=1e-5)


def test_a_pass_started_from_recorded_inputs_refuses_a_sequence_that_was_not_recorded():
    model = tiny_model("llama", num_layers=4).eval()
    ids = random_ids(4, 16)
    stack = surgery.snapshot(model)
    hidden = torch.zeros(4, 16, model.config.hidden_size)
    with stack.starting_at(2, ids, hidden, False), pytest.raises(RuntimeError, match="not recorded"):
        model(random_ids(1, 16, seed=5))
    assert stack.kept_layers() == list(range(4))  # put back after the error


def test_stage2_started_at_the_previous_target_fits_exactly_what_it_fits_from_the_first_layer(monkeypatch):
    """Every pass of a fit starts at the previous target (what it received recorded once): bit for bit the folds,
    lambdas and choices of passes run from the first layer."""
    from optimum_gradmap import GradMAPConfig
    from optimum_gradmap.compensation import stage2

    def prune(start_at_targets: bool) -> tuple[dict, dict]:
        if not start_at_targets:
            monkeypatch.setattr(stage2, "_start_of", lambda layer, recorder: None)
        model = tiny_model("llama", num_layers=8)
        config = GradMAPConfig(layers_to_prune=[2, 5, 6], num_samples=16, seq_len=16, batch_size=4)
        result = GradMAPPruner(config, progress_bar=False).prune(model, random_ids(16, 16))
        return result.compensation.to_dict(), {name: tensor.clone() for name, tensor in model.state_dict().items()}

    started, started_weights = prune(True)
    whole, whole_weights = prune(False)
    assert started["targets"] == {"1": 2, "4": 6} and started == {**whole, "seconds": started["seconds"]}
    assert all(torch.equal(tensor, whole_weights[name]) for name, tensor in started_weights.items())
