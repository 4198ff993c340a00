"""Which of a Stage 2's fits does what (issue 38): for one model, ratio, selection of removed layers and Stage 2
variant (those of benchmarks/accuracy.py), the fits are made once, then held-out perplexity is measured with
every fit, with each fit alone (the others put back to Stage 1's weights), and with none; and, for each fitted
layer, what its W' does to the first token of each calibration sequence (the massive-activation token) and to
the others: the norm of the layer's MLP output (median over tokens for the others) and the norm of the change
W' makes to it.

    python benchmarks/fit_probe.py --model smollm2-135m --ratio 0.25 --selection block_influence --variant mixed+no_outliers

Writes benchmarks/results/fit_probe-<model>-<ratio>-<selection>-<variant>.json, with its provenance.
"""

from __future__ import annotations

import argparse
import json
import logging
import os

import torch
from accuracy import CALIBRATION, RESULTS, SELECTIONS, layers_of, variant_settings
from provenance import finish, provenance

from optimum_gradmap import GradMAPConfig, GradMAPPruner
from optimum_gradmap.adapters import get_adapter
from optimum_gradmap.assets import MODEL_ASSETS, load_model
from optimum_gradmap.data import calibration_sha256, prepare_calibration_data
from optimum_gradmap.evaluation import evaluate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", choices=sorted(MODEL_ASSETS))
    parser.add_argument("--ratio", type=float, default=0.25)
    parser.add_argument("--selection", default="block_influence", choices=sorted(SELECTIONS))
    parser.add_argument("--variant", default="mixed+no_outliers", help="a Stage 2 variant of benchmarks/accuracy.py")
    parser.add_argument("--num-samples", type=int, default=128)
    parser.add_argument("--max-segments", type=int, default=24, help="held-out 128-token segments per domain")
    parser.add_argument("--probe-samples", type=int, default=8, help="calibration sequences for the MLP output norms")
    args = parser.parse_args()
    logging.getLogger("optimum_gradmap").setLevel(logging.WARNING)
    torch.manual_seed(0)
    settings = variant_settings(args.variant)
    if settings is None:
        raise SystemExit("--variant must be a Stage 2 variant, not stage1")
    started = provenance()

    model, tokenizer = load_model(args.model)
    calibration = prepare_calibration_data(CALIBRATION, tokenizer, args.num_samples, 128, 0, CALIBRATION)
    layers, layers_from = layers_of(args.model, args.ratio, args.selection)
    config = GradMAPConfig(layers_to_prune=layers, num_samples=args.num_samples, seq_len=128, dataset=CALIBRATION)
    pruner = GradMAPPruner(config, tokenizer=tokenizer, progress_bar=False)
    result = pruner.select_layers(model, calibration)
    adapter = get_adapter(model)
    kept = list(adapter.get_layers(model))
    down_projections = []
    for layer in kept:
        (projection,) = adapter.get_down_projections(layer)  # a dense MLP: one down projection per layer
        down_projections.append(projection.weight)

    def perplexities() -> list[float]:
        evaluation = evaluate(
            model, tokenizer, ("offline:wikipedia", "offline:web_text"), segment_length=128,
            max_segments=args.max_segments, progress_bar=False,
        )  # fmt: skip
        return [entry.perplexity for entry in evaluation.perplexities]

    stage1_weights = [weight.detach().clone() for weight in down_projections]
    record = {"model": args.model, "ratio": args.ratio, "selection": args.selection, "variant": args.variant}
    record.update(removed_layers=layers, layers_from=layers_from, calibration_sha256=calibration_sha256(calibration))
    record["stage1_perplexity"] = perplexities()
    print(f"Stage 1 alone: {record['stage1_perplexity']}", flush=True)
    pruner.compensate(result, **settings)
    fitted_weights = [weight.detach().clone() for weight in down_projections]
    changed = [i for i, (a, b) in enumerate(zip(stage1_weights, fitted_weights)) if not torch.equal(a, b)]
    kept_dense_index = result.kept_layers  # dense-model index of each kept layer
    record.update(
        compensated_layers=result.compensation.compensated_layers,
        compensation_lambda={str(k): v for k, v in result.compensation.reg_lambda.items()},
        stage2_settings=settings,
        stage2_calibration_sha256=result.compensation.calibration_sha256,
    )
    record["every_fit_perplexity"] = perplexities()
    print(f"every fit: {record['every_fit_perplexity']}", flush=True)

    # each fit's MLP outputs on the Stage 1 model, and what its W' (= fitted W_down pinv(Stage 1 W_down)) does to them
    with torch.no_grad():
        for weight, original in zip(down_projections, stage1_weights):
            weight.copy_(original)
    outputs: dict[int, torch.Tensor] = {}
    hooks = [
        adapter.get_mlp(kept[i]).register_forward_hook(lambda m, a, o, i=i: outputs.__setitem__(i, o.detach().double()))
        for i in changed
    ]
    with torch.no_grad():
        model(calibration[: args.probe_samples], use_cache=False)
    for hook in hooks:
        hook.remove()
    fits = {}
    for i in changed:
        matrix = fitted_weights[i].double() @ torch.linalg.pinv(stage1_weights[i].double())
        output = outputs[i]
        change = (output @ matrix.T - output).norm(dim=-1)
        norms = output.norm(dim=-1)
        with torch.no_grad():
            for j, (weight, original, fitted) in enumerate(zip(down_projections, stage1_weights, fitted_weights)):
                weight.copy_(fitted if j == i else original)
        alone = perplexities()
        fits[str(kept_dense_index[i])] = {
            "perplexity_this_fit_alone": alone,
            "first_token_mlp_output_norm": float(norms[:, 0].mean()),
            "first_token_change_norm": float(change[:, 0].mean()),
            "other_tokens_median_mlp_output_norm": float(norms[:, 1:].median()),
            "other_tokens_median_change_norm": float(change[:, 1:].median()),
            "relative_distance_from_identity": float(
                (matrix - torch.eye(matrix.shape[0], dtype=matrix.dtype)).norm() / matrix.shape[0] ** 0.5
            ),
        }
        print(f"layer {kept_dense_index[i]}: {fits[str(kept_dense_index[i])]}", flush=True)
    record["fits"] = fits
    record["provenance"] = finish(started)
    path = os.path.join(RESULTS, f"fit_probe-{args.model}-{args.ratio:g}-{args.selection}-{args.variant}.json")
    with open(path, "w", encoding="utf-8") as file:
        json.dump(record, file, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
