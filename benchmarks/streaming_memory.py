"""Peak memory and time of one GradMAP Stage 1 round with the weights in memory, against the
layer-streamed execution on a model whose weights Accelerate offloaded to disk.

    python benchmarks/streaming_memory.py --model smollm2-135m
    python benchmarks/streaming_memory.py --model qwen2.5-coder-0.5b --num-samples 32 --batch-size 8

Each mode runs in its own subprocess, with glibc handing every freed block of 64 KiB or more back to
the system (MALLOC_MMAP_THRESHOLD_) so that resident memory follows the live tensors:

- `in_memory`: `from_pretrained` as usual, `execution="in_memory"`;
- `layer_streamed`: `from_pretrained(device_map="auto", max_memory={"cpu": 1 MiB}, offload_folder=...)`,
  which leaves every weight in the checkpoint's safetensors file (Accelerate reads each module's
  weights for its forward pass only), and `execution="auto"` (so layer-streamed).

Memory: the peak of resident memory during the rounds (sampled every 5 ms) above the process's resident
memory before the model was loaded (torch imported, the calibration set tokenized), as a fraction of the
model's weight bytes (loading itself, which transformers does its own way, is not counted); beside
it, what the streamed mode must hold: the largest module's weights (a decoder layer, or the tied
embedding / head), the stored layer inputs (layers x batch x tokens x hidden x 4 bytes) and one
layer's activations. Time: the round is run twice, the second run counts. Also checks that both modes
give the same scores. Writes benchmarks/results/streaming_memory-<model>-batch<B>.json, which carries the
provenance of both subprocesses' measurement, taken in the parent (`benchmarks/provenance.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time

import records
import torch
from common import RESULTS, parser
from provenance import finish, provenance


def resident_bytes() -> int:
    with open("/proc/self/statm") as file:
        return int(file.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakMemory:
    """Peak resident memory above the level at entry, sampled every 5 ms."""

    def __enter__(self) -> PeakMemory:
        self.base = self.peak = resident_bytes()
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while self.running:
            self.peak = max(self.peak, resident_bytes())
            time.sleep(0.005)

    def __exit__(self, *exc_info) -> None:
        self.running = False
        self.thread.join()
        self.extra = max(self.peak, resident_bytes()) - self.base


def worker(args: argparse.Namespace) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from optimum_gradmap import streaming
    from optimum_gradmap.adapters import get_adapter
    from optimum_gradmap.assets import get_model_path
    from optimum_gradmap.data import prepare_calibration_data
    from optimum_gradmap.importance import gradient_importance

    path = get_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = prepare_calibration_data(
        "offline:wikipedia", tokenizer, args.num_samples, args.seq_len, seed=0, default_dataset="offline:wikipedia"
    )
    without_model = resident_bytes()
    with tempfile.TemporaryDirectory() as offload_folder:
        if args.worker == "in_memory":
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        else:
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.float32, device_map="auto", max_memory={"cpu": 2**20}, offload_folder=offload_folder
            )
        layers = list(get_adapter(model).get_layers(model))
        timings = []
        mode = "in_memory" if args.worker == "in_memory" else "auto"
        with streaming.execution_mode(mode), PeakMemory() as memory:
            for _ in range(2):
                start = time.perf_counter()
                scores = gradient_importance(model, layers, ids, args.batch_size, progress_bar=False)
                timings.append(time.perf_counter() - start)
        offloaded = streaming.is_offloaded(model)
    config = model.config
    weight_bytes = 4 * sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(path).parameters())
    return {
        "seconds": timings[-1],
        "all_seconds": timings,
        "peak_extra_bytes": memory.extra + memory.base - without_model,  # the round's peak, above the process without a model
        "resident_after_load_bytes": memory.base - without_model,
        "weight_bytes": weight_bytes,
        "offloaded": offloaded,
        "num_layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "scores": scores.tolist(),
    }


def module_bytes(model_name: str) -> dict:
    """Weight bytes of the largest decoder layer and of the input embedding (float32)."""
    from transformers import AutoModelForCausalLM

    from optimum_gradmap.adapters import get_adapter
    from optimum_gradmap.assets import get_model_path

    model = AutoModelForCausalLM.from_pretrained(get_model_path(model_name), dtype=torch.float32)
    layers = get_adapter(model).get_layers(model)
    return {
        "largest_layer_bytes": max(4 * sum(p.numel() for p in layer.parameters()) for layer in layers),
        "embedding_bytes": 4 * model.get_input_embeddings().weight.numel(),
    }


def main() -> None:
    arguments = parser(__doc__)
    arguments.add_argument("--model", default="smollm2-135m")
    arguments.add_argument("--num-samples", type=int, default=32, help="calibration sequences of the round (default 32)")
    arguments.add_argument("--seq-len", type=int, default=128)
    arguments.add_argument("--batch-size", type=int, default=8)
    arguments.add_argument("--worker", choices=["in_memory", "layer_streamed"], help=argparse.SUPPRESS)
    arguments.add_argument("--output-dir", default=RESULTS)
    arguments.add_argument("--resume", action="store_true", help="keep a record written already: print it, measure nothing")
    args = arguments.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    path = os.path.join(args.output_dir, f"streaming_memory-{args.model}-batch{args.batch_size}.json")
    if args.resume and os.path.exists(path):
        print(json.dumps(records.read(path)["figures"], indent=1))
        return

    environment = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    results = {}
    started = provenance()
    for mode in ("in_memory", "layer_streamed"):
        command = [sys.executable, __file__, "--worker", mode, f"--model={args.model}", f"--num-samples={args.num_samples}"]
        command += [f"--seq-len={args.seq_len}", f"--batch-size={args.batch_size}"]
        completed = subprocess.run(command, capture_output=True, text=True, env=environment)
        if completed.returncode != 0:
            raise SystemExit(completed.stderr[-3000:])
        results[mode] = json.loads(completed.stdout.strip().splitlines()[-1])
        figure = results[mode]["peak_extra_bytes"] / results[mode]["weight_bytes"]
        print(f"{mode}: {results[mode]['seconds']:.1f} s per round, peak memory {figure:.3f} x the weight bytes", flush=True)
    origin = finish(started)

    sizes = module_bytes(args.model)
    streamed, in_memory = results["layer_streamed"], results["in_memory"]
    stored_inputs = streamed["num_layers"] * args.batch_size * args.seq_len * streamed["hidden_size"] * 4
    scores_streamed, scores_in_memory = torch.tensor(streamed["scores"]), torch.tensor(in_memory["scores"])
    figures = {
        "in_memory_peak_over_weight_bytes": in_memory["peak_extra_bytes"] / in_memory["weight_bytes"],
        "streamed_peak_over_weight_bytes": streamed["peak_extra_bytes"] / streamed["weight_bytes"],
        "largest_layer_over_weight_bytes": sizes["largest_layer_bytes"] / streamed["weight_bytes"],
        "embedding_over_weight_bytes": sizes["embedding_bytes"] / streamed["weight_bytes"],
        "stored_inputs_over_weight_bytes": stored_inputs / streamed["weight_bytes"],
        "streamed_time_over_in_memory_time": streamed["seconds"] / in_memory["seconds"],
        "max_relative_score_difference": float(((scores_streamed - scores_in_memory).abs() / scores_in_memory).max()),
        "same_ranking": scores_streamed.argsort().tolist() == scores_in_memory.argsort().tolist(),
    }
    report = {
        "command": "python benchmarks/streaming_memory.py " + " ".join(sys.argv[1:]),
        "settings": vars(args),
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(), "torch": torch.__version__},
        "results": results,
        "module_bytes": sizes,
        "figures": figures,
        "provenance": origin,
    }
    os.makedirs(args.output_dir, exist_ok=True)
    records.write(path, report)
    for name, value in figures.items():
        print(f"{name}: {value:.4g}")
    print(f"saved {path}")


if __name__ == "__main__":
    main()
