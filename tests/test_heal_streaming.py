"""The heal stage on a model whose weights Accelerate offloaded to disk, and layer-streamed on a model in memory
(optimum_gradmap.heal with optimum_gradmap.streaming): the same gradients, KL curve and merged weights as in memory,
one offloaded layer's weights at a time, the merge written to the offload folder and never into the model's own
files."""

from __future__ import annotations

import contextlib
import copy
import os

import pytest
import torch
from torch import nn

from optimum_gradmap import GradMAPPruner, streaming
from optimum_gradmap.adapters import get_adapter
from optimum_gradmap.distillation import TOP_K, teacher_targets
from optimum_gradmap.errors import InvalidInputError
from optimum_gradmap.heal import PlannedPruning, check_heal_settings, heal
from optimum_gradmap.heal.trainable import Trainable, choose_trainable
from optimum_gradmap.objectives import (
    TeacherTargets,
    rest_log_prob,
    top_k_kl,
    top_k_kl_gradient,
    vocab_sliced_top_k_kl_gradient,
)
from optimum_gradmap.passes import calibration_mode
from optimum_gradmap.weights import stored_state_dict, weights_digest

from .conftest import random_ids, small_config, tiny_model
from .test_heal import HEAL, heal_settings, peaked_model
from .test_streaming import _counting_streamed_batches, _offloaded, _sha256

SETTINGS = dict(heal_lr=1e-2, heal_batch_size=4, heal_check_every=1, heal_autocast=False)


def _flat(curve: list[list[float]]) -> list[float]:
    return [value for point in curve for value in point]


def _assert_same_update(value: torch.Tensor, expected: torch.Tensor, start: torch.Tensor) -> None:
    """`value` and `expected`, both moved by training from `start`, moved alike: the difference of the two updates is
    a small share of the update (AdamW's first steps, about sign(gradient), amplify float32 rounding a little)."""
    update = (expected - start).norm()
    assert float((value - expected).norm()) <= 2e-3 * float(update) + 1e-7, float((value - expected).norm() / update)


def _targets(vocab_size: int, shape: tuple[int, int], seed: int = 0) -> TeacherTargets:
    generator = torch.Generator().manual_seed(seed)
    log_p = torch.log_softmax(torch.randn(*shape, vocab_size, generator=generator) * 3, -1)
    top = log_p.topk(min(TOP_K, vocab_size), -1)
    return TeacherTargets(top.indices.int(), top.values, rest_log_prob(log_p, top.indices))


@pytest.mark.parametrize("vocab_size", [256, 48])  # 48 < TOP_K: the teacher has no mass outside its top-K
def test_the_top_k_kl_gradients_at_the_final_hidden_states_equal_autograd_of_the_heal_loss(vocab_size):
    model = tiny_model("gemma2", vocab_size=vocab_size)  # its head soft-caps the logits
    adapter = get_adapter(model)
    head = lambda states: adapter.compute_logits(model, states)  # noqa: E731
    hidden = torch.randn(3, 16, model.config.hidden_size, requires_grad=True)
    targets = _targets(vocab_size, (3, 15))
    (expected,) = torch.autograd.grad(top_k_kl(head(hidden)[:, :-1], targets).mean() * 3, hidden)
    plain = top_k_kl_gradient(hidden, targets, head, vocab_size)
    sliced = vocab_sliced_top_k_kl_gradient(
        hidden, targets, head, model.get_output_embeddings(), vocab_size, max_logits=45 * 20
    )  # 45 rows: slices of 20 tokens, the last one shorter
    torch.testing.assert_close(plain, expected, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(sliced, expected, rtol=1e-5, atol=1e-8)
    assert model.get_output_embeddings().weight.shape[0] == vocab_size  # the head is whole again


def _gradients(model: nn.Module, ids: torch.LongTensor, targets: TeacherTargets, mode: str) -> list[torch.Tensor]:
    """One step's gradients of LoRA adapters set to the same random values, in memory or layer-streamed."""
    adapter = get_adapter(model)
    with calibration_mode(model, grad=True, freeze_parameters=True):
        chosen = Trainable(model, choose_trainable(model, adapter, "lora"), 4)
        with torch.no_grad():
            for index, parameter in enumerate(chosen.parameters):
                parameter.copy_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(index)) * 0.1)
        if mode == "in_memory":
            (top_k_kl(model(input_ids=ids).logits[:, :-1], targets).mean() * ids.shape[0]).backward()
        else:
            with streaming.execution_mode("layer_streamed"):
                streamed = streaming.DecoderGradient(model, adapter, ids)
                gradient = streamed.loss_gradient(top_k_kl_gradient, vocab_sliced_top_k_kl_gradient, targets=targets)
                streamed.backward(ids, gradient, chosen.parameters)
        gradients = [parameter.grad.clone() for parameter in chosen.parameters]
        chosen.finish(merge=False)
    return gradients


def test_a_streamed_step_gives_the_in_memory_gradients(tmp_path):
    folder = str(tmp_path / "pruned")
    dense = peaked_model(num_layers=4)
    dense.save_pretrained(folder)
    ids = random_ids(4, 16, seed=1)
    targets = teacher_targets(peaked_model(num_layers=4, seed=1), ids, 4, progress_bar=False)
    expected = _gradients(copy.deepcopy(dense), ids, targets, "in_memory")
    streamed = _gradients(copy.deepcopy(dense), ids, targets, "layer_streamed")
    offloaded = _gradients(_offloaded(folder, max_cpu_bytes=1), ids, targets, "layer_streamed")  # head by slices
    assert len(expected) == 4 * 7 * 2 and all(float(gradient.abs().max()) > 0 for gradient in expected)
    for reference, same, close in zip(expected, streamed, offloaded):
        torch.testing.assert_close(same, reference, rtol=1e-6, atol=1e-9)
        assert float((close - reference).abs().max()) < 1e-5 * float(reference.abs().max())  # float32 sums, other order


def _one_layer_at_a_time(model: nn.Module) -> tuple[list, list[int]]:
    """Forward hooks that record, at every decoder layer's forward pass, how many layers hold real weights."""
    layers = list(get_adapter(model).get_layers(model))
    counts: list[int] = []

    def count(module, args, output):
        counts.append(sum(layer.post_attention_layernorm.weight.device.type != "meta" for layer in layers))

    return [layer.register_forward_hook(count) for layer in layers], counts


@pytest.mark.parametrize("max_cpu_bytes", [1, 60_000])  # every weight on disk; the first layers in memory
def test_an_offloaded_heal_equals_the_heal_in_memory_one_layer_at_a_time(tmp_path, max_cpu_bytes):
    folder = str(tmp_path / "pruned")
    dense = peaked_model(num_layers=4)
    dense.save_pretrained(folder)
    source_hash = _sha256(os.path.join(folder, "model.safetensors"))
    teacher_model = peaked_model(num_layers=4, seed=1)
    teacher = lambda: contextlib.nullcontext(teacher_model)  # noqa: E731
    train, validation = random_ids(8, 16, seed=1), random_ids(4, 16, seed=2)
    in_memory = copy.deepcopy(dense)
    expected = heal(in_memory, teacher, train, validation, heal_settings(heal_trainable="lora", **SETTINGS), progress_bar=False)

    model = _offloaded(folder, max_cpu_bytes=max_cpu_bytes)
    assert streaming.is_offloaded(model) and model.hf_device_map.get("model.layers.3", "disk") == "disk"
    handles, counts = _one_layer_at_a_time(model)
    calls = []
    try:
        with _counting_streamed_batches(calls):
            result = heal(model, teacher, train, validation, heal_settings(heal_trainable="lora", **SETTINGS), progress_bar=False)
    finally:
        for handle in handles:
            handle.remove()
    assert len(calls) == result.steps == 2 and max(counts) == 1  # each step streamed, one offloaded layer at a time
    assert result.best_tokens == expected.best_tokens == 128
    # the same KL after every step; Adam's first steps amplify float32 rounding a little
    assert [tokens for tokens, _ in result.kl_curve] == [tokens for tokens, _ in expected.kl_curve]
    assert [kl for _, kl in result.kl_curve] == pytest.approx([kl for _, kl in expected.kl_curve], rel=1e-5)

    # merged into plain weights where they live: the offload folder, never the model's own files
    assert all(type(module) is nn.Linear for name, module in model.named_modules() if name.endswith("proj"))
    assert not hasattr(model, "peft_config") and model.model.layers[3].mlp.down_proj.weight.device.type == "meta"
    written = os.listdir(os.path.join(folder, "offload"))
    assert "model.layers.3.mlp.down_proj.weight.dat" in written and all(name.endswith(".dat") for name in written)
    assert _sha256(os.path.join(folder, "model.safetensors")) == source_hash, "the model's own files were written"
    merged, start = dict(stored_state_dict(model)), dense.state_dict()
    for name, value in in_memory.state_dict().items():
        _assert_same_update(merged[name], value, start[name])
    probe = random_ids(2, 16, seed=5)
    with torch.no_grad():
        _assert_same_update(model(probe).logits, in_memory(probe).logits, dense(probe).logits)


@pytest.mark.parametrize("trainable", ["lora", "norms"])  # the final norm's gradient comes from after the layers
def test_a_layer_streamed_heal_in_memory_equals_the_heal_in_memory(trainable):
    dense = peaked_model(num_layers=4)
    teacher_model = peaked_model(num_layers=4, seed=1)
    teacher = lambda: contextlib.nullcontext(teacher_model)  # noqa: E731
    train, validation = random_ids(8, 16, seed=1), random_ids(4, 16, seed=2)
    models, results = [copy.deepcopy(dense), copy.deepcopy(dense)], []
    calls = []
    for model, mode in zip(models, ["in_memory", "layer_streamed"]):
        with streaming.execution_mode(mode), _counting_streamed_batches(calls):
            results.append(
                heal(model, teacher, train, validation, heal_settings(heal_trainable=trainable, **SETTINGS), progress_bar=False)
            )
    assert len(calls) == 2  # the second heal's two steps
    assert _flat(results[1].kl_curve) == pytest.approx(_flat(results[0].kl_curve), rel=1e-6)
    assert results[1].best_tokens == results[0].best_tokens > 0
    for (name, value), other in zip(models[0].state_dict().items(), models[1].state_dict().values()):
        torch.testing.assert_close(other, value, rtol=1e-5, atol=1e-7, msg=name)


def test_a_prune_with_a_heal_on_an_offloaded_model_equals_it_in_memory(tmp_path):
    """The pruner's heal: its teacher is the offloaded dense model with the removed layers put back."""
    folder = str(tmp_path / "dense")
    dense = peaked_model()
    dense.save_pretrained(folder)
    source_hash = _sha256(os.path.join(folder, "model.safetensors"))
    config = small_config(num_samples=16, compensation=False, heal_tokens=16 * 16, heal_lr=1e-4, **HEAL)
    ids, heal_ids = random_ids(16, 16), random_ids(24, 16, seed=1)
    expected = GradMAPPruner(config, progress_bar=False).prune(copy.deepcopy(dense), ids, heal_data=heal_ids)
    result = GradMAPPruner(config, progress_bar=False).prune(_offloaded(folder, max_cpu_bytes=1), ids, heal_data=heal_ids)
    assert result.removed_layers == expected.removed_layers
    assert _flat(result.heal.kl_curve) == pytest.approx(_flat(expected.heal.kl_curve), rel=1e-5)
    assert result.heal.best_tokens == expected.heal.best_tokens > 0
    probe = random_ids(2, 16, seed=5)
    with torch.no_grad():
        before = copy.deepcopy(dense)
        for index in sorted(expected.removed_layers, reverse=True):
            del before.model.layers[index]
        _assert_same_update(result.model(probe).logits, expected.model(probe).logits, before(probe).logits)
    assert _sha256(os.path.join(folder, "model.safetensors")) == source_hash, "the model's own files were written"


def test_training_offloaded_weights_is_refused_before_anything_runs_and_lora_is_not(tmp_path):
    folder = str(tmp_path / "pruned")
    tiny_model("llama", num_layers=4).save_pretrained(folder)
    model = _offloaded(folder, max_cpu_bytes=1)
    before_pruning = PlannedPruning(compensation=True)
    check_heal_settings(model, heal_settings(heal_trainable="lora"), before_pruning)
    with pytest.raises(InvalidInputError, match="heal_trainable='norms' trains the model's own weights, and Accelerate"):
        check_heal_settings(model, heal_settings(heal_trainable="norms"), before_pruning)
    with pytest.raises(InvalidInputError, match="execution='in_memory' with offloaded weights"):  # a whole copy kept
        check_heal_settings(model, heal_settings(execution="in_memory"), before_pruning)

    def teacher():
        raise AssertionError("the teacher ran")

    with pytest.raises(InvalidInputError, match="heal_trainable='all' .* heal_trainable='lora'"):
        heal(
            model,
            teacher,
            random_ids(8, 16),
            random_ids(4, 16),
            heal_settings(heal_trainable="all", **SETTINGS),
            progress_bar=False,
        )


def test_the_weights_digest_reads_offloaded_weights_where_they_live(tmp_path):
    folder = str(tmp_path / "pruned")
    dense = tiny_model("llama", num_layers=4)
    dense.save_pretrained(folder)
    assert weights_digest(_offloaded(folder, max_cpu_bytes=1)) == weights_digest(dense)
