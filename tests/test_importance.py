"""Stage 1: the batched, gradient-free-of-buffers score equals the naive per-sample definition."""

import pytest
import torch

from optimum_gradmap.importance import gradient_importance, linear_per_sample_sq_norms
from optimum_gradmap.testing import naive_layer_scores

from .conftest import ARCHITECTURES, random_ids, tiny_model


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_scores_equal_naive_per_sample_reference(model_type):
    model = tiny_model(model_type, attention_bias=(model_type == "llama"))
    ids = random_ids(num_samples=6, seq_len=12)
    fast = gradient_importance(model, list(model.model.layers), ids, batch_size=4, progress_bar=False)
    reference = naive_layer_scores(model, list(model.model.layers), ids)
    relative = ((fast - reference).abs() / reference).max().item()
    assert relative < 1e-4, (fast, reference)


def test_score_is_per_sample_not_the_batch_gradient():
    model = tiny_model("llama")
    ids = random_ids(num_samples=6, seq_len=12)
    fast = gradient_importance(model, list(model.model.layers), ids, batch_size=6, progress_bar=False)
    model.zero_grad(set_to_none=True)
    # squared norm of the gradient of the mean loss over the batch: a different quantity
    losses = [model(s.unsqueeze(0), labels=s.unsqueeze(0)).loss for s in ids]
    torch.stack(losses).mean().backward()
    batch_norms = torch.tensor([sum(p.grad.double().pow(2).sum() for p in layer.parameters()) for layer in model.model.layers])
    assert torch.all(fast > batch_norms * 1.5)


def test_batch_size_does_not_change_scores():
    model = tiny_model("qwen2")
    ids = random_ids(num_samples=6, seq_len=12)
    one = gradient_importance(model, list(model.model.layers), ids, batch_size=1, progress_bar=False)
    all_at_once = gradient_importance(model, list(model.model.layers), ids, batch_size=6, progress_bar=False)
    torch.testing.assert_close(one, all_at_once, rtol=1e-5, atol=0)


def test_no_parameter_gradients_weights_mode_and_flags_untouched():
    model = tiny_model("llama")
    model.train()
    model.model.layers[1].mlp.up_proj.weight.requires_grad_(False)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    flags = {name: p.requires_grad for name, p in model.named_parameters()}
    gradient_importance(model, list(model.model.layers), random_ids(4, 10), batch_size=2, progress_bar=False)
    assert model.training
    assert all(p.grad is None for p in model.parameters())
    assert {name: p.requires_grad for name, p in model.named_parameters()} == flags
    assert all(torch.equal(before[name], p) for name, p in model.named_parameters())


@pytest.mark.parametrize("tokens, d_in, d_out", [(4, 16, 24), (32, 4, 6)])  # Gram form, then materialised form
def test_linear_norms_match_explicit_per_sample_gradients(tokens, d_in, d_out):
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(3, tokens, d_in, generator=generator)
    g = torch.randn(3, tokens, d_out, generator=generator)
    explicit = torch.stack([(g[j].T @ a[j]).pow(2).sum() + g[j].sum(0).pow(2).sum() for j in range(3)])
    torch.testing.assert_close(linear_per_sample_sq_norms(a, g, has_bias=True), explicit, rtol=1e-5, atol=1e-5)


def test_layers_of_another_model_are_refused():
    model, other = tiny_model("llama"), tiny_model("llama")
    with pytest.raises(ValueError, match="did not run in the model's forward pass"):
        gradient_importance(model, list(other.model.layers), random_ids(4, 10), batch_size=2, progress_bar=False)


def test_broadcast_path_is_exact_for_rms_norms_and_checked_before_use():
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from optimum_gradmap.importance import PerSampleGradientNorms, broadcast_per_sample_sq_norms, module_per_sample_sq_norms

    generator = torch.Generator().manual_seed(0)
    x, g = torch.randn(3, 7, 16, generator=generator), torch.randn(3, 7, 16, generator=generator)
    for norm in (LlamaRMSNorm(16), Gemma2RMSNorm(16)):
        torch.nn.init.normal_(norm.weight, generator=generator)
        torch.testing.assert_close(broadcast_per_sample_sq_norms(norm, x, g, 3), module_per_sample_sq_norms(norm, (x,), {}, g, 3))
    # LayerNorm takes no per-sample weights: the collector falls back to vmap for the class after one check
    collector = PerSampleGradientNorms([])
    collector._batch_size = 3
    layer_norm = torch.nn.LayerNorm(16)
    expected = module_per_sample_sq_norms(layer_norm, (x,), {}, g, 3)
    torch.testing.assert_close(collector._broadcast_or_check(layer_norm, (x,), {}, g), expected)
    assert collector._broadcast_ok[torch.nn.LayerNorm] is False
    assert collector._broadcast_ok.get(LlamaRMSNorm) is None


def test_loss_gradient_in_chunks_equals_autograd_of_the_per_sample_mean_loss(monkeypatch):
    from optimum_gradmap import objectives, vocabulary

    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 9, 8, generator=generator, dtype=torch.float64, requires_grad=True)
    head = torch.nn.Linear(8, 11, dtype=torch.float64)
    ids = torch.randint(0, 11, (3, 9), generator=generator)
    per_sample = torch.nn.functional.cross_entropy(head(hidden[:, :-1]).transpose(1, 2), ids[:, 1:], reduction="none").mean(1)
    (expected,) = torch.autograd.grad(per_sample.sum(), hidden)
    monkeypatch.setattr(vocabulary, "MAX_LOGIT_ELEMENTS", 5 * 11)  # chunks of 5 rows, across sample boundaries
    chunked = objectives.causal_lm_loss_gradient(hidden.detach(), ids, head, vocab_size=11)
    torch.testing.assert_close(chunked.double(), expected)
    assert torch.all(chunked[:, -1] == 0)


def test_a_head_the_adapter_does_not_reproduce_falls_back_to_the_whole_model(caplog):
    """Gemma2 caps its logits; an adapter that forgets it must not change the scores, only the memory."""
    from optimum_gradmap.adapters import DecoderAdapter
    from optimum_gradmap.streaming import split_at_lm_head

    class UncappedHead(DecoderAdapter):
        def compute_logits(self, model, hidden_states):
            return model.get_output_embeddings()(hidden_states)

    model = tiny_model("gemma2", final_logit_softcapping=0.5)
    layers = list(model.model.layers)
    ids = random_ids(num_samples=4, seq_len=10)
    with caplog.at_level("WARNING"):
        _, head, _ = split_at_lm_head(model, UncappedHead(), ids)
    assert isinstance(head, torch.nn.Identity) and "does not reproduce" in caplog.text
    fallback = gradient_importance(model, layers, ids, batch_size=2, progress_bar=False, adapter=UncappedHead())
    reference = naive_layer_scores(model, layers, ids)
    assert ((fallback - reference).abs() / reference).max().item() < 1e-4


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory (simulated)"), MemoryError("simulated")])
def test_running_out_of_memory_while_splitting_off_the_head_is_raised_not_taken_for_an_unknown_head(error):
    """Falling back to the whole model's logits would form every logit of a batch at once: never after an
    out-of-memory error."""
    from optimum_gradmap.adapters import DecoderAdapter
    from optimum_gradmap.streaming import split_at_lm_head

    class HeadOutOfMemory(DecoderAdapter):
        def compute_logits(self, model, hidden_states):
            raise error

    with pytest.raises(type(error), match="simulated"):
        split_at_lm_head(tiny_model("llama"), HeadOutOfMemory(), random_ids(num_samples=2, seq_len=8))


@pytest.mark.parametrize("execution", ["in_memory", "layer_streamed"])
def test_a_round_keeps_nothing_alive_after_it(execution):
    """The hooks of a round's last batch once held its activations through a cycle Python's collector cannot see (the
    autograd graph): every Stage 1 round kept its activations, and memory grew by round."""
    import gc

    from optimum_gradmap import streaming
    from optimum_gradmap.importance import PerSampleGradientNorms

    model = tiny_model("llama")
    ids = random_ids(num_samples=6, seq_len=12)

    def live_tensors() -> int:
        gc.collect()
        return sum(1 for item in gc.get_objects() if isinstance(item, torch.Tensor))

    with streaming.execution_mode(execution):
        gradient_importance(model, list(model.model.layers), ids, batch_size=2, progress_bar=False)
        before = live_tensors()
        for _ in range(3):
            gradient_importance(model, list(model.model.layers), ids, batch_size=2, progress_bar=False)
    assert live_tensors() == before
    assert not any(isinstance(item, PerSampleGradientNorms) for item in gc.get_objects())
