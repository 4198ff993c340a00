"""Cost of one Stage 1 round on a real model, against a plain forward pass and the naive per-sample
implementation (one backward pass per sample, parameter gradients materialised).

    python benchmarks/stage1_speed.py                              # SmolLM2-135M, fp32, CPU, 128 x 128 calibration
    python benchmarks/stage1_speed.py --device cuda --dtype bfloat16

Each measurement runs in a fresh subprocess so that its peak memory is its own. Prints four
figures and writes benchmarks/results/stage1_speed-<model>-<device>-<dtype>-batch<batch size>.json.
The forward pass and the round are each timed `--repeats` times and the fastest run counts (the
machine is shared and noisy); the naive path runs once:

- round_time / forward_time: one Stage 1 round (all layers scored) over one plain forward pass
  over the same calibration set (goal <= 2.5);
- for reference, the same passes without any per-sample work (forward with autograd, loss
  gradient, input-gradient backward): the floor of any exact method on this machine;
- speed-up of the fast path over the naive one, per round (each round scores every remaining
  layer the same way, so the whole of Stage 1 scales alike);
- (peak memory during the round - memory before it) / the model's weight bytes (goal <= 0.5);
  on CPU, resident memory sampled every 5 ms over the first two batches, in a separate run where
  glibc returns every freed block of 64 KiB or more to the system (MALLOC_MMAP_THRESHOLD_), so that
  resident memory follows the live tensors; on CUDA, torch's peak allocated memory;
- agreement of the scores (max relative difference, goal <= 1e-4) and of the layers removed;
- with `--workers forward prune_round`: one whole round through `GradMAPPruner.prune` (one layer removed,
  compensation off, on a copy of the warm model) over one plain forward pass: the passes and everything
  `prune` does around them.

Figures of runs with other `--workers` go to a file named after them; every file carries its provenance
(`benchmarks/provenance.py`).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import subprocess
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.provenance import finish, provenance  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = ("forward", "gradient_passes", "fast", "prune_round", "naive")


class PeakMemory:
    """Peak memory above the level at entry: CUDA's allocator statistics, or sampled resident memory."""

    def __init__(self, device: torch.device):
        self.device = device
        self.extra = 0

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as file:
            return int(file.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            self.base = self._rss()
            self.peak = self.base
            self.running = True
            self.thread = threading.Thread(target=self._sample, daemon=True)
            self.thread.start()
        return self

    def _sample(self) -> None:
        while self.running:
            self.peak = max(self.peak, self._rss())
            time.sleep(0.005)

    def __exit__(self, *exc_info) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.extra = torch.cuda.max_memory_allocated() - self.base
        else:
            self.running = False
            self.thread.join()
            self.extra = max(self.peak, self._rss()) - self.base


def worker(args: argparse.Namespace) -> dict:
    sys.path.insert(0, ROOT)
    from optimum_gradmap.adapters import get_adapter
    from optimum_gradmap.assets import load_model
    from optimum_gradmap.data import prepare_calibration_data
    from optimum_gradmap.importance import causal_lm_loss_gradient, gradient_importance, split_at_lm_head
    from optimum_gradmap.passes import calibration_batches
    from optimum_gradmap.testing import naive_layer_scores

    device = torch.device(args.device)
    model, tokenizer = load_model(args.model, dtype=getattr(torch, args.dtype))
    model.to(device).eval()
    ids = prepare_calibration_data(
        "offline:wikipedia", tokenizer, args.num_samples, args.seq_len, seed=0, default_dataset="offline:wikipedia"
    )
    if args.memory_run:  # the peak is reached within a batch; two batches show it
        ids = ids[: 2 * args.batch_size]
    layers = list(get_adapter(model).get_layers(model))
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    def forward() -> None:
        with torch.no_grad():
            for start in range(0, ids.shape[0], args.batch_size):
                model(input_ids=ids[start : start + args.batch_size].to(device), use_cache=False)

    def gradient_passes() -> None:
        """What any exact method needs before per-sample norms: forward with autograd, loss gradient,
        input-gradient backward (the output gradient of every linear map), no per-sample work."""
        adapter = get_adapter(model)
        embeddings = model.get_input_embeddings()
        with calibration_batches(model, ids, args.batch_size, progress_bar=False, grad=True, freeze_parameters=True) as batches:
            decoder, head, width = split_at_lm_head(model, adapter, ids)
            for batch in batches:
                inputs_embeds = embeddings(batch).detach().requires_grad_(True)
                hidden_states = decoder(inputs_embeds)
                torch.autograd.grad(hidden_states, inputs_embeds, causal_lm_loss_gradient(hidden_states, batch, head, width))

    if args.worker == "forward":
        forward()  # warm-up
        run = forward
    elif args.worker == "gradient_passes":
        gradient_passes()  # warm-up
        run = gradient_passes
    elif args.worker == "fast":
        gradient_importance(model, layers, ids[: args.batch_size], args.batch_size, progress_bar=False)  # warm-up
        run = lambda: gradient_importance(model, layers, ids, args.batch_size, progress_bar=False)  # noqa: E731
    elif args.worker == "prune_round":  # one round through the public API: everything `prune` does around the passes
        from optimum_gradmap import GradMAPConfig, GradMAPPruner

        config = GradMAPConfig(
            num_layers_to_prune=1,
            num_samples=args.num_samples,
            seq_len=args.seq_len,
            batch_size=args.batch_size,
            compensation=False,
        )
        pruner = GradMAPPruner(config, tokenizer=tokenizer, progress_bar=False)
        dense_state = {name: tensor.clone() for name, tensor in model.state_dict().items()}

        def prune_round() -> None:
            pruned = copy.deepcopy(model)
            pruner.prune(pruned, ids)
            del pruned

        gradient_importance(model, layers, ids[: args.batch_size], args.batch_size, progress_bar=False)  # warm-up
        run = prune_round
    else:
        run = lambda: naive_layer_scores(model, layers, ids)  # noqa: E731
    if device.type == "cuda":
        torch.cuda.synchronize()
    scores = None
    timings = []
    with PeakMemory(device) as memory:
        for _ in range(args.repeats if args.worker != "naive" and not args.memory_run else 1):
            start = time.perf_counter()
            outcome = run()
            scores = outcome if args.worker != "prune_round" else None
            if args.worker == "prune_round":
                assert all(torch.equal(tensor, dense_state[name]) for name, tensor in model.state_dict().items())
            if device.type == "cuda":
                torch.cuda.synchronize()
            timings.append(time.perf_counter() - start)
    return {
        "seconds": min(timings),
        "all_seconds": timings,
        "peak_extra_bytes": memory.extra,
        "weight_bytes": weight_bytes,
        "scores": scores.tolist() if scores is not None else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--num-samples", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument(
        "--repeats", type=int, default=2, help="timed runs of the forward pass and of the round; the fastest counts"
    )
    parser.add_argument(
        "--num-layers-to-prune", type=int, default=8, help="K, for comparing which layers a one-shot selection removes"
    )
    parser.add_argument("--memory-run", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--workers",
        nargs="+",
        default=["forward", "gradient_passes", "fast", "naive"],
        choices=WORKERS,
        help="what to time (default: all but prune_round; ratios need forward, the scores' agreement fast and naive)",
    )
    parser.add_argument("--worker", choices=WORKERS, help=argparse.SUPPRESS)
    parser.add_argument("--output-dir", default=os.path.join(ROOT, "benchmarks", "results"))
    args = parser.parse_args()
    suffix = "" if args.workers == parser.get_default("workers") else "-" + "-".join(args.workers)

    if args.worker:
        print(json.dumps(worker(args)))
        return

    results = {}
    started = provenance()
    for kind in args.workers:
        command = [sys.executable, __file__, "--worker", kind] + [
            f"--{name.replace('_', '-')}={value}"
            for name, value in vars(args).items()
            if name not in ("worker", "workers", "output_dir", "memory_run")
        ]
        completed = subprocess.run(command, capture_output=True, text=True, check=True)
        results[kind] = json.loads(completed.stdout.strip().splitlines()[-1])
        # Memory in its own run, where glibc hands every block of 64 KiB or more straight back to the
        # system when freed: resident memory then follows the live tensors, instead of keeping (or
        # hiding, after a warm-up) freed blocks.
        if kind != "prune_round":
            environment = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
            completed = subprocess.run(command + ["--memory-run"], capture_output=True, text=True, check=True, env=environment)
            results[kind]["peak_extra_bytes"] = json.loads(completed.stdout.strip().splitlines()[-1])["peak_extra_bytes"]
        print(f"{kind}: {results[kind]['seconds']:.1f} s, peak extra memory {results[kind]['peak_extra_bytes'] / 2**20:.0f} MiB")
    origin = finish(started)

    figures = {}
    forward = results.get("forward", {}).get("seconds")
    for kind in ("gradient_passes", "fast", "prune_round"):
        if forward and kind in results:
            figures[f"{kind}_over_forward_time"] = results[kind]["seconds"] / forward
    if "fast" in figures:
        figures["round_time_over_forward_time"] = figures.pop("fast_over_forward_time")
    if "fast" in results and "naive" in results:
        fast, naive = torch.tensor(results["fast"]["scores"]), torch.tensor(results["naive"]["scores"])
        k = args.num_layers_to_prune
        figures.update(
            {
                "speedup_over_naive": results["naive"]["seconds"] / results["fast"]["seconds"],
                "peak_memory_over_weight_bytes": results["fast"]["peak_extra_bytes"] / results["fast"]["weight_bytes"],
                "naive_peak_memory_over_weight_bytes": results["naive"]["peak_extra_bytes"] / results["naive"]["weight_bytes"],
                "max_relative_score_difference": float(((fast - naive).abs() / naive).max()),
                "same_first_removal": int(fast.argmin()) == int(naive.argmin()),
                f"same_{k}_lowest": sorted(fast.argsort()[:k].tolist()) == sorted(naive.argsort()[:k].tolist()),
            }
        )
    report = {
        "model": args.model,
        "device": args.device,
        "dtype": args.dtype,
        "calibration": f"{args.num_samples} x {args.seq_len} tokens, batch size {args.batch_size}",
        "figures": figures,
        "seconds": {kind: results[kind]["seconds"] for kind in results},
        "all_seconds": {kind: results[kind]["all_seconds"] for kind in results},
        "peak_extra_bytes": {kind: results[kind]["peak_extra_bytes"] for kind in results},
        "weight_bytes": next(iter(results.values()))["weight_bytes"],
        "environment": {
            "torch": torch.__version__,
            "platform": platform.platform(),
            "cpu_threads": torch.get_num_threads(),
            "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
        },
        "date": time.strftime("%Y-%m-%d"),
        "provenance": origin,
    }
    os.makedirs(args.output_dir, exist_ok=True)
    path = os.path.join(
        args.output_dir, f"stage1_speed-{args.model}-{args.device.split(':')[0]}-{args.dtype}-batch{args.batch_size}{suffix}.json"
    )
    with open(path, "w") as file:
        json.dump(report, file, indent=2)
    print()
    for name, value in figures.items():
        print(f"{name}: {value:.3f}" if isinstance(value, float) else f"{name}: {value}")
    print(f"written to {path}")


if __name__ == "__main__":
    main()
