"""The scale harness: real architectures' published configs with random weights, pruned and healed from disk.
Random weights make the chosen layers and every perplexity meaningless: this harness measures time, memory, disk
and the machinery's correctness (the pruned checkpoint reloads with plain `AutoModelForCausalLM` and computes the
logits the pruned model computed in the process), never quality.

    # write Llama-3.1-8B's shape with random weights, sharded as `save_pretrained(max_shard_size="5GB")` shards it
    python benchmarks/scale.py build --model llama-3.1-8b --dtype bfloat16 --output ../scale/llama-3.1-8b-bf16
    # prune it from disk with the command line, layer-streamed, and measure (`--keep`: keep the checkpoint)
    python benchmarks/scale.py prune --model llama-3.1-8b --weights ../scale/llama-3.1-8b-bf16 \
        --dtype bfloat16 --num-samples 16 --max-memory cpu=2GiB --resume
    # heal the kept checkpoint from disk, the dense model as teacher, and measure
    python benchmarks/scale.py heal --model llama-3.1-8b --weights DENSE --pruned PRUNED --dtype bfloat16 \
        --heal-tokens 2048 --max-memory cpu=2GiB --work DIR -- --heal-validation-sequences 8

`build` draws every weight as the family's `_init_weights` does (normal with `initializer_range` for linear maps
and embeddings, ones for norms, zeros for biases), one module at a time from one seeded generator, so the whole
model is never in memory; the tokenizer is SmolLM2-135M's (its ids lie inside the vocabulary).

`prune` and `heal` run the command line's own `optimum-gradmap prune` / `heal` (`--device-map auto --max-memory ...
--offload-folder ...`) in a child process whose memory is sampled (`common.run_monitored`); once the checkpoint is
written, the pruned model's logits on a few tokens are saved, and a second child reloads the checkpoint with plain
`AutoModelForCausalLM` (offloaded the same way) to compare its logits. Seconds per Stage 1 round come from the
Stage 1 checkpoint, Stage 2's from the report. Writes benchmarks/results/scale-<model>-<dtype>.json (one row per
run; `--resume` skips a finished run).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable

import records
from common import RESULTS, folder_bytes, gib, parser, replaced, run_monitored, shown, stop_at_exit
from memory import cli_command
from provenance import finish, provenance

RANDOM_WEIGHTS = "random weights: time, memory, disk and correctness only, never quality"

# Published configs (the `config.json` of each Hub repository), written out here: no Hub.
ARCHITECTURES: dict[str, dict] = {
    "llama-3.1-8b": {  # meta-llama/Llama-3.1-8B
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_act": "silu",
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
    "llama-3.2-1b": {  # meta-llama/Llama-3.2-1B
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "hidden_act": "silu",
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "initializer_range": 0.02,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
}


def architecture_config(name: str, num_layers: int | None = None):
    """The published config of `name` as a transformers config (`num_layers` overrides its depth, for quick tries)."""
    from transformers import AutoConfig

    values = dict(ARCHITECTURES[name])
    if num_layers is not None:
        values["num_hidden_layers"] = num_layers
        if "max_window_layers" in values:
            values["max_window_layers"] = num_layers
    model_type = values.pop("model_type")
    return AutoConfig.for_model(model_type, **values)


# ------------------------------------------------------------------------------------------------------------- build
def build(args: argparse.Namespace) -> None:
    """Writes the architecture with random weights into `args.output`, one shard at a time."""
    import torch
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from optimum_gradmap.assets import get_model_path

    dtype = getattr(torch, args.dtype)
    config = architecture_config(args.model, args.num_layers)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    meta_state, seen = {}, set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:  # a tied head is its embedding: written once, as the Hub checkpoints write it
            seen.add(id(tensor))
            meta_state[name] = tensor.detach()
    split = split_torch_state_dict_into_shards(meta_state, max_shard_size=args.max_shard_size)
    modules = dict(model.named_modules())
    owner = {}  # parameter name -> (module name, attribute)
    for name in meta_state:
        module_name, _, attribute = name.rpartition(".")
        owner[name] = (module_name, attribute)
    os.makedirs(args.output, exist_ok=True)
    generator = torch.Generator().manual_seed(args.seed)
    std = config.initializer_range
    started = time.time()
    written = 0
    for shard_file, names in split.filename_to_tensors.items():
        tensors = {}
        for name in names:  # the state dict's order within each shard: one generator, a fixed order
            module_name, attribute = owner[name]
            module = modules[module_name]
            shape = meta_state[name].shape
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)) and attribute == "weight":
                tensor = torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=generator)
            elif attribute == "bias":
                tensor = torch.zeros(shape, dtype=torch.float32)
            elif "Norm" in type(module).__name__ and attribute == "weight":
                tensor = torch.ones(shape, dtype=torch.float32)
            else:
                raise ValueError(f"{name} ({type(module).__name__}.{attribute}): no rule for its initial values")
            tensors[name] = tensor.to(dtype)
        save_file(tensors, os.path.join(args.output, shard_file), metadata={"format": "pt"})
        written += sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
        print(f"{shard_file}: {len(tensors)} tensors, {gib(written)} GiB written, {time.time() - started:.0f} s", flush=True)
        del tensors
    if split.is_sharded:
        index = {"metadata": {"total_size": written}, "weight_map": split.tensor_to_filename}
        with open(os.path.join(args.output, "model.safetensors.index.json"), "w") as file:
            json.dump(index, file, indent=2, sort_keys=True)
    config.architectures = ARCHITECTURES[args.model]["architectures"]
    config.dtype = args.dtype
    config.save_pretrained(args.output)
    AutoTokenizer.from_pretrained(get_model_path("smollm2-135m")).save_pretrained(args.output)
    with open(os.path.join(args.output, "SCALE_README.txt"), "w") as file:
        file.write(f"{args.model} shape, {RANDOM_WEIGHTS}; seed {args.seed}; tokenizer: SmolLM2-135M's.\n")
    print(f"wrote {args.output}: {gib(written)} GiB in {time.time() - started:.0f} s", flush=True)


# ------------------------------------------------------------------------------------------------------ measurement
PROBE_TOKENS = [1, 504, 3458, 282, 1410, 314, 260, 2269, 2484, 30, 378, 314, 8318, 28, 2634, 2]


def prune_child(args: argparse.Namespace) -> None:
    """In the child: the command line's own `prune`, plus the logits probe once the checkpoint is written."""
    import torch

    stop_at_exit()
    from optimum_gradmap import cli
    from optimum_gradmap.result import PruningResult

    original_save = PruningResult.save_pretrained

    def save_and_probe(self, *save_args, **save_kwargs):
        folder = original_save(self, *save_args, **save_kwargs)
        with torch.no_grad():
            logits = self.model(input_ids=torch.tensor([PROBE_TOKENS]), use_cache=False).logits.float()
        torch.save(logits, os.path.join(args.work, "probe_logits.pt"))
        return folder

    PruningResult.save_pretrained = save_and_probe
    sys.exit(cli.main(json.loads(args.child_argv)) or 0)


def reload_child(args: argparse.Namespace) -> None:
    """In the child: plain `AutoModelForCausalLM`, offloaded as the prune was, and its logits against the probe's."""
    import torch
    from transformers import AutoModelForCausalLM

    stop_at_exit()
    placement = json.loads(args.placement)
    model = AutoModelForCausalLM.from_pretrained(args.output_dir, dtype=getattr(torch, args.dtype), **placement)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([PROBE_TOKENS]), use_cache=False).logits.float()
    expected = torch.load(os.path.join(args.work, "probe_logits.pt"))
    result = {
        "num_layers": model.config.num_hidden_layers,
        "max_abs_difference": float((logits - expected).abs().max()),
        "equal": bool(torch.equal(logits, expected)),
        "logits_scale": float(expected.abs().max()),
    }
    with open(os.path.join(args.work, "reload.json"), "w") as file:
        json.dump(result, file)


def rows_to_run(args: argparse.Namespace, key: dict, done: Callable[[dict], bool]) -> list[dict] | None:
    """The rows of the model's record; `None` with `--resume` where the row of `key` is `done` already."""
    path = os.path.join(RESULTS, f"scale-{args.model}-{args.dtype}.json")
    rows = records.read(path) if os.path.exists(path) else []
    if args.resume and any(row.get("key") == key and done(row) for row in rows):
        print(f"{key}: done already ({path})")
        return None
    return rows


def run_child(row: dict, command: list[str], log_path: str) -> int:
    """Runs the measured child of `row`, and puts its provenance, exit code, seconds and memory in the row."""
    row["provenance"] = provenance()
    code, seconds, memory = run_monitored(command, log_path)
    row["provenance"] = finish(row["provenance"])
    row["exit_code"], row["seconds"], row["memory"] = code, round(seconds, 1), memory
    return code


def save(args: argparse.Namespace, rows: list[dict], row: dict) -> None:
    records.write(os.path.join(RESULTS, f"scale-{args.model}-{args.dtype}.json"), replaced(rows, row, "key"))
    print(json.dumps(shown(row), indent=1))


def heal(args: argparse.Namespace) -> None:
    """`optimum-gradmap heal PRUNED --teacher WEIGHTS` with both models offloaded as the prune was, measured."""
    key = {"heal_tokens": args.heal_tokens, "max_memory": args.max_memory, "pruned": os.path.basename(args.pruned)}
    rows = rows_to_run(args, key, lambda row: row.get("exit_code") == 0)
    if rows is None:
        return
    os.makedirs(args.work, exist_ok=True)
    output = os.path.join(args.work, "healed")
    argv = [
        "heal", args.pruned, "--teacher", args.weights, "--heal-tokens", str(args.heal_tokens),
        "--heal-dataset", "offline:web_text", "--output", output, "--overwrite", "--dtype", args.dtype,
        "--device-map", "auto", "--max-memory", args.max_memory, "--offload-folder", os.path.join(args.work, "offload"),
        *args.extra,
    ]  # fmt: skip
    row = {"key": key, "model": args.model, "dtype": args.dtype, "weights": RANDOM_WEIGHTS, "argv": argv}
    if run_child(row, cli_command(argv), os.path.join(args.work, "heal.log")) == 0:
        healed = json.load(open(os.path.join(output, "pruning_report.json")))["heal"]
        row["heal"] = {
            name: healed[name] for name in ("trained_tokens", "steps", "seconds", "teacher_seconds", "start_kl", "best_kl")
        }
        training = healed["seconds"] - healed["teacher_seconds"]
        row["heal"]["tokens_per_second"] = healed["trained_tokens"] / training if training > 0 else None
        row["output_bytes"] = folder_bytes(output)
    save(args, rows, row)


def prune(args: argparse.Namespace) -> None:
    """`optimum-gradmap prune WEIGHTS` offloaded to disk, measured, and its checkpoint reloaded and checked."""
    key = {"num_samples": args.num_samples, "seq_len": args.seq_len, "ratio": args.ratio, "max_memory": args.max_memory}
    if args.label:  # a second row of the same settings (the same run at another commit)
        key["label"] = args.label
    rows = rows_to_run(args, key, lambda row: bool(row.get("reloaded")))
    if rows is None:
        return
    work = args.work or tempfile.mkdtemp(prefix="scale-", dir=os.path.dirname(os.path.abspath(args.weights)))
    os.makedirs(work, exist_ok=True)
    output, offload, stage1_checkpoint = (os.path.join(work, name) for name in ("pruned", "offload", "stage1.json"))
    if not args.resume and os.path.exists(stage1_checkpoint):
        os.remove(stage1_checkpoint)  # a fresh measurement times every round; `--resume` continues an interrupted one
    # the layers given after `--` (`--layers-to-prune`) replace Stage 1's choice by ratio, and its checkpoint
    given = "--layers-to-prune" in args.extra
    removal = [] if given else ["--pruning-ratio", str(args.ratio), "--stage1-checkpoint", stage1_checkpoint]
    argv = [
        "prune", args.weights, *removal, "--output", output, "--overwrite",
        "--dtype", args.dtype, "--device-map", "auto", "--max-memory", args.max_memory, "--offload-folder", offload,
        "--num-samples", str(args.num_samples), "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size),
        "--dataset", "offline:wikipedia", *args.extra,
    ]  # fmt: skip
    row = {"key": key, "model": args.model, "dtype": args.dtype, "weights": RANDOM_WEIGHTS, "argv": argv}
    row["weight_bytes_on_disk"] = folder_bytes(args.weights)
    command = [sys.executable, __file__, "_prune_child", "--work", work, "--child-argv", json.dumps(argv)]
    if run_child(row, command, os.path.join(work, "prune.log")) == 0:
        report = json.load(open(os.path.join(output, "pruning_report.json")))
        checkpoint = json.load(open(stage1_checkpoint)) if os.path.exists(stage1_checkpoint) else {}
        row["removed_layers"] = report.get("removed_layers")
        row["round_seconds"] = [round(done["seconds"], 1) for done in checkpoint.get("rounds", [])]
        row["timings"] = report.get("timings")
        row["output_bytes"] = folder_bytes(output)
        row["reload"] = reload(work, output, offload, args)
        if row["reload"]["exit_code"] == 0:
            row["reloaded"] = True
    save(args, rows, row)
    if not args.keep:
        shutil.rmtree(output, ignore_errors=True)


def reload(work: str, output: str, offload: str, args: argparse.Namespace) -> dict:
    """The pruned checkpoint reloaded in a child with plain `AutoModelForCausalLM`, offloaded as the prune was."""
    limits = {}
    for item in args.max_memory.split(","):
        device, _, size = item.partition("=")
        limits[int(device) if device.isdigit() else device] = size
    placement = {"device_map": "auto", "max_memory": limits, "offload_folder": offload + "-reload"}
    command = [
        sys.executable, __file__, "_reload_child", "--work", work, "--output-dir", output,
        "--dtype", args.dtype, "--placement", json.dumps(placement),
    ]  # fmt: skip
    code, seconds, memory = run_monitored(command, os.path.join(work, "reload.log"))
    result = {"exit_code": code, "seconds": round(seconds, 1), "memory": memory}
    if code == 0:
        result.update(json.load(open(os.path.join(work, "reload.json"))))
    return result


def main() -> None:
    arguments = parser(__doc__)
    commands = arguments.add_subparsers(dest="command", required=True)
    built = commands.add_parser("build", help="write an architecture with random weights")
    built.add_argument("--model", choices=ARCHITECTURES, required=True)
    built.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    built.add_argument("--num-layers", type=int, default=None, help="override the depth (quick tries only)")
    built.add_argument("--max-shard-size", default="5GB")
    built.add_argument("--seed", type=int, default=0)
    built.add_argument("--output", required=True)
    pruned = commands.add_parser("prune", help="prune from disk with the command line, and measure")
    pruned.add_argument("--model", choices=ARCHITECTURES, required=True)
    pruned.add_argument("--weights", required=True, help="the folder `build` wrote")
    pruned.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    pruned.add_argument("--ratio", type=float, default=0.25)
    pruned.add_argument("--num-samples", type=int, default=16)
    pruned.add_argument("--seq-len", type=int, default=128)
    pruned.add_argument("--batch-size", type=int, default=8)
    pruned.add_argument("--max-memory", default="cpu=2GiB", help="--max-memory of the command line (the rest on disk)")
    pruned.add_argument("--work", default=None, help="folder for the output, offload and logs")
    pruned.add_argument("--keep", action="store_true", help="keep the pruned checkpoint")
    pruned.add_argument("--resume", action="store_true")
    pruned.add_argument("--label", default=None, help="a name for this row, kept beside the rows of the same settings")
    pruned.add_argument("extra", nargs="*", help="more options for `prune` (after --)")
    healed = commands.add_parser("heal", help="heal a pruned checkpoint from disk with the command line, and measure")
    healed.add_argument("--model", choices=ARCHITECTURES, required=True)
    healed.add_argument("--weights", required=True, help="the dense folder `build` wrote (the teacher)")
    healed.add_argument("--pruned", required=True, help="the checkpoint `prune --keep` left")
    healed.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    healed.add_argument("--heal-tokens", type=int, default=4096)
    healed.add_argument("--max-memory", default="cpu=2GiB")
    healed.add_argument("--work", required=True)
    healed.add_argument("--resume", action="store_true")
    healed.add_argument("extra", nargs="*", help="more options for `heal` (after --)")
    child = commands.add_parser("_prune_child")
    child.add_argument("--work", required=True)
    child.add_argument("--child-argv", required=True)
    reloaded = commands.add_parser("_reload_child")
    for name in ("--work", "--output-dir", "--dtype", "--placement"):
        reloaded.add_argument(name, required=True)
    args = arguments.parse_args()
    handlers = {"build": build, "prune": prune, "heal": heal, "_prune_child": prune_child, "_reload_child": reload_child}
    handlers[args.command](args)


if __name__ == "__main__":
    main()
