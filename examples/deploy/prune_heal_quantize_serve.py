"""The whole chain a model ships through: prune, heal, quantize, serve.

Loads SmolLM2-135M from the offline assets (an explicit opt-in; `--model` takes a Hub id or a folder instead), removes
25% of its layers with both stages of GradMAP on 128 x 128 tokens of Wikipedia, heals it (LoRA, `--heal-tokens` tokens
of other text), quantizes it with llm-compressor (`--scheme`, calibrated on Stage 1's sequences), all in one
`GradMAPPruner.prune` call, and saves the compressed-tensors checkpoint with its report and model card. Then it reloads
the checkpoint with plain `AutoModelForCausalLM`, measures held-out perplexity and the KL from the dense model, and,
with `--vllm-python`, serves it in vLLM and measures the agreement with transformers. It prints the row of the table
in docs/benchmarks/deploy.md that this run makes (without vLLM's speed: benchmarks/vllm_speed.py measures that).

    pip install -e ".[quantize]"     # llm-compressor; vLLM in its own environment (docs/guides/serving.md)
    python examples/deploy/prune_heal_quantize_serve.py --vllm-python vllm-env/bin/python
    python examples/deploy/prune_heal_quantize_serve.py --scheme w4a16 --heal-tokens 0   # no heal, INT4 weights
    python examples/deploy/prune_heal_quantize_serve.py --num-samples 8 --heal-tokens 2048 --max-eval-segments 8   # a smoke run
"""

from __future__ import annotations

import argparse
import os

import torch
from transformers import AutoModelForCausalLM

from optimum_gradmap import GradMAPConfig, GradMAPPruner, evaluate
from optimum_gradmap.assets import MODEL_ASSETS, load_model

HEAL_TEXT = "offline:web_text+offline:wikipedia"  # the calibration parts of both: other text than Stage 1 and 2 saw
HELD_OUT = ("offline:wikipedia", "offline:web_text")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help=f"offline asset ({', '.join(MODEL_ASSETS)}), Hub id or folder")
    parser.add_argument("--ratio", type=float, default=0.25, help="fraction of decoder layers to remove (default: 0.25)")
    parser.add_argument("--num-samples", type=int, default=128, help="calibration sequences (default: 128, the paper's)")
    parser.add_argument("--heal-tokens", type=int, default=196_608, help="heal budget in tokens; 0: no heal")
    parser.add_argument("--scheme", choices=("w8a8", "w4a16", "fp8"), default="w8a8", help="quantization (default: w8a8)")
    parser.add_argument("--max-eval-segments", type=int, default=32, help="held-out 128-token segments per dataset")
    parser.add_argument("--vllm-python", default=None, help="the Python of an environment with vLLM (None: no serving)")
    parser.add_argument("--output", default="out/smollm2-gradmap-deploy", help="the checkpoint folder")
    args = parser.parse_args()

    if args.model in MODEL_ASSETS:
        model, tokenizer = load_model(args.model, dtype=torch.float32)
        dense, _ = load_model(args.model, dtype=torch.float32)
    else:
        from transformers import AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        dense = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    config = GradMAPConfig(
        pruning_ratio=args.ratio,
        num_samples=args.num_samples,
        dataset="offline:wikipedia",
        heal_tokens=args.heal_tokens,
        heal_dataset=HEAL_TEXT,
        quantization=args.scheme,
    )
    result = GradMAPPruner(config, tokenizer=tokenizer).prune(model, "offline:wikipedia")
    folder = result.save_pretrained(args.output, overwrite=True)
    print(f"removed layers {result.removed_layers}; compensated {result.compensated_layers}")
    if result.heal is not None:
        print(f"heal: held-out KL {result.heal.start_kl:.4f} -> {result.heal.best_kl:.4f}")
    print(f"quantized to {args.scheme} in {result.quantization.seconds:.0f} s; saved to {folder}")

    reloaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)  # plain transformers
    evaluation = evaluate(
        reloaded, tokenizer, HELD_OUT, segment_length=128, max_segments=args.max_eval_segments,
        reference_model=dense, reference_model_name="dense", progress_bar=False,
    )  # fmt: skip
    size = sum(os.path.getsize(os.path.join(folder, name)) for name in os.listdir(folder) if name.endswith(".safetensors"))
    cells = [f"{args.model}, {args.ratio:.0%}{' healed' if result.heal else ''}", args.scheme, f"{size / 1e6:,.0f} MB"]
    cells += [f"{entry.dataset} ppl {entry.perplexity:.2f} (KL {entry.kl_to_reference:.3f})" for entry in evaluation.perplexities]
    if args.vllm_python:
        from optimum_gradmap.quantize.serving import verify_quantized_serving

        check = verify_quantized_serving(folder, args.vllm_python)
        print(check.summary())
        cells.append(
            f"vLLM {'agrees' if check.agrees else 'DISAGREES'} (mean |logprob diff| {check.served.mean_logprob_difference:.3f})"
        )
    print("row: | " + " | ".join(cells) + " |")


if __name__ == "__main__":  # vLLM may start its engine in a spawned process, which re-imports this file
    main()
