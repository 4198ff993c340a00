"""Bit-for-bit fingerprint of what the library computes on a real model, to show that a refactoring
changed nothing: Stage 1 scores (and verified losses) of every round, the removed layers, and Stage 2's
drift, lambdas, objectives and the SHA-256 of every folded weight and of the final logits.

    python benchmarks/equivalence.py --output /tmp/before.json          # on the old commit
    python benchmarks/equivalence.py --output /tmp/after.json           # on the new one
    python benchmarks/equivalence.py --compare /tmp/before.json /tmp/after.json

Every float is written with `repr` (all its digits), so two files are equal only if every figure is
bit-identical. The default settings (SmolLM2-135M, 32 x 64 calibration tokens of offline Wikipedia, 3
layers) take a few minutes on 2 CPU cores. The record carries its provenance (`benchmarks/provenance.py`),
which `--compare` leaves out.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.provenance import finish, provenance  # noqa: E402
from optimum_gradmap import GradMAPConfig, GradMAPPruner  # noqa: E402
from optimum_gradmap.assets import load_model  # noqa: E402
from optimum_gradmap.configuration import PAPER_STAGE2  # noqa: E402
from optimum_gradmap.data import calibration_sha256, prepare_calibration_data  # noqa: E402

# name -> GradMAPConfig settings; each run prunes a fresh copy of the model with both stages.
RUNS = {
    "gradmap": {"importance": "gradmap"},
    "gradmap_bound_token": {"importance": "gradmap_bound_token"},
    "sleb": {"importance": "sleb"},
    "quality": {"importance": "gradmap_bound_token", "verify_top_k": 4, "verify_halving": True},
    "fast": {"importance": "relative_magnitude"},
    "gradmap+paper_stage2": {"importance": "gradmap", **PAPER_STAGE2},
    "gradmap+diagonal": {"importance": "gradmap", "compensation_form": "diagonal"},
}


def _sha(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().cpu().contiguous().numpy().tobytes()).hexdigest()


def _floats(value):
    """`value` with every float as its repr (exact), keys as strings."""
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, dict):
        return {str(key): _floats(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_floats(item) for item in value]
    return value


def fingerprint(model_name: str, num_samples: int, seq_len: int, num_layers: int, runs: list[str]) -> dict:
    _, tokenizer = load_model(model_name)
    ids = prepare_calibration_data("offline:wikipedia", tokenizer, num_samples, seq_len, 0, "offline:wikipedia")
    probe = ids[:2]
    record = {"model": model_name, "calibration_sha256": calibration_sha256(ids), "runs": {}}
    for name in runs:
        started = time.perf_counter()
        model, _ = load_model(model_name, dtype=torch.float32)
        config = GradMAPConfig(num_layers_to_prune=num_layers, num_samples=num_samples, seq_len=seq_len, **RUNS[name])
        pruner = GradMAPPruner(config, model=model, tokenizer=tokenizer, progress_bar=False)
        result = pruner.prune(calibration_data=ids)
        with torch.no_grad():
            logits = model(input_ids=probe, use_cache=False).logits
        summary = result.to_dict()
        for volatile in ("timings", "calibration_source"):
            summary.pop(volatile, None)
        summary["compensation"].pop("seconds")
        summary["folded_weights_sha256"] = {
            str(index): _sha(model.model.layers[result.kept_layers.index(index)].mlp.down_proj.weight)
            for index in result.compensated_layers
        }
        summary["logits_sha256"] = _sha(logits)
        record["runs"][name] = _floats(summary)
        print(
            f"{name}: removed {result.removed_layers}, compensated {result.compensated_layers} "
            f"({time.perf_counter() - started:.0f} s)",
            flush=True,
        )
    return record


def compare(before_path: str, after_path: str) -> int:
    with open(before_path) as file:
        before = json.load(file)
    with open(after_path) as file:
        after = json.load(file)
    for record in (before, after):  # where and when each was measured: not a figure
        record.pop("provenance", None)
    differences = []

    def walk(a, b, where):
        if isinstance(a, dict) and isinstance(b, dict):
            for key in sorted(set(a) | set(b)):
                if key not in a or key not in b:
                    differences.append(f"{where}.{key}: only in {'after' if key not in a else 'before'}")
                else:
                    walk(a[key], b[key], f"{where}.{key}")
        elif a != b:
            differences.append(f"{where}: {a!r} != {b!r}")

    walk(before, after, "")
    for line in differences[:50]:
        print(line)
    print(f"{len(differences)} difference(s)" if differences else "identical: every figure bit for bit")
    return 1 if differences else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--num-samples", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=3)
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--output", help="write the fingerprint to this JSON file")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="compare two fingerprints")
    args = parser.parse_args()
    if args.compare:
        return compare(*args.compare)
    started = provenance()
    record = fingerprint(args.model, args.num_samples, args.seq_len, args.num_layers, args.runs)
    record["provenance"] = finish(started)
    text = json.dumps(record, indent=1)
    if args.output:
        with open(args.output, "w") as file:
            file.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
