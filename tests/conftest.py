"""Shared fixtures: tiny random models built from configs, a byte-level tokenizer, and the real
SmolLM2-135M from the offline assets."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, PreTrainedTokenizerFast, Qwen2Config

from optimum_gradmap import GradMAPConfig

VOCAB_SIZE = 256

TINY_CONFIGS = {
    "llama": lambda **kw: LlamaConfig(**kw),
    "mistral": lambda **kw: MistralConfig(sliding_window=None, **kw),
    # Sliding attention on the layers from index 3 on, so `layer_types` is not uniform.
    "qwen2": lambda **kw: Qwen2Config(use_sliding_window=True, sliding_window=8, max_window_layers=3, **kw),
}
ARCHITECTURES = sorted(TINY_CONFIGS)


def tiny_model(model_type: str, num_layers: int = 6, seed: int = 0, **overrides) -> torch.nn.Module:
    """A randomly initialised causal LM of the given family, small enough for CPU tests."""
    settings = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    settings.update(overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(TINY_CONFIGS[model_type](**settings), dtype=torch.float32)
    # At random init the importance simply decays with depth. Shape the layers like a trained LLM's
    # instead: strong first and last layers, weak middle ones (so pruning removes middle layers and
    # the later kept layers drift).
    with torch.no_grad():
        for index, layer in enumerate(model.model.layers):
            depth = index / max(1, num_layers - 1)
            scale = 0.4 + 1.6 * abs(2 * depth - 1) ** 2
            for parameter in layer.parameters():
                if parameter.dim() == 2:
                    parameter.mul_(scale)
    return model.eval()


def random_ids(num_samples: int = 8, seq_len: int = 16, seed: int = 0) -> torch.LongTensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB_SIZE, (num_samples, seq_len), generator=generator)


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


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M (offline asset, fetched and converted once), and its tokenizer."""
    from optimum_gradmap.assets import get_model_path

    path = get_model_path("smollm2-135m")
    from transformers import AutoTokenizer

    return path, AutoTokenizer.from_pretrained(path)
