"""The pipeline (optimum_gradmap.pipeline): every check of every step before the first step runs, every step that ran
undone in reverse order when a later one fails, and the refusals that depend on more than one step (a tokenizer for
the quantization, the extra on the command line, the calibration a saved checkpoint cannot read again)."""

from __future__ import annotations

import importlib.machinery
import json
import os
import sys
import types

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from optimum_gradmap import GradMAPConfig, GradMAPPruner
from optimum_gradmap.cli import main
from optimum_gradmap.errors import InvalidInputError
from optimum_gradmap.loading import ModelLoading
from optimum_gradmap.quantize.schemes import QuantizationScheme

from .conftest import random_ids, small_config, tiny_model

NORMS_HEAL = dict(heal_tokens=256, heal_trainable="norms", heal_seq_len=16, heal_batch_size=4, heal_validation_sequences=4)


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def assert_as_it_came(model: nn.Module, before: dict[str, torch.Tensor], num_layers: int = 6) -> None:
    after = model.state_dict()
    assert model.config.num_hidden_layers == num_layers and list(after) == list(before)
    assert all(torch.equal(after[name], before[name]) for name in before)
    assert not any(hasattr(module, "quantization_scheme") or module._forward_hooks for module in model.modules())


@pytest.fixture
def fake_llmcompressor(monkeypatch):
    """llm-compressor stand-in whose `oneshot` does what a failure part-way leaves: a rounded weight, a new parameter,
    a forward hook and an attribute on one map, then an error. Its recipes are empty."""
    module = types.ModuleType("llmcompressor")
    module.__spec__ = importlib.machinery.ModuleSpec("llmcompressor", None)
    calls = []

    def oneshot(model, recipe, **data):
        calls.append(data)
        down = model.model.layers[0].mlp.down_proj
        down.weight.data.mul_(0.5)
        down.register_parameter("weight_scale", nn.Parameter(torch.ones(1)))
        down.register_forward_hook(lambda *args: None)
        down.quantization_scheme = "W8A8"
        raise RuntimeError("llm-compressor failed part-way")

    module.oneshot = oneshot
    monkeypatch.setitem(sys.modules, "llmcompressor", module)
    monkeypatch.setattr(QuantizationScheme, "recipe", lambda self, ignored, group_size: [])
    return calls


def _forward_calls(model: nn.Module) -> list[int]:
    calls: list[int] = []
    model.register_forward_pre_hook(lambda module, args: calls.append(1))
    return calls


# ------------------------------------------------------------------------------------------ the walk
def test_every_check_runs_before_the_first_step_and_a_failure_undoes_the_steps_that_ran_last_first():
    from optimum_gradmap.pipeline import Run, Step, run_steps

    events: list[str] = []

    class Recorded(Step):
        def __init__(self, name: str, fails: str | None = None):
            self.label, self.fails = name, fails

        def check_settings(self) -> None:
            events.append(f"settings {self.label}")

        def check(self, run) -> None:
            events.append(f"check {self.label}")
            if self.fails == "check":
                raise InvalidInputError(f"{self.label} refused")

        def run(self, run) -> None:
            events.append(f"run {self.label}")
            if self.fails == "run":
                raise RuntimeError(f"{self.label} failed")

        def undo(self, run) -> None:
            events.append(f"undo {self.label}")

    run = Run(model=tiny_model("llama"), config=small_config())
    with pytest.raises(InvalidInputError, match="c refused"):
        run_steps([Recorded("a"), Recorded("b"), Recorded("c", fails="check")], run)
    assert events == ["settings a", "settings b", "settings c", "check a", "check b", "check c"]  # nothing ran
    events.clear()
    with pytest.raises(RuntimeError, match="c failed"):
        run_steps([Recorded("a"), Recorded("b"), Recorded("c", fails="run"), Recorded("d")], run)
    assert events[8:] == ["run a", "run b", "run c", "undo c", "undo b", "undo a"]


def test_prune_reads_as_the_list_of_steps_its_config_asks_for():
    from optimum_gradmap.pipeline import Compensate, Heal, Quantize, SelectLayers, pruning_steps

    names = lambda config: [type(step) for step in pruning_steps(config)]  # noqa: E731
    assert names(small_config()) == [SelectLayers, Compensate]
    assert names(small_config(compensation=False, heal_tokens=256)) == [SelectLayers, Heal]
    steps = pruning_steps(small_config(heal_tokens=256, quantization="w8a8"))
    assert [type(step) for step in steps] == [SelectLayers, Compensate, Heal, Quantize]
    assert steps[2].undoable and not pruning_steps(small_config(heal_tokens=256))[2].undoable  # a copy only when needed
    with pytest.raises(dataclasses_frozen()):
        steps[0].settings = None  # a step's settings are frozen


def dataclasses_frozen() -> type[Exception]:
    import dataclasses

    return dataclasses.FrozenInstanceError


# ------------------------------------------------------------------------------------------ defects the wiring made
def test_a_failed_quantization_after_a_heal_puts_the_model_back_as_it_came(fake_llmcompressor, byte_tokenizer):
    """The rollback undid Stage 1 and 2 only: the heal's trained norms stayed, and so did what llm-compressor left."""
    model = tiny_model("llama", vocab_size=256)
    before = state(model)
    pruner = GradMAPPruner(small_config(quantization="w8a8", **NORMS_HEAL), model=model, tokenizer=byte_tokenizer)
    with pytest.raises(RuntimeError, match="failed part-way"):
        pruner.prune(calibration_data=random_ids(8, 16), heal_data=random_ids(64, 16, seed=1))
    assert len(fake_llmcompressor) == 1  # it ran, after the heal
    assert_as_it_came(model, before)
    assert pruner.result is None


def test_quantization_without_a_tokenizer_is_refused_before_stage1(fake_llmcompressor):
    """Calibration given as token ids needs no tokenizer, llm-compressor does: refused before Stage 1 ran (it ran both
    stages, then refused)."""
    model = tiny_model("llama", vocab_size=256)
    calls, before = _forward_calls(model), state(model)
    pruner = GradMAPPruner(small_config(quantization="w8a8"), model=model)
    with pytest.raises(InvalidInputError, match="`w8a8` calibrates with llm-compressor, which needs the model's tokenizer"):
        pruner.prune(calibration_data=random_ids(8, 16))
    assert calls == [] and not fake_llmcompressor
    assert_as_it_came(model, before)


def test_prune_with_quantization_but_no_extra_fails_its_dry_run_and_its_run_before_reading_a_weight(
    monkeypatch, tiny_checkpoint, tmp_path, capsys
):
    monkeypatch.setitem(sys.modules, "llmcompressor", None)  # not importable, whatever this environment has
    import optimum_gradmap.quantize.checks as checks

    monkeypatch.setattr(checks.importlib.util, "find_spec", lambda name: None)

    def load(*args, **kwargs):
        raise AssertionError("a weight was read")

    monkeypatch.setattr(ModelLoading, "load", load)
    arguments = ["prune", tiny_checkpoint, "--num-layers-to-prune", "2", "--quantization", "w8a8", "-o", str(tmp_path / "out")]
    assert main([*arguments, "--dry-run", "-q"]) == 2
    assert "pip install 'optimum-gradmap[quantize]'" in capsys.readouterr().err
    assert main([*arguments, "-q"]) == 2
    assert not os.path.exists(tmp_path / "out")


def test_a_broken_llmcompressor_install_is_refused_by_the_check(monkeypatch):
    """The check looked for the package only: an install that does not import failed after all the work."""
    from optimum_gradmap.quantize import require_llmcompressor

    module = types.ModuleType("llmcompressor")
    module.__spec__ = importlib.machinery.ModuleSpec("llmcompressor", None)  # found, but has no `oneshot`
    monkeypatch.setitem(sys.modules, "llmcompressor", module)
    with pytest.raises(InvalidInputError, match="installed but cannot be imported"):
        require_llmcompressor()


def test_quantization_dataset_without_quantization_is_refused():
    with pytest.raises(InvalidInputError, match="set `quantization` too"):
        GradMAPConfig(pruning_ratio=0.25, quantization_dataset="offline:web_text")


def test_plan_quantization_names_an_unknown_scheme():
    from optimum_gradmap.planning import plan_quantization

    with pytest.raises(InvalidInputError, match="Unknown quantization scheme 'int3'"):
        plan_quantization(tiny_model("llama").config, "int3", 8, 16, measure=False)


def _pruned_on_token_ids(folder: str, byte_tokenizer) -> str:
    model = tiny_model("llama", vocab_size=256)
    result = GradMAPPruner(small_config(), model=model, tokenizer=byte_tokenizer).prune(calibration_data=random_ids(8, 16))
    result.save_pretrained(folder)
    return folder


def test_quantize_asks_for_a_dataset_where_the_checkpoint_was_calibrated_on_data_given_directly(
    fake_llmcompressor, monkeypatch, tmp_path, byte_tokenizer, capsys
):
    """It fell back to the config's default Hub dataset (offline: an error about the Hub), after loading the model."""
    pruned = _pruned_on_token_ids(str(tmp_path / "pruned"), byte_tokenizer)
    monkeypatch.setattr(ModelLoading, "load", lambda *args, **kwargs: pytest.fail("a weight was read"))
    assert main(["quantize", pruned, "--scheme", "w8a8", "-o", str(tmp_path / "q"), "-q"]) == 2
    error = capsys.readouterr().err
    assert "calibrated on data given directly (token ids given directly (8 x 16))" in error and "--dataset" in error


def test_quantize_checks_its_dataset_name_and_the_weight_groups_before_loading_the_model(
    fake_llmcompressor, monkeypatch, tmp_path, byte_tokenizer, capsys
):
    odd = tiny_model("llama", vocab_size=256, hidden_size=48, intermediate_size=96, num_attention_heads=4, head_dim=12)
    result = GradMAPPruner(small_config(), model=odd, tokenizer=byte_tokenizer).prune(calibration_data=random_ids(8, 16))
    result.save_pretrained(tmp_path / "odd")
    monkeypatch.setattr(ModelLoading, "load", lambda *args, **kwargs: pytest.fail("a weight was read"))
    command = ["quantize", str(tmp_path / "odd"), "-o", str(tmp_path / "q"), "-q"]
    assert main([*command, "--scheme", "w8a8", "--dataset", "no-such-dataset"]) == 2
    assert "no-such-dataset" in capsys.readouterr().err
    assert main([*command, "--scheme", "w4a16", "--dataset", "offline:wikipedia"]) == 2
    assert "none of these divides the input widths" in capsys.readouterr().err


def test_the_reproduce_snippet_of_a_model_calibrated_on_data_given_directly_passes_that_data(tmp_path, byte_tokenizer):
    pruned = _pruned_on_token_ids(str(tmp_path / "pruned"), byte_tokenizer)
    report = json.load(open(os.path.join(pruned, "pruning_report.json"), encoding="utf-8"))
    assert report["steps"] == ["Stage 1", "Stage 2"]  # the pipeline's, in the order they ran
    snippet = report["reproduce"]["python"]
    assert ".prune(calibration_data=calibration_data)" in snippet and "token ids given directly (8 x 16)" in snippet


def test_the_card_of_a_quantized_checkpoint_shows_the_figures_measured_before_the_quantization():
    from optimum_gradmap.report import cost_table

    measured = {"perplexities": [{"dataset": "offline:wikipedia", "protocol": "p", "perplexity": 21.5}]}
    report = {
        "original_num_layers": 6,
        "kept_layers": [0, 1, 2, 5],
        "original_num_parameters": 100,
        "num_parameters": 70,
        "evaluation": None,
        "evaluation_before_quantization": {"evaluation": measured},
        "dense_evaluation": {"perplexities": [{"dataset": "offline:wikipedia", "protocol": "p", "perplexity": 12.0}]},
        "quantization": {"scheme": "w8a8"},
    }
    table = cost_table(report)
    assert "| | dense | before quantization |" in table and "| 12.000 | 21.500 |" in table
    assert "measured before the quantization, on the unquantized weights" in table


def test_the_heal_of_a_quantized_checkpoint_writes_back_only_what_it_trained(tmp_path):
    """The writer rounded every float tensor to the model's dtype: a float32 checkpoint healed in bfloat16 lost the
    exact values of the embeddings and the head it meant to copy unchanged."""
    from optimum_gradmap.heal.quantized import stored_weights_writer

    source, target = tmp_path / "quantized", tmp_path / "healed"
    source.mkdir(), target.mkdir()
    stored = {"embed.weight": torch.randn(8, 4), "norm.weight": torch.ones(4)}
    save_file(stored, str(source / "model.safetensors"))
    model = nn.Module()
    model.embed, model.norm = nn.Embedding(8, 4).to(torch.bfloat16), nn.LayerNorm(4).to(torch.bfloat16)
    with torch.no_grad():
        model.embed.weight.copy_(stored["embed.weight"])  # loaded in bfloat16: rounded
        model.norm.weight.fill_(1.5)  # the heal trained it
    stored_weights_writer(str(source), model, ["norm.weight"])(str(target))
    written = load_file(str(target / "model.safetensors"))
    assert torch.equal(written["embed.weight"], stored["embed.weight"])  # as stored, bit for bit
    assert torch.equal(written["norm.weight"], torch.full((4,), 1.5)) and written["norm.weight"].dtype == torch.float32


def test_the_quantized_serving_check_does_not_read_missing_outputs_as_agreement():
    from optimum_gradmap.quantize.serving import Agreement, QuantizedServingCheck, agreement

    reference = [{"prompt_logprobs": [-1.0, -2.0], "tokens": [5, 6]}, {"prompt_logprobs": [-0.5], "tokens": [7]}]
    same = agreement(reference, reference)
    assert same.mean_logprob_difference == 0.0 and same.greedy_tokens_equal == 3
    for other in ([], reference[:1], [reference[0], {"prompt_logprobs": [], "tokens": []}]):
        missing = agreement(reference, other)
        assert missing.mean_logprob_difference == float("inf")
        check = QuantizedServingCheck("folder", "vLLM", served=missing, bfloat16=Agreement(0.01, 0.02, 3, 3))
        assert not check.agrees
    assert agreement([], []).mean_logprob_difference == float("inf")  # nothing compared


def test_verify_serving_refuses_a_logprob_tolerance_for_a_quantized_checkpoint(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "compressed-tensors"}}))
    assert main(["verify-serving", str(tmp_path), "--logprob-tolerance", "0.1", "-q"]) == 2
    assert "Leave --logprob-tolerance out" in capsys.readouterr().err


def test_where_the_undoing_copies_do_not_fit_the_checks_say_so_and_a_failure_says_what_is_left(
    fake_llmcompressor, monkeypatch, byte_tokenizer, caplog
):
    from optimum_gradmap.pipeline import heal as heal_step
    from optimum_gradmap.pipeline import quantize as quantize_step

    monkeypatch.setattr(heal_step, "available_host_bytes", lambda: 1)
    monkeypatch.setattr(quantize_step, "available_host_bytes", lambda: 1)
    model = tiny_model("llama", vocab_size=256)
    pruner = GradMAPPruner(small_config(quantization="w8a8", **NORMS_HEAL), model=model, tokenizer=byte_tokenizer)
    with caplog.at_level("WARNING"), pytest.raises(InvalidInputError, match="left partly quantized: load it again"):
        pruner.prune(calibration_data=random_ids(8, 16), heal_data=random_ids(64, 16, seed=1))
    warned = [record.getMessage() for record in caplog.records if "cannot keep a copy" in record.getMessage()]
    assert len(warned) == 2 and "the model keeps the heal's changes" in warned[0] and "partly quantized" in warned[1]
