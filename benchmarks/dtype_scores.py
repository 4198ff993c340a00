"""Why bfloat16 removed another layer (issue 55): GradMAP's scores of one Stage 1 round, on the model with the layers
float32 removed before that round, computed three ways: float32 weights in float32; the same weights rounded to
bfloat16, computed in float32 (the exact score of the bfloat16 model); and bfloat16 weights computed in bfloat16.
Where the second and third agree and differ from the first, the rounding of the weights, not the arithmetic, changed
the ranking: no float32 accumulation can bring float32's choice back.

    python benchmarks/dtype_scores.py --model smollm2-135m --removed 26 25 21 18 14 13 17

Writes benchmarks/results/dtype_scores-<model>-<K>.{json,md} (K: the number of layers removed before the round),
with the provenance of the run.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from accuracy import CALIBRATION, RESULTS
from provenance import finish, provenance

from optimum_gradmap.assets import load_model
from optimum_gradmap.data import calibration_sha256, prepare_calibration_data
from optimum_gradmap.importance import gradient_importance
from optimum_gradmap.surgery import remove_layers

WAYS = {
    "float32 weights, float32": (torch.float32, torch.float32),
    "bfloat16 weights, computed in float32": (torch.bfloat16, torch.float32),
    "bfloat16 weights, bfloat16": (torch.bfloat16, torch.bfloat16),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--removed", type=int, nargs="+", required=True, help="dense indices removed before the round")
    parser.add_argument("--num-samples", type=int, default=128)
    args = parser.parse_args()
    started = provenance()
    record = {"model": args.model, "removed_before_round": args.removed, "num_samples": args.num_samples, "ways": {}}
    for name, (load_dtype, compute_dtype) in WAYS.items():
        model, tokenizer = load_model(args.model, dtype=load_dtype)
        model = model.to(compute_dtype)
        ids = prepare_calibration_data(CALIBRATION, tokenizer, args.num_samples, 128, 0, CALIBRATION)
        record["calibration_sha256"] = calibration_sha256(ids)
        kept = remove_layers(model, args.removed)
        scores = gradient_importance(model, list(model.get_decoder().layers), ids, 8, progress_bar=False)
        record["ways"][name] = {str(layer): float(score) for layer, score in zip(kept, scores.tolist())}
        print(name, sorted(record["ways"][name].items(), key=lambda item: item[1])[:4], flush=True)
    record["provenance"] = finish(started)
    lines = [
        f"# GradMAP's scores after removing {args.removed} from {args.model}: float32 and bfloat16",
        "",
        f"Calibration {args.num_samples} x 128 tokens, {record['calibration_sha256'][:12]}. The four lowest scores of the "
        "round (the lowest is removed), each way:",
        "",
        "| computed | four lowest (layer: score) |",
        "|---|---|",
    ]
    for name, scores in record["ways"].items():
        lowest = sorted(scores.items(), key=lambda item: item[1])[:4]
        lines.append(f"| {name} | {', '.join(f'{layer}: {score:.4f}' for layer, score in lowest)} |")
    path = os.path.join(RESULTS, f"dtype_scores-{args.model}-{len(args.removed)}")
    with open(path + ".json", "w", encoding="utf-8") as file:
        json.dump(record, file, indent=1)
    with open(path + ".md", "w", encoding="utf-8") as file:
        file.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
