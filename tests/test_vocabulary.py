"""Forward-only quantities over the vocabulary formed a few tokens at a time (optimum_gradmap.objectives, the logits
from optimum_gradmap.vocabulary): the same next-token loss, teacher targets and KL as from the whole logits, in memory
and with the head offloaded (a slice of the vocabulary at a time), and the same pruning: selected layers, scores and
Stage 2's choices."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from optimum_gradmap import GradMAPPruner, objectives, vocabulary
from optimum_gradmap.adapters import get_adapter
from optimum_gradmap.distillation import TOP_K, targets_from_logits, teacher_targets
from optimum_gradmap.objectives import summed_next_token_loss, top_k_kl
from optimum_gradmap.streaming import split_at_lm_head
from tests.conftest import random_ids, small_config, tiny_model


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 5 rows (or vocabulary slices of 64 // rows tokens), across sequence boundaries."""
    monkeypatch.setattr(vocabulary, "MAX_LOGIT_ELEMENTS", 5 * 64)


def _offloaded_copy(model: torch.nn.Module, folder: str) -> torch.nn.Module:
    """`model` saved, then dispatched by Accelerate with its head and most layers on disk."""
    model.save_pretrained(folder)
    return AutoModelForCausalLM.from_pretrained(
        folder, device_map="auto", max_memory={"cpu": 60_000}, offload_folder=os.path.join(folder, "offload"), dtype=torch.float32
    )


def _whole(model: torch.nn.Module, batch: torch.LongTensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=batch, use_cache=False).logits


@pytest.mark.parametrize("offloaded", [False, True])
def test_chunked_loss_targets_and_kl_equal_those_of_the_whole_logits(tmp_path, small_chunks, offloaded):
    dense = tiny_model("llama")
    model = _offloaded_copy(dense, str(tmp_path / "model")) if offloaded else dense
    ids = random_ids(3, 12)
    assert vocabulary.vocabulary_head(model).final_hidden_states is None  # no gradient pass has checked the split yet
    split_at_lm_head(model, get_adapter(model), ids)
    head = vocabulary.vocabulary_head(model)
    assert head.final_hidden_states is not None and (head.sliced is not None) == offloaded
    logits = _whole(dense, ids)
    with torch.no_grad():
        hidden = head.final_hidden_states(ids)
        loss = objectives.summed_loss(model, ids, head)
        indices, log_probs, rest = objectives.chunked_top_k(hidden, head, TOP_K)
    torch.testing.assert_close(loss, summed_next_token_loss(logits, ids), rtol=1e-6, atol=0)
    expected = targets_from_logits(logits[:, :-1])
    assert torch.equal(indices.int(), expected.indices)
    torch.testing.assert_close(log_probs, expected.log_probs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rest, expected.rest_log_prob, rtol=1e-5, atol=1e-5)
    # the teacher's targets of another model, and this one's KL to them
    teacher = tiny_model("llama", seed=1)
    targets = targets_from_logits(_whole(teacher, ids)[:, :-1])
    kl = objectives.chunked_top_k_kl(hidden, targets, head)
    # a small difference of float32 logs summed over the positions: float32's rounding, relatively larger
    torch.testing.assert_close(kl, top_k_kl(logits[:, :-1], targets).double().sum(), rtol=1e-4, atol=0)
    chunked_targets = teacher_targets(model, ids, batch_size=2, progress_bar=False)
    assert torch.equal(chunked_targets.indices, expected.indices)
    torch.testing.assert_close(chunked_targets.log_probs, expected.log_probs, rtol=1e-5, atol=1e-5)


def test_chunked_pruning_selects_and_scores_as_the_whole_logits(monkeypatch):
    """After Stage 1's gradient passes have checked the split at the head, Stage 2's held-out next-token loss (its
    passes starting from recorded hidden states) reads the loss a few logits at a time: the same layers, scores and
    compensation as with every logit of a batch at once. SLEB (no gradient pass) keeps the whole logits: the same."""
    ids = random_ids(8, 24)  # longer than the 16 tokens that check the head's split: not a recorded sequence
    config = small_config(importance="gradmap", seq_len=24, reg_lambda="auto", compensation_target="span_end")
    results = {}
    for name, size in (("whole", 2**40), ("chunked", 5 * 64)):
        monkeypatch.setattr(vocabulary, "MAX_LOGIT_ELEMENTS", size)
        results[name] = GradMAPPruner(config, progress_bar=False).prune(tiny_model("llama"), ids)
    whole, chunked = results["whole"], results["chunked"]
    assert chunked.removed_layers == whole.removed_layers
    assert chunked.compensated_layers == whole.compensated_layers
    for chunked_round, whole_round in zip(chunked.scores, whole.scores):
        assert chunked_round == pytest.approx(whole_round, rel=1e-5)
    torch.testing.assert_close(_whole(chunked.model, ids), _whole(whole.model, ids))  # Stage 2 chose the same fits
    sleb = small_config(importance="sleb", seq_len=24)
    for name, size in (("whole", 2**40), ("chunked", 5 * 64)):
        monkeypatch.setattr(vocabulary, "MAX_LOGIT_ELEMENTS", size)
        results[name] = GradMAPPruner(sleb, progress_bar=False).prune(tiny_model("llama"), ids)
    assert results["chunked"].removed_layers == results["whole"].removed_layers
    for chunked_round, whole_round in zip(results["chunked"].scores, results["whole"].scores):
        assert chunked_round == pytest.approx(whole_round, rel=1e-6)
