"""Where the time of one GradMAP round goes: torch's profiler over one warm round of the score
(`gradient_importance`, all layers) and over one plain forward pass, on the same calibration batches.

    python benchmarks/profile_round.py --model smollm2-135m --num-samples 16 --batch-size 8

Prints, for the round and for the forward pass, the self CPU time of the operators that take the most,
and groups them: the per-sample Gram products (`aten::bmm`: the score's own work, every other matrix
product is a forward or backward pass of the model or its head), the model's matrix products, attention,
and everything else. Writes benchmarks/results/profile_round-<model>-<num samples>x<seq len>-batch<batch size>.json
with its provenance (`benchmarks/provenance.py`). Timings under the profiler run somewhat slower than
without it; the shares are what this script is for.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.provenance import finish, provenance  # noqa: E402
from optimum_gradmap.adapters import get_adapter  # noqa: E402
from optimum_gradmap.assets import MODEL_ASSETS, load_model  # noqa: E402
from optimum_gradmap.data import prepare_calibration_data  # noqa: E402
from optimum_gradmap.importance import gradient_importance  # noqa: E402

GROUPS = {
    "per-sample Gram products (aten::bmm)": ("aten::bmm",),
    "model matrix products (mm, addmm, linear)": ("aten::mm", "aten::addmm", "aten::linear", "aten::matmul"),
    "attention": ("aten::_scaled_dot_product", "aten::scaled_dot_product"),
}


def grouped(events: list[dict]) -> dict[str, float]:
    totals = dict.fromkeys([*GROUPS, "everything else"], 0.0)
    for event in events:
        group = next((name for name, prefixes in GROUPS.items() if event["name"].startswith(prefixes)), "everything else")
        totals[group] += event["self_cpu_seconds"]
    return totals


def profiled(run) -> tuple[float, list[dict]]:
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        start = time.perf_counter()
        run()
        seconds = time.perf_counter() - start
    events = [
        {"name": event.key, "calls": event.count, "self_cpu_seconds": event.self_cpu_time_total / 1e6}
        for event in profiler.key_averages()
    ]
    return seconds, sorted(events, key=lambda event: -event["self_cpu_seconds"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", choices=sorted(MODEL_ASSETS))
    parser.add_argument("--num-samples", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--top", type=int, default=15, help="operators to print")
    parser.add_argument("--output-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args()

    model, tokenizer = load_model(args.model)
    model.eval()
    ids = prepare_calibration_data(
        "offline:wikipedia", tokenizer, args.num_samples, args.seq_len, seed=0, default_dataset="offline:wikipedia"
    )
    layers = list(get_adapter(model).get_layers(model))

    def forward() -> None:
        with torch.no_grad():
            for start in range(0, ids.shape[0], args.batch_size):
                model(input_ids=ids[start : start + args.batch_size], use_cache=False)

    def score() -> None:
        gradient_importance(model, layers, ids, args.batch_size, progress_bar=False)

    started = provenance()
    forward()
    score()  # warm-up
    forward_seconds, forward_events = profiled(forward)
    round_seconds, round_events = profiled(score)
    origin = finish(started)

    record = {
        "settings": vars(args) | {"output_dir": None},
        "forward_seconds": forward_seconds,
        "round_seconds": round_seconds,
        "round_over_forward": round_seconds / forward_seconds,
        "forward_groups": grouped(forward_events),
        "round_groups": grouped(round_events),
        "forward_top": forward_events[: args.top],
        "round_top": round_events[: args.top],
        "provenance": origin,
    }
    for label, seconds, groups, events in (
        ("plain forward pass", forward_seconds, record["forward_groups"], forward_events),
        ("one round of the score", round_seconds, record["round_groups"], round_events),
    ):
        print(f"\n{label}: {seconds:.2f} s under the profiler ({seconds / forward_seconds:.2f} forward passes)")
        for name, total in groups.items():
            print(f"  {name:45s} {total:7.2f} s  ({total / forward_seconds:.2f} forward passes)")
        for event in events[: args.top]:
            print(f"    {event['name'][:60]:60s} {event['calls']:6d} calls {event['self_cpu_seconds']:7.2f} s")
    os.makedirs(args.output_dir, exist_ok=True)
    path = os.path.join(
        args.output_dir, f"profile_round-{args.model}-{args.num_samples}x{args.seq_len}-batch{args.batch_size}.json"
    )
    with open(path, "w", encoding="utf-8") as file:
        json.dump(record, file, indent=1)
    print(f"\nwritten to {path}")


if __name__ == "__main__":
    main()
