"""The cost told before the run against the run: the plan `optimum-gradmap prune --dry-run` prints
(`GradMAPPruner.plan`, its throughput measured on this machine in a few seconds), for the runs whose time and memory
other benchmarks measured:

- `smollm2-135m-0.25`: the command line's own `optimum-gradmap prune offline:smollm2-135m --pruning-ratio 0.25
  --dtype float32` (benchmarks/memory.py prune --model smollm2-135m): 128 x 128 tokens, float32, in memory,
  no evaluation: the run the plan describes;
- `qwen2.5-coder-0.5b-0.25`: the same on Qwen2.5-Coder-0.5B with `--num-samples 32`
  (benchmarks/memory.py prune --model qwen2.5-coder-0.5b -- --num-samples 32);
- `smollm2-135m-0.25-main-job`, `qwen2.5-coder-0.5b-0.25-main-job`: the README's main job on the same settings
  (benchmarks/memory.py main-job), which does more than the command line's run: its perplexity evaluations (3 x 128
  segments of 128 tokens, counted in its plan) and the reload of the checkpoint, evaluated again (not counted);
- `llama-3.1-8b-0.25`: the 8B run of benchmarks/scale.py (random weights, bfloat16 on disk, layer-streamed);
- `llama-3.2-1b-0.25`: the 1B run of benchmarks/scale.py (random weights, float32 on disk, 8 x 128 tokens, a 128k
  vocabulary).

    python benchmarks/plan_accuracy.py --row smollm2-135m-0.25 --resume
    python benchmarks/plan_accuracy.py --row smollm2-135m-0.25 --replan   # a planner change: the throughput kept

Each plan is made without looking at the run: from the model's config, the run's settings and a short throughput
measurement; Stage 2's fits are then a range (how many runs of layers Stage 1 removes decides them). A second plan,
with the same throughput, is made with the layers the run removed (`plan_after_stage1`): what the plan says once
Stage 1 is done, Stage 2's fits known.
Writes benchmarks/results/plan_accuracy.json, one row per plan with its provenance; docs/benchmarks/scale.md renders
the comparison from it and the measurement records.
"""

from __future__ import annotations

import functools
import json
import os

import records
from common import RESULTS, ROOT, parser, replaced
from memory import prune_key
from provenance import finish, provenance

RECORD = os.path.join(RESULTS, "plan_accuracy.json")
EVALUATION_TOKENS = 3 * 128 * 128  # the main job's perplexities: dense, after Stage 1, after Stage 2
SMOLLM2 = {"model": "offline:smollm2-135m", "dtype": "float32", "settings": {"pruning_ratio": 0.25}}
QWEN = {"model": "offline:qwen2.5-coder-0.5b", "dtype": "float32", "settings": {"pruning_ratio": 0.25, "num_samples": 32}}
QWEN_MAIN_JOB = ["--model", "qwen2.5-coder-0.5b", "--num-samples", "32", "--output", "out/qwen-main"]
# row -> how the plan is made, and where the measurement lives: (record, the key of its row)
ROWS = {
    "smollm2-135m-0.25": {
        **SMOLLM2,
        "evaluation_tokens": 0,
        "measured": ("cli_prune_memory", prune_key("smollm2-135m", 0.25, "float32", [])),
    },
    "qwen2.5-coder-0.5b-0.25": {
        **QWEN,
        "evaluation_tokens": 0,
        "measured": ("cli_prune_memory", prune_key("qwen2.5-coder-0.5b", 0.25, "float32", ["--num-samples", "32"])),
    },
    "smollm2-135m-0.25-main-job": {**SMOLLM2, "evaluation_tokens": EVALUATION_TOKENS, "measured": ("main_job_memory", [])},
    "qwen2.5-coder-0.5b-0.25-main-job": {
        **QWEN,
        "evaluation_tokens": EVALUATION_TOKENS,
        "measured": ("main_job_memory", QWEN_MAIN_JOB),
    },
    "llama-3.1-8b-0.25": {
        "model": os.path.join(os.path.dirname(ROOT), "scale", "llama-3.1-8b-bf16"),  # scale.py build --output ../scale/...
        "dtype": "bfloat16",
        "settings": {"pruning_ratio": 0.25, "num_samples": 16},
        "device_map": "auto",
        "max_memory": {"cpu": "2GiB"},
        "evaluation_tokens": 0,
        "measured": ("scale-llama-3.1-8b-bfloat16", {"num_samples": 16, "seq_len": 128, "ratio": 0.25, "max_memory": "cpu=2GiB"}),
    },
    "llama-3.2-1b-0.25": {
        "model": os.path.join(os.path.dirname(ROOT), "scale", "llama-3.2-1b-fp32"),  # scale.py build --output ../scale/...
        "dtype": "float32",
        "settings": {"pruning_ratio": 0.25, "num_samples": 8},
        "device_map": "auto",
        "max_memory": {"cpu": "1GiB"},
        "evaluation_tokens": 0,
        "measured": (
            "scale-llama-3.2-1b-float32",
            {
                "num_samples": 8,
                "seq_len": 128,
                "ratio": 0.25,
                "max_memory": "cpu=1GiB",
                "label": "all of the above, the chunks after a gradient pass's check",
            },
        ),
    },
}


def removed_layers(source: str, key) -> list[int] | None:
    """The layers the measured run removed (from its record), for the plan made once Stage 1 is done."""
    path = os.path.join(RESULTS, source + ".json")
    if not os.path.exists(path):
        return None
    for row in records.read(path):
        if source == "main_job_memory" and row["options"] == key and row["exit_code"] == 0:
            for line in row["printed"]:
                if line.startswith("removed layers, in removal order: "):
                    return json.loads(line.split(": ", 1)[1])
        if source == "cli_prune_memory" and row["key"] == key and row["exit_code"] == 0:
            return row["removed_layers"]
        if source.startswith("scale-") and row.get("key") == key and row.get("exit_code") == 0:
            return row["removed_layers"]
    return None


def main() -> None:
    arguments = parser(__doc__)
    arguments.add_argument("--row", choices=ROWS, required=True)
    arguments.add_argument("--resume", action="store_true")
    replan = (
        "plan the row again with the throughput its earlier plan measured (a change of the planner, not of the "
        "machine: nothing is measured, so the row needs no quiet machine); the row records where its throughput came from"
    )
    arguments.add_argument("--replan", action="store_true", help=replan)
    args = arguments.parse_args()
    import torch

    from optimum_gradmap import GradMAPConfig, GradMAPPruner
    from optimum_gradmap.loading import resolve_model
    from optimum_gradmap.planning import DeviceThroughput

    rows = records.read(RECORD) if os.path.exists(RECORD) else []
    if args.resume and any(row["row"] == args.row for row in rows):
        print(f"{args.row}: planned already ({RECORD})")
        return
    spec = ROWS[args.row]
    earlier = next((row for row in rows if row["row"] == args.row), None)
    if args.replan and earlier is None:
        arguments.error(f"--replan: {args.row} has no plan in {RECORD} to take the throughput from")
    path = resolve_model(spec["model"]).path if spec["model"].startswith("offline:") else spec["model"]
    config = GradMAPConfig(**spec["settings"])
    record = {"row": args.row, "model": spec["model"], "settings": spec["settings"], "measured": spec["measured"]}
    record["provenance"] = provenance()
    placement = {key: spec[key] for key in ("device_map", "max_memory") if key in spec}
    make_plan = functools.partial(
        GradMAPPruner.plan,
        path,
        config,
        dtype=getattr(torch, spec["dtype"]),
        evaluation_tokens=spec["evaluation_tokens"],
        name=spec["model"],
        **placement,
    )
    if args.replan:
        plan = make_plan(throughput=DeviceThroughput(**earlier["plan"]["throughput"]))
        measured_at = earlier.get("throughput_measured", earlier["provenance"])
        record["throughput_measured"] = measured_at
    else:
        plan = make_plan()
    record["provenance"] = finish(record["provenance"])
    if args.replan:
        record["provenance"]["note"] = (
            f"planned again with the throughput measured at commit {measured_at['commit'][:8]}, "
            f"{measured_at['date'][:16].replace('T', ' ')} UTC ({'quiet' if measured_at.get('quiet') else 'not quiet'})"
        )
    record["plan"] = plan.to_dict()
    record["printed"] = str(plan)
    removed = removed_layers(*spec["measured"])
    if removed is not None:  # what the plan says once Stage 1 is done: Stage 2's fits are then known
        after = make_plan(throughput=plan.throughput, removed_layers=removed)  # the same throughput measurement
        record["removed_layers"] = removed
        record["plan_after_stage1"] = after.to_dict()
    records.write(RECORD, replaced(rows, record, "row"))
    print(plan)


if __name__ == "__main__":
    main()
