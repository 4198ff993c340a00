"""The next-token selection of lambda, checked on a real model (issue 55): for every fit of the default Stage 2 on one
model, ratio and selection of removed layers, the held-out loss of every strength of the grid as the library computes
it (each candidate run from the fitted layer on), the same losses by a pass of the whole model per candidate
(`optimum_gradmap.testing.reference_next_token_choice`, with `--reference`), and the choice of each search
(`lambda_search="grid"` and `"golden"`, the latter replayed on the grid's losses, with the number of passes it needs).

    python benchmarks/next_token_selection.py --model smollm2-135m --ratio 0.25 --selection gradmap --reference
    python benchmarks/next_token_selection.py --model qwen2.5-coder-0.5b --ratio 0.25 --selection gradmap

The removed layers are those of `--selection` in compare-<model>-<ratio>.json (as in benchmarks/accuracy.py). Writes
benchmarks/results/next_token_selection-<model>-<ratio>-<selection>.json and .md, with the provenance of the run.
"""

from __future__ import annotations

import argparse
import json
import os

from accuracy import CALIBRATION, RESULTS, add_layer_arguments, layer_record, layers_of
from provenance import finish, provenance

import optimum_gradmap.compensation.fit as fit_module
from optimum_gradmap import GradMAPConfig, GradMAPPruner
from optimum_gradmap.assets import load_model
from optimum_gradmap.compensation.next_token import _choose, searched_losses
from optimum_gradmap.compensation.solvers import AUTO_RIDGE_GRID
from optimum_gradmap.data import prepare_calibration_data
from optimum_gradmap.testing import reference_next_token_choice


def markdown(record: dict) -> str:
    lines = [
        f"# The next-token selection on {record['model']}, {record['ratio']:g}, layers of {record['selection']}",
        "",
        f"Removed layers {record['removed_layers']}; calibration {record['num_samples']} x 128 tokens, "
        f"{record['calibration_sha256'][:12]}. Chosen strength (alpha, relative to tr(A)/d; `none`: the layer is left "
        "alone) by the grid from the fitted layer on (the library), by the whole model per candidate (the reference), "
        "and by the golden-section search replayed on the grid's losses; the largest relative difference between the "
        "library's and the reference's losses.",
        "",
        "| fitted layer | grid | reference | largest relative loss difference | golden | golden passes (of 9) |",
        "|---|---|---|---|---|---|",
    ]
    for fit in record["fits"]:
        reference = fit.get("reference_alpha", "not run")
        difference = f"{fit['largest_relative_difference']:.1e}" if "largest_relative_difference" in fit else "-"
        lines.append(
            f"| {fit['layer']} | {fit['alpha']} | {reference} | {difference} | {fit['golden_alpha']} | {fit['golden_passes']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_layer_arguments(parser)
    parser.add_argument("--reference", action="store_true", help="also score every candidate with the whole model")
    args = parser.parse_args()
    layers, layers_from = layers_of(args.model, args.ratio, args.selection)
    model, tokenizer = load_model(args.model)
    calibration = prepare_calibration_data(CALIBRATION, tokenizer, args.num_samples, 128, 0, CALIBRATION)
    record = {
        **layer_record(args, layers, layers_from, calibration),
        "fits": [],
    }
    started = provenance()
    learn = fit_module.learn_by_next_token_loss

    def recorded(model, adapter, layer, original_outputs, input_ids, config, progress_bar=True, first_sample=0):
        fit = {"layer": list(adapter.get_layers(model)).index(layer)}
        if args.reference:
            reference = reference_next_token_choice(model, adapter, layer, original_outputs, input_ids, config)
            fit["reference_alpha"] = reference.alpha
            fit["reference_losses"] = {repr(alpha): loss for alpha, loss in reference.heldout_error.items()}
            fit["reference_identity"] = reference.identity_error
        found = learn(model, adapter, layer, original_outputs, input_ids, config, progress_bar, first_sample)
        losses, identity = found.cross_validation.heldout_error, found.cross_validation.identity_error
        golden = searched_losses(losses.__getitem__, AUTO_RIDGE_GRID, "golden")
        fit.update(
            alpha=found.cross_validation.alpha,
            losses={repr(alpha): loss for alpha, loss in losses.items()},
            identity=identity,
            golden_alpha=_choose(golden, identity).alpha,
            golden_passes=len(golden),
        )
        if args.reference:
            pairs = [(losses[alpha], reference.heldout_error[alpha]) for alpha in losses]
            pairs.append((identity, reference.identity_error))
            fit["largest_relative_difference"] = max(abs(a - b) / abs(b) for a, b in pairs)
        record["fits"].append(fit)
        print(fit, flush=True)
        return found

    fit_module.learn_by_next_token_loss = recorded
    config = GradMAPConfig(
        layers_to_prune=layers, num_samples=args.num_samples, seq_len=128, dataset=CALIBRATION, lambda_search="grid"
    )
    pruner = GradMAPPruner(config, tokenizer=tokenizer, progress_bar=False)
    result = pruner.select_layers(model, calibration)
    pruner.compensate(result)
    for fit in record["fits"]:  # the stack position recorded above, as a dense layer index
        fit["layer"] = result.kept_layers[fit["layer"]]
    record["provenance"] = finish(started)
    path = os.path.join(RESULTS, f"next_token_selection-{args.model}-{args.ratio:g}-{args.selection}")
    with open(path + ".json", "w", encoding="utf-8") as file:
        json.dump(record, file, indent=1)
    with open(path + ".md", "w", encoding="utf-8") as file:
        file.write(markdown(record))
    print(markdown(record))


if __name__ == "__main__":
    main()
