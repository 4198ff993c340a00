"""Stage 1 against SLEB at the cost of SLEB's own code: same model, ratio and calibration set, one run. Each
selection runs on a fresh copy of the dense model, Stage 1 only (the layers alone are compared):

- `sleb_reference`: SLEB's criterion as SLEB's code computes it, one full forward pass over the calibration set per
  candidate block (`optimum_gradmap.testing.reference_removal_losses`);
- `sleb`: our SLEB, each candidate started from its recorded input: the same layers, less work;
- `quality`, `fast`, `paper`: those presets' Stage 1.

Each row: the removed layers, Stage 1 seconds, held-out perplexity on Wikipedia and web text (128-token segments),
and its provenance (the machine's load and the other busy processes: timings mean something only on a quiet one).

    python benchmarks/stage1_peers.py --model smollm2-135m --ratio 0.25 --num-samples 16 --resume \
        --methods sleb_reference sleb quality fast paper
    python benchmarks/stage1_peers.py --model qwen2.5-coder-0.5b --ratio 0.25 --num-samples 8 --resume

Writes benchmarks/results/stage1_peers-<model>-<ratio>-<num samples>.json, after every row; `--resume` keeps the
rows already there (same settings, same calibration set by its SHA-256) and runs the others.
"""

from __future__ import annotations

import copy
import os

import records
from common import RESULTS, log_rounds, parser, perplexities, resumed
from provenance import finish, provenance

from optimum_gradmap import GradMAPConfig, GradMAPPruner
from optimum_gradmap.assets import MODEL_ASSETS, load_model
from optimum_gradmap.configuration import PRESETS, QUALITY_SELECTION
from optimum_gradmap.data import calibration_sha256
from optimum_gradmap.importance.metrics import SLEBImportance
from optimum_gradmap.testing import reference_removal_losses


class ReferenceCostSLEB(SLEBImportance):
    """SLEB's criterion at the cost of SLEB's code: every candidate by a full forward pass over the calibration set
    (the same losses as `sleb`, which the test suite checks on every family)."""

    name = "sleb_reference"

    def score_layers(self, model, adapter, input_ids, batch_size, positions, progress_bar=True, description="Scoring layers"):
        return reference_removal_losses(model, input_ids, batch_size, positions)


METHODS = {
    "sleb_reference": lambda: {"importance": ReferenceCostSLEB()},
    "sleb": lambda: {"importance": "sleb"},
    "quality": lambda: dict(QUALITY_SELECTION),  # its Stage 1 (the preset heals too)
    "fast": lambda: dict(PRESETS["fast"]),
    "paper": lambda: {"importance": PRESETS["paper"]["importance"]},
}


def main() -> None:
    arguments = parser(__doc__)
    arguments.add_argument("--model", default="smollm2-135m", choices=sorted(MODEL_ASSETS))
    arguments.add_argument("--ratio", type=float, default=0.25)
    arguments.add_argument("--num-samples", type=int, default=32, help="calibration sequences of 128 tokens (default 32)")
    arguments.add_argument("--methods", nargs="+", default=["sleb_reference", "sleb", "quality", "fast"], choices=list(METHODS))
    arguments.add_argument("--max-eval-segments", type=int, default=128)
    arguments.add_argument("--output-dir", default=RESULTS)
    arguments.add_argument("--resume", action="store_true")
    args = arguments.parse_args()
    log_rounds()

    settings = {
        "model": args.model,
        "ratio": args.ratio,
        "num_samples": args.num_samples,
        "max_eval_segments": args.max_eval_segments,
    }
    os.makedirs(args.output_dir, exist_ok=True)
    path = os.path.join(args.output_dir, f"stage1_peers-{args.model}-{args.ratio}-{args.num_samples}.json")
    record = resumed(path, args.resume, {"settings": settings, "rows": []}, settings)

    def save() -> None:
        records.write(path, record)

    dense, tokenizer = load_model(args.model)
    if "dense_perplexity" not in record:
        record["dense_perplexity"] = perplexities(dense, tokenizer, args.max_eval_segments)
        save()
    done = {row["method"] for row in record["rows"]}
    for method in args.methods:
        if method in done:
            continue
        model = copy.deepcopy(dense)
        config = GradMAPConfig(
            **{
                **METHODS[method](),
                "pruning_ratio": args.ratio,
                "num_samples": args.num_samples,
                "seq_len": 128,
                "compensation": False,
            }
        )
        started = provenance()
        result = GradMAPPruner(config, tokenizer=tokenizer, progress_bar=False).prune(model, "offline:wikipedia")
        origin = finish(started)
        calibration = calibration_sha256(result.calibration_ids)
        if record.setdefault("calibration_sha256", calibration) != calibration:
            raise SystemExit(f"{method}: another calibration set ({calibration}) than the other rows'")
        record["rows"].append(
            {
                "method": method,
                "removed_layers": result.removed_layers,
                "stage1_seconds": result.timings["stage1"],
                "perplexity": perplexities(model, tokenizer, args.max_eval_segments),
                "provenance": origin,
            }
        )
        save()
        row = record["rows"][-1]
        print(
            f"{method}: removed {row['removed_layers']}, Stage 1 {row['stage1_seconds']:.1f} s, {row['perplexity']}", flush=True
        )
        del model


if __name__ == "__main__":
    main()
