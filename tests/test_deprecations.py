"""Names that moved keep working for one release, with a FutureWarning that names the new place."""

import pytest
import torch

from .conftest import random_ids, tiny_model


@pytest.mark.parametrize(
    "module, name, new_home",
    [
        ("optimum_gradmap.hub", "validate_checkpoint", "optimum_gradmap.checkpoint"),
        ("optimum_gradmap.hub", "save_checkpoint", "optimum_gradmap.checkpoint"),
        ("optimum_gradmap.hub", "InvalidCheckpointError", "optimum_gradmap.checkpoint"),
        ("optimum_gradmap.hub", "load_report", "optimum_gradmap.report"),
        ("optimum_gradmap.hub", "REPORT_NAME", "optimum_gradmap.report"),
        ("optimum_gradmap.adapters", "remove_layers", "optimum_gradmap.surgery"),
        ("optimum_gradmap.adapters", "LayerSnapshot", "optimum_gradmap.surgery"),
        ("optimum_gradmap.data", "wikipedia_documents", "optimum_gradmap.assets"),
        ("optimum_gradmap.data", "EVALUATION_EVERY", "optimum_gradmap.assets"),
        ("optimum_gradmap.pruner", "MIN_TOKENS_PER_HIDDEN_UNIT", "optimum_gradmap.compensation"),
        ("optimum_gradmap.hooks", "forward_hooks", "optimum_gradmap.passes"),
    ],
)
def test_moved_names_still_import_with_a_warning(module, name, new_home):
    import importlib

    with pytest.warns(FutureWarning, match=new_home.replace(".", r"\.")):
        old = getattr(importlib.import_module(module), name)
    assert old is getattr(importlib.import_module(new_home), name)


def test_old_adapter_surgery_methods_still_work_with_a_warning():
    from optimum_gradmap import surgery
    from optimum_gradmap.adapters import get_adapter

    model = tiny_model("llama", num_layers=5)
    adapter = get_adapter(model)
    with pytest.warns(FutureWarning, match="surgery.snapshot"):
        snapshot = adapter.snapshot(model)
    with pytest.warns(FutureWarning, match="surgery.keep"):
        adapter.keep_layers(model, snapshot, [0, 2, 4])
    assert surgery.kept_layers(model, snapshot) == [0, 2, 4] and model.config.num_hidden_layers == 3
    with pytest.warns(FutureWarning, match="surgery.restore"):
        adapter.restore(model, snapshot)
    assert model.config.num_hidden_layers == 5


def test_an_adapter_written_for_the_old_update_config_is_still_called():
    from optimum_gradmap import remove_layers
    from optimum_gradmap.adapters import _ADAPTERS, LlamaAdapter, register_adapter

    calls = []

    class OldStyleAdapter(LlamaAdapter):
        def update_config(self, config, snapshot, kept):
            super().update_config(config, snapshot, kept)
            calls.append(list(kept))

    try:
        register_adapter("llama")(OldStyleAdapter)
        model = tiny_model("llama", num_layers=4)
        with pytest.warns(FutureWarning, match="rewrite_index_fields"):
            remove_layers(model, [1])
        assert calls == [[0, 2, 3]] and model.config.num_hidden_layers == 3
    finally:
        register_adapter("llama", "mistral", "phi3")(LlamaAdapter)
    assert _ADAPTERS["llama"] is LlamaAdapter


def test_old_names_of_datasets_metrics_and_helpers():
    from optimum_gradmap import configuration, data
    from optimum_gradmap.adapters import adapter_for_model_type
    from optimum_gradmap.hooks import run_batches
    from optimum_gradmap.importance import frozen_for_scoring

    with pytest.warns(FutureWarning, match="offline:web_text"):
        assert data.check_dataset_name("web_text", "evaluation") == "offline:web_text"
    with pytest.warns(FutureWarning, match="importance_metric_names"):
        assert "gradmap" in configuration.IMPORTANCE_METRICS
    with pytest.warns(FutureWarning, match="get_adapter"):
        assert adapter_for_model_type("bloom") is None
    model = tiny_model("llama", num_layers=2).train()
    with pytest.warns(FutureWarning, match="calibration_mode"), frozen_for_scoring(model):
        assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert model.training and all(p.requires_grad for p in model.parameters())
    with pytest.warns(FutureWarning, match="calibration_batches"):
        seen = []
        handle = model.register_forward_hook(lambda m, a, o: seen.append((m.training, torch.is_grad_enabled())))
        batches = list(run_batches(model, random_ids(4, 8), 2, "", False))
        handle.remove()
    assert [tuple(batch.shape) for batch in batches] == [(2, 8), (2, 8)]
    assert seen == [(True, True), (True, True)]  # as before: the caller's training and gradient modes
    with pytest.warns(FutureWarning, match="HUB_DATASETS"):
        assert data.HUB_DATASETS == ("wikipedia", "wikitext2", "c4")
    with pytest.warns(FutureWarning, match="OFFLINE_DATASETS"):
        assert data.OFFLINE_DATASETS == ("offline:wikipedia", "offline:web_text")


def test_the_former_result_and_report_interfaces():
    from optimum_gradmap import GradMAPPruner
    from optimum_gradmap.report import build_report

    from .conftest import small_config

    config = small_config(num_layers_to_prune=1, compensation=False)
    result = GradMAPPruner(config, progress_bar=False).prune(tiny_model("llama", num_layers=4), random_ids(8, 16))
    with pytest.warns(FutureWarning, match="always None"):
        assert result.snapshot is None
    with pytest.warns(FutureWarning, match="build_report"):
        former = build_report(result, config, "org/base", license="mit")
    current = build_report(result.model, result.to_dict(), config, "org/base", license="mit")
    assert {key: value for key, value in former.items() if key != "created"} == {
        key: value for key, value in current.items() if key != "created"
    }
    assert former["base_model"] == "org/base" and former["removed_layers"] == result.removed_layers
