"""The cases of the data-parallel check, shared by tests/test_distributed.py (one process) and
tests/integration/distributed_worker.py (each of the torchrun processes)."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from optimum_gradmap import GradMAPConfig
from tests.conftest import random_ids, tiny_model

# case -> (family, config settings, calibration sequences). 10 sequences over 2 processes: shares of 5, so
# the cross-validation folds (sequence j in fold j mod 4) must be counted from each share's first sequence.
CASES = {
    "gradmap_default_stage2": ("llama", dict(num_layers_to_prune=2), 8),  # GradMAP, then the default Stage 2
    "bound_halving_shortlist_span_end_auto": (  # 3 candidates: 2 rungs of 5 sequences, shares of 2 and 3
        "llama",
        dict(
            num_layers_to_prune=2,
            importance="gradmap_bound_token",
            verify_top_k=3,
            verify_halving=True,
            compensation_target="span_end",
            reg_lambda="auto",
        ),
        10,
    ),
    "sleb_norm_after_mlp": (
        "gemma2",
        dict(num_layers_to_prune=2, importance="sleb", compensation_target="span_end", reg_lambda="auto", adam_steps=50),
        10,
    ),
    "taylor_moe": ("mixtral", dict(num_layers_to_prune=2, importance="taylor", protected_layers=[0, 5]), 8),
    # the default Stage 2 on 6 sequences: shares of 3, so rank 0 holds no held-out sequence (j mod 4 = 3) of the
    # next-token selection, and the outlier threshold's median is taken over both shares
    "default_stage2_no_held_out_sequence_on_rank_0": ("llama", dict(num_layers_to_prune=2), 6),
    # the heal stage, data-parallel: batches of 4 rows (2 per process; the last batch of 2: 1 each), 3 held-out
    # sequences (shares of 1 and 2), LoRA adapters merged at the end
    "heal_lora": (
        "llama",
        dict(
            num_layers_to_prune=2,
            heal_tokens=10 * 16,
            heal_seq_len=16,
            heal_validation_sequences=3,
            heal_batch_size=4,
            heal_check_every=1,
            heal_lr=1e-4,
            heal_autocast=False,
        ),
        8,
    ),
}


def case_heal_data(case: str) -> torch.LongTensor | None:
    """The heal text of `case`, or `None` for a case without the heal stage: 10 random sequences and, held out (the last
    rows), 3 of them again, so that what training learns shows in the held-out KL."""
    if not CASES[case][1].get("heal_tokens"):
        return None
    ids = random_ids(10, 16, seed=2)
    return torch.cat([ids, ids[:3]])


def case_inputs(case: str) -> tuple[torch.nn.Module, GradMAPConfig, torch.LongTensor, torch.LongTensor]:
    """The model, config, calibration sequences and probe sequences (for logits) of `case`."""
    family, settings, num_samples = CASES[case]
    config = GradMAPConfig(**settings, num_samples=num_samples, seq_len=16, batch_size=2)
    model = tiny_model(family, num_layers=6)
    if config.heal_tokens:  # next-token distributions far from uniform, so that the heal has something to repair
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(30)
    return model, config, random_ids(num_samples, 16), random_ids(2, 16, seed=1)


# The perplexity `prune --evaluate` measures, shared by the processes: dataset, segments (5 over 2 processes: shares
# of 2 and 3) and the model it is measured on.
EVALUATION = {"dataset": "offline:wikipedia", "max_segments": 5}


def evaluation_inputs() -> tuple[torch.nn.Module, PreTrainedTokenizerFast]:
    """The model and tokenizer of the shared evaluation: a tiny Llama and a byte-level tokenizer (256 tokens, one
    per byte, as tests/conftest.py's `byte_tokenizer` fixture)."""
    byte_encoder = pre_tokenizers.ByteLevel.alphabet()
    tokenizer = Tokenizer(models.BPE(vocab={symbol: index for index, symbol in enumerate(sorted(byte_encoder))}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tiny_model("llama", num_layers=4), PreTrainedTokenizerFast(tokenizer_object=tokenizer)
