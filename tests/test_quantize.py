"""The quantization step (optimum_gradmap.quantize): llm-compressor on tiny pruned models, the compressed-tensors
checkpoint reloaded by plain transformers, the chain in the report and card, and every refusal before any work."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM

from optimum_gradmap import GradMAPConfig, GradMAPPruner
from optimum_gradmap.cli import main
from optimum_gradmap.errors import InvalidInputError
from optimum_gradmap.pipeline import plan_pruning
from optimum_gradmap.planning import describe_model, plan_quantization
from optimum_gradmap.planning.quantization import stored_bytes
from optimum_gradmap.quantize import SCHEMES, check_linear_maps, checks, hardware_problem, quantize_model

from .conftest import random_ids, small_config, tiny_model

NEEDS_EXTRA = "needs the [quantize] extra: .ci/run installs it after the suite and runs this file"
# Widths that INT4's groups of 128 input columns divide; of 64; of none of 128, 64 and 32 (the tiny default: 32 and 64).
WIDE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
MIDDLE = dict(hidden_size=64, intermediate_size=192, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
ODD = dict(hidden_size=48, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=12)
CALIBRATION_TEXT = " ".join(f"sentence {i} of the calibration text, with some words in it." for i in range(200))


def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def assert_untouched(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[name], before[name]) for name in before)
    assert not any(hasattr(module, "quantization_scheme") for module in model.modules())


def stored_dtypes(folder: str) -> dict[str, torch.dtype]:
    with safe_open(os.path.join(folder, "model.safetensors"), framework="pt") as weights:
        return {name: weights.get_slice(name).get_dtype() for name in weights.keys()}


@pytest.fixture
def llmcompressor_importable(monkeypatch):
    """The extra's check passes without the extra: what the model alone decides is refused after it."""
    from optimum_gradmap.pipeline import quantize as quantize_step

    monkeypatch.setattr(checks, "require_llmcompressor", lambda: None)
    monkeypatch.setattr(quantize_step, "require_llmcompressor", lambda: None)


# ------------------------------------------------------------------------------------------ refusals, before any work
def test_an_unknown_scheme_is_refused_by_the_config():
    with pytest.raises(InvalidInputError, match="`quantization` must be one of \\('w8a8', 'w4a16', 'fp8'\\)"):
        GradMAPConfig(pruning_ratio=0.25, quantization="int3")


def test_prune_refuses_quantization_without_llmcompressor_before_stage1(monkeypatch, byte_tokenizer):
    real_find_spec = checks.importlib.util.find_spec
    monkeypatch.setattr(
        checks.importlib.util, "find_spec", lambda name: None if name == "llmcompressor" else real_find_spec(name)
    )
    model = tiny_model("llama", vocab_size=256)
    before = state(model)
    pruner = GradMAPPruner(small_config(quantization="w8a8"), model=model, tokenizer=byte_tokenizer)
    with pytest.raises(InvalidInputError, match=r"pip install 'optimum-gradmap\[quantize\]'"):
        pruner.prune(calibration_data=random_ids(8, 16))
    assert model.config.num_hidden_layers == 6
    assert_untouched(model, before)


@pytest.mark.parametrize(
    "capabilities, machine, refused",
    [
        ([], "x86_64", ["fp8"]),  # a CPU: INT8 and INT4 run, FP8 does not
        ([(8, 0)], "x86_64", ["fp8"]),  # an A100: no FP8 kernels
        ([(9, 0)], "x86_64", []),  # an H100 runs all three
        ([], "aarch64", ["w8a8", "w4a16", "fp8"]),  # an ARM CPU without a GPU: none
    ],
)
def test_the_schemes_this_hardware_cannot_run_are_refused(monkeypatch, capabilities, machine, refused):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(capabilities))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: capabilities[index])
    monkeypatch.setattr(checks.platform, "machine", lambda: machine)
    assert sorted(name for name, scheme in SCHEMES.items() if hardware_problem(scheme)) == sorted(refused)
    if "fp8" in refused and capabilities:
        assert "compute capability 8.9 or newer" in hardware_problem(SCHEMES["fp8"])


def test_prune_refuses_fp8_on_a_machine_without_a_capable_gpu_before_stage1(monkeypatch, byte_tokenizer):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    model = tiny_model("llama", vocab_size=256)
    before = state(model)
    pruner = GradMAPPruner(small_config(quantization="fp8"), model=model, tokenizer=byte_tokenizer)
    with pytest.raises(InvalidInputError, match="`fp8` needs an NVIDIA GPU of compute capability 8.9 or newer"):
        pruner.prune(calibration_data=random_ids(8, 16))
    assert_untouched(model, before)


@pytest.mark.parametrize(
    "quantization_config, message",
    [
        ({"quant_method": "gguf"}, "loaded from a GGUF file"),
        ({"quant_method": "gptq", "bits": 4}, "quantized already \\(gptq\\)"),
    ],
)
def test_a_gguf_loaded_or_quantized_model_is_refused_before_stage1(
    llmcompressor_importable, byte_tokenizer, quantization_config, message
):
    model = tiny_model("llama", vocab_size=256)
    model.config.quantization_config = quantization_config
    before = state(model)
    pruner = GradMAPPruner(small_config(quantization="w8a8"), model=model, tokenizer=byte_tokenizer)
    with pytest.raises(InvalidInputError, match=message):
        pruner.prune(calibration_data=random_ids(8, 16))
    assert model.config.num_hidden_layers == 6
    assert_untouched(model, before)


def test_a_failure_inside_llmcompressor_undoes_every_step_and_the_model_runs_the_pipeline_again(monkeypatch, byte_tokenizer):
    """GPTQ fails on its third weight, after SmoothQuant and two GPTQ fits changed the model in place: the quantization,
    the heal, Stage 2 and Stage 1 are undone, the last first, and the model is as it came (no hook, parameter or
    attribute of llm-compressor's left); the same model then goes through the whole pipeline."""
    pytest.importorskip("llmcompressor", reason=NEEDS_EXTRA)
    from llmcompressor.modifiers.gptq import base as gptq

    real, calls = gptq.quantize_weight, []

    def fails_on_the_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("GPTQ failed part-way (simulated)")
        return real(*args, **kwargs)

    monkeypatch.setattr(gptq, "quantize_weight", fails_on_the_third)
    model = tiny_model("llama", vocab_size=256, **WIDE)
    before = state(model)
    heal = dict(heal_tokens=256, heal_trainable="norms", heal_seq_len=16, heal_batch_size=4, heal_validation_sequences=4)
    config = small_config(quantization="w8a8", **heal)
    inputs = dict(calibration_data=random_ids(8, 16), heal_data=random_ids(64, 16, seed=1))
    with pytest.raises(RuntimeError, match="part-way"):
        GradMAPPruner(config, model=model, tokenizer=byte_tokenizer).prune(**inputs)
    assert len(calls) == 3 and model.config.num_hidden_layers == 6
    assert_untouched(model, before)
    assert not any(module._forward_hooks or module._forward_pre_hooks or "forward" in vars(module) for module in model.modules())
    monkeypatch.undo()
    result = GradMAPPruner(config, model=model, tokenizer=byte_tokenizer).prune(**inputs)
    assert result.steps == ["Stage 1", "Stage 2", "Heal", "Quantize"] and result.quantization.scheme == "w8a8"


def test_a_calibrated_scheme_without_sequences_or_tokenizer_is_refused(byte_tokenizer):
    model = tiny_model("llama", vocab_size=256)
    before = state(model)
    with pytest.raises(InvalidInputError, match="give both `calibration_ids` and the model's `tokenizer`"):
        quantize_model(model, "w4a16", random_ids(4, 16), tokenizer=None)
    with pytest.raises(InvalidInputError, match=r"shape \(num_samples, seq_len >= 2\)"):
        quantize_model(model, "w8a8", torch.zeros(4, dtype=torch.long), tokenizer=byte_tokenizer)
    assert_untouched(model, before)


def test_w4a16_takes_the_largest_group_of_128_64_32_that_divides_every_quantized_width():
    head = ["lm_head"]
    assert check_linear_maps(tiny_model("llama", vocab_size=256, **WIDE), SCHEMES["w4a16"], head) == 128
    assert check_linear_maps(tiny_model("llama", vocab_size=256, **MIDDLE), SCHEMES["w4a16"], head) == 64
    assert check_linear_maps(tiny_model("llama", vocab_size=256), SCHEMES["w4a16"], head) == 32
    assert check_linear_maps(tiny_model("llama", vocab_size=256), SCHEMES["w8a8"], head) is None  # per channel
    assert SCHEMES["w4a16"].describe(64).startswith("INT4 weights (one scale per group of 64 input columns)")


def test_w4a16_refuses_linear_maps_no_group_divides_before_stage1(llmcompressor_importable, byte_tokenizer):
    model = tiny_model("llama", vocab_size=256, **ODD)
    before = state(model)
    pruner = GradMAPPruner(small_config(quantization="w4a16"), model=model, tokenizer=byte_tokenizer)
    with pytest.raises(InvalidInputError, match=r"groups of 128, 64, 32 input columns.*self_attn.q_proj \(48\)"):
        pruner.prune(calibration_data=random_ids(8, 16))
    assert_untouched(model, before)


@pytest.fixture
def pruned_checkpoint(tmp_path, byte_tokenizer) -> str:
    """A tiny Llama pruned (Stage 1 + 2) on a text file, saved with its report, as `optimum-gradmap prune` saves it."""
    text = tmp_path / "calibration.txt"
    text.write_text(CALIBRATION_TEXT)
    model = tiny_model("llama", vocab_size=256, **WIDE)
    config = small_config(dataset=str(text), num_samples=8, seq_len=32)
    result = GradMAPPruner(config, model=model, tokenizer=byte_tokenizer).prune()
    return result.save_pretrained(tmp_path / "pruned")


def test_the_quantize_command_refuses_before_loading(tmp_path, pruned_checkpoint, capsys):
    output = str(tmp_path / "out")
    with pytest.raises(SystemExit) as exited:  # argparse's choices
        main(["quantize", pruned_checkpoint, "--scheme", "int3", "--output", output])
    assert exited.value.code == 2
    assert main(["quantize", pruned_checkpoint, "--scheme", "w8a8", "--num-samples", "0", "--output", output]) == 2
    assert "--num-samples must be at least 1" in capsys.readouterr().err
    with open(os.path.join(pruned_checkpoint, "pruning_report.json"), encoding="utf-8") as file:
        report = json.load(file)
    report["quantization"] = {"scheme": "w8a8"}
    with open(os.path.join(pruned_checkpoint, "pruning_report.json"), "w", encoding="utf-8") as file:
        json.dump(report, file)
    assert main(["quantize", pruned_checkpoint, "--scheme", "w4a16", "--output", output]) == 2
    assert "is quantized already (w8a8)" in capsys.readouterr().err
    assert not os.path.exists(output)


# ------------------------------------------------------------------------------------------ the step, with llm-compressor
def test_prune_then_w8a8_writes_a_compressed_tensors_checkpoint_that_transformers_reloads(tmp_path, byte_tokenizer):
    pytest.importorskip("llmcompressor", reason=NEEDS_EXTRA)
    model = tiny_model("llama", vocab_size=256)
    ids = random_ids(8, 16)
    with torch.no_grad():
        dense_logits = model(ids[:2]).logits
    result = GradMAPPruner(small_config(quantization="w8a8"), model=model, tokenizer=byte_tokenizer).prune(calibration_data=ids)
    quantization = result.quantization
    assert (quantization.scheme, quantization.algorithm, quantization.ignored) == ("w8a8", "SmoothQuant + GPTQ", ["lm_head"])
    assert quantization.calibration_sha256 == result.calibration_sha256  # Stage 1's sequences by default
    assert (quantization.num_samples, quantization.seq_len) == (8, 16)
    assert "quantization" in result.timings
    with torch.no_grad():
        quantized_logits = result.model(ids[:2]).logits
    folder = result.save_pretrained(tmp_path / "w8a8")
    config = json.load(open(os.path.join(folder, "config.json"), encoding="utf-8"))
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    assert config["num_hidden_layers"] == 4
    dtypes = stored_dtypes(folder)
    assert dtypes["model.layers.0.mlp.down_proj.weight"] == "I8" and "model.layers.0.mlp.down_proj.weight_scale" in dtypes
    assert dtypes["lm_head.weight"] == "F32"  # the head stays in full precision
    reloaded = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        reloaded_logits = reloaded(ids[:2]).logits
    torch.testing.assert_close(reloaded_logits, quantized_logits, rtol=1e-5, atol=1e-5)
    report = json.load(open(os.path.join(folder, "pruning_report.json"), encoding="utf-8"))
    assert report["quantization"]["scheme"] == "w8a8" and report["removed_layers"] == result.removed_layers
    card = open(os.path.join(folder, "README.md"), encoding="utf-8").read()
    assert "quantized it to `w8a8`" in card and "Stage 2 compensated" in card and "- compressed-tensors" in card
    assert not torch.equal(quantized_logits, dense_logits)


def test_the_quantize_command_calibrates_on_the_checkpoints_own_set_and_records_the_chain(tmp_path, pruned_checkpoint):
    pytest.importorskip("llmcompressor", reason=NEEDS_EXTRA)
    output = str(tmp_path / "w4a16")
    assert main(["quantize", pruned_checkpoint, "--scheme", "w4a16", "--output", output]) == 0
    before = json.load(open(os.path.join(pruned_checkpoint, "pruning_report.json"), encoding="utf-8"))
    report = json.load(open(os.path.join(output, "pruning_report.json"), encoding="utf-8"))
    quantization = report["quantization"]
    assert quantization["calibration_sha256"] == before["calibration_sha256"]
    assert "Stage 1's calibration sequences (the same SHA-256)" in quantization["calibration_source"]
    assert report["reproduce"]["step"] == "quantize" and report["reproduce"]["earlier"]["step"] == "prune"
    assert report["reproduce"]["command"].startswith("optimum-gradmap quantize ")
    assert report["kept_layers"] == before["kept_layers"] and report["compensation"] == before["compensation"]
    dtypes = stored_dtypes(output)
    assert "model.layers.0.mlp.down_proj.weight_packed" in dtypes and "model.layers.0.mlp.down_proj.weight" not in dtypes
    unquantized = AutoModelForCausalLM.from_pretrained(pruned_checkpoint)
    quantized = AutoModelForCausalLM.from_pretrained(output)
    ids = random_ids(2, 16, seed=1)
    with torch.no_grad():
        reference, rounded = unquantized(ids).logits, quantized(ids).logits
    error = (rounded - reference).norm() / reference.norm()
    assert 0 < error < 0.5, error  # INT4 weights: close to, not equal to, the unquantized model
    card = open(os.path.join(output, "README.md"), encoding="utf-8").read()
    assert "Quantized with optimum-gradmap" in card and "Pruned with optimum-gradmap" in card
    saved = GradMAPConfig.from_pretrained(output)  # it said `quantization: null`
    assert (saved.quantization, saved.quantization_dataset) == ("w4a16", None) and report["steps"][-1] == "Quantize"


def test_the_quantize_command_reads_no_calibration_text_for_fp8(tmp_path, pruned_checkpoint, monkeypatch):
    """FP8's dynamic scales need no calibration: the command read and tokenized the checkpoint's text all the same."""
    pytest.importorskip("llmcompressor", reason=NEEDS_EXTRA)
    from optimum_gradmap import data
    from optimum_gradmap.pipeline import quantize as quantize_step

    monkeypatch.setattr(checks, "hardware_problem", lambda scheme: None)
    monkeypatch.setattr(quantize_step, "hardware_problem", lambda scheme: None)
    monkeypatch.setattr(data, "prepare_calibration_data", lambda *args, **kwargs: pytest.fail("calibration text was read"))
    assert main(["quantize", pruned_checkpoint, "--scheme", "fp8", "--output", str(tmp_path / "fp8"), "-q"]) == 0
    report = json.load(open(tmp_path / "fp8" / "pruning_report.json", encoding="utf-8"))
    assert report["quantization"]["num_samples"] == 0 and report["quantization"]["calibration_source"] is None


def test_w4a16_with_groups_of_64_writes_them_and_reloads(tmp_path, byte_tokenizer):
    pytest.importorskip("llmcompressor", reason=NEEDS_EXTRA)
    model = tiny_model("llama", vocab_size=256, **MIDDLE)
    ids = random_ids(8, 16)
    result = quantize_model(model, "w4a16", ids, byte_tokenizer, "random tokens")
    assert result.group_size == 64 and "group of 64 input columns" in result.description
    assert "group 64" in result.recipe[0]
    with torch.no_grad():
        quantized_logits = model(ids[:2]).logits
    model.save_pretrained(tmp_path / "w4a16")
    config = json.load(open(tmp_path / "w4a16" / "config.json", encoding="utf-8"))
    (group,) = config["quantization_config"]["config_groups"].values()
    assert (group["weights"]["num_bits"], group["weights"]["group_size"]) == (4, 64)
    dtypes = stored_dtypes(str(tmp_path / "w4a16"))
    assert "model.layers.0.mlp.down_proj.weight_packed" in dtypes
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "w4a16")
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids[:2]).logits, quantized_logits, rtol=1e-5, atol=1e-5)


def test_prune_from_a_folder_with_quantization_saves_the_pruned_config_not_the_folders(tmp_path, byte_tokenizer):
    """llm-compressor's save rewrites config.json from the folder the model was loaded from (the dense model's): the
    saved checkpoint must keep the pruned layer count."""
    pytest.importorskip("llmcompressor", reason=NEEDS_EXTRA)
    dense = tmp_path / "dense"
    tiny_model("llama", vocab_size=256).save_pretrained(dense)
    byte_tokenizer.save_pretrained(dense)
    text = tmp_path / "calibration.txt"
    text.write_text(CALIBRATION_TEXT)
    output = str(tmp_path / "out")
    arguments = ["prune", str(dense), "--num-layers-to-prune", "2", "--dataset", str(text), "--num-samples", "8"]
    assert main([*arguments, "--seq-len", "16", "--quantization", "w8a8", "--output", output, "-q"]) == 0
    config = json.load(open(os.path.join(output, "config.json"), encoding="utf-8"))
    assert config["num_hidden_layers"] == 4 and config["quantization_config"]["quant_method"] == "compressed-tensors"
    assert AutoModelForCausalLM.from_pretrained(output).config.num_hidden_layers == 4


# ------------------------------------------------------------------------------------------ quantize, then heal
HEAL = ["--heal-tokens", "512", "--heal-dataset", "offline:web_text", "--heal-seq-len", "16", "--heal-validation-sequences",
        "8", "--heal-batch-size", "4", "--heal-check-every", "2", "--no-heal-autocast", "--no-evaluate", "-q"]  # fmt: skip
W4A16_CONFIG = {"quant_method": "compressed-tensors", "config_groups": {"group_0": {"weights": {"num_bits": 4}}}}
W8A8_CONFIG = {
    "quant_method": "compressed-tensors",
    "config_groups": {"group_0": {"weights": {"num_bits": 8}, "input_activations": {"num_bits": 8, "dynamic": True}}},
}


@pytest.mark.parametrize(
    "quantization_config, trainable, message",
    [
        (W4A16_CONFIG, "lora", "Use --heal-trainable norms (not lora)"),
        (W8A8_CONFIG, "norms", "rounds its activations too (group_0)"),
        ({"quant_method": "gptq", "bits": 4}, "norms", "is quantized with gptq: only compressed-tensors"),
    ],
)
def test_the_heal_command_refuses_a_quantized_checkpoint_it_cannot_heal_before_loading(
    tmp_path, pruned_checkpoint, capsys, quantization_config, trainable, message
):
    config_path = os.path.join(pruned_checkpoint, "config.json")
    config = json.load(open(config_path, encoding="utf-8"))
    with open(config_path, "w", encoding="utf-8") as file:
        json.dump({**config, "quantization_config": quantization_config}, file)
    output = str(tmp_path / "healed")
    arguments = ["heal", pruned_checkpoint, "--teacher", pruned_checkpoint, "--heal-trainable", trainable, *HEAL]
    assert main([*arguments, "--output", output]) == 2
    assert message in capsys.readouterr().err
    assert not os.path.exists(output)


def test_a_w4a16_checkpoint_heals_its_norms_and_keeps_its_rounded_weights(tmp_path, byte_tokenizer):
    pytest.importorskip("llmcompressor", reason=NEEDS_EXTRA)
    from safetensors.torch import load_file

    dense = tmp_path / "dense"
    tiny_model("llama", vocab_size=256, num_layers=6, **WIDE).save_pretrained(dense)
    byte_tokenizer.save_pretrained(dense)
    text = tmp_path / "calibration.txt"
    text.write_text(CALIBRATION_TEXT)
    pruned, quantized, healed = (str(tmp_path / name) for name in ("pruned", "w4a16", "healed"))
    arguments = ["prune", str(dense), "--num-layers-to-prune", "2", "--dataset", str(text), "--num-samples", "8"]
    assert main([*arguments, "--seq-len", "16", "--output", pruned, "-q"]) == 0
    assert main(["quantize", pruned, "--scheme", "w4a16", "--output", quantized, "-q"]) == 0
    assert main(["heal", quantized, "--teacher", str(dense), "--heal-trainable", "norms", *HEAL, "--output", healed]) == 0

    before = load_file(os.path.join(quantized, "model.safetensors"))
    after = load_file(os.path.join(healed, "model.safetensors"))
    assert after.keys() == before.keys()
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert changed and all(name.endswith("norm.weight") for name in changed)  # the norms, and nothing rounded
    assert all(torch.equal(before[name], after[name]) for name in before if "weight_packed" in name or "scale" in name)
    assert json.load(open(os.path.join(healed, "config.json"))) == json.load(open(os.path.join(quantized, "config.json")))
    report = json.load(open(os.path.join(healed, "pruning_report.json"), encoding="utf-8"))
    heal = report["heal"]
    assert heal["after_quantization"] and heal["trainable"] == "norms" and heal["best_kl"] < heal["start_kl"]
    assert report["quantization"]["scheme"] == "w4a16" and report["reproduce"]["earlier"]["step"] == "quantize"
    card = open(os.path.join(healed, "README.md"), encoding="utf-8").read()
    assert card.index("quantized it to `w4a16`") < card.index("into the quantized model, its rounded weights as stored")

    from optimum_gradmap.planning import plan_heal  # the dry run's disk: the quantized weights, as stored

    config = GradMAPConfig.from_pretrained(quantized)
    norms = dataclasses.replace(config, heal_tokens=512, heal_trainable="norms")
    planned = plan_heal(quantized, str(dense), norms, measure=False)
    stored = os.path.getsize(os.path.join(healed, "model.safetensors"))
    assert stored <= planned.output_bytes.high < stored + 2**20

    ids = random_ids(2, 16, seed=1)  # what transformers computes from the healed checkpoint: the healed norms in use
    with torch.no_grad():
        rounded, mended = (AutoModelForCausalLM.from_pretrained(folder)(ids).logits for folder in (quantized, healed))
    assert not torch.allclose(rounded, mended)


# ------------------------------------------------------------------------------------------ the plan of the step
def test_the_prune_plan_counts_the_quantization_step_and_the_compressed_checkpoints_bytes():
    model = tiny_model("llama", vocab_size=256, **WIDE)
    plain, quantized = (
        plan_pruning(model, small_config(quantization=scheme), removed_layers=[2, 3], measure=False) for scheme in (None, "w4a16")
    )
    kept = model.config.num_hidden_layers - 2
    names = [stage.name for stage in quantized.stages]
    assert names == [stage.name for stage in plain.stages][:-1] + ["Quantize", "Save"]
    quantize = quantized.stage("Quantize")
    config = small_config()
    assert quantize.work.layer_forward.high == kept * 2 * config.num_samples * config.seq_len  # GPTQ's 2 passes a layer
    assert "w4a16 (GPTQ): each layer run 2 times" in str(quantized)
    # INT4 weights with a float32 scale per 128 input columns, in place of float32 weights: the layers' linear maps
    maps = sum(width * outputs for width, outputs in describe_model(model.config, torch.float32, 1, 8).layer_linear_maps[0])
    assert plain.output_bytes.high - quantized.output_bytes.high == pytest.approx(kept * maps * (4 - 0.5), rel=0.02)


def test_the_quantize_dry_run_plans_llm_compressors_layer_passes_and_the_bytes_it_writes(tmp_path, pruned_checkpoint, capsys):
    pytest.importorskip("llmcompressor", reason=NEEDS_EXTRA)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(pruned_checkpoint)
    ids = random_ids(4, 32)
    for scheme in ("w8a8", "w4a16"):
        output = str(tmp_path / scheme)
        assert main(["quantize", pruned_checkpoint, "--scheme", scheme, "--output", output, "--dry-run"]) == 0
        assert "Quantize" in capsys.readouterr().out and not os.path.exists(output)
        plan = plan_quantization(pruned_checkpoint, scheme, 4, 32, measure=False)
        model = AutoModelForCausalLM.from_pretrained(pruned_checkpoint)
        calls = []
        for layer in model.model.layers:
            layer.register_forward_hook(lambda module, args, out, calls=calls: calls.append(args[0].shape[:2].numel()))
        quantize_model(model, scheme, ids, tokenizer, "random tokens")
        assert sum(calls) == plan.stages[0].work.layer_forward.high  # layer-tokens: W8A8's SmoothQuant runs its own
        model.save_pretrained(output)
        with safe_open(os.path.join(output, "model.safetensors"), framework="pt") as weights:
            stored = sum(weights.get_tensor(name).nbytes for name in weights.keys())
        assert stored == stored_bytes(describe_model(AutoConfig.from_pretrained(pruned_checkpoint), torch.float32, 1, 32), scheme)


def test_fp8_writes_a_float_quantized_checkpoint_that_transformers_reloads(tmp_path, monkeypatch):
    """FP8 runs in vLLM on recent NVIDIA GPUs only, and is refused here: with that check lifted, the recipe itself runs
    on the CPU (round to nearest, no calibration), and what it writes reloads and has the bytes the plan gives."""
    pytest.importorskip("llmcompressor", reason=NEEDS_EXTRA)
    monkeypatch.setattr(checks, "hardware_problem", lambda scheme: None)
    model = tiny_model("llama", vocab_size=256, **WIDE)
    ids = random_ids(2, 16)
    with torch.no_grad():
        dense_logits = model(ids).logits
    result = quantize_model(model, "fp8")
    assert (result.algorithm, result.num_samples, result.calibration_sha256) == ("round to nearest", 0, None)
    with torch.no_grad():
        quantized_logits = model(ids).logits
    model.save_pretrained(tmp_path / "fp8")
    config = json.load(open(tmp_path / "fp8" / "config.json", encoding="utf-8"))
    assert config["quantization_config"]["format"] == "float-quantized"
    assert stored_dtypes(str(tmp_path / "fp8"))["model.layers.0.mlp.down_proj.weight"] == "F8_E4M3"
    with torch.no_grad():
        reloaded_logits = AutoModelForCausalLM.from_pretrained(tmp_path / "fp8")(ids).logits
    torch.testing.assert_close(reloaded_logits, quantized_logits, rtol=1e-5, atol=1e-5)
    assert 0 < ((quantized_logits - dense_logits).norm() / dense_logits.norm()) < 0.2
    with safe_open(os.path.join(tmp_path / "fp8", "model.safetensors"), framework="pt") as weights:
        stored = sum(weights.get_tensor(name).nbytes for name in weights.keys())
    assert stored == stored_bytes(describe_model(model.config, torch.float32, 1, 16), "fp8")
