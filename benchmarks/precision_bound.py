"""How far bfloat16 passes move the values that GradMAP's decisions compare (the measurement behind
`optimum_gradmap.precision.SCORE_BOUND` and `LOSS_BOUND`), on one model and ratio, the library's default settings:

- Stage 1: every round scores the layers twice on the same model, in float32 and under bfloat16 autocast (float32
  weights), and float32's choice is removed; each layer's relative difference is recorded.
- Stage 2: on float32's removed layers, every strength of the grid and W' = I are scored by the held-out next-token
  loss, in float32 and under bfloat16 autocast.

    python benchmarks/precision_bound.py --model smollm2-135m --rounds 12 --resume
    python benchmarks/precision_bound.py --model qwen2.5-coder-0.5b --rounds 6 --resume
    python benchmarks/precision_bound.py --rounds 2 --stage2-removed 26 25 21 18 14 13 17 10 --resume  # the main job's layers

Writes benchmarks/results/precision-bound-<model>.json, a round at a time; with `--resume`, the rounds and the Stage 2
part already there are kept (`--rounds` may grow between runs).
"""

from __future__ import annotations

import os
import time

import records
import torch
from common import CALIBRATION, RESULTS, calibration, parser, resumed
from provenance import finish, provenance

from optimum_gradmap import GradMAPConfig, surgery
from optimum_gradmap.adapters import get_adapter
from optimum_gradmap.assets import load_model
from optimum_gradmap.compensation import Stage2Settings, lambda_search, next_token, stage2
from optimum_gradmap.data import calibration_sha256
from optimum_gradmap.importance.gradient import gradient_importance


def bfloat16(enabled: bool = True) -> torch.autocast:
    """The library's bfloat16 passes (`Precision.passes`): autocast without a cache of the cast weights."""
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled, cache_enabled=False)


def stage1_round(dense: surgery.LayerSnapshot, removed: list[int], ids: torch.LongTensor) -> dict:
    """One round: the scores of the layers left in float32 and in bfloat16, and float32's choice."""
    kept = [index for index in range(dense.num_layers) if index not in removed]
    dense.keep(kept)
    layers = list(get_adapter(dense.model).get_layers(dense.model))
    started = provenance()
    scores = {}
    for name in ("float32", "bfloat16"):
        with bfloat16(name == "bfloat16"):
            scores[name] = gradient_importance(dense.model, layers, ids, 8, progress_bar=False).tolist()
    choice = min(range(len(kept)), key=lambda position: (scores["float32"][position], kept[position]))
    return {"kept": kept, **scores, "removed": kept[choice], "provenance": finish(started)}


def stage2_losses(dense: surgery.LayerSnapshot, removed: list[int], ids: torch.LongTensor) -> dict:
    """The held-out losses of every strength and of W' = I, per fitted layer, in float32 and in bfloat16."""
    dense.keep([index for index in range(dense.num_layers) if index not in removed])
    settings = Stage2Settings.from_config(GradMAPConfig(num_layers_to_prune=len(removed)))
    calls: list[dict] = []
    choose = next_token.choose_strength

    def recording(losses: dict[float, float], identity_loss: float):
        calls.append({"losses": {str(alpha): loss for alpha, loss in losses.items()}, "identity": identity_loss})
        return choose(losses, identity_loss)

    measured = {"removed": removed, "provenance": provenance()}
    next_token.choose_strength, lambda_search.SEARCH = recording, "grid"  # every strength's loss, to compare
    try:
        for name in ("float32", "bfloat16"):
            calls.clear()
            started = time.perf_counter()
            with bfloat16(name == "bfloat16"):
                result = stage2.compensate(dense, ids, settings, progress_bar=False)
            lambdas = {str(layer): value for layer, value in result.reg_lambda.items()}
            measured[name] = {"fits": list(calls), "targets": list(result.targets), "lambda": lambdas}
            measured[name]["compensated_layers"] = result.compensated_layers
            measured[name]["seconds"] = time.perf_counter() - started
            result.undo()
    finally:
        next_token.choose_strength, lambda_search.SEARCH = choose, "golden"
    measured["provenance"] = finish(measured["provenance"])
    return measured


def main() -> None:
    arguments = parser(__doc__)
    arguments.add_argument("--model", default="smollm2-135m")
    arguments.add_argument("--rounds", type=int, default=8, help="Stage 1 rounds (the layers of the largest ratio wanted)")
    arguments.add_argument(
        "--stage2-layers", type=int, default=None, help="Stage 2 on float32's first N removals (default: --rounds)"
    )
    arguments.add_argument(
        "--stage2-removed",
        type=int,
        nargs="+",
        default=None,
        help="Stage 2 on these removed layers (float32's, from another run)",
    )
    arguments.add_argument("--resume", action="store_true")
    args = arguments.parse_args()
    path = os.path.join(RESULTS, f"precision-bound-{args.model}.json")
    record = resumed(path, args.resume, {"model": args.model, "num_samples": 128, "rounds": [], "stage2": None})
    model, tokenizer = load_model(args.model)
    ids = calibration(tokenizer, 128)
    record["calibration_sha256"] = calibration_sha256(ids)
    record["calibration"] = CALIBRATION
    dense = surgery.snapshot(model)
    while len(record["rounds"]) < args.rounds:
        measured = stage1_round(dense, [done["removed"] for done in record["rounds"]], ids)
        record["rounds"].append(measured)
        records.write(path, record)
        print(f"round {len(record['rounds'])}: float32 removes {measured['removed']}", flush=True)
    removed = args.stage2_removed or [done["removed"] for done in record["rounds"]][: args.stage2_layers or args.rounds]
    if record["stage2"] is None or record["stage2"]["removed"] != removed:
        record["stage2"] = stage2_losses(dense, removed, ids)
        records.write(path, record)
        print(f"Stage 2 on {removed}: lambdas {record['stage2']['float32']['lambda']} / {record['stage2']['bfloat16']['lambda']}")


if __name__ == "__main__":
    main()
