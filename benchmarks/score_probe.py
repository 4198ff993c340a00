"""How well each importance score ranks the layers of a real model against the true damage of
removing them: one round, on the dense model, with the paper's calibration set.

The true damage of layer i is the calibration loss of the model without layer i (every layer
removed in turn: SLEB's criterion, `removal_losses`) minus the dense model's calibration loss. For
each score the script reports the Spearman correlation with the true damage, where its first
choice (its lowest-scored layer) falls in the true ranking (1 = the layer whose removal hurts
least), where the true best layer falls in its ranking, and how long its round took. All in one
process, so the timings compare.

    python benchmarks/score_probe.py --model smollm2-135m
    python benchmarks/score_probe.py --model qwen2.5-coder-0.5b --resume

Writes benchmarks/results/score_probe-<model>.{json,md}; with --resume, scores already in the JSON
are kept (the calibration set is checked to be the same one). Every score, and the true damage
(`true_damage_provenance`), carries its provenance (`benchmarks/provenance.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.provenance import finish, provenance  # noqa: E402
from optimum_gradmap.adapters import get_adapter  # noqa: E402
from optimum_gradmap.assets import MODEL_ASSETS, load_model  # noqa: E402
from optimum_gradmap.data import calibration_sha256, prepare_calibration_data  # noqa: E402
from optimum_gradmap.importance import get_importance_metric  # noqa: E402
from optimum_gradmap.importance.metrics import ResidualBranchMetric, removal_losses  # noqa: E402
from optimum_gradmap.importance.residual import residual_branch_scores, stacked_statistics  # noqa: E402
from optimum_gradmap.passes import mean_next_token_loss  # noqa: E402

SCORES = (
    "gradmap",
    "gradmap_bound",
    "gradmap_bound_token",
    "gradmap_bound_squared",
    "taylor_gate",
    "taylor_gate_abs",
    "taylor_gate_squared",
    "block_influence",
    "relative_magnitude",
    "taylor",
)


def ranks(values: list[float]) -> torch.Tensor:
    """Ranks from 1 (smallest), ties sharing their mean rank."""
    tensor = torch.tensor(values, dtype=torch.float64)
    order = tensor.argsort()
    result = torch.empty_like(tensor)
    result[order] = torch.arange(1, len(values) + 1, dtype=torch.float64)
    for value in tensor.unique():
        tied = tensor == value
        result[tied] = result[tied].mean()
    return result


def spearman(a: list[float], b: list[float]) -> float:
    x, y = ranks(a), ranks(b)
    x, y = x - x.mean(), y - y.mean()
    return float((x * y).sum() / (x.norm() * y.norm()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", choices=sorted(MODEL_ASSETS), help="offline model asset")
    parser.add_argument("--num-samples", type=int, default=128, help="calibration sequences (default 128, as in the paper)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--scores", nargs="+", default=list(SCORES))
    parser.add_argument("--output-dir", default=os.path.join(os.path.dirname(__file__), "results"))
    parser.add_argument("--resume", action="store_true", help="keep the scores already in the JSON")
    args = parser.parse_args()

    model, tokenizer = load_model(args.model)
    adapter = get_adapter(model)
    ids = prepare_calibration_data(
        "offline:wikipedia", tokenizer, args.num_samples, args.seq_len, seed=0, default_dataset="offline:wikipedia"
    )
    num_layers = adapter.num_layers(model)
    os.makedirs(args.output_dir, exist_ok=True)
    prefix = os.path.join(args.output_dir, f"score_probe-{args.model}")
    command = f"python benchmarks/score_probe.py --model {args.model} --num-samples {args.num_samples} --seq-len {args.seq_len}"
    if args.resume and os.path.exists(f"{prefix}.json"):
        with open(f"{prefix}.json", encoding="utf-8") as file:
            record = json.load(file)
        if record["calibration_sha256"] != calibration_sha256(ids):
            raise SystemExit(f"--resume: {prefix}.json was measured on another calibration set")
        record["commands"].append(command + " --resume")
    else:
        record = {
            "commands": [command],
            "model": args.model,
            "num_layers": num_layers,
            "calibration": f"{args.num_samples} x {args.seq_len} tokens of offline:wikipedia (calibration articles), seed 0",
            "calibration_sha256": calibration_sha256(ids),
            "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(), "torch": torch.__version__},
            "scores": {},
        }

    def save() -> None:
        with open(f"{prefix}.json", "w", encoding="utf-8") as file:
            json.dump(record, file, indent=2)
        with open(f"{prefix}.md", "w", encoding="utf-8") as file:
            file.write("\n".join(f"`{line}`  " for line in record["commands"]) + "\n\n" + markdown(record) + "\n")

    if "true_damage" not in record:
        begun = provenance()
        started = time.perf_counter()
        dense_loss = mean_next_token_loss(model, ids, args.batch_size, progress_bar=False)
        losses = removal_losses(model, adapter, ids, args.batch_size, range(num_layers), progress_bar=False)
        record["dense_loss"] = dense_loss
        record["true_damage"] = [losses[position] - dense_loss for position in range(num_layers)]
        record["true_damage_seconds"] = time.perf_counter() - started
        record["true_damage_provenance"] = finish(begun)
        save()
        print(f"true damage measured in {record['true_damage_seconds']:.0f} s", flush=True)
    damage = record["true_damage"]
    true_order = sorted(range(num_layers), key=lambda index: (damage[index], index))

    def keep(name: str, scores: list[float], seconds: float, shared_with: list[str], origin: dict) -> None:
        order = sorted(range(num_layers), key=lambda index: (scores[index], index))
        record["scores"][name] = {
            "scores": scores,
            "seconds": seconds,
            "shared_pass": shared_with,
            "provenance": origin,
            "spearman": spearman(scores, damage),
            "first_choice": order[0],
            "first_choice_true_rank": true_order.index(order[0]) + 1,
            "true_best_rank_in_score": order.index(true_order[0]) + 1,
        }
        save()
        print(f"{name}: {record['scores'][name]['spearman']:.3f} in {seconds:.0f} s", flush=True)

    pending = [name for name in args.scores if name not in record["scores"]]
    # The scores from the residual branch differ only in the per-sample statistic of (g_i, f_i): one
    # pass gives them all (each alone costs the same one pass).
    branch = [name for name in pending if isinstance(get_importance_metric(name), ResidualBranchMetric)]
    if len(branch) > 1:
        statistics = [type(get_importance_metric(name)).statistic for name in branch]
        begun = provenance()  # one pass for every score of the branch: they share its provenance
        started = time.perf_counter()
        table = residual_branch_scores(
            model,
            adapter,
            adapter.get_layers(model),
            ids,
            args.batch_size,
            stacked_statistics(statistics),
            progress_bar=False,
        )
        seconds = time.perf_counter() - started
        origin = finish(begun)
        for column, name in enumerate(branch):
            keep(name, table[:, column].tolist(), seconds, branch, origin)
        pending = [name for name in pending if name not in branch]
    for name in pending:
        begun = provenance()
        started = time.perf_counter()
        scores = get_importance_metric(name).score(model, adapter, ids, args.batch_size, progress_bar=False)
        seconds = time.perf_counter() - started
        keep(name, scores, seconds, [], finish(begun))
    print(markdown(record))


def markdown(record: dict) -> str:
    damage = record.get("true_damage")
    if damage is None:
        return "(true damage not measured yet)"
    true_best = min(range(len(damage)), key=lambda index: (damage[index], index))
    lines = [
        f"True damage: the calibration loss without each layer minus the dense model's ({record['dense_loss']:.4f}); "
        f"least harmful layer: {true_best}; measured in {record['true_damage_seconds']:.0f} s (one SLEB round over every layer). "
        "Seconds marked * are one pass that gave all the scores marked * (each alone costs that one pass).",
        "",
        "| score | Spearman vs true damage | its first choice (true rank) | true best layer's rank in it | seconds |",
        "|---|---|---|---|---|",
    ]
    ordered = sorted(record["scores"].items(), key=lambda item: -item[1]["spearman"])
    for name, entry in ordered:
        lines.append(
            f"| {name} | {entry['spearman']:.3f} | layer {entry['first_choice']} ({entry['first_choice_true_rank']}) | "
            f"{entry['true_best_rank_in_score']} | {entry['seconds']:.1f}{'*' if entry.get('shared_pass') else ''} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
