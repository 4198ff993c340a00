"""Held-out perplexity of GradMAP on a real model: dense, Stage 1 only, Stage 1 + Stage 2 with each
solver, and the same number of layers removed at random.

One Stage 1 run serves every row: Stage 2 is run with each solver in turn on the same Stage 1 result
(`pruner.compensate(result, solver=...)` replaces the previous fit), and the random rows run the
dense model's layers through `LayerSnapshot.temporarily`.

    python benchmarks/quality.py --model smollm2-135m --ratio 0.25

Prints a table and writes benchmarks/results/quality-<model>-<ratio>.json, which carries its provenance
(`benchmarks/provenance.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.provenance import finish, provenance  # noqa: E402
from optimum_gradmap import GradMAPConfig, GradMAPPruner, load_evaluation_segments, perplexity, surgery  # noqa: E402
from optimum_gradmap.assets import MODEL_ASSETS, load_model  # noqa: E402
from optimum_gradmap.configuration import PAPER_STAGE2  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", choices=sorted(MODEL_ASSETS), help="offline model asset")
    parser.add_argument("--architecture", default=None, help="load the asset with another family's classes, e.g. mistral")
    parser.add_argument("--ratio", type=float, default=0.25, help="pruning ratio (default 0.25)")
    parser.add_argument("--num-samples", type=int, default=128, help="calibration sequences (default 128)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per calibration sequence (default 128)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--adam-steps", type=int, default=2000)
    parser.add_argument(
        "--reg-lambdas", type=float, nargs="+", default=[1e-3], help="Stage 2 lambda values to compare (default: 1e-3)"
    )
    parser.add_argument("--solvers", nargs="+", default=["closed_form", "adam"], choices=["closed_form", "adam"])
    parser.add_argument("--layers", type=int, nargs="+", default=None, help="remove these layers instead of running Stage 1")
    parser.add_argument("--random-seeds", type=int, default=3, help="number of random-removal baselines (default 3)")
    parser.add_argument("--max-eval-segments", type=int, default=None, help="cap on 128-token evaluation segments (default: all)")
    parser.add_argument("--output-dir", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()

    torch.manual_seed(0)
    model, tokenizer = load_model(args.model, architecture=args.architecture)
    segments = load_evaluation_segments("offline:wikipedia", tokenizer, segment_length=128, max_segments=args.max_eval_segments)
    print(
        f"{args.model}: {model.config.num_hidden_layers} layers; "
        f"evaluation: {segments.shape[0]} segments x 128 tokens of held-out Wikipedia"
    )

    started = provenance()
    rows: dict[str, float] = {}
    rows["dense"] = perplexity(model, segments)
    print(f"dense: {rows['dense']:.3f}")

    selection = {"layers_to_prune": args.layers} if args.layers else {"pruning_ratio": args.ratio}
    config = GradMAPConfig(
        **selection, num_samples=args.num_samples, seq_len=args.seq_len, batch_size=args.batch_size, adam_steps=args.adam_steps
    )
    num_layers = model.config.num_hidden_layers
    num_to_prune = config.num_layers_to_remove(num_layers)
    dense = surgery.snapshot(model)
    random_rows = []
    for seed in range(args.random_seeds):
        removed = sorted(random.Random(seed).sample(range(num_layers), num_to_prune))
        with dense.temporarily([i for i in range(num_layers) if i not in removed]):
            value = perplexity(model, segments)
        random_rows.append({"seed": seed, "removed_layers": removed, "perplexity": value})
        print(f"random removal, seed {seed} {removed}: {value:.3f}")

    pruner = GradMAPPruner(config, tokenizer=tokenizer)
    result = pruner.select_layers(model, "offline:wikipedia")
    rows["stage1"] = perplexity(model, segments)
    print(f"stage 1 only (removed {result.removed_layers}): {rows['stage1']:.3f}  [{result.timings['stage1']:.1f}s]")
    if args.layers:
        print("(layers given with --layers: Stage 1 scoring skipped)")

    solvers: dict[str, dict] = {}
    for solver in args.solvers:
        for reg_lambda in args.reg_lambdas:
            name = f"stage1+2 ({solver}, lambda={reg_lambda:g})"
            # the paper's Stage 2 (largest-drift layer) with this solver and lambda; replaces the previous fit
            pruner.compensate(result, **{**PAPER_STAGE2, "solver": solver, "reg_lambda": reg_lambda})
            rows[name] = perplexity(model, segments)
            solvers[name] = {
                "compensated_layers": list(result.compensated_layers),
                "objective": {str(k): v for k, v in result.compensation.objective.items()},
                "stage2_seconds": result.timings["stage2"],
            }
            print(f"{name}, layer {result.compensated_layers}: {rows[name]:.3f}  [{result.timings['stage2']:.1f}s]")
    origin = finish(started)

    report = {
        "model": args.model,
        "architecture": type(model).__name__,
        "ratio": args.ratio,
        "calibration": {"dataset": "wikipedia (calibration articles)", "num_samples": args.num_samples, "seq_len": args.seq_len},
        "evaluation": {
            "dataset": "wikipedia (held-out articles)",
            "protocol": "non-overlapping 128-token segments",
            "segments": int(segments.shape[0]),
        },
        "removed_layers": result.removed_layers,
        "scores": [{str(k): v for k, v in s.items()} for s in result.scores],
        "drift": {str(k): v for k, v in result.compensation.drift.items()},
        "perplexity": rows,
        "solvers": solvers,
        "random_removal": random_rows,
        "stage1_seconds": result.timings["stage1"],
        "environment": {"torch": torch.__version__, "platform": platform.platform(), "threads": torch.get_num_threads()},
        "date": time.strftime("%Y-%m-%d"),
        "provenance": origin,
    }
    os.makedirs(args.output_dir, exist_ok=True)
    suffix = "layers-" + "-".join(map(str, args.layers)) if args.layers else str(args.ratio)
    name = args.model + (f"-as-{args.architecture}" if args.architecture else "")
    path = os.path.join(args.output_dir, f"quality-{name}-{suffix}.json")
    with open(path, "w") as file:
        json.dump(report, file, indent=2)
    print("\n| model | perplexity (held-out Wikipedia, 128-token segments) |\n|---|---|")
    for name, value in rows.items():
        print(f"| {name} | {value:.3f} |")
    for row in random_rows:
        print(f"| random {row['removed_layers']} | {row['perplexity']:.3f} |")
    print(f"\nwritten to {path}")


if __name__ == "__main__":
    main()
