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


def test_auto_dtype_is_bfloat16_on_this_machine_exactly_where_its_cpu_computes_bfloat16_natively():
    from optimum_gradmap.precision import has_native_bfloat16, resolve_dtype

    capabilities = torch.cpu.get_capabilities()
    native = bool(capabilities.get("avx512_bf16") or capabilities.get("amx_bf16"))
    assert has_native_bfloat16("cpu") == native
    assert resolve_dtype("auto") == (torch.bfloat16 if native else torch.float32)
    assert resolve_dtype("auto", "cpu") == resolve_dtype("auto")


@pytest.mark.parametrize(
    "device, capabilities, cuda_capability, expected",
    [
        ("cpu", {"avx512_bf16": True}, None, torch.bfloat16),
        ("cpu", {"amx_bf16": True, "avx512_bf16": False}, None, torch.bfloat16),
        ("cpu", {"avx512_bf16": False, "avx2": True}, None, torch.float32),
        ("cpu", {}, None, torch.float32),
        ("cuda", {}, (8, 0), torch.bfloat16),
        ("cuda:1", {}, (9, 0), torch.bfloat16),
        ("cuda", {"avx512_bf16": True}, (7, 5), torch.float32),
        ("mps", {"avx512_bf16": True}, None, torch.float32),
    ],
)
def test_auto_dtype_follows_the_hardware_capability(monkeypatch, device, capabilities, cuda_capability, expected):
    from optimum_gradmap.precision import resolve_dtype

    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: capabilities)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda_capability is not None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: cuda_capability)
    assert resolve_dtype("auto", device) == expected


def test_named_dtypes_resolve_to_themselves_and_a_wrong_name_says_what_is_accepted():
    from optimum_gradmap.errors import InvalidInputError
    from optimum_gradmap.precision import resolve_dtype

    assert resolve_dtype("float32") == torch.float32 and resolve_dtype("bfloat16") == torch.bfloat16
    assert resolve_dtype("float16") == torch.float16 and resolve_dtype(torch.float16) == torch.float16
    assert resolve_dtype("checkpoint") == "auto"  # transformers' name for the checkpoint's own dtype
    with pytest.raises(InvalidInputError, match="auto, float32, bfloat16, float16, checkpoint"):
        resolve_dtype("fp8")


@pytest.mark.parametrize("native", [True, False])
def test_the_dtype_option_auto_loads_the_model_in_the_dtype_the_hardware_computes_natively(tiny_checkpoint, monkeypatch, native):
    from optimum_gradmap import GradMAPConfig
    from optimum_gradmap.loading import ModelLoading

    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx512_bf16": native})
    model, _ = ModelLoading(model=tiny_checkpoint, dtype="auto").load(tiny_checkpoint)
    assert model.dtype == (torch.bfloat16 if native else torch.float32)
    pruner = GradMAPPruner.from_pretrained(tiny_checkpoint, GradMAPConfig(num_layers_to_prune=1), dtype="auto")
    assert pruner.model.dtype == model.dtype


def test_stage2_statistics_and_losses_of_a_bfloat16_model_are_computed_in_float64_and_float32():
    from optimum_gradmap.compensation import FitData, compensation_statistics, record_layer_outputs
    from optimum_gradmap.objectives import next_token_loss_sum
    from optimum_gradmap.surgery import remove_layers

    model = tiny_model("llama", num_layers=4).to(torch.bfloat16)
    ids = random_ids(8, 16)
    target = model.model.layers[1]
    (original,) = record_layer_outputs(model, [model.model.layers[2]], ids, 4, progress_bar=False)
    assert original.dtype == torch.float32
    remove_layers(model, [2])
    statistics = compensation_statistics(FitData(model, get_adapter(model), target, original, ids), 4, progress_bar=False)
    assert statistics.gram.dtype == statistics.cross.dtype == torch.float64
    total, count = next_token_loss_sum(model, ids, 4, progress_bar=False)
    assert total.dtype == torch.float64 and count == 8 * 15 and torch.isfinite(total)
