"""Half-precision models and models dispatched with accelerate's device_map."""

import pytest
import torch
from accelerate import dispatch_model
from transformers import AutoModelForCausalLM

from optimum_gradmap import GradMAPPruner, validate_checkpoint
from optimum_gradmap.adapters import get_adapter
from optimum_gradmap.importance import gradient_importance
from optimum_gradmap.testing import naive_layer_scores

from .conftest import random_ids, small_config, tiny_model


def _max_relative_error(scores, exact):
    return ((scores - exact).abs() / exact).max().item()


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_scores_are_as_accurate_as_the_naive_reference_in_that_precision(model_type, dtype):
    """The tolerance, justified: the exact score of a half-precision model is the score of its
    weights computed in float32. Any computation in half precision perturbs every activation and
    gradient by about the unit roundoff (2**-8 for bfloat16, 2**-11 for float16), so no
    half-precision method is exact; the naive per-sample reference run in the same precision
    measures how far that noise moves this model's scores. The fast path (which accumulates Gram
    matrices and norms in float32) must be no further from the exact scores than twice that, and
    well inside the 5% a ranking of layers can tolerate."""
    half = tiny_model(model_type).to(dtype)
    exact_model = tiny_model(model_type).to(dtype).float()  # the same half-precision weights, computed in float32
    ids = random_ids(8, 16)
    exact = naive_layer_scores(exact_model, list(exact_model.model.layers), ids)
    naive = naive_layer_scores(half, list(half.model.layers), ids)
    fast = gradient_importance(half, list(half.model.layers), ids, 4, progress_bar=False)
    assert torch.isfinite(fast).all() and fast.dtype == torch.float64
    naive_error, fast_error = _max_relative_error(naive, exact), _max_relative_error(fast, exact)
    assert fast_error <= 2 * naive_error, (fast_error, naive_error)
    assert fast_error < 0.05, fast_error


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_model_prunes_and_reloads(dtype, tmp_path):
    model = tiny_model("qwen2").to(dtype)
    ids = random_ids(8, 16)
    full_precision = tiny_model("qwen2")
    reference = gradient_importance(full_precision, list(full_precision.model.layers), ids, 4, progress_bar=False)
    pruner = GradMAPPruner(small_config(), progress_bar=False)
    result = pruner.prune(model, ids)
    first_round = torch.tensor([result.scores[0][i] for i in range(6)], dtype=torch.float64)
    assert torch.isfinite(first_round).all()
    # half-precision weights and activations move the scores by a few percent at most (see the test above)
    assert _max_relative_error(first_round, reference) < 0.1
    (target,) = result.compensated_layers
    assert (
        get_adapter(model).get_down_projections(result.model.model.layers[result.kept_layers.index(target)])[0].weight.dtype
        == dtype
    )
    assert all(p.dtype == dtype for p in model.parameters())
    pruner.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype).eval()
    assert all(torch.equal(tensor, reloaded.state_dict()[name]) for name, tensor in model.state_dict().items())
    # `.to(dtype)` also cast the rotary buffer that `from_pretrained` keeps in float32: logits agree to half precision
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reloaded(ids).logits, rtol=0.02, atol=0.02)


def test_model_dispatched_with_a_device_map(tmp_path):
    model = tiny_model("llama", num_layers=6)
    ids = random_ids(8, 16)
    with torch.no_grad():
        expected_model = tiny_model("llama", num_layers=6)
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
    device_map.update({f"model.layers.{i}": "cpu" for i in range(6)})
    model = dispatch_model(model, device_map=device_map, force_hooks=True)
    model.hf_device_map = device_map
    assert all(hasattr(layer, "_hf_hook") for layer in model.model.layers)

    pruner = GradMAPPruner(small_config(), progress_bar=False)
    result = pruner.prune(model, ids)
    expected = GradMAPPruner(small_config(), progress_bar=False).prune(expected_model, ids)
    assert (result.removed_layers, result.compensated_layers) == (expected.removed_layers, expected.compensated_layers)
    assert sorted(k for k in model.hf_device_map if k.startswith("model.layers.")) == [f"model.layers.{i}" for i in range(4)]
    assert all(hasattr(layer, "_hf_hook") for layer in model.model.layers)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected_model(ids).logits)
    pruner.save_pretrained(tmp_path)
    assert validate_checkpoint(tmp_path)["num_layers"] == 4
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert (reloaded(ids).logits - expected_model(ids).logits).abs().max().item() < 1e-5
