"""Shared fixtures: tiny random models built from configs, a byte-level tokenizer, and the real
SmolLM2-135M from the offline assets."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from optimum_gradmap import GradMAPConfig, precision
from optimum_gradmap.adapters import get_adapter

VOCAB_SIZE = 256

_DECODER = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)

# Per family: the settings of a tiny model that still exercises what is special about the family.
TINY_SETTINGS = {
    "llama": dict(_DECODER),
    "mistral": dict(_DECODER, sliding_window=None),
    # sliding attention from layer 3 on: `layer_types` is not uniform and `max_window_layers` matters
    "qwen2": dict(_DECODER, use_sliding_window=True, sliding_window=8, max_window_layers=3),
    "qwen3": dict(_DECODER, head_dim=8),
    "gemma2": dict(_DECODER, head_dim=8, sliding_window=8),
    "gemma3_text": dict(_DECODER, head_dim=8, sliding_window=8, sliding_window_pattern=3),
    "phi3": dict(_DECODER, pad_token_id=0),
    "olmo2": dict(_DECODER),
    "opt": dict(hidden_size=32, ffn_dim=64, num_attention_heads=4, word_embed_proj_dim=32, max_position_embeddings=128),
    "gpt2": dict(n_embd=32, n_head=4, n_positions=128),
    "gpt_neox": dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, max_position_embeddings=128),
    "mixtral": dict(_DECODER, num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
    "qwen2_moe": dict(
        _DECODER, **_MOE, num_experts=4, shared_expert_intermediate_size=32, decoder_sparse_step=2, mlp_only_layers=[4]
    ),
    "qwen3_moe": dict(_DECODER, **_MOE, num_experts=4, head_dim=8, mlp_only_layers=[1]),
}
ARCHITECTURES = ["llama", "mistral", "qwen2"]  # the first three families, used where one of each layout suffices
FAMILIES = sorted(TINY_SETTINGS)


def use_float32_passes() -> None:
    """Stage 1 and Stage 2 compute in float32 in this process: the worker processes of the data-parallel tests call
    it, since the one-process runs they are compared with compute so (the fixture below)."""
    precision.bfloat16_passes_available = lambda device: False


@pytest.fixture(autouse=True)
def float32_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stage 1 and Stage 2 compute in float32 (as on hardware without native bfloat16, where `precision="auto"` is
    float32), so that the suite's figures are exact on every machine; tests/test_precision.py turns the bfloat16
    passes on where it tests them."""
    monkeypatch.setattr(precision, "bfloat16_passes_available", lambda device: False)


def tiny_model(model_type: str, num_layers: int = 6, seed: int = 0, **overrides) -> torch.nn.Module:
    """A randomly initialised causal LM of the given family, small enough for CPU tests."""
    settings = dict(TINY_SETTINGS[model_type], vocab_size=VOCAB_SIZE, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    settings["n_layer" if model_type == "gpt2" else "num_hidden_layers"] = num_layers
    settings.update(overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **settings), dtype=torch.float32)
    # At random init the importance simply decays with depth. Shape the layers like a trained LLM's
    # instead: strong first and last layers, weak middle ones (so pruning removes middle layers and
    # the later kept layers drift).
    with torch.no_grad():
        for index, layer in enumerate(get_adapter(model).get_layers(model)):
            depth = index / max(1, num_layers - 1)
            scale = 0.4 + 1.6 * abs(2 * depth - 1) ** 2
            for name, parameter in layer.named_parameters():
                if parameter.dim() >= 2:
                    parameter.mul_(scale)
                elif "norm" in name and name.endswith("weight"):  # post-norm families: the norm sets the scale
                    if torch.count_nonzero(parameter) == 0:  # Gemma stores (scale - 1)
                        parameter.fill_(scale - 1)
                    else:
                        parameter.mul_(scale)
    return model.eval()


def random_ids(num_samples: int = 8, seq_len: int = 16, seed: int = 0) -> torch.LongTensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB_SIZE, (num_samples, seq_len), generator=generator)


def layers_before_removed_runs(removed_layers: list[int]) -> list[int]:
    """Where the default Stage 2 (`compensation_target="span_end"`) fits: the kept layer just before each run
    of consecutive removed layers (a run that starts at layer 0 has none)."""
    removed = set(removed_layers)
    return sorted(index - 1 for index in removed if index > 0 and index - 1 not in removed)


def small_config(**overrides) -> GradMAPConfig:
    settings = dict(num_layers_to_prune=2, num_samples=8, seq_len=16, batch_size=4)
    settings.update(overrides)
    return GradMAPConfig(**settings)


@pytest.fixture
def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer with 256 tokens, one per byte: works offline on any text."""
    byte_encoder = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: index for index, symbol in enumerate(sorted(byte_encoder))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


@pytest.fixture
def tiny_checkpoint(tmp_path, byte_tokenizer) -> str:
    """A dense tiny Llama saved as a normal checkpoint folder, with a tokenizer."""
    folder = tmp_path / "dense"
    tiny_model("llama", num_layers=6).save_pretrained(folder)
    byte_tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M (offline asset, fetched and converted once), and its tokenizer."""
    from optimum_gradmap.assets import get_model_path

    path = get_model_path("smollm2-135m")
    from transformers import AutoTokenizer

    return path, AutoTokenizer.from_pretrained(path)
