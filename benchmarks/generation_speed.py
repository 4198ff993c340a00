"""How fast the dense model writes its own heal text (`heal_dataset="generated"`), by batch size and by how each token
is drawn, in one run:

    python benchmarks/generation_speed.py --model smollm2-135m

`optimum_gradmap.generation.sample_batch` samples `--seq-len` tokens (the heal's default 128) from 8-token prompts of
random ids, at temperature 1, for each batch size, with the tokens drawn two ways: `torch.multinomial` (the sampler
before `GENERATION_VERSION` 3) and `draw_tokens` (inverting the cumulative distribution, the sampler since). One
untimed warm-up batch first; each figure is one timed batch (tokens written / seconds, the prompts included, as the
heal counts them). A float32 model on the CPU, every thread torch uses; each setting with and without bfloat16
autocast where the heal would use it (`heal_autocast`'s rule, `precision.uses_bfloat16_autocast`: a CPU that computes
bfloat16 natively), float32 alone elsewhere.

Writes benchmarks/results/generation_speed-<model>.json with its provenance (`benchmarks/provenance.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.provenance import finish, provenance  # noqa: E402
from optimum_gradmap import generation  # noqa: E402
from optimum_gradmap.assets import MODEL_ASSETS, load_model  # noqa: E402
from optimum_gradmap.precision import uses_bfloat16_autocast  # noqa: E402

PROMPT_TOKENS = 8


def multinomial(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> torch.LongTensor:
    """The draw before `GENERATION_VERSION` 3."""
    probabilities = torch.softmax(logits / temperature, dim=-1)
    return torch.multinomial(probabilities, 1, generator=generator).squeeze(1)


SAMPLERS = {"multinomial": multinomial, "draw_tokens": generation.draw_tokens}


def tokens_per_second(model: torch.nn.Module, batch_size: int, seq_len: int, vocab_size: int, autocast: bool) -> float:
    generator = torch.Generator().manual_seed(batch_size)
    prompts = [torch.randint(0, vocab_size, (PROMPT_TOKENS,), generator=generator) for _ in range(batch_size)]
    start = time.perf_counter()
    generation.sample_batch(model, prompts, seq_len, 1.0, torch.Generator().manual_seed(0), autocast)
    return batch_size * seq_len / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", choices=sorted(MODEL_ASSETS))
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--output-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args()

    model, _ = load_model(args.model)
    model.eval()
    vocab_size = model.config.vocab_size
    precisions = [False] + ([True] if uses_bfloat16_autocast(True, model) else [])
    started = provenance()
    rows = []
    for autocast in precisions:
        tokens_per_second(model, 8, args.seq_len, vocab_size, autocast)  # warm-up
        for sampler, draw in SAMPLERS.items():
            with mock.patch.object(generation, "draw_tokens", draw):
                for batch_size in args.batch_sizes:
                    speed = tokens_per_second(model, batch_size, args.seq_len, vocab_size, autocast)
                    rows.append({"sampler": sampler, "batch_size": batch_size, "autocast": autocast, "tokens_per_second": speed})
                    passes = "bf16 autocast" if autocast else "float32"
                    print(f"{passes:13s} {sampler:12s} batch {batch_size:4d}: {speed:7.1f} tokens/s", flush=True)
    record = {
        "model": args.model,
        "seq_len": args.seq_len,
        "prompt_tokens": PROMPT_TOKENS,
        "dtype": "float32",
        "autocast_measured": precisions,
        "threads": torch.get_num_threads(),
        "rows": rows,
        "provenance": finish(started),
    }
    os.makedirs(args.output_dir, exist_ok=True)
    path = os.path.join(args.output_dir, f"generation_speed-{args.model}.json")
    with open(path, "w") as file:
        json.dump(record, file, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
