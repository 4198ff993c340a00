"""What GradMAP costs on a real model: dense vs Stage 1 only vs both stages, on every measurement
of `optimum_gradmap.evaluation` (perplexities, the seven zero-shot tasks, inference speed).

One Stage 1 run serves both pruned rows: the model is evaluated after Stage 1, then Stage 2 is
applied to it and it is evaluated again. Every row uses the same perplexity segments and the same
task sample limit. Every row carries its provenance (`benchmarks/provenance.py`).

    python benchmarks/evaluation.py --model smollm2-135m --ratio 0.25 --task-limit 200

Prints a Markdown table and writes benchmarks/results/evaluation-<model>-<ratio>-limit<N>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.provenance import finish, provenance  # noqa: E402
from optimum_gradmap import GradMAPConfig, GradMAPPruner  # noqa: E402
from optimum_gradmap.assets import MODEL_ASSETS, load_model  # noqa: E402
from optimum_gradmap.configuration import PAPER_STAGE2  # noqa: E402
from optimum_gradmap.evaluation import PAPER_TASKS, EvaluationResult, evaluate  # noqa: E402


def table(rows: list[EvaluationResult]) -> str:
    """A Markdown table of several results with the same measurements."""
    first = rows[0]
    header = ["model"] + [f"{entry.dataset} ppl" for entry in first.perplexities]
    if first.zero_shot:
        header += [entry.task for entry in first.zero_shot.tasks] + ["avg acc", "avg acc/acc_norm"]
    if first.speed:
        header += ["prefill ms", "decode tok/s", "decode speed-up"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [row.model] + [f"{entry.perplexity:.2f}" for entry in row.perplexities]
        if row.zero_shot:
            cells += [
                f"{entry.acc:.3f}" + ("" if entry.acc_norm is None else f" / {entry.acc_norm:.3f}")
                for entry in row.zero_shot.tasks
            ]
            cells += [f"{row.zero_shot.average_acc:.4f}", f"{row.zero_shot.average_best:.4f}"]
        if row.speed:
            ratio = row.speed.decode_tokens_per_second / first.speed.decode_tokens_per_second
            cells += [f"{row.speed.prefill_latency_ms:.1f}", f"{row.speed.decode_tokens_per_second:.2f}", f"{ratio:.3f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", choices=sorted(MODEL_ASSETS), help="offline model asset")
    parser.add_argument("--ratio", type=float, default=0.25, help="pruning ratio (default 0.25)")
    parser.add_argument("--task-limit", type=int, default=200, help="questions per zero-shot task (default 200)")
    parser.add_argument("--tasks", nargs="+", default=list(PAPER_TASKS), choices=PAPER_TASKS)
    parser.add_argument(
        "--max-eval-segments",
        type=int,
        default=392,
        help="perplexity segments per dataset (default 392: all 385 held-out Wikipedia segments for SmolLM2, 392 of web text)",
    )
    parser.add_argument(
        "--layers",
        type=int,
        nargs="+",
        default=None,
        help="remove these layers instead of running Stage 1 (e.g. the ones a GradMAP run already selected)",
    )
    parser.add_argument("--output-dir", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()

    model, tokenizer = load_model(args.model)
    num_layers = model.config.num_hidden_layers

    def measure(label: str) -> EvaluationResult:
        start = time.perf_counter()
        result = evaluate(
            model,
            tokenizer,
            perplexity_datasets=("offline:wikipedia", "offline:web_text"),
            segment_length=128,
            max_segments=args.max_eval_segments,
            tasks=args.tasks,
            task_limit=args.task_limit,
            task_data="offline",
            speed=True,
            model_name=label,
        )
        print(f"{label}: evaluated in {time.perf_counter() - start:.0f} s", flush=True)
        return result

    os.makedirs(args.output_dir, exist_ok=True)
    path = os.path.join(args.output_dir, f"evaluation-{args.model}-{args.ratio}-limit{args.task_limit}.json")
    command = (
        f"python benchmarks/evaluation.py --model {args.model} --ratio {args.ratio} "
        f"--task-limit {args.task_limit} --max-eval-segments {args.max_eval_segments}"
        + (f" --layers {' '.join(map(str, args.layers))}" if args.layers else "")
    )
    record = {
        "command": command,
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(), "torch": torch.__version__},
        "rows": [],
    }

    def save(row: EvaluationResult, started: dict) -> None:  # after every row: a late failure loses nothing measured
        record["rows"].append({**row.to_dict(), "provenance": finish(started)})
        with open(path, "w", encoding="utf-8") as file:
            json.dump(record, file, indent=2)

    started = provenance()
    rows = [measure(f"dense ({num_layers} layers)")]
    save(rows[-1], started)
    started = provenance()  # the Stage 1 row: from the selection of its layers on
    selection = {"layers_to_prune": args.layers} if args.layers else {"pruning_ratio": args.ratio}
    pruner = GradMAPPruner(GradMAPConfig(**selection), tokenizer=tokenizer)
    pruning = pruner.select_layers(model, "offline:wikipedia")
    kept = len(pruning.kept_layers)
    stage1 = "given layers" if args.layers else "Stage 1"
    rows.append(measure(f"GradMAP {args.ratio:.0%}, {stage1} only ({kept} layers)"))
    save(rows[-1], started)
    started = provenance()  # the Stage 2 row: from Stage 2 on
    # the paper's Stage 2, as in the figures of docs/benchmarks/accuracy-and-fidelity.md
    pruner.compensate(pruning, **PAPER_STAGE2)
    rows.append(measure(f"GradMAP {args.ratio:.0%}, {stage1} + Stage 2 ({kept} layers)"))
    record["pruning"] = pruning.to_dict()
    save(rows[-1], started)

    print()
    print(f"removed layers {pruning.removed_layers}, compensated {pruning.compensated_layers}")
    print(f"expected decoding speed-up L/(L-K) = {num_layers}/{kept} = {num_layers / kept:.3f}")
    print(table(rows))
    print(f"saved {path}")


if __name__ == "__main__":
    main()
