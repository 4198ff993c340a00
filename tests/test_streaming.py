"""Layer-streamed execution (optimum_gradmap.streaming) and models dispatched by Accelerate with CPU/disk
offload: the same scores, layers and logits as in memory, one layer's weights at a time, the fold written
where offloaded weights live and never into the model's own files."""

from __future__ import annotations

import copy
import hashlib
import os
from contextlib import contextmanager

import pytest
import torch
from transformers import AutoModelForCausalLM

from optimum_gradmap import GradMAPConfig, GradMAPPruner, streaming
from optimum_gradmap.adapters import get_adapter
from optimum_gradmap.configuration import PAPER_STAGE2
from optimum_gradmap.importance import get_importance_metric
from optimum_gradmap.objectives import causal_lm_loss_gradient, vocab_sliced_loss_gradient
from tests.conftest import FAMILIES, random_ids, small_config, tiny_model

# every gradient pass: per-parameter hooks (gradmap), residual-branch hooks (the bound), parameter .grad (taylor)
STREAMED_METRICS = ["gradmap", "gradmap_bound_token", "taylor"]


@contextmanager
def _counting_streamed_batches(calls: list):
    original = streaming.streamed_backward

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    streaming.streamed_backward = counted
    try:
        yield
    finally:
        streaming.streamed_backward = original


@pytest.mark.parametrize("family", FAMILIES)
def test_layer_streamed_scores_equal_in_memory(family):
    model = tiny_model(family)
    adapter = get_adapter(model)
    ids = random_ids(6, 16)
    for name in STREAMED_METRICS:
        metric = get_importance_metric(name)
        in_memory = metric.score(model, adapter, ids, 4, progress_bar=False)
        calls = []
        with streaming.execution_mode("layer_streamed"), _counting_streamed_batches(calls):
            streamed = metric.score(model, adapter, ids, 4, progress_bar=False)
        assert len(calls) == 2, "two batches, each streamed"
        torch.testing.assert_close(torch.tensor(streamed), torch.tensor(in_memory), rtol=1e-10, atol=0, msg=f"{family} {name}")


def _offloaded(folder: str, max_cpu_bytes: int = 120_000) -> torch.nn.Module:
    """The checkpoint in `folder` dispatched by Accelerate: what fits in `max_cpu_bytes` in memory, the rest on disk."""
    return AutoModelForCausalLM.from_pretrained(
        folder,
        device_map="auto",
        max_memory={"cpu": max_cpu_bytes},
        offload_folder=os.path.join(folder, "offload"),
        dtype=torch.float32,
    )


def _sha256(path: str) -> str:
    with open(path, "rb") as file:
        return hashlib.sha256(file.read()).hexdigest()


@pytest.mark.parametrize(
    "family, stage2",
    [
        ("llama", dict()),  # the paper's Stage 2: the largest-drift layer, the last one, is on disk
        ("llama", dict(compensation_target="span_end", reg_lambda="auto")),
        ("gemma2", dict(compensation_target="span_end", reg_lambda="auto", adam_steps=50)),  # norm after the MLP
        ("mixtral", dict()),  # 3-D expert weights
        # SLEB's verification (forward passes with stand-ins) and the fold between removals, offloaded too
        ("llama", dict(importance="gradmap_bound_token", verify_top_k=2, compensate_each_round=True, reg_lambda="auto")),
    ],
)
def test_offloaded_model_prunes_like_in_memory(tmp_path, family, stage2):
    dense = tiny_model(family)
    folder = str(tmp_path / "dense")
    dense.save_pretrained(folder)
    source_hash = _sha256(os.path.join(folder, "model.safetensors"))
    ids, probe = random_ids(8, 16), random_ids(2, 16, seed=1)
    config = small_config(**stage2)

    in_memory = GradMAPPruner(config, progress_bar=False).prune(copy.deepcopy(dense), ids)
    model = _offloaded(folder)
    assert "disk" in model.hf_device_map.values() and streaming.is_offloaded(model)
    offloaded = GradMAPPruner(config, progress_bar=False).prune(model, ids)

    assert offloaded.removed_layers == in_memory.removed_layers
    assert offloaded.compensated_layers == in_memory.compensated_layers
    for streamed_round, in_memory_round in zip(offloaded.scores, in_memory.scores):
        assert streamed_round == pytest.approx(
            in_memory_round, rel=1e-5
        )  # the head by vocabulary slices: float32 sums, other order
    with torch.no_grad():
        expected = in_memory.model(probe).logits
        torch.testing.assert_close(offloaded.model(probe).logits, expected, rtol=1e-6, atol=1e-6)
    assert _sha256(os.path.join(folder, "model.safetensors")) == source_hash, "the model's own files were written"

    saved = offloaded.save_pretrained(str(tmp_path / "pruned"))
    with torch.no_grad():
        reloaded = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32)(probe).logits
    torch.testing.assert_close(reloaded, expected, rtol=1e-6, atol=1e-6)


def test_offloaded_fold_is_written_to_the_offload_folder(tmp_path):
    folder = str(tmp_path / "dense")
    tiny_model("llama").save_pretrained(folder)
    model = _offloaded(folder)
    assert model.hf_device_map["model.layers.5"] == "disk"
    config = GradMAPConfig(layers_to_prune=[2, 3], num_samples=8, seq_len=16, batch_size=4, **PAPER_STAGE2)
    result = GradMAPPruner(config, progress_bar=False).prune(model, random_ids(8, 16))
    assert result.compensated_layers == [5]  # the paper's target, the largest drift: the last layer, on disk
    written = os.listdir(os.path.join(folder, "offload"))
    assert written == ["model.layers.5.mlp.down_proj.weight.dat"]
    assert model.model.layers[-1].mlp.down_proj.weight.device.type == "meta"  # still offloaded after the fold


def test_layer_streamed_pass_holds_one_offloaded_layer_at_a_time(tmp_path):
    folder = str(tmp_path / "dense")
    tiny_model("llama").save_pretrained(folder)
    model = _offloaded(folder, max_cpu_bytes=60_000)
    adapter = get_adapter(model)
    layers = list(adapter.get_layers(model))
    offloaded = [layer for layer in layers if layer.mlp.down_proj.weight.device.type == "meta"]
    assert len(offloaded) >= 4
    most_at_once = 0

    def count(module, args, output):
        nonlocal most_at_once
        real = sum(layer.mlp.down_proj.weight.device.type != "meta" for layer in offloaded)
        most_at_once = max(most_at_once, real)

    handles = [layer.register_forward_hook(count) for layer in layers]
    try:
        scores = get_importance_metric("gradmap").score(model, adapter, random_ids(4, 16), 4, progress_bar=False)
    finally:
        for handle in handles:
            handle.remove()
    assert most_at_once == 1
    assert all(score > 0 for score in scores)


def test_parameter_gradient_score_on_offloaded_model_says_why(tmp_path):
    folder = str(tmp_path / "dense")
    tiny_model("llama").save_pretrained(folder)
    model = _offloaded(folder)
    with pytest.raises(NotImplementedError, match="offloaded weights cannot accumulate"):
        get_importance_metric("taylor").score(model, get_adapter(model), random_ids(4, 16), 4, progress_bar=False)


def test_execution_mode_is_checked():
    with pytest.raises(ValueError, match="`execution` must be one of \\('auto', 'in_memory', 'layer_streamed'\\)"):
        GradMAPConfig(pruning_ratio=0.25, execution="streamed")


def test_inference_speed_runs_on_a_model_whose_embeddings_are_offloaded(tmp_path):
    """The embeddings' weight is a "meta" placeholder under offload: the prompt goes where they run."""
    from optimum_gradmap.evaluation import inference_speed

    folder = str(tmp_path / "dense")
    tiny_model("llama").save_pretrained(folder)
    model = _offloaded(folder, max_cpu_bytes=1_000)  # nothing fits in memory: every weight on disk
    assert model.get_input_embeddings().weight.device.type == "meta"
    speed = inference_speed(model, prompt_length=8, new_tokens=2, warmup=0, repeats=1)
    assert speed.device == "cpu" and speed.decode_tokens_per_second > 0


def test_vocab_sliced_loss_gradient_equals_the_whole_head():
    model = tiny_model("gemma2")  # its head soft-caps the logits: the slices must differentiate through it
    assert model.config.final_logit_softcapping
    adapter = get_adapter(model)
    hidden = torch.randn(2, 16, model.config.hidden_size)
    ids = random_ids(2, 16)
    head = lambda states: adapter.compute_logits(model, states)  # noqa: E731
    expected = causal_lm_loss_gradient(hidden, ids, head, model.config.vocab_size)
    sliced = vocab_sliced_loss_gradient(
        hidden, ids, head, model.get_output_embeddings(), model.config.vocab_size, max_logits=30 * 40
    )  # 30 rows: slices of 40 of the 256 tokens, the last one shorter
    torch.testing.assert_close(sliced, expected, rtol=1e-5, atol=1e-7)
    assert model.get_output_embeddings().weight.shape[0] == model.config.vocab_size  # the head is whole again


def test_offloaded_head_read_by_slices_stays_whole(tmp_path):
    folder = str(tmp_path / "dense")
    dense = tiny_model("llama", tie_word_embeddings=True)
    dense.save_pretrained(folder)
    model = _offloaded(folder, max_cpu_bytes=1)
    head = model.get_output_embeddings()
    assert head.weight.device.type == "meta"
    adapter = get_adapter(model)
    hidden, ids = torch.randn(2, 16, model.config.hidden_size), random_ids(2, 16)
    compute_logits = lambda states: adapter.compute_logits(model, states)  # noqa: E731
    with torch.no_grad():
        expected = causal_lm_loss_gradient(hidden, ids, lambda states: adapter.compute_logits(dense, states), 256)
    for _ in range(2):  # the head must be whole again after each use
        sliced = vocab_sliced_loss_gradient(hidden, ids, compute_logits, head, 256, max_logits=30 * 100)
        torch.testing.assert_close(sliced, expected, rtol=1e-5, atol=1e-7)
        assert head.weight.shape == (256, model.config.hidden_size) and head.weight.device.type == "meta"
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, dense(ids).logits)


def test_offloaded_embedding_read_by_slices(tmp_path):
    folder = str(tmp_path / "dense")
    dense = tiny_model("gemma3_text", pad_token_id=250)  # it scales what it looks up; a padding row past the first slice
    dense.save_pretrained(folder)
    model = _offloaded(folder, max_cpu_bytes=1)
    embeddings = model.get_input_embeddings()
    assert embeddings.weight.device.type == "meta"
    ids = random_ids(2, 16)
    sliced = streaming.vocab_sliced_embeddings(embeddings, ids, 256, max_rows=100)  # 3 slices
    with torch.no_grad():
        torch.testing.assert_close(sliced, dense.get_input_embeddings()(ids))
    assert embeddings.weight.shape == (256, model.config.hidden_size) and embeddings.weight.device.type == "meta"


def test_an_offloaded_model_is_saved_in_shards_of_the_default_size(tmp_path, monkeypatch):
    """Saving an offloaded model reads its weights a shard at a time: the library's 5GB default (the Hub's), not
    transformers' 50GB, bounds the memory a large model's save holds. A smaller limit gives smaller shards, and the
    checkpoint reloads to the same logits."""
    from optimum_gradmap import checkpoint

    folder = str(tmp_path / "dense")
    tiny_model("llama").save_pretrained(folder)
    model = _offloaded(folder)
    config = small_config(num_layers_to_prune=None, layers_to_prune=[2], compensation=False)
    result = GradMAPPruner(config, progress_bar=False).prune(model, random_ids(8, 16))
    sizes = []
    original = type(model).save_pretrained

    def recorded(self, *args, **kwargs):
        sizes.append(kwargs.get("max_shard_size"))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "save_pretrained", recorded)
    result.save_pretrained(str(tmp_path / "default"))
    assert sizes == [checkpoint.DEFAULT_MAX_SHARD_SIZE] == ["5GB"]
    saved = result.save_pretrained(str(tmp_path / "small"), max_shard_size="100KB")
    shards = [name for name in os.listdir(saved) if name.endswith(".safetensors")]
    assert len(shards) > 1 and all(os.path.getsize(os.path.join(saved, name)) < 400_000 for name in shards)
    probe = random_ids(2, 16, seed=1)
    with torch.no_grad():
        reloaded = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32)(probe).logits
        torch.testing.assert_close(reloaded, model(probe).logits, rtol=1e-6, atol=1e-6)
