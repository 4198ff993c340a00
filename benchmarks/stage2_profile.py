"""Where Stage 2's seconds go, against the plan's (issue 64: the plan's Stage 2 before Stage 1): one Stage 2 run on the
layers `--selection` removed (benchmarks/compare.py's record, as in benchmarks/accuracy.py), in the same process as
the planner's throughput measurement, so that both see the same machine. Each part of Stage 2 is timed by wrapping
its function (the dense and pruned hidden-state passes, the fits' statistics passes, the held-out next-token losses
and how many, the ridge solves), and the plan of the same layers (`GradMAPPruner.plan(..., removed_layers=...)`) is
printed beside: its range, its likely value, and the held-out losses it expects per fit.

    python benchmarks/stage2_profile.py --model smollm2-135m --ratio 0.25 --selection gradmap

Writes benchmarks/results/stage2_profile-<model>-<ratio>-<selection>.json with its provenance (quiet or not: the
ratio of measured to planned seconds is what it is for, both taken under the same load).
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import time

import torch
from accuracy import CALIBRATION, RESULTS, add_layer_arguments, layer_record, layers_of
from provenance import finish, provenance

from optimum_gradmap import GradMAPConfig, GradMAPPruner
from optimum_gradmap.assets import get_model_path, load_model
from optimum_gradmap.compensation import next_token
from optimum_gradmap.compensation import stage2 as stage2_module
from optimum_gradmap.data import prepare_calibration_data
from optimum_gradmap.planning import DeviceThroughput

# (module, function, name in the record): the parts of Stage 2, wrapped with a timer and a counter
PARTS = [
    (stage2_module, "hidden_state_means_and_outputs", "dense hidden states"),
    (stage2_module, "hidden_state_means", "pruned hidden states"),
    (stage2_module, "_compensated_means", "hidden states after the folds"),
    (stage2_module, "fit_and_fold", "fits (statistics, held-out losses, solves)"),
    (next_token, "compensation_statistics", "statistics passes"),
    (next_token.HeldOutLoss, "__call__", "held-out next-token losses"),
    (next_token, "ridge_solutions", "ridge solves"),
]


def timed_parts() -> tuple[dict[str, float], collections.Counter]:
    seconds: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter = collections.Counter()
    for owner, name, label in PARTS:
        original = getattr(owner, name)

        def wrapper(*args, _original=original, _label=label, **kwargs):
            started = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                seconds[_label] += time.perf_counter() - started
                calls[_label] += 1

        setattr(owner, name, wrapper)
    return seconds, calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_layer_arguments(parser)
    args = parser.parse_args()
    logging.getLogger("optimum_gradmap").setLevel(logging.WARNING)
    torch.manual_seed(0)
    layers, layers_from = layers_of(args.model, args.ratio, args.selection)
    seconds, calls = timed_parts()
    model, tokenizer = load_model(args.model)
    calibration = prepare_calibration_data(CALIBRATION, tokenizer, args.num_samples, 128, 0, CALIBRATION)
    config = GradMAPConfig(layers_to_prune=layers, num_samples=args.num_samples, seq_len=128, dataset=CALIBRATION)
    path = get_model_path(args.model)
    started = provenance()
    throughput = DeviceThroughput.measure(path)
    plan = GradMAPPruner.plan(path, config, throughput=throughput, removed_layers=layers)
    pruner = GradMAPPruner(config, tokenizer=tokenizer, progress_bar=False)
    result = pruner.select_layers(model, calibration)
    pruner.compensate(result)
    compensation = result.compensation
    planned = plan.stage("Stage 2")
    record = {
        **layer_record(args, layers, layers_from, calibration),
        "stage2_seconds": compensation.seconds,
        "parts": {label: {"seconds": seconds[label], "calls": calls[label]} for _, _, label in PARTS},
        "fitted_layers": {str(layer): value for layer, value in compensation.reg_lambda.items()},
        "left_alone": {str(layer): why for layer, why in compensation.skipped_layers.items()},
        "planned_seconds": planned.seconds.to_dict(),
        "planned_evaluations_per_fit": plan.stage2,
        "throughput": throughput.to_dict(),
        "provenance": finish(started),
    }
    path = os.path.join(RESULTS, f"stage2_profile-{args.model}-{args.ratio:g}-{args.selection}.json")
    with open(path, "w", encoding="utf-8") as file:
        json.dump(record, file, indent=1)
    shown = ("stage2_seconds", "parts", "planned_seconds", "planned_evaluations_per_fit")
    print(json.dumps({key: record[key] for key in shown}, indent=1))


if __name__ == "__main__":
    main()
