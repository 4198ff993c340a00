"""What the language-model head and the loss cost in one SLEB candidate's pass, which starting a candidate from its
recorded input (our SLEB) cannot skip.

    python benchmarks/head_cost.py --model smollm2-135m
    python benchmarks/head_cost.py --model qwen2.5-coder-0.5b

The model is cut to its first two layers so that the head dominates; one batch of 8 x 128 random token ids; each
figure is the best of five runs after a warm-up:

- `decoder`: embeddings and the two layers;
- `plain`: the whole model's logits sliced to the positions that predict a token, then the cross-entropy (what
  `removal_losses` and SLEB's code do); head + loss = plain - decoder;
- `final_positions_only`: the head applied to the decoder's final hidden states of those positions only, then the
  cross-entropy (no copy of the sliced `(batch, seq_len, vocab)` logits);
- `full_forward`: the whole uncut model with its loss, for the share;
- `loss_only`: the slice and the cross-entropy alone, on logits computed beforehand.

Writes benchmarks/results/head_cost-<model>.json with its provenance (`benchmarks/provenance.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.provenance import finish, provenance  # noqa: E402
from optimum_gradmap.adapters import get_adapter  # noqa: E402
from optimum_gradmap.assets import MODEL_ASSETS, load_model  # noqa: E402
from optimum_gradmap.surgery import snapshot  # noqa: E402


def best_of(run, repeats: int = 5) -> float:
    run()
    timings = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        timings.append(time.perf_counter() - start)
    return min(timings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", choices=sorted(MODEL_ASSETS))
    parser.add_argument("--output-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args()

    model, _ = load_model(args.model)
    model.eval()
    adapter = get_adapter(model)
    ids = torch.randint(0, 1000, (8, 128), generator=torch.Generator().manual_seed(0))
    labels = ids[:, 1:].reshape(-1)

    def loss(logits: torch.Tensor) -> float:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels, reduction="sum").item()

    def plain() -> float:
        return loss(model(input_ids=ids, use_cache=False).logits[:, :-1].float())

    def decoder() -> torch.Tensor:
        return adapter.final_hidden_states(model, input_ids=ids, use_cache=False)

    def final_positions_only() -> float:
        return loss(adapter.compute_logits(model, decoder()[:, :-1]).float())

    started = provenance()
    with torch.no_grad():
        seconds = {"full_forward": best_of(plain)}
        stack = snapshot(model, adapter)
        with stack.temporarily([0, 1]):
            seconds |= {
                name: best_of(run)
                for name, run in (("decoder", decoder), ("plain", plain), ("final_positions_only", final_positions_only))
            }
            same = abs(plain() - final_positions_only()) <= 1e-4 * abs(plain())
            logits = model(input_ids=ids, use_cache=False).logits
            seconds["loss_only"] = best_of(lambda: loss(logits[:, :-1].float()))
    figures = {
        "head_and_loss_plain": seconds["plain"] - seconds["decoder"],
        "head_and_loss_final_positions_only": seconds["final_positions_only"] - seconds["decoder"],
    }
    figures["head_and_loss_share_of_full_forward"] = figures["head_and_loss_plain"] / seconds["full_forward"]
    figures["saving_of_final_positions_only"] = 1 - figures["head_and_loss_final_positions_only"] / figures["head_and_loss_plain"]
    record = {"model": args.model, "seconds": seconds, "figures": figures, "same_loss": same, "provenance": finish(started)}
    for name, value in {**seconds, **figures}.items():
        print(f"{name:40s} {value:.3f}")
    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, f"head_cost-{args.model}.json"), "w", encoding="utf-8") as file:
        json.dump(record, file, indent=1)


if __name__ == "__main__":
    main()
