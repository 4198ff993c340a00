"""Prune, heal, quantize, serve: the table a user who ships a model needs. For one model: the dense model, GradMAP at
25% (Stage 1 + 2) and GradMAP 25% healed, each stored in bfloat16, W8A8 and W4A16 (llm-compressor through
`optimum_gradmap.quantize`, calibrated on the first `--quantization-samples` of the benchmarks' 128 x 128 Wikipedia
sequences, Stage 1's set: its SHA-256 in the record).

    # the pruned and healed checkpoints, made once with the command line (float32):
    optimum-gradmap prune offline:smollm2-135m --layers-to-prune 26 25 21 18 14 13 17 10 --dtype float32 \\
        --dataset offline:wikipedia --output ../deploy/pruned
    optimum-gradmap heal ../deploy/pruned --teacher offline:smollm2-135m --dtype float32 --heal-trainable lora \\
        --heal-tokens 65536 --heal-dataset offline:web_text+offline:wikipedia --no-evaluate --output ../deploy/healed
    # the table (in an environment with the [quantize] extra; vLLM in its own):
    python benchmarks/deploy.py --model smollm2-135m --pruned ../deploy/pruned --healed ../deploy/healed \\
        --work ../deploy/work --vllm-python .venv-vllm/bin/python --resume
    # which order of heal and INT4: the pruned checkpoint healed on its norms, and its W4A16 healed on its norms
    optimum-gradmap heal ../deploy/pruned --teacher offline:smollm2-135m --dtype float32 --heal-trainable norms \
        --heal-tokens 65536 --heal-dataset offline:web_text+offline:wikipedia --no-evaluate --output ../deploy/healed-norms
    optimum-gradmap quantize ../deploy/pruned --scheme w4a16 --num-samples 32 --dtype bfloat16 --output ../deploy/w4a16
    optimum-gradmap heal ../deploy/w4a16 --teacher offline:smollm2-135m --dtype float32 --heal-trainable norms \
        --heal-tokens 65536 --heal-dataset offline:web_text+offline:wikipedia --no-evaluate --output ../deploy/w4a16-healed
    python benchmarks/deploy.py ... --healed-norms ../deploy/healed-norms --w4a16-healed-norms ../deploy/w4a16-healed \
        --rows gradmap-25-healed-norms/bfloat16 gradmap-25-healed-norms/w4a16 gradmap-25-w4a16-healed-norms/w4a16
    # Qwen2.5-Coder-0.5B: the same, with `offline:qwen2.5-coder-0.5b`, `--layers-to-prune 12 10 8 19 18 9` and
    # `--model qwen2.5-coder-0.5b`

The layers are those GradMAP's Stage 1 removes at 25% on the same calibration set (SmolLM2-135M: the main job's;
Qwen2.5-Coder-0.5B: benchmarks/compare.py's record).
Each row: the checkpoint's bytes on disk; vLLM on this CPU (benchmarks/vllm_speed.py: bfloat16 activations, time to
first token for a 128-token prompt, decode tokens per second at batch 1 and 16; INT4 weights served with bfloat16
activations, `VLLM_CPU_INT4_W4A8=0`, not vLLM's INT8 on CPUs with AMX); held-out perplexity on the first
`--max-segments` 128-token segments of held-out Wikipedia and web text with the next-token KL divergence from the dense
model (float32), and the seven zero-shot tasks with `--task-limit` questions each, every answer kept. Quality is
measured in transformers with float32 arithmetic on the weights as stored (bfloat16-rounded, or dequantized; W8A8's
activations rounded to INT8 per token as its kernels do). The paired accuracy difference against the dense float32
model (with its standard error) and the flips are counted from the kept answers at every save.
Writes benchmarks/results/deploy-<model>.json; `--resume` keeps the rows there.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict

import records
import torch
from common import HELD_OUT, RESULTS, calibration, expand, folder_bytes, parser
from provenance import finish, provenance

from optimum_gradmap.assets import get_model_path, load_model
from optimum_gradmap.data import calibration_sha256
from optimum_gradmap.errors import InvalidInputError
from optimum_gradmap.evaluation import PAPER_TASKS, compare_zero_shot, evaluate, flips
from optimum_gradmap.quantize.serving import AS_STORED

VARIANTS = ("dense", "gradmap-25", "gradmap-25-healed")
ORDER_VARIANTS = ("gradmap-25-healed-norms", "gradmap-25-w4a16-healed-norms")
"""Which order of heal and quantization: the pruned model healed on its norms, then quantized; and quantized to W4A16,
then healed on its norms (its W4A16 row is the checkpoint as `--w4a16-healed-norms` gives it: no second quantization)."""
PRECISIONS = ("bfloat16", "w8a8", "w4a16")
UNQUANTIZED = {"gradmap-25-w4a16-healed-norms": "gradmap-25-healed-norms"}
"""The variant whose bfloat16 row a quantized row is paired with, where it is not its own: the same heal, unquantized."""
OTHER_ORDER = {"gradmap-25-w4a16-healed-norms/w4a16": "gradmap-25-healed-norms/w4a16"}
"""Quantize, then heal: paired with heal, then quantize (`against_other_order`)."""
HERE = os.path.dirname(os.path.abspath(__file__))


def compact(zero_shot) -> dict[str, dict]:
    """Every question's id, right/wrong and choice, per task: enough to pair two rows and count flips."""
    return {
        task.task: {"doc_ids": [q.doc_id for q in task.questions], "acc": "".join(str(q.acc) for q in task.questions),
                    "choice": [q.choice for q in task.questions]}
        for task in zero_shot.tasks
    }  # fmt: skip


def build(source: str, precision: str, folder: str, tokenizer, ids) -> dict:
    """Writes `source` stored in `precision` to `folder` (bfloat16 as it is; W8A8 and W4A16 quantized from bfloat16,
    the rest of the model kept in bfloat16, as llm-compressor's examples do; a quantized `source` copied as it is);
    returns what the quantization did."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from optimum_gradmap.quantize import quantize_model

    if "quantization_config" in AutoConfig.from_pretrained(source):  # quantized (and healed) already: as it is
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(source, folder)
        return {"as_given": source}
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    done = {}
    if precision != "bfloat16":
        source = f"offline:wikipedia, the first {len(ids)} of Stage 1's 128 x 128 sequences"
        done = quantize_model(model, precision, ids, tokenizer, source).to_dict()
    shutil.rmtree(folder, ignore_errors=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return done


def speed(folder: str, vllm_python: str) -> dict:
    """benchmarks/vllm_speed.py on `folder`, in the vLLM environment, served as stored (`AS_STORED`: on CPUs with AMX
    vLLM would otherwise round the W4A16 rows' activations to INT8, which their quality columns do not measure)."""
    output = folder.rstrip("/") + "-speed.json"
    command = [vllm_python, os.path.join(HERE, "vllm_speed.py"), folder, "--dtype", "bfloat16", "--output", output]
    environment = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    environment.update(AS_STORED)
    completed = subprocess.run(command, capture_output=True, text=True, env=environment)
    if completed.returncode != 0:
        raise RuntimeError(f"vLLM failed on {folder}:\n" + "\n".join((completed.stdout + completed.stderr).splitlines()[-20:]))
    with open(output, encoding="utf-8") as file:
        return json.load(file)


def quality(folder: str, tokenizer, dense, args) -> dict:
    """Perplexities with the KL from the dense model, and the zero-shot answers, float32 arithmetic."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    started = time.perf_counter()
    result = evaluate(
        model, tokenizer, HELD_OUT, segment_length=128, max_segments=args.max_segments, tasks=PAPER_TASKS,
        task_limit=args.task_limit, task_data="offline", model_name=os.path.basename(folder), progress_bar=False,
        reference_model=dense, reference_model_name="dense float32",
    )  # fmt: skip
    measured = {
        "perplexities": {entry.dataset: entry.perplexity for entry in result.perplexities},
        "kl_to_dense": {entry.dataset: entry.kl_to_reference for entry in result.perplexities},
        "accuracy": result.zero_shot.pooled_acc,
        "accuracy_by_task": {task.task: task.acc for task in result.zero_shot.tasks},
        "answers": compact(result.zero_shot),
        "seconds": time.perf_counter() - started,
    }
    return measured


def count(record: dict) -> None:
    """Every row's paired accuracy difference and flips against the dense float32 answers, a quantized row's paired
    difference against the same model in bfloat16 (what quantizing that model cost), and the quantize-then-heal row's
    against heal-then-quantize."""
    dense = expand(record["dense_answers"])
    rows = [row for row in record["rows"] if "refused" not in row]
    unquantized = {row["variant"]: row for row in rows if row["precision"] == "bfloat16"}
    for row in rows:
        mine = expand(row["answers"])
        pooled = compare_zero_shot(dense, mine, names=("dense", row["label"])).to_dict()
        row["against_dense"] = pooled.get("pooled", pooled)
        row["flips"] = asdict(flips(mine, dense).pooled)
        before = unquantized.get(UNQUANTIZED.get(row["variant"], row["variant"]))
        if before is not None and before is not row:
            pooled = compare_zero_shot(expand(before["answers"]), mine, names=(before["label"], row["label"])).to_dict()
            row["against_unquantized"] = pooled.get("pooled", pooled)
        other = next((earlier for earlier in rows if earlier["label"] == OTHER_ORDER.get(row["label"])), None)
        if other is not None:
            pooled = compare_zero_shot(expand(other["answers"]), mine, names=(other["label"], row["label"])).to_dict()
            row["against_other_order"] = pooled.get("pooled", pooled)


def place(record: dict, row: dict) -> None:
    """Adds `row` to the record, in the place of an earlier row of the same label (a refusal tried again)."""
    labels = [earlier["label"] for earlier in record["rows"]]
    if row["label"] in labels:
        record["rows"][labels.index(row["label"])] = row
    else:
        record["rows"].append(row)


def rebuild(row: dict, folder: str, sources: dict, tokenizer, ids) -> None:
    """Writes a row's checkpoint again where --work lacks it (a new machine), and checks that it has the recorded
    bytes on disk: the speed measured is that of the row's checkpoint."""
    source = sources.get(row["variant"])
    if source is None:
        raise SystemExit(f"--speed-again: {folder} is missing and no source for {row['variant']} was given")
    build(source, row["precision"], folder, tokenizer, ids)
    if folder_bytes(folder) != row["bytes_on_disk"]:
        raise SystemExit(f"--speed-again: {folder} rebuilt has {folder_bytes(folder)} bytes, the record {row['bytes_on_disk']}")


def speed_again(record: dict, path: str, args, sources: dict, tokenizer, ids) -> None:
    """vLLM's speed measured again for every row, one after the other (the rows' first measurements ran beside their
    own quantization and evaluation); each row keeps the new figures under `vllm` with their provenance. Every missing
    checkpoint is written first (the same bytes on disk), so that the measurements run back to back."""
    rows = [row for row in record["rows"] if "refused" not in row]
    folders = [os.path.join(args.work, row["label"].replace("/", "-")) for row in rows]
    for row, folder in zip(rows, folders):
        if not os.path.isdir(folder):
            rebuild(row, folder, sources, tokenizer, ids)
    for row, folder in zip(rows, folders):
        started = provenance()
        row["vllm"] = speed(folder, args.vllm_python)
        row["vllm_provenance"] = finish(started)
        records.write(path, record)
        print(row["label"], json.dumps(row["vllm"]), flush=True)


def main() -> None:
    arguments = parser(__doc__)
    arguments.add_argument("--model", default="smollm2-135m")
    arguments.add_argument("--pruned", required=True)
    arguments.add_argument("--healed", required=True)
    arguments.add_argument("--healed-norms", help="the pruned checkpoint healed on its norms (the order's rows)")
    arguments.add_argument("--w4a16-healed-norms", help="its W4A16 form healed on its norms (the order's rows)")
    arguments.add_argument("--work", required=True, help="where the stored checkpoints are written (outside the repository)")
    arguments.add_argument("--vllm-python", required=True)
    arguments.add_argument("--max-segments", type=int, default=32)
    arguments.add_argument("--task-limit", type=int, default=200)
    arguments.add_argument(
        "--quantization-samples", type=int, default=128, help="the first N of the 128 calibration sequences llm-compressor reads"
    )
    arguments.add_argument("--rows", nargs="+", default=[f"{v}/{p}" for v in VARIANTS for p in PRECISIONS])
    arguments.add_argument("--resume", action="store_true")
    arguments.add_argument(
        "--speed-again",
        action="store_true",
        help="measure vLLM's speed again for every row, back to back (its own provenance); missing checkpoints are written first",
    )
    args = arguments.parse_args()
    path = os.path.join(RESULTS, f"deploy-{args.model}.json")
    settings = {"model": args.model, "max_segments": args.max_segments, "task_limit": args.task_limit}
    settings["quantization_samples"] = args.quantization_samples
    record = records.read(path) if args.resume and os.path.exists(path) else {"settings": settings, "rows": []}
    assert record["settings"] == settings, f"--resume: {path} has settings {record['settings']}"
    dense, tokenizer = load_model(args.model, dtype=torch.float32)
    ids = calibration(tokenizer, 128)
    record["calibration_sha256"] = calibration_sha256(ids)
    if "dense_answers" not in record:  # the reference: the dense model in float32
        record["dense_float32"] = quality(get_model_path(args.model), tokenizer, dense, args)
        record["dense_answers"] = record["dense_float32"].pop("answers")
        records.write(path, record)
    sources = {"dense": get_model_path(args.model), "gradmap-25": args.pruned, "gradmap-25-healed": args.healed}
    sources |= {"gradmap-25-healed-norms": args.healed_norms, "gradmap-25-w4a16-healed-norms": args.w4a16_healed_norms}
    if args.speed_again:
        return speed_again(record, path, args, sources, tokenizer, ids[: args.quantization_samples])
    done = {row["label"] for row in record["rows"] if "refused" not in row}  # a refusal is tried again
    for label in args.rows:
        if label in done:
            continue
        variant, precision = label.split("/")
        folder = os.path.join(args.work, label.replace("/", "-"))
        started = provenance()
        row = {"label": label, "variant": variant, "precision": precision}
        try:
            row["quantization"] = build(sources[variant], precision, folder, tokenizer, ids[: args.quantization_samples])
        except InvalidInputError as error:  # the library refuses it before any work: the row says why
            place(record, {**row, "refused": str(error), "provenance": finish(started)})
            records.write(path, record)
            continue
        row["bytes_on_disk"] = folder_bytes(folder)
        row["vllm"] = speed(folder, args.vllm_python)
        row.update(quality(folder, tokenizer, dense, args))
        row["provenance"] = finish(started)
        place(record, row)
        count(record)
        records.write(path, record)
        print(json.dumps({key: row[key] for key in ("label", "bytes_on_disk", "perplexities", "kl_to_dense")}), flush=True)
    count(record)
    records.write(path, record)


if __name__ == "__main__":
    sys.exit(main())
