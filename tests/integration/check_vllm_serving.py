"""Integration check (run by `.ci/run`, not collected by pytest): every checkpoint we write serves in vLLM
exactly as the pruned model runs in transformers.

For each case: prune with both stages (a small calibration set: this checks serving, not quality), save
with `save_pretrained` (which validates the folder), serve the folder with vLLM in its own environment
and compare with the pruned model still in memory (`verify_serving(reference_model=...)`): identical
greedy tokens and log-probabilities within `DEFAULT_LOGPROB_TOLERANCE`. Then the stale-config cases:
the checkpoint's config is rewritten as a careless tool would leave it (`layer_types` cut to length
instead of sliced; `max_window_layers` not recounted); `validate_checkpoint` must refuse it, and vLLM,
given it anyway, must disagree with the pruned model. Then the quantized cases (the [quantize] extra): the pruned
SmolLM2 and the tiny Llama quantized by llm-compressor to W8A8 and W4A16 (SmolLM2's INT4 weights in groups of 64: 128
does not divide its width, 576) serve in vLLM with bfloat16 activations and agree with transformers on the same
checkpoint within `optimum_gradmap.quantize.serving`'s bound (quantized kernels cannot match bit for bit).

    python tests/integration/check_vllm_serving.py --vllm-python /path/to/vllm-env/bin/python
    python tests/integration/check_vllm_serving.py --vllm-python V/bin/python --cases gemma3_text qwen2 --output results.json

Exits 1 if any case fails; prints one line per case and writes the details as JSON with `--output`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from optimum_gradmap import GradMAPConfig, GradMAPPruner, InvalidCheckpointError, validate_checkpoint
from optimum_gradmap.serving import verify_serving

TINY_LAYERS = 6
# Tiny random models of the families vLLM runs on CPU. Head size 32 (vLLM's CPU attention supports 32
# and up); weights initialised 5x larger than usual so that next-token distributions are peaked and a
# greedy choice is not decided by float32 rounding.
_TINY = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=256,
    initializer_range=0.1,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)
TINY_CASES = {
    # mixed sliding/full layers: a stale `layer_types` puts windows on the wrong layers
    "gemma3_text": ("gemma3_text", dict(_TINY, sliding_window=8, sliding_window_pattern=3, num_hidden_layers=TINY_LAYERS)),
    # Qwen2.5's own pattern: `max_window_layers` below the layer count, `use_sliding_window` off
    "qwen2": (
        "qwen2",
        dict(_TINY, use_sliding_window=False, sliding_window=8, max_window_layers=5, num_hidden_layers=TINY_LAYERS),
    ),
    "qwen3": (
        "qwen3",
        dict(_TINY, use_sliding_window=False, sliding_window=8, max_window_layers=5, num_hidden_layers=TINY_LAYERS),
    ),
    "llama": ("llama", dict(_TINY, num_hidden_layers=TINY_LAYERS)),
    "mistral": ("mistral", dict(_TINY, sliding_window=None, num_hidden_layers=TINY_LAYERS)),
    "phi3": ("phi3", dict(_TINY, pad_token_id=0, num_hidden_layers=TINY_LAYERS)),
    "gemma2": (
        "gemma2",
        dict(_TINY, sliding_window=8, num_hidden_layers=TINY_LAYERS, tie_word_embeddings=True),
    ),  # as every Gemma2: vLLM has no separate lm_head
    "olmo2": ("olmo2", dict(_TINY, num_hidden_layers=TINY_LAYERS)),
    "opt": ("opt", dict(_TINY, ffn_dim=256, word_embed_proj_dim=128, num_hidden_layers=TINY_LAYERS)),
    "gpt2": ("gpt2", dict(_TINY, n_embd=128, n_head=4, n_layer=TINY_LAYERS, n_positions=256)),
    "gpt_neox": (
        "gpt_neox",
        dict(_TINY, num_key_value_heads=4, num_hidden_layers=TINY_LAYERS),
    ),  # no grouped KV heads in GPT-NeoX
    "mixtral": (
        "mixtral",
        dict(_TINY, num_local_experts=4, num_experts_per_tok=2, sliding_window=None, num_hidden_layers=TINY_LAYERS),
    ),
    "qwen2_moe": (
        "qwen2_moe",
        dict(
            _TINY,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=128,
            shared_expert_intermediate_size=128,
            num_hidden_layers=TINY_LAYERS,
        ),
    ),
    "qwen3_moe": (
        "qwen3_moe",
        dict(_TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128, num_hidden_layers=TINY_LAYERS),
    ),
    # sliding window from layer 3 on: vLLM refuses such a Qwen2 (dense or pruned), see REFUSED_BY_VLLM
    "qwen2_mixed_sliding": (
        "qwen2",
        dict(_TINY, use_sliding_window=True, sliding_window=8, max_window_layers=3, num_hidden_layers=TINY_LAYERS),
    ),
}
# Cases vLLM itself cannot serve, with the reason its error gives: the check asserts that it refuses them
# with that reason (and not with another error), so that a vLLM that learns to serve them shows up here.
REFUSED_BY_VLLM = {
    "qwen2_mixed_sliding": "Sliding window for some but all layers is not supported",
}
# Stale configs to check: case -> whether the stale field changes what the model computes. It does for
# Gemma3's `layer_types` (windows on other layers); Qwen2.5's `max_window_layers` matters only with
# `use_sliding_window`, which vLLM does not serve on some layers only, so there only validation can tell.
STALE_CASES = {"gemma3_text": True, "qwen2": False}
REAL_CASES = {"smollm2-135m": 0.25, "qwen2.5-coder-0.5b": 0.25}
# Quantized with llm-compressor (the [quantize] extra), served with bfloat16 activations, after the exact check of
# the same pruned checkpoint: the agreement with transformers, within the bound of optimum_gradmap.quantize.serving.
QUANTIZED_CASES = {"smollm2-135m": ("w8a8", "w4a16"), "llama": ("w8a8", "w4a16")}


def tiny_model(case: str) -> torch.nn.Module:
    model_type, settings = TINY_CASES[case]
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **settings), dtype=torch.float32)


def prune_and_save(case: str, folder: str):
    """Both stages, saved (and validated) into `folder`; returns the pruned model."""
    if case in REAL_CASES:
        from optimum_gradmap.assets import load_model

        model, tokenizer = load_model(case)
        config = GradMAPConfig(pruning_ratio=REAL_CASES[case], num_samples=8, seq_len=64, dataset="offline:wikipedia")
        data = None
    else:
        model, tokenizer = tiny_model(case), None
        # random weights rank the last layers lowest; keep them (and the first) so that the removed layers lie
        # inside the stack: per-layer config fields then change, and Stage 2 has a kept layer to compensate. On
        # random tokens the default's next-token loss leaves most fits out; lambda by the hidden state's error
        # folds a W' in every family, so that what is served carries one.
        config = GradMAPConfig(
            num_layers_to_prune=2,
            num_samples=8,
            seq_len=32,
            protected_layers=[0, TINY_LAYERS - 1],
            compensation_selection="hidden_state",
        )
        data = torch.randint(3, 512, (8, 32), generator=torch.Generator().manual_seed(0))
    pruner = GradMAPPruner(config, tokenizer=tokenizer, progress_bar=False)
    result = pruner.prune(model, data)
    pruner.save_pretrained(folder)
    return result


def make_stale(folder: str, dense_layer_config: dict) -> str:
    """Rewrites the saved config as a tool that only fixes the layer count leaves it; returns what changed."""
    path = os.path.join(folder, "config.json")
    with open(path, encoding="utf-8") as file:
        config = json.load(file)
    num_layers = config["num_hidden_layers"]
    if "max_window_layers" in dense_layer_config:
        config["max_window_layers"] = dense_layer_config["max_window_layers"]
        changed = f"max_window_layers left at the dense model's {config['max_window_layers']}"
    else:
        config["layer_types"] = dense_layer_config["layer_types"][:num_layers]
        changed = "layer_types cut to the first layers' instead of the kept layers'"
    with open(path, "w", encoding="utf-8") as file:
        json.dump(config, file, indent=2)
    return changed


def calibration_tokenizer(folder: str):
    """The checkpoint's tokenizer, or for a tiny model without one a byte-level tokenizer (llm-compressor wants a
    tokenizer beside calibration data; the sequences are token ids already)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if os.path.isfile(os.path.join(folder, "tokenizer.json")):
        return AutoTokenizer.from_pretrained(folder)
    vocabulary = {symbol: index for index, symbol in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE(vocab=vocabulary, merges=[])))


def check_quantized(case: str, folder: str, result, vllm_python: str | None, records: list) -> list[str]:
    """Quantizes the pruned checkpoint in `folder` with each of the case's `QUANTIZED_CASES` schemes (calibrated on its
    Stage 1 sequences), serves it and measures the agreement; returns the failures."""
    from optimum_gradmap.quantize import quantize_model
    from optimum_gradmap.quantize.serving import verify_quantized_serving

    failures = []
    tokenizer = calibration_tokenizer(folder)
    for scheme in QUANTIZED_CASES[case]:
        start = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
        quantize_model(model, scheme, result.calibration_ids, tokenizer, "Stage 1's calibration sequences")
        quantized = f"{folder}-{scheme}"
        model.save_pretrained(quantized)
        if tokenizer.name_or_path:  # the checkpoint's own (a stand-in for a tiny model is not saved)
            tokenizer.save_pretrained(quantized)
        try:
            check = verify_quantized_serving(quantized, vllm_python, unquantized=folder)
        except RuntimeError as error:
            print(f"[{case} {scheme}] FAIL: {error}")
            failures.append(f"{case} {scheme}")
            continue
        records.append({"case": f"{case} {scheme}", **check.to_dict()})
        print(f"[{case} {scheme}] {time.perf_counter() - start:.0f} s")
        print(check.summary(), flush=True)
        if not check.agrees:
            failures.append(f"{case} {scheme}")
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", default=None, help="Python of the environment with vLLM")
    parser.add_argument("--cases", nargs="+", default=[*REAL_CASES, *TINY_CASES], help="which models to check")
    parser.add_argument("--stale-cases", nargs="*", default=list(STALE_CASES), help="tiny models to check stale")
    parser.add_argument("--quantized-cases", nargs="*", default=list(QUANTIZED_CASES), help="cases also quantized")
    parser.add_argument("--output", default=None, help="write every comparison as JSON to this file")
    args = parser.parse_args()

    failures, records = [], []
    with tempfile.TemporaryDirectory(prefix="gradmap-vllm-check-") as root:
        for case in args.cases:
            start = time.perf_counter()
            folder = os.path.join(root, case)
            result = prune_and_save(case, folder)
            if case in REFUSED_BY_VLLM:
                try:
                    verify_serving(folder, args.vllm_python, reference_model=result.model)
                    print(f"[{case}] FAIL: vLLM served it; it is listed as refused ({REFUSED_BY_VLLM[case]})")
                    failures.append(case)
                except RuntimeError as error:
                    refused = REFUSED_BY_VLLM[case] in str(error)
                    print(f"[{case}] vLLM refuses it{'' if refused else ' with another error'}: {REFUSED_BY_VLLM[case]}")
                    records.append({"case": case, "refused": REFUSED_BY_VLLM[case], "as_expected": refused})
                    if not refused:
                        print(str(error))
                        failures.append(case)
                continue
            try:
                check = verify_serving(folder, args.vllm_python, reference_model=result.model)
            except RuntimeError as error:  # vLLM could not load it: a failure, with vLLM's own words
                print(f"[{case}] FAIL: {error}")
                failures.append(case)
                continue
            records.append({"case": case, "removed_layers": result.removed_layers, **check.to_dict()})
            print(
                f"[{case}] removed {result.removed_layers}, compensated {result.compensated_layers}; "
                f"{time.perf_counter() - start:.0f} s"
            )
            print(check.summary(), flush=True)
            if not check.matched:
                failures.append(case)
            if case in args.quantized_cases:
                failures += check_quantized(case, folder, result, args.vllm_python, records)
            if case not in args.stale_cases:
                continue
            changed = make_stale(folder, result.dense_layer_config)
            try:
                validate_checkpoint(folder)
                print(f"[{case} stale] FAIL: validate_checkpoint accepted a config with {changed}")
                failures.append(f"{case} stale (validation)")
            except InvalidCheckpointError as error:
                print(f"[{case} stale] validate_checkpoint refused it: {str(error).splitlines()[1]}")
            if not STALE_CASES[case]:
                continue
            stale = verify_serving(folder, args.vllm_python, reference_model=result.model, validate=False)
            records.append({"case": f"{case} stale", "changed": changed, **stale.to_dict()})
            print(stale.summary(), flush=True)
            if stale.matched:
                print(f"[{case} stale] FAIL: vLLM served the stale checkpoint as the pruned model runs")
                failures.append(f"{case} stale (vLLM)")
    if args.output:
        with open(args.output, "w", encoding="utf-8") as file:
            json.dump(records, file, indent=2)
    print(
        f"vLLM serving check: {len(args.cases)} checkpoints, {len(args.stale_cases)} stale, "
        f"{sum(len(QUANTIZED_CASES[case]) for case in args.quantized_cases if case in args.cases)} quantized; "
        f"failures: {failures or 'none'}"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
