"""GradMAP at the paper's setting on a GPU (issue 64, item 5): an 8B-shaped model built on the device itself with random
weights, Stage 1 (128 x 128 tokens, 25%), Stage 2 and a short heal, each timed, with its peak GPU memory and Stage 1's
share of the device's peak FLOP/s (MFU), set beside the paper's 123 s on two A40s.

Random weights make the chosen layers and every loss meaningless: this measures time, memory and throughput only.

    python benchmarks/scale_gpu.py --model llama-3.1-8b --device cuda --resume

**On the lent GPU machine** (`run` tool; /work/.library/device/README.md). That machine has no network and its own
python3 with torch 2.11, transformers 5.17, accelerate and peft, which is all this needs: the repository travels (the
working tree) and runs from `PYTHONPATH`, nothing is installed (`pip install -e .` would need the network for its build
backend and for `optimum` and `datasets`, which no code path here imports). Nothing large travels: the model is built
there. The calibration text (offline Wikipedia through SmolLM2-135M's tokenizer) and the heal's web text travel as a
7 MB folder laid out like the offline-asset cache; without it the run uses random token ids and says so. Here, once:

    echo /.scale_gpu_assets/ >> .git/info/exclude
    .venv/bin/python benchmarks/scale_gpu.py --pack-assets .scale_gpu_assets

then `run` with `carry=[".scale_gpu_assets"]`, `timeout_s=480` (with the machine's start, about 10 of the session's 15
device minutes, leaving enough for a `--resume` rerun) and this command (COMMIT: `git rev-parse HEAD` here, written
out: the copy there may have no git history; run it from a committed tree, else the rows say `dirty` only here):

    set -o pipefail; export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD OPTIMUM_GRADMAP_CACHE=$PWD/.scale_gpu_assets
    PROVENANCE_COMMIT=COMMIT; python3 benchmarks/scale_gpu.py --model llama-3.1-8b --device cuda --resume
    --copy-to $OUT 2>&1 | tee $OUT/scale_gpu.log

The record (and the Stage 1 checkpoint) come back under the reply's `files_at`: copy them into benchmarks/results/.
Each stage's row is written (and copied to `--copy-to`) as soon as it is measured, so a slot that ends early still
returns what was measured; with those files copied back, `--resume` skips the stages already recorded, and a Stage 1
that a later stage needs is replayed from its checkpoint instead of scored again (the record travels by itself; the
checkpoint, `benchmarks/results/scale_gpu-<model>-<device>-stage1.json`, is git-ignored: name it in `carry` too).

**What it does.** The model is the published config of `benchmarks/scale.py` (`ARCHITECTURES`, `architecture_config`),
built with `AutoModelForCausalLM.from_config` under `torch.device(DEVICE)` in bfloat16, then every weight is drawn again
from one seeded generator on the device in `named_parameters` order, as the family's `_init_weights` draws it: normal(0,
`initializer_range`) for linear maps and embeddings, ones for norms, zeros for biases (each drawn in float32, then cast).
Calibration: 128 windows of 128 tokens of `offline:wikipedia` (`prepare_calibration_data`, seed 0; the SmolLM2 ids,
< 49,152, lie inside every vocabulary here), or, with `--calibration random` or without the offline assets, ids drawn
uniformly from the vocabulary (seed 0). Which text does not matter with random weights; the record says which it was.
Then, each between `torch.cuda.synchronize()` calls, with the peak memory reset before it:

1. Stage 1 with the default config at the paper's setting, `GradMAPPruner(GradMAPConfig(pruning_ratio=0.25,
   num_samples=128, seq_len=128, batch_size=B)).select_layers(model, ids, stage1_checkpoint=...)`: seconds in all and per
   round (the checkpoint's), peak memory (`torch.cuda.max_memory_allocated`), FLOPs (below) and MFU;
2. Stage 2, `pruner.compensate(result)`: seconds, peak memory, the layers it fitted;
3. the heal, `pruner.heal(result, heal_data, heal_tokens=N)` (LoRA, the default; the teacher is the pruned model with its
   layers put back): tokens per second of training (trained tokens over the seconds after the teacher's pass, held-out
   checks included) and in all, peak memory.

**Stage 1's FLOPs**, counted from the config (`stage1_flops`; tests/test_scale_gpu.py checks them against the FLOPs
`torch.utils.flop_counter` counts for every matrix product of the library's Stage 1 on a tiny model). Stage 1 at
ratio r removes K = round(r L) layers in K rounds; round k (k = 0..K-1) scores the model's L - k layers with one
gradient pass over the N x T calibration tokens, on the GPU with the model in memory (no layer streaming). With P the
linear-map parameters of one decoder layer, d = heads x head_dim, V the vocabulary, h the hidden size, a pass over
n = L - k layers costs

    forward   2 P n N T + 4 T^2 d n N                 (matrix products, and attention's QK^T and AV over all T^2 pairs)
    backward  2 P n N T + 8 T^2 d n N                 (input gradients only: the parameters are frozen)
    head      2 x 2 V h N (T - 1)                     (logits and their gradient, for the T - 1 positions with a label)
    norms     N n sum over linear maps of 2 T^2 (d_in + d_out), an input's Gram counted once for the maps that share it
              (q, k, v; gate, up), or 2 T d_in d_out where that is cheaper (the code picks the same way)

(a few more: a 16-token check of the head split, and 2 T^2 per map and sample for the Gram products). That is about
2 x 2 x (non-embedding parameters of the kept layers + head) x N T, not 3 x 2 x: without weight gradients the backward
costs about one forward. For Llama-3.1-8B at 128 x 128: 0.50 PFLOP in the first round (the norms 2% of it, the head
7%), 3.6 PFLOP for the 8 rounds. MFU = those FLOPs / Stage 1's seconds / the device's peak dense bf16
FLOP/s, from `PEAK_BF16_FLOPS` keyed by `torch.cuda.get_device_name()` (vendor datasheets; unknown device: no MFU).

**Time on an H100/H200** (under the 8-minute budget): start and imports ~30 s, the build ~20 s, Stage 1 3.6 PFLOP: at
40% of 989 TFLOP/s, 9 s (8 rounds of ~1.1 s), at 10%, 37 s; Stage 2 (`GradMAPPruner.plan`: 0.4-3.3 PFLOP plus float64
solves on the host) up to ~2.5 min; the heal of 65,536 tokens (the teacher's pass, training, held-out checks: ~3.4
PFLOP) 10-40 s. About 2 to 4 minutes in all; peak memory ~16 GB of weights plus ~22 GB of activations at batch 32
(`GradMAPPruner.plan`, math attention: an upper bound), inside 80 GB. `--time-limit` (default 420 s from the start)
skips Stage 2 when less than `STAGE2_RESERVE_SECONDS` is left, and the heal when less than twice its estimate at
Stage 1's achieved FLOP/s (plus 30 s) is left.

**The paper's figure**, copied into the record (`PAPER`), marked as a copy: Stage 1 in 123.42 s (169.42 s with Stage 2)
for Llama-2-7B at 25% with 128 x 128 calibration tokens on two NVIDIA A40s (149.7 TFLOP/s dense bf16 each); beside it,
the FLOP/s that figure implies if the paper's code did the work this library's count gives for Llama-2-7B's shape (a
derived figure, labelled so: the paper does not state its FLOPs).

A smoke run on a CPU (the published depth and width are far too large for one; `--width-divisor` divides the hidden
size, the MLP width and the head counts, and is recorded):

    python benchmarks/scale_gpu.py --device cpu --num-layers 2 --num-samples 8 --width-divisor 8 --heal-tokens 1024 \
        --record /tmp/scale_gpu-smoke.json

Writes benchmarks/results/scale_gpu-<model>-<device name slug>.json (`--record` to change it): the device, the paper's
copied figure, and one row per stage and settings, each with its provenance (`benchmarks/provenance.py`).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass
from typing import Any

STARTED = time.time()  # the time limit counts from here

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from provenance import finish, mark_copy, provenance  # noqa: E402
from scale import ARCHITECTURES, RANDOM_WEIGHTS, architecture_config  # noqa: E402

RESULTS = os.path.join(ROOT, "benchmarks", "results")
STAGES = ("stage1", "stage2", "heal")
STAGE2_RESERVE_SECONDS = 150.0  # Stage 2 starts only with this much of --time-limit left (plan: up to ~2.5 min on 8B)
HEAL_MARGIN_SECONDS = 30.0
SPLIT_CHECK_TOKENS = 16  # `split_at_lm_head` checks the head split on one sequence of at most 16 tokens, twice
TOKENIZER_ASSET = "smollm2-135m"
CALIBRATION_DATASET = "offline:wikipedia"
HEAL_DATASET = "offline:web_text"

# Peak dense (no sparsity) bfloat16 tensor-core FLOP/s, from the vendors' datasheets (their "with sparsity" figure
# halved), matched against `torch.cuda.get_device_name()` lowercased: the first entry whose words all appear wins, so
# the more specific names come first.
PEAK_BF16_FLOPS: list[tuple[tuple[str, ...], float, str]] = [
    (("h100", "pcie"), 756e12, "NVIDIA H100 PCIe"),
    (("h100", "nvl"), 835e12, "NVIDIA H100 NVL"),
    (("h200", "nvl"), 835e12, "NVIDIA H200 NVL"),
    (("h100",), 989e12, "NVIDIA H100 SXM"),
    (("h200",), 989e12, "NVIDIA H200 SXM"),
    (("a100",), 312e12, "NVIDIA A100"),
    (("l40s",), 362e12, "NVIDIA L40S"),
    (("a40",), 149.7e12, "NVIDIA A40"),
]

# The paper's Stage 1 figure, as printed there (GradMAP paper, Table "Zero-shot evaluations ..." (tab:zeroshot),
# "Pruning Time" in seconds, LLaMA2-7B at 25%; Experimental Setup: 128 Wikipedia sequences of 128 tokens, two NVIDIA
# A40 GPUs with 48GB memory).
PAPER = {
    "model": "Llama-2-7B",
    "pruning_ratio": 0.25,
    "calibration": "128 x 128 tokens of Wikipedia",
    "stage1_seconds": 123.42,
    "stage1_and_stage2_seconds": 169.42,
    "devices": "2 x NVIDIA A40 (48 GB)",
    "device_peak_bf16_flops_per_second": 149.7e12,
    "devices_peak_bf16_flops_per_second": 2 * 149.7e12,
}
PAPER_SOURCE = (
    "the GradMAP paper: Table 'Zero-shot evaluations ...' (tab:zeroshot), pruning time of GradMAP (Stage 1 only, and with "
    "Stage 2), LLaMA2-7B, 25%; its Experimental Setup (128 x 128 calibration tokens, two NVIDIA A40 GPUs). The A40's peak "
    "is NVIDIA's datasheet figure, not the paper's"
)
# Llama-2-7B's published config (meta-llama/Llama-2-7b-hf), for the FLOPs the paper's figure implies.
LLAMA_2_7B = {
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "head_dim": 128,
    "vocab_size": 32000,
}


# ------------------------------------------------------------------------------------------------------------ FLOPs
@dataclass(frozen=True)
class DecoderShape:
    """The sizes of a Llama-like decoder (Llama, Mistral, Qwen2) that its FLOPs depend on."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    num_layers: int

    @classmethod
    def from_config(cls, config: Any) -> DecoderShape:
        """Reads the sizes from a transformers config or a dict of its values."""
        values = config if isinstance(config, dict) else config.to_dict()
        heads = values["num_attention_heads"]
        return cls(
            hidden_size=values["hidden_size"],
            intermediate_size=values["intermediate_size"],
            num_heads=heads,
            num_kv_heads=values.get("num_key_value_heads") or heads,
            head_dim=values.get("head_dim") or values["hidden_size"] // heads,
            vocab_size=values["vocab_size"],
            num_layers=values["num_hidden_layers"],
        )

    @property
    def attention_width(self) -> int:
        """d: heads x head_dim, the width of QK^T and AV."""
        return self.num_heads * self.head_dim

    def linear_maps(self) -> list[tuple[str, int, int, str]]:
        """Each linear map of one decoder layer: (name, d_in, d_out, the input it reads: maps that share one share it)."""
        h, inner, kv = self.hidden_size, self.intermediate_size, self.num_kv_heads * self.head_dim
        return [
            ("q_proj", h, self.attention_width, "attention input"),
            ("k_proj", h, kv, "attention input"),
            ("v_proj", h, kv, "attention input"),
            ("o_proj", self.attention_width, h, "attention output"),
            ("gate_proj", h, inner, "mlp input"),
            ("up_proj", h, inner, "mlp input"),
            ("down_proj", inner, h, "mlp activation"),
        ]

    def layer_linear_parameters(self) -> int:
        """P: the weights of one decoder layer's linear maps (norms and biases are left out: no products)."""
        return sum(d_in * d_out for _, d_in, d_out, _ in self.linear_maps())


def uses_gram_form(seq_len: int, d_in: int, d_out: int) -> bool:
    """The per-sample norm's form the code picks (`optimum_gradmap.importance.gradient._uses_gram_form`)."""
    return seq_len * (d_in + d_out) <= d_in * d_out


def forward_flops(shape: DecoderShape, num_layers: int, num_samples: int, seq_len: int, head_positions: int) -> float:
    """A forward pass of `num_layers` decoder layers over `num_samples` x `seq_len` tokens, with the head's logits at
    `head_positions` positions per sample: 2 P n N T + 4 T^2 d n N + 2 V h N positions."""
    layers = 2 * shape.layer_linear_parameters() * num_layers * num_samples * seq_len
    attention = 4 * seq_len**2 * shape.attention_width * num_layers * num_samples
    head = 2 * shape.vocab_size * shape.hidden_size * num_samples * head_positions
    return float(layers + attention + head)


def per_sample_norm_flops(shape: DecoderShape, seq_len: int) -> tuple[float, float]:
    """One layer's per-sample gradient norms for one sample: (matrix products, elementwise Gram products)."""
    products = elementwise = 0.0
    gram_inputs: set[str] = set()
    for _, d_in, d_out, source in shape.linear_maps():
        if uses_gram_form(seq_len, d_in, d_out):
            if source not in gram_inputs:  # the Gram of an input shared by several maps is formed once
                gram_inputs.add(source)
                products += 2 * seq_len**2 * d_in
            products += 2 * seq_len**2 * d_out
            elementwise += 2 * seq_len**2
        else:
            products += 2 * seq_len * d_in * d_out
    return products, elementwise


def gradient_round_flops(shape: DecoderShape, num_layers: int, num_samples: int, seq_len: int) -> dict[str, float]:
    """The FLOPs of one Stage 1 round of GradMAP's score on a model of `num_layers` layers (module docstring)."""
    linear = 2.0 * shape.layer_linear_parameters() * num_layers * num_samples * seq_len
    attention = 4.0 * seq_len**2 * shape.attention_width * num_layers * num_samples
    head = 2.0 * shape.vocab_size * shape.hidden_size * num_samples * (seq_len - 1)
    products, elementwise = per_sample_norm_flops(shape, seq_len)
    check_tokens = min(SPLIT_CHECK_TOKENS, seq_len)
    counts = {
        "forward": linear + attention,
        "backward": linear + 2 * attention,
        "head": 2 * head,
        "per_sample_norms": products * num_layers * num_samples,
        "gram_products": elementwise * num_layers * num_samples,
        "split_check": 2 * forward_flops(shape, num_layers, 1, check_tokens, check_tokens),
    }
    counts["total"] = sum(counts.values())
    return counts


def stage1_round_flops(shape: DecoderShape, num_to_prune: int, num_samples: int, seq_len: int) -> list[float]:
    """Each Stage 1 round's FLOPs: round k scores the model's `shape.num_layers - k` layers."""
    return [
        gradient_round_flops(shape, shape.num_layers - round_index, num_samples, seq_len)["total"]
        for round_index in range(num_to_prune)
    ]


def stage1_flops(shape: DecoderShape, pruning_ratio: float, num_samples: int, seq_len: int) -> float:
    """Stage 1's FLOPs at `pruning_ratio` (K = the ratio of the layers, rounded half up, as the config rounds it)."""
    return sum(stage1_round_flops(shape, layers_to_remove(shape.num_layers, pruning_ratio), num_samples, seq_len))


def layers_to_remove(num_layers: int, pruning_ratio: float) -> int:
    """K for a ratio, rounded half up (`GradMAPConfig.num_layers_to_remove`)."""
    return int(math.floor(pruning_ratio * num_layers + 0.5))


def heal_flops_estimate(shape: DecoderShape, num_layers: int, tokens: int, validation_tokens: int) -> float:
    """A rough count of the heal, for the time limit only: the dense teacher's forward pass over every sequence, then
    forward and backward (input gradients and LoRA's) over the training tokens, and the held-out checks."""
    per_token_dense = forward_flops(shape, shape.num_layers, 1, 1, 1)
    per_token_pruned = forward_flops(shape, num_layers, 1, 1, 1)
    return (per_token_dense + 3 * per_token_pruned) * (tokens + validation_tokens)


def peak_bf16_flops(device_name: str | None) -> tuple[float | None, str | None]:
    """The device's peak dense bf16 FLOP/s and the entry that matched, from `PEAK_BF16_FLOPS`; (None, None) if unknown."""
    if not device_name:
        return None, None
    name = device_name.lower()
    for words, peak, label in PEAK_BF16_FLOPS:
        if all(word in name for word in words):
            return peak, label
    return None, None


def paper_implied() -> dict[str, Any]:
    """The FLOP/s the paper's Stage 1 figure implies if its code did this library's work on Llama-2-7B's shape."""
    shape = DecoderShape.from_config(LLAMA_2_7B)
    flops = stage1_flops(shape, PAPER["pruning_ratio"], 128, 128)
    rate = flops / PAPER["stage1_seconds"]
    return {
        "what": "derived here, not in the paper: this library's Stage 1 FLOP count for Llama-2-7B's shape at 128 x 128 "
        "and 25%, over the paper's seconds (the paper's code may do other work)",
        "stage1_flops": flops,
        "flops_per_second": rate,
        "share_of_two_a40s_peak": rate / PAPER["devices_peak_bf16_flops_per_second"],
        "share_of_one_a40s_peak": rate / PAPER["device_peak_bf16_flops_per_second"],
    }


# ------------------------------------------------------------------------------------------------------------ model
def published_config(name: str, num_layers: int | None, width_divisor: int) -> Any:
    """`architecture_config(name, num_layers)`; with `width_divisor` > 1 (smoke runs only), the hidden size, the MLP
    width and both head counts divided by it (head_dim kept)."""
    config = architecture_config(name, num_layers)
    if width_divisor == 1:
        return config
    shape = DecoderShape.from_config(config)
    for value in (shape.hidden_size, shape.intermediate_size, shape.num_heads, shape.num_kv_heads):
        if value % width_divisor:
            raise SystemExit(f"--width-divisor {width_divisor} does not divide {name}'s sizes and head counts.")
    config.hidden_size = shape.hidden_size // width_divisor
    config.intermediate_size = shape.intermediate_size // width_divisor
    config.num_attention_heads = shape.num_heads // width_divisor
    config.num_key_value_heads = shape.num_kv_heads // width_divisor
    config.head_dim = shape.head_dim
    return config


def build_model(config: Any, dtype: torch.dtype, device: str, seed: int) -> torch.nn.Module:
    """The architecture on `device` in `dtype`, every weight drawn again from one seeded generator on the device, in
    `named_parameters` order, as the family's `_init_weights` draws it (scale.py's `build` rule)."""
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if next(model.parameters()).device != torch.empty(0, device=device).device:  # built elsewhere: moved (slower)
        print(f"from_config built the model on {next(model.parameters()).device}: moving it to {device}", flush=True)
        model.to(device)
    modules = dict(model.named_modules())
    generator = torch.Generator(device=device).manual_seed(seed)
    std = config.initializer_range
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            module_name, _, attribute = name.rpartition(".")
            module = modules[module_name]
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)) and attribute == "weight":
                values = torch.empty(parameter.shape, dtype=torch.float32, device=device)
                parameter.copy_(values.normal_(0.0, std, generator=generator))
                del values
            elif attribute == "bias":
                parameter.zero_()
            elif "Norm" in type(module).__name__ and attribute == "weight":
                parameter.fill_(1.0)
            else:
                raise ValueError(f"{name} ({type(module).__name__}.{attribute}): no rule for its initial values")
    model.eval()
    return model


# ------------------------------------------------------------------------------------------------------ calibration
def offline_assets_missing() -> str | None:
    """What of the offline assets this run reads is not in the cache (None: all there), found without the network."""
    from optimum_gradmap import assets

    missing = []
    tokenizer_folder = os.path.join(
        assets.cache_dir(), "checkpoints", f"{TOKENIZER_ASSET}-{assets.MODEL_ASSETS[TOKENIZER_ASSET].sha256[:16]}"
    )
    if not os.path.isfile(os.path.join(tokenizer_folder, "config.json")):
        missing.append(f"{TOKENIZER_ASSET}'s tokenizer")
    for name in ("wikipedia", "web_text"):
        asset = assets.TEXT_ASSETS[name]
        if not os.path.isfile(assets._cached_path(asset)) or os.path.getsize(assets._cached_path(asset)) != asset.size:
            missing.append(f"the {name} text")
    return ", ".join(missing) + f" (in {assets.cache_dir()})" if missing else None


def pack_assets(folder: str) -> None:
    """Copies what the offline calibration and heal text need (SmolLM2-135M's tokenizer files, without its weights,
    and the two texts) into `folder`, laid out like the asset cache: `OPTIMUM_GRADMAP_CACHE=folder` then reads them."""
    from optimum_gradmap import assets

    cache = assets.cache_dir()
    tokenizer_folder = assets.get_model_path(TOKENIZER_ASSET)
    files = [assets.get_text_path("wikipedia"), assets.get_text_path("web_text")]
    files += [
        os.path.join(tokenizer_folder, name)
        for name in sorted(os.listdir(tokenizer_folder))
        if not name.endswith((".safetensors", ".bin", ".gguf"))
    ]
    total = 0
    for path in files:
        target = os.path.join(folder, os.path.relpath(path, cache))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copyfile(path, target)
        total += os.path.getsize(target)
    print(f"{folder}: {len(files)} files, {total / 2**20:.1f} MiB (carry it; OPTIMUM_GRADMAP_CACHE={folder})")


def resolve_calibration(requested: str) -> tuple[str, str | None]:
    """The calibration this run uses (`offline` or `random`), and why it is not the one requested, if it is not:
    `offline` falls back to `random` when the offline assets are not in the cache (the network is never tried)."""
    if requested == "offline":
        missing = offline_assets_missing()
        if missing is not None:
            return "random", f"offline assets not in the cache: {missing}"
    return requested, None


def calibration_and_heal_data(
    kind: str, vocab_size: int, args: argparse.Namespace, heal_rows: int
) -> tuple[torch.LongTensor, Any, Any, str]:
    """The calibration ids, the heal data, the tokenizer (or None) and a description of where they came from, for a
    `kind` that [`resolve_calibration`] returned."""
    from transformers import AutoTokenizer

    from optimum_gradmap import assets
    from optimum_gradmap.data import prepare_calibration_data

    if kind == "offline":
        tokenizer = AutoTokenizer.from_pretrained(assets.get_model_path(TOKENIZER_ASSET))
        ids = prepare_calibration_data(
            CALIBRATION_DATASET, tokenizer, args.num_samples, args.seq_len, seed=0, default_dataset=CALIBRATION_DATASET
        )
        described = (
            f"{CALIBRATION_DATASET} through SmolLM2-135M's tokenizer (ids < {tokenizer.vocab_size}), seed 0; heal: {HEAL_DATASET}"
        )
        return ids, HEAL_DATASET, tokenizer, described
    generator = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, vocab_size, (args.num_samples, args.seq_len), generator=generator)
    heal_generator = torch.Generator().manual_seed(args.seed + 2)
    heal_ids = torch.randint(0, vocab_size, (heal_rows, args.heal_seq_len), generator=heal_generator)
    described = (
        f"token ids uniform over the {vocab_size:,}-token vocabulary, seed {args.seed} (heal: seed {args.seed + 2}); "
        "with random weights the text does not change the work"
    )
    return ids, heal_ids, None, described


# ------------------------------------------------------------------------------------------------------------ record
def device_slug(device_name: str) -> str:
    """`NVIDIA H200` -> `nvidia-h200`."""
    return re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")


def load_record(path: str) -> dict[str, Any]:
    """The record at `path`, or an empty one."""
    if os.path.exists(path):
        with open(path, encoding="utf-8") as file:
            return json.load(file)
    return {"rows": []}


def save_record(record: dict[str, Any], path: str, copy_to: str | None, extra_files: tuple[str, ...] = ()) -> None:
    """Writes `record` atomically, and copies it (and `extra_files` that exist) into `copy_to`."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    temporary = path + ".tmp"
    with open(temporary, "w", encoding="utf-8") as file:
        json.dump(record, file, indent=1)
    os.replace(temporary, path)
    if copy_to:
        os.makedirs(copy_to, exist_ok=True)
        for source in (path, *extra_files):
            if os.path.exists(source):
                shutil.copyfile(source, os.path.join(copy_to, os.path.basename(source)))


def find_row(record: dict[str, Any], stage: str, key: dict[str, Any]) -> dict[str, Any] | None:
    """The row of `stage` measured with `key`, if any."""
    return next((row for row in record["rows"] if row["stage"] == stage and row["key"] == key), None)


def put_row(record: dict[str, Any], row: dict[str, Any]) -> None:
    """Adds `row`, replacing a row of the same stage and key."""
    record["rows"] = [old for old in record["rows"] if not (old["stage"] == row["stage"] and old["key"] == row["key"])]
    record["rows"].append(row)


# ------------------------------------------------------------------------------------------------------ measurement
def synchronize(device: str) -> None:
    """Waits for the device's queued work (a no-op on the CPU)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def reset_peak(device: str) -> None:
    """Starts a stage's peak-memory window."""
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()


def memory(device: str) -> dict[str, float | None]:
    """The GPU memory now and at its peak since `reset_peak`, GiB (None on the CPU)."""
    if not device.startswith("cuda"):
        return {"allocated_gib": None, "peak_allocated_gib": None, "peak_reserved_gib": None}
    return {
        "allocated_gib": round(torch.cuda.memory_allocated() / 2**30, 3),
        "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3),
        "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 3),
    }


def seconds_left(time_limit: float) -> float:
    """What is left of `time_limit`, counted from the process's start."""
    return time_limit - (time.time() - STARTED)


def replay_stage1(
    pruner: Any, model: torch.nn.Module, ids: torch.LongTensor, checkpoint_path: str, row: dict[str, Any] | None
) -> Any:
    """Stage 1's result replayed from its checkpoint (no scoring) when `row`, the recorded Stage 1, is there and the
    checkpoint is the one that run wrote (the same removals, the same run's fingerprint); else None."""
    from optimum_gradmap.errors import InvalidInputError

    if row is None or not os.path.exists(checkpoint_path):
        return None
    try:
        with open(checkpoint_path, encoding="utf-8") as file:
            removed = [index for saved in json.load(file)["rounds"] for index in saved["removed"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if removed != row["removed_layers"]:
        return None
    try:
        return pruner.select_layers(model, ids, stage1_checkpoint=checkpoint_path)
    except InvalidInputError as error:  # written by a run of other settings
        print(f"the Stage 1 checkpoint does not fit this run ({error}): Stage 1 is measured again", flush=True)
        return None


def run(args: argparse.Namespace) -> None:
    """Builds the model, runs the stages not yet recorded, and writes each row as soon as it is measured."""
    from optimum_gradmap import GradMAPConfig, GradMAPPruner

    device = args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no GPU is visible (torch.cuda.is_available() is False).")
    device_name = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    peak, peak_label = peak_bf16_flops(device_name) if device.startswith("cuda") else (None, None)
    dtype = getattr(torch, args.dtype)
    record_path = args.record or os.path.join(RESULTS, f"scale_gpu-{args.model}-{device_slug(device_name)}.json")
    checkpoint_path = re.sub(r"\.json$", "", record_path) + "-stage1.json"
    config = published_config(args.model, args.num_layers, args.width_divisor)
    shape = DecoderShape.from_config(config)
    calibration_kind, fallback = resolve_calibration(args.calibration)
    if fallback is not None:
        print(f"{fallback}: random token ids instead", flush=True)
    key = {
        "model": args.model,
        "num_layers": shape.num_layers,
        "width_divisor": args.width_divisor,
        "dtype": args.dtype,
        "pruning_ratio": args.pruning_ratio,
        "num_samples": args.num_samples,
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "calibration": calibration_kind,
        "seed": args.seed,
    }
    heal_key = {
        **key,
        "heal_tokens": args.heal_tokens,
        "heal_batch_size": args.heal_batch_size,
        "heal_seq_len": args.heal_seq_len,
        "heal_validation_sequences": args.heal_validation_sequences,
    }
    stage_keys = {"stage1": key, "stage2": key, "heal": heal_key}
    wanted = [stage for stage in STAGES if stage in args.stages]
    record = load_record(record_path)  # rows of other settings stay; without --resume, these settings' are measured again
    todo = [stage for stage in wanted if not (args.resume and find_row(record, stage, stage_keys[stage]))]
    record.update(
        {
            "what": f"GradMAP on {args.model}'s published shape on one device ({RANDOM_WEIGHTS})",
            "model": args.model,
            "device": {
                "name": device_name,
                "peak_bf16_dense_flops_per_second": peak,
                "peak_from": f"{peak_label} datasheet (dense: the 'with sparsity' figure halved)" if peak_label else None,
            },
            "paper": mark_copy({**PAPER, "implied": paper_implied()}, PAPER_SOURCE),
            "stage1_flops_formula": (
                "per round over n kept layers, N x T tokens: forward 2 P n N T + 4 T^2 d n N; backward (input gradients) "
                "2 P n N T + 8 T^2 d n N; head 2 x 2 V h N (T-1); per-sample norms N n sum_maps 2 T^2 (d_in + d_out) "
                "(shared inputs' Grams once) or 2 T d_in d_out; plus a 16-token split check and 2 T^2 per map and sample"
            ),
            "rows": record["rows"],
        }
    )
    if not todo:
        print(f"every stage of {key} is in {record_path} already (--resume)")
        return
    print(f"{device_name}: {', '.join(todo)} of {key}; record {record_path}", flush=True)

    started = time.perf_counter()
    model = build_model(config, dtype, device, args.seed)
    num_to_prune = layers_to_remove(shape.num_layers, args.pruning_ratio)
    heal_rows = -(-args.heal_tokens // args.heal_seq_len) + args.heal_validation_sequences
    ids, heal_data, tokenizer, calibration = calibration_and_heal_data(calibration_kind, shape.vocab_size, args, heal_rows)
    if fallback is not None:
        calibration = f"{calibration} ({fallback})"
    with torch.no_grad():  # the device's libraries load here, outside Stage 1's time
        model(input_ids=ids[:1, :SPLIT_CHECK_TOKENS].to(device), use_cache=False)
    synchronize(device)
    build = {
        "seconds": round(time.perf_counter() - started, 2),
        "parameters": model.num_parameters(),
        "weights_gib": memory(device)["allocated_gib"],
    }
    print(f"built {build['parameters']:,} parameters in {build['seconds']} s; calibration: {calibration}", flush=True)

    gradmap_config = GradMAPConfig(
        pruning_ratio=args.pruning_ratio, num_samples=args.num_samples, seq_len=args.seq_len, batch_size=args.batch_size
    )
    pruner = GradMAPPruner(gradmap_config, model=model, tokenizer=tokenizer, progress_bar=False)
    extra_files = (checkpoint_path,)

    # Stage 1: measured unless recorded; replayed from its checkpoint when it is recorded and a later stage needs it
    result = replay_stage1(pruner, model, ids, checkpoint_path, find_row(record, "stage1", key) if args.resume else None)
    if result is None:
        if os.path.exists(checkpoint_path):  # another run's, or an unfinished one: Stage 1 is measured whole
            os.remove(checkpoint_path)
        row = {"stage": "stage1", "key": key, "provenance": provenance(), "calibration": calibration, "build": build}
        reset_peak(device)
        synchronize(device)
        begun = time.perf_counter()
        result = pruner.select_layers(model, ids, stage1_checkpoint=checkpoint_path)
        synchronize(device)
        wall = time.perf_counter() - begun
        row["provenance"] = finish(row["provenance"])
        with open(checkpoint_path, encoding="utf-8") as file:
            rounds = json.load(file)["rounds"]
        round_seconds = [saved["seconds"] for saved in rounds]
        round_flops = stage1_round_flops(shape, num_to_prune, args.num_samples, args.seq_len)
        seconds = result.timings["stage1"]
        flops = sum(round_flops)
        row.update(
            {
                "seconds": round(seconds, 3),
                "wall_seconds": round(wall, 3),
                "round_seconds": [round(value, 3) for value in round_seconds],
                "round_flops": round_flops,
                "flops": flops,
                "flops_per_second": flops / seconds,
                "mfu": flops / seconds / peak if peak and args.dtype == "bfloat16" else None,
                "round_mfu": [
                    round_flops[index] / value / peak if peak and args.dtype == "bfloat16" and value > 0 else None
                    for index, value in enumerate(round_seconds)
                ],
                "memory": memory(device),
                "removed_layers": result.removed_layers,
                "timings": dict(result.timings),
            }
        )
        put_row(record, row)
        save_record(record, record_path, args.copy_to, extra_files)
        mfu = f", MFU {row['mfu']:.1%}" if row["mfu"] is not None else ""
        print(
            f"Stage 1: {seconds:.1f} s, rounds {row['round_seconds']}, {flops / 1e12:.1f} TFLOP, "
            f"{flops / seconds / 1e12:.2f} TFLOP/s{mfu}, peak {row['memory']['peak_allocated_gib']} GiB, "
            f"removed {result.removed_layers}",
            flush=True,
        )
    else:
        print(f"Stage 1 replayed from {checkpoint_path}: removed {result.removed_layers}", flush=True)
    stage1_rate = find_row(record, "stage1", key)["flops_per_second"]

    if "stage2" in todo or ("heal" in todo and "stage2" in wanted):  # the heal follows Stage 2 when both are wanted
        if seconds_left(args.time_limit) < STAGE2_RESERVE_SECONDS:
            print(f"Stage 2 and the heal skipped: {seconds_left(args.time_limit):.0f} s left of --time-limit", flush=True)
            return
        row = {"stage": "stage2", "key": key, "provenance": provenance(), "calibration": calibration}
        reset_peak(device)
        synchronize(device)
        begun = time.perf_counter()
        pruner.compensate(result)
        synchronize(device)
        seconds = time.perf_counter() - begun
        row["provenance"] = finish(row["provenance"])
        compensation = result.compensation
        row.update(
            {
                "seconds": round(seconds, 3),
                "library_seconds": round(compensation.seconds, 3),
                "memory": memory(device),
                "compensated_layers": compensation.compensated_layers,
                "reg_lambda": {str(layer): value for layer, value in compensation.reg_lambda.items()},
                "skipped_layers": {str(layer): why for layer, why in compensation.skipped_layers.items()},
            }
        )
        if "stage2" in todo:
            put_row(record, row)
            save_record(record, record_path, args.copy_to, extra_files)
        print(
            f"Stage 2: {seconds:.1f} s, peak {row['memory']['peak_allocated_gib']} GiB, "
            f"compensated {compensation.compensated_layers}",
            flush=True,
        )

    if "heal" in todo:
        validation_tokens = args.heal_validation_sequences * args.heal_seq_len
        heal_flops = heal_flops_estimate(shape, shape.num_layers - num_to_prune, args.heal_tokens, validation_tokens)
        estimate = 2 * heal_flops / max(stage1_rate, 1.0) + HEAL_MARGIN_SECONDS
        if seconds_left(args.time_limit) < estimate:
            print(f"heal skipped: {seconds_left(args.time_limit):.0f} s left, it needs about {estimate:.0f} s", flush=True)
            return
        row = {"stage": "heal", "key": heal_key, "provenance": provenance(), "calibration": calibration}
        reset_peak(device)
        synchronize(device)
        begun = time.perf_counter()
        pruner.heal(
            result,
            heal_data,
            heal_tokens=args.heal_tokens,
            heal_batch_size=args.heal_batch_size,
            heal_seq_len=args.heal_seq_len,
            heal_validation_sequences=args.heal_validation_sequences,
        )
        synchronize(device)
        seconds = time.perf_counter() - begun
        row["provenance"] = finish(row["provenance"])
        healed = result.heal
        training_seconds = healed.seconds - healed.teacher_seconds
        row.update(
            {
                "seconds": round(seconds, 3),
                "library_seconds": round(healed.seconds, 3),
                "teacher_seconds": round(healed.teacher_seconds, 3),
                "trained_tokens": healed.trained_tokens,
                "steps": healed.steps,
                "training_tokens_per_second": healed.trained_tokens / training_seconds if training_seconds > 0 else None,
                "tokens_per_second": healed.trained_tokens / healed.seconds if healed.seconds > 0 else None,
                "trainable": healed.trainable,
                "num_trainable_parameters": healed.num_trainable_parameters,
                "dataset": healed.dataset,
                "memory": memory(device),
            }
        )
        put_row(record, row)
        save_record(record, record_path, args.copy_to, extra_files)
        print(
            f"heal: {healed.trained_tokens:,} tokens in {healed.seconds:.1f} s (teacher {healed.teacher_seconds:.1f} s), "
            f"{row['training_tokens_per_second']:.0f} tokens/s training, peak {row['memory']['peak_allocated_gib']} GiB",
            flush=True,
        )
    pruner.release()
    print(f"done in {time.time() - STARTED:.0f} s; {record_path}", flush=True)


def main(argv: list[str] | None = None) -> None:
    """The command line (module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=ARCHITECTURES, default="llama-3.1-8b")
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--num-layers", type=int, default=None, help="override the depth (smoke runs)")
    parser.add_argument("--width-divisor", type=int, default=1, help="divide the width and head counts (smoke runs)")
    parser.add_argument("--pruning-ratio", type=float, default=0.25)
    parser.add_argument("--num-samples", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=32, help="Stage 1's and Stage 2's sequences per pass")
    parser.add_argument("--calibration", choices=["offline", "random"], default="offline")
    parser.add_argument("--heal-tokens", type=int, default=65536)
    parser.add_argument("--heal-batch-size", type=int, default=8)
    parser.add_argument("--heal-seq-len", type=int, default=128)
    parser.add_argument("--heal-validation-sequences", type=int, default=32)
    parser.add_argument("--stages", default=",".join(STAGES), help="a subset of stage1,stage2,heal")
    parser.add_argument("--time-limit", type=float, default=420.0, help="seconds from the start; later stages are skipped")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--resume", action="store_true", help="skip the stages already in the record")
    parser.add_argument("--record", default=None, help="the record's path (default benchmarks/results/scale_gpu-...)")
    parser.add_argument("--copy-to", default=None, help="also copy the record and Stage 1 checkpoint here ($OUT)")
    parser.add_argument("--pack-assets", default=None, metavar="FOLDER", help="only pack the offline text and tokenizer")
    args = parser.parse_args(argv)
    if args.pack_assets:
        pack_assets(args.pack_assets)
        return
    args.stages = [stage.strip() for stage in args.stages.split(",") if stage.strip()]
    unknown = sorted(set(args.stages) - set(STAGES))
    if unknown:
        raise SystemExit(f"--stages: unknown {unknown}; these are {list(STAGES)}")
    logging.basicConfig(format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("optimum_gradmap").setLevel(logging.INFO)  # one line per Stage 1 round, as it ends
    run(args)


if __name__ == "__main__":
    main()
