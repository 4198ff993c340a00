"""Inference speed of a dense model and the same model with layers removed: decoding throughput
and prefill latency with the KV cache, after warm-up, median of repeated runs.

Speed depends on how many layers remain, not on which ones or on their weights, so by default the
script removes the layers GradMAP removed from SmolLM2-135M at 25% (see docs/benchmarks/layer-selection.md); pass
`--layers` for others, or `--report` to read them from a pruned checkpoint's pruning_report.json.

    python benchmarks/inference_speed.py
    python benchmarks/inference_speed.py --batch-size 8 --device cuda --dtype bfloat16

Prints the figures and the expected ratio L / (L - K), and writes
benchmarks/results/inference_speed-<model>-<device>-<dtype>-batch<B>.json, which carries its provenance
(`benchmarks/provenance.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.provenance import finish, provenance  # noqa: E402
from optimum_gradmap import load_report, remove_layers  # noqa: E402
from optimum_gradmap.assets import MODEL_ASSETS, load_model  # noqa: E402
from optimum_gradmap.evaluation import inference_speed  # noqa: E402

GRADMAP_SMOLLM2_25 = [26, 25, 21, 18, 14, 13, 17, 10]  # examples/main_job/prune_smollm2.py, docs/benchmarks/


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", choices=sorted(MODEL_ASSETS), help="offline model asset")
    parser.add_argument("--layers", type=int, nargs="+", default=None, help="layers to remove (default: GradMAP's 25%%)")
    parser.add_argument("--report", default=None, help="a pruned checkpoint folder: remove the layers its report names")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--prompt-length", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--output-dir", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()

    if args.report:
        layers = load_report(args.report)["removed_layers"]
    else:
        layers = args.layers or GRADMAP_SMOLLM2_25
    model, _ = load_model(args.model, dtype=getattr(torch, args.dtype))
    model.to(args.device)
    settings = dict(
        batch_size=args.batch_size,
        prompt_length=args.prompt_length,
        new_tokens=args.new_tokens,
        warmup=args.warmup,
        repeats=args.repeats,
    )
    started = provenance()
    dense = inference_speed(model, **settings)
    remove_layers(model, layers)
    pruned = inference_speed(model, **settings)
    origin = finish(started)

    expected = dense.num_layers / pruned.num_layers
    decode_ratio = pruned.decode_tokens_per_second / dense.decode_tokens_per_second
    prefill_ratio = dense.prefill_latency_ms / pruned.prefill_latency_ms
    print(
        f"{args.model} on {args.device} ({args.dtype}), batch {args.batch_size}, {args.prompt_length}-token prompt, "
        f"{args.new_tokens} new tokens, median of {args.repeats} runs after {args.warmup} warm-up runs"
    )
    print(f"{'':24s}{'layers':>8s}{'prefill ms':>12s}{'decode tok/s':>14s}")
    for name, result in (("dense", dense), ("pruned", pruned)):
        print(f"{name:24s}{result.num_layers:8d}{result.prefill_latency_ms:12.1f}{result.decode_tokens_per_second:14.2f}")
    print(f"decoding speed-up {decode_ratio:.3f}x, prefill speed-up {prefill_ratio:.3f}x, L/(L-K) = {expected:.3f}")

    os.makedirs(args.output_dir, exist_ok=True)
    name = f"inference_speed-{args.model}-{args.device}-{args.dtype}-batch{args.batch_size}.json"
    record = {
        "command": "python benchmarks/inference_speed.py "
        + f"--batch-size {args.batch_size} --device {args.device} --dtype {args.dtype} --repeats {args.repeats}",
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(), "torch": torch.__version__},
        "removed_layers": layers,
        "dense": dense.__dict__,
        "pruned": pruned.__dict__,
        "decode_speedup": decode_ratio,
        "prefill_speedup": prefill_ratio,
        "expected_speedup": expected,
        "provenance": origin,
    }
    if args.device.startswith("cuda"):
        record["machine"]["gpu"] = torch.cuda.get_device_name()
    with open(os.path.join(args.output_dir, name), "w", encoding="utf-8") as file:
        json.dump(record, file, indent=2)
    print(f"saved {os.path.join(args.output_dir, name)}")


if __name__ == "__main__":
    main()
