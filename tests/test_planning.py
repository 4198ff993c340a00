"""The cost told before the run ([`optimum_gradmap.planning`], `prune --dry-run`): the plan's pass counts are the passes
a run makes (forward hooks on every decoder layer and on the head count the layer-tokens and head tokens of a real
run on a tiny model, with and without gradients, stage by stage), K and the rounds follow the config, a budget is
told as "up to", the table prints, and the dry runs read no weight."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

from optimum_gradmap import GradMAPConfig, GradMAPPruner
from optimum_gradmap.adapters import get_adapter
from optimum_gradmap.errors import InvalidInputError
from optimum_gradmap.pipeline import plan_pruning
from optimum_gradmap.planning import (
    Count,
    DeviceThroughput,
    Work,
    describe_model,
    golden_search_evaluations,
    plan_heal,
)

from .conftest import random_ids, tiny_model

ASSUMED = DeviceThroughput.assumed(1e12, 0.5, "a test device (1 TFLOP/s)")
COUNTS = ("layer_forward", "layer_gradient", "head_forward", "head_gradient")
SMALL = dict(num_layers_to_prune=2, num_samples=8, seq_len=16, batch_size=4)


class PassCounter:
    """Forward hooks on every decoder layer and on the head: the tokens each runs, with and without gradients."""

    def __init__(self, model: torch.nn.Module):
        self.modules = list(get_adapter(model).get_layers(model)), model.get_output_embeddings()
        self.counts = dict.fromkeys(COUNTS, 0)
        self.handles = []

    def __enter__(self) -> PassCounter:
        layers, head = self.modules

        def on_layer(module, args, kwargs, output):
            hidden = args[0] if args else kwargs["hidden_states"]
            self.counts["layer_gradient" if torch.is_grad_enabled() else "layer_forward"] += hidden.shape[0] * hidden.shape[1]

        def on_head(module, args, output):
            rows = args[0].numel() // args[0].shape[-1]
            self.counts["head_gradient" if torch.is_grad_enabled() else "head_forward"] += rows

        self.handles = [layer.register_forward_hook(on_layer, with_kwargs=True) for layer in layers]
        self.handles.append(head.register_forward_hook(on_head))
        return self

    def __exit__(self, *exc_info) -> None:
        for handle in self.handles:
            handle.remove()

    def take(self) -> dict[str, int]:
        counts, self.counts = self.counts, dict.fromkeys(COUNTS, 0)
        return counts


def assert_counted(measured: dict[str, int], work: Work, stage: str) -> None:
    """Each measured count is the plan's where the plan says it is exact, and within its range where it is not."""
    for name in COUNTS:
        planned = getattr(work, name)
        if planned.exact:
            assert measured[name] == planned.low, f"{stage} {name}: measured {measured[name]}, planned {planned.low}"
        else:
            assert planned.low <= measured[name] <= planned.high, f"{stage} {name}: {measured[name]} outside {planned}"


def run_counted(config: GradMAPConfig, heal_data: torch.LongTensor | None = None) -> tuple[dict, object, object]:
    """Stage 1, Stage 2 (and the heal) of a tiny Llama, counted stage by stage; the dense config, for the plan."""
    model = tiny_model("llama", num_layers=6)
    dense_config = copy.deepcopy(model.config)
    pruner = GradMAPPruner(config, progress_bar=False)
    measured = {}
    with PassCounter(model) as counter:
        result = pruner.select_layers(model, random_ids(8, 16))
        measured["Stage 1"] = counter.take()
        pruner.compensate(result)
        measured["Stage 2"] = counter.take()
        if heal_data is not None:
            pruner.heal(result, heal_data=heal_data)
            measured["Heal"] = counter.take()
    return measured, result, dense_config


@pytest.mark.parametrize("preset", [None, "paper", "fast", "quality"])
def test_the_plans_pass_counts_are_the_passes_a_tiny_run_makes(preset):
    config = GradMAPConfig(**SMALL) if preset is None else GradMAPConfig.from_preset(preset, **SMALL)
    measured, result, dense_config = run_counted(config)
    before = plan_pruning(dense_config, config, throughput=ASSUMED)  # as told before the run
    after = plan_pruning(dense_config, config, throughput=ASSUMED, removed_layers=result.removed_layers)
    for plan in (before, after):
        assert_counted(measured["Stage 1"], plan.stage("Stage 1").work, "Stage 1")
        assert_counted(measured["Stage 2"], plan.stage("Stage 2").work, "Stage 2")
    if preset != "quality":  # a shortlist's positions are known only as the run goes; every other Stage 1 is exact
        assert all(getattr(before.stage("Stage 1").work, name).exact for name in COUNTS)
    assert before.num_layers_to_remove == 2 and before.rounds == Count.of(1 if preset == "fast" else 2)


def test_with_the_removed_layers_known_and_the_whole_grid_scored_stage_2_is_counted_exactly(monkeypatch):
    monkeypatch.setattr("optimum_gradmap.compensation.lambda_search.SEARCH", "grid")  # the reference search
    config = GradMAPConfig(**SMALL)
    measured, result, dense_config = run_counted(config)
    plan = plan_pruning(dense_config, config, throughput=ASSUMED, removed_layers=result.removed_layers)
    work = plan.stage("Stage 2").work
    assert all(getattr(work, name).exact for name in COUNTS)
    assert_counted(measured["Stage 2"], work, "Stage 2")


def test_layer_streamed_passes_and_the_heal_are_counted_exactly():
    config = GradMAPConfig(
        **SMALL, execution="layer_streamed", heal_tokens=64, heal_seq_len=16, heal_batch_size=2,
        heal_validation_sequences=2, heal_check_every=1, heal_trainable="norms", heal_autocast=False,
    )  # fmt: skip
    measured, result, dense_config = run_counted(config, heal_data=random_ids(10, 16, seed=3))
    plan = plan_pruning(dense_config, config, throughput=ASSUMED, removed_layers=result.removed_layers)
    assert plan.execution == "layer_streamed"
    for stage in ("Stage 1", "Stage 2", "Heal"):
        assert_counted(measured[stage], plan.stage(stage).work, stage)
    assert all(getattr(plan.stage(stage).work, name).exact for stage in ("Stage 1", "Heal") for name in COUNTS)
    # streaming adds the forward pass that stores each layer's input: as many layer-tokens as the gradient passes
    in_memory = plan_pruning(dense_config, config, throughput=ASSUMED, execution="in_memory").stage("Stage 1").work
    streamed = plan.stage("Stage 1").work
    assert streamed.layer_forward.low - in_memory.layer_forward.low == streamed.layer_gradient.low
    assert plan.stage("Stage 1").peak_bytes_streamed.low < plan.stage("Stage 1").peak_bytes_in_memory.low


def test_in_memory_peaks_on_the_cpu_count_the_host_allocators_overhead(monkeypatch):
    from optimum_gradmap import planning
    from optimum_gradmap.planning import pruning

    monkeypatch.setattr(pruning, "process_bytes", lambda: 0)  # the peaks without this process's own memory
    dense_config = tiny_model("llama").config
    config = GradMAPConfig(**SMALL)
    on_cpu = plan_pruning(dense_config, config, throughput=ASSUMED, device="cpu")
    on_gpu = plan_pruning(dense_config, config, throughput=ASSUMED, device="cuda")
    beside_on_cpu = on_cpu.stage("Stage 1").peak_bytes_in_memory.low - on_cpu.weight_bytes
    beside_on_gpu = on_gpu.stage("Stage 1").peak_bytes_in_memory.low - on_gpu.weight_bytes  # the activations' bytes
    assert beside_on_gpu > 0 and beside_on_cpu == pytest.approx(planning.HOST_ALLOCATOR_OVERHEAD * beside_on_gpu)
    assert on_cpu.stage("Save").peak_bytes_in_memory.low == on_cpu.weight_bytes  # nothing beside the weights
    assert any("allocator" in note for note in on_cpu.notes) and not any("allocator" in note for note in on_gpu.notes)
    # the factor is an assumption about the C allocator: stated, it replaces the default
    returned = plan_pruning(dense_config, config, throughput=ASSUMED, device="cpu", host_allocator_overhead=1.0)
    assert returned.stage("Stage 1").peak_bytes_in_memory.low - returned.weight_bytes == pytest.approx(beside_on_gpu)
    assert any("counted 1x" in note for note in returned.notes)
    with pytest.raises(InvalidInputError, match="above 0"):
        plan_pruning(dense_config, config, throughput=ASSUMED, host_allocator_overhead=0)


def test_golden_search_scores_four_or_five_strengths_and_more_on_a_tie_never_more_than_the_grid():
    from optimum_gradmap.compensation.next_token import searched_losses

    grid = list(range(9))
    counts = {
        len(searched_losses(lambda index, values=values: values[index], grid, "golden"))
        for values in torch.rand(300, 9, generator=torch.Generator().manual_seed(0)).tolist()
    }
    counts.add(len(searched_losses(lambda index: 1.0, grid, "golden")))  # every loss tied
    planned = golden_search_evaluations(9)
    assert (planned.low, planned.high) == (4, 9) and min(counts) == 4 and 5 < max(counts) <= 9
    single_minimum = [  # losses with one minimum and no tie: what the plan calls likely
        len(searched_losses(lambda index, best=best, tilt=tilt: (index - best) ** 2 + tilt * index, grid, "golden"))
        for best in grid
        for tilt in (1e-3, -1e-3)
    ]
    assert set(single_minimum) <= {4, 5} and planned.likely == pytest.approx(sum(single_minimum) / len(single_minimum))


def test_a_count_adds_and_scales_its_likely_value_and_keeps_none_where_neither_has_one():
    assert Count(1, 3, likely=1.5) + Count.of(2) == Count(3, 5, likely=3.5)
    assert Count(1, 3) + Count.of(2) == Count(3, 5) and (Count(1, 3) + 2).typical == 4
    assert 2 * Count(1, 3, likely=1.5) == Count(2, 6, likely=3.0)
    assert Count(1, 3, likely=1.5).to_dict() == {"low": 1, "high": 3, "likely": 1.5} and Count.of(2).to_dict() == 2


def test_stage2_before_stage1_spans_the_layouts_stage1_may_leave_with_their_median_as_likely():
    import statistics

    from optimum_gradmap.compensation.targets import compensation_targets
    from optimum_gradmap.planning.stage2 import layouts

    model_config = tiny_model("llama", num_layers=8).config
    config = GradMAPConfig(**SMALL)
    before = plan_pruning(model_config, config, throughput=ASSUMED)
    fits = [
        len(compensation_targets([i for i in range(8) if i not in removed], {}, 8, "span_end", 1))
        for removed in layouts(8, 2, set())
    ]
    stage2 = before.stage("Stage 2")
    assert "likely" in before.stage2 and (min(fits), max(fits)) == (0, 2)  # none when the last layers go
    assert stage2.seconds.low < stage2.seconds.likely < stage2.seconds.high
    one_run = plan_pruning(model_config, config, throughput=ASSUMED, removed_layers=[5, 6]).stage("Stage 2").seconds
    two_runs = plan_pruning(model_config, config, throughput=ASSUMED, removed_layers=[2, 5]).stage("Stage 2").seconds
    assert stage2.seconds.low <= one_run.low and two_runs.high <= stage2.seconds.high
    assert f"likely {statistics.median(fits):.0f}" in before.stage2


@pytest.mark.parametrize(("ratio", "iterative", "rounds"), [(0.25, None, 2), (0.5, None, 3), (0.25, False, 1)])
def test_k_and_the_rounds_follow_the_config(ratio, iterative, rounds):
    config = GradMAPConfig(pruning_ratio=ratio, iterative=iterative, num_samples=8, seq_len=16, batch_size=4)
    plan = plan_pruning(tiny_model("llama", num_layers=6).config, config, throughput=ASSUMED)
    assert plan.num_layers_to_remove == config.num_layers_to_remove(6)
    assert plan.rounds == Count.of(rounds)
    assert ("iterative" if iterative is None else "one-shot") in plan.stage1


def test_a_budget_is_told_as_up_to_k_rounds_not_refused():
    model_config = tiny_model("llama", num_layers=6).config
    budget = plan_pruning(
        model_config, GradMAPConfig(**dict(SMALL, num_layers_to_prune=3), max_loss_increase=0.1), throughput=ASSUMED
    )
    assert budget.rounds == Count(1, 3) and "up to 3 rounds" in budget.budget and "up to 3 rounds" in str(budget)
    assert not budget.stage("Stage 1").work.layer_gradient.exact
    unbounded = {name: value for name, value in SMALL.items() if name != "num_layers_to_prune"}
    layer = (budget.num_parameters - _head_and_embeddings(model_config)) // 6
    sized = plan_pruning(
        model_config, GradMAPConfig(target_num_parameters=budget.num_parameters - 2 * layer, **unbounded), throughput=ASSUMED
    )
    assert sized.rounds == Count.of(2) and sized.num_layers_to_remove == 5  # all but one layer allowed, two needed


def _head_and_embeddings(model_config) -> int:
    model = tiny_model("llama", num_layers=6)
    return sum(parameter.numel() for parameter in model.parameters()) - sum(
        parameter.numel() for layer in get_adapter(model).get_layers(model) for parameter in layer.parameters()
    )


def test_the_plan_prints_as_a_table_and_converts_to_json():
    model = tiny_model("llama", num_layers=6)
    plan = plan_pruning(model, GradMAPConfig(**SMALL, heal_tokens=64, heal_seq_len=16), throughput=ASSUMED, evaluation_tokens=256)
    text = str(plan)
    for expected in ("Stage 1", "Stage 2", "Heal", "Evaluation", "Total", "Peak, in memory", "Peak, layer-streamed", "TFLOP"):
        assert expected in text
    assert "assumed, not measured" in text and "Disk: the output checkpoint takes" in text
    values = json.loads(json.dumps(plan.to_dict()))
    assert values["num_layers_to_remove"] == 2 and [stage["name"] for stage in values["stages"]][:2] == ["Stage 1", "Stage 2"]
    assert plan.seconds.low > 0 and plan.peak_bytes.low > plan.weight_bytes
    # the same plan from the model, from its config: only the config is read
    from_config = plan_pruning(
        model.config, GradMAPConfig(**SMALL, heal_tokens=64, heal_seq_len=16), throughput=ASSUMED, evaluation_tokens=256
    )
    assert from_config.stage("Stage 1").work == plan.stage("Stage 1").work


def test_the_disk_is_the_kept_layers_weights_and_the_time_follows_the_throughput():
    model_config = tiny_model("llama", num_layers=6).config
    plan = plan_pruning(model_config, GradMAPConfig(**SMALL), throughput=ASSUMED, tokenizer_bytes=0)
    layer_bytes = 4 * (plan.num_parameters - _head_and_embeddings(model_config)) // 6
    assert plan.output_bytes.low == plan.weight_bytes - 2 * layer_bytes + 300_000
    twice = DeviceThroughput.assumed(2e12, 0.5, "twice as fast", host_float64_flops_per_second=1e11)
    faster = plan_pruning(model_config, GradMAPConfig(**SMALL), throughput=twice)
    assert faster.stage("Stage 1").seconds.low == pytest.approx(plan.stage("Stage 1").seconds.low / 2)


def test_a_config_the_model_cannot_follow_is_refused_with_a_clear_error():
    from optimum_gradmap.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match="at least one must go"):
        plan_pruning(tiny_model("llama", num_layers=6).config, GradMAPConfig(num_layers_to_prune=6), throughput=ASSUMED)
    with pytest.raises(InvalidInputError, match="efficiency"):
        DeviceThroughput.assumed(1e12, 1.5, "too efficient")


def _refuse_weights(monkeypatch):
    """Every way a weight could be read fails the test."""
    import safetensors.torch
    from transformers import AutoModelForCausalLM

    def refused(*args, **kwargs):
        raise AssertionError("a dry run read a weight")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refused)
    monkeypatch.setattr(safetensors.torch, "load_file", refused)
    monkeypatch.setattr(safetensors, "safe_open", refused)


def test_prune_dry_run_prints_the_plan_and_reads_no_weight(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    from optimum_gradmap.cli import main

    os.remove(os.path.join(tiny_checkpoint, "model.safetensors"))
    _refuse_weights(monkeypatch)
    output = tmp_path / "pruned"
    argv = ["prune", tiny_checkpoint, "--num-layers-to-prune", "2", "--num-samples", "8", "--seq-len", "16",
            "--batch-size", "4", "--dataset", "offline:wikipedia", "--output", str(output), "--dry-run"]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert f"GradMAP plan for {tiny_checkpoint}" in printed and "Remove 2 of 6 layers" in printed
    assert "measured in" in printed and "Stage 2" in printed
    assert not output.exists()
    assert main([*argv, "--preset", "fast"]) == 0 and "relative_magnitude (one-shot)" in capsys.readouterr().out


def test_heal_dry_run_prints_the_heals_plan_and_reads_no_weight(tiny_checkpoint, byte_tokenizer, tmp_path, monkeypatch, capsys):
    from optimum_gradmap.cli import main

    pruner = GradMAPPruner(GradMAPConfig(layers_to_prune=[2, 3], compensation=False), progress_bar=False)
    result = pruner.prune(tiny_model("llama", num_layers=6), random_ids(8, 16))
    pruned = str(tmp_path / "pruned")
    result.save_pretrained(pruned, tokenizer=byte_tokenizer)
    for folder in (pruned, tiny_checkpoint):
        os.remove(os.path.join(folder, "model.safetensors"))
    _refuse_weights(monkeypatch)
    argv = ["heal", pruned, "--teacher", tiny_checkpoint, "--heal-tokens", "512", "--heal-seq-len", "16",
            "--heal-batch-size", "4", "--output", str(tmp_path / "healed"), "--dry-run"]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "Heal" in printed and "8 steps" in printed and "heal trains lora" in printed
    assert not (tmp_path / "healed").exists()


def test_an_auto_heal_budget_is_planned_at_stage1s_planned_time():
    model_config = tiny_model("llama", num_layers=6).config
    heal = dict(heal_tokens="auto", heal_seq_len=16, heal_batch_size=2, heal_validation_sequences=2)
    plan = plan_pruning(model_config, GradMAPConfig(**{**SMALL, "num_samples": 64}, **heal), throughput=ASSUMED)
    stage1 = plan.stage("Stage 1").seconds.high
    assert plan.stage("Heal").seconds.high == pytest.approx(stage1, rel=0.05)  # AUTO_TIME_SHARE = 1, whole steps
    assert any("heal_tokens='auto': about" in note for note in plan.notes)
    longer = plan_pruning(model_config, GradMAPConfig(**{**SMALL, "num_samples": 128}, **heal), throughput=ASSUMED)
    assert longer.stage("Heal").tokens > plan.stage("Heal").tokens  # a longer Stage 1 buys more heal tokens
    generated = plan_pruning(
        model_config, GradMAPConfig(**{**SMALL, "num_samples": 64}, **{**heal, "heal_dataset": "generated"}), throughput=ASSUMED
    )
    assert generated.stage("Heal").work.generated_tokens.low > 0  # the dense model's own text, in the heal's time
    with pytest.raises(InvalidInputError, match="a number of tokens"):
        plan_heal(model_config, model_config, GradMAPConfig(**SMALL, **heal), throughput=ASSUMED)


def _offloaded_map(num_layers: int) -> dict[str, str]:
    """A device map of a tiny Llama with every module on the CPU: its layers offloaded, for a GPU run."""
    return {"model.embed_tokens": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"} | {
        f"model.layers.{index}": "cpu" for index in range(num_layers)
    }


def test_offloaded_layers_come_to_the_device_once_per_batch_of_the_stage_that_calls_them():
    model_config = tiny_model("llama", num_layers=6).config
    heal = dict(heal_seq_len=16, heal_batch_size=2, heal_validation_sequences=2)  # heal batches of 32 tokens, Stage 1's 64

    def plan(heal_tokens, device_map):
        config = GradMAPConfig(**{**SMALL, "num_samples": 64}, heal_tokens=heal_tokens, **heal)
        return plan_pruning(
            model_config, config, throughput=ASSUMED, execution="layer_streamed", device_map=device_map, evaluation_tokens=256
        )

    auto, fixed, not_offloaded = plan("auto", _offloaded_map(6)), plan(640, _offloaded_map(6)), plan(640, None)
    # an `auto` heal budget leaves the other stages' transfers as they are
    assert auto.stage("Evaluation").seconds == fixed.stage("Evaluation").seconds
    layer_bytes = 4 * (fixed.num_parameters - _head_and_embeddings(model_config)) / 6
    for name, batch_tokens in (("Stage 1", 4 * 16), ("Heal", 2 * 16), ("Evaluation", 4 * 16)):
        work = fixed.stage(name).work
        calls = (work.layer_forward.low + work.layer_gradient.low) / batch_tokens
        transfers = fixed.stage(name).seconds.low - not_offloaded.stage(name).seconds.low
        assert transfers == pytest.approx(calls * layer_bytes / 12e9), name  # the assumed CPU-to-device bandwidth


def test_the_heals_plan_counts_the_transfers_and_passes_of_offloaded_layers():
    dense, pruned = tiny_model("llama", num_layers=6).config, tiny_model("llama", num_layers=4).config
    config = GradMAPConfig(num_layers_to_prune=2, heal_tokens=640, heal_seq_len=16, heal_batch_size=2)
    in_memory = plan_heal(pruned, dense, config, throughput=ASSUMED, device="cuda").stages[0]
    offloaded = plan_heal(pruned, dense, config, throughput=ASSUMED, device="cuda", device_map=_offloaded_map(4)).stages[0]
    # layer-streamed, each step first runs the kept layers forward to store their inputs: 4 layers x 20 sequences x 16
    assert offloaded.work.layer_forward.low - in_memory.work.layer_forward.low == 4 * (40 * 16 + 2 * 16)
    # and each call of an offloaded layer (a heal batch of 2 x 16 tokens) brings its weights at the assumed 12 GB/s
    teacher = describe_model(dense, torch.float32, 2, 16)
    calls = (offloaded.work.layer_forward.low + offloaded.work.layer_gradient.low) / (2 * 16)
    transfers = calls * sum(teacher.layer_parameters) / 6 * 4 / 12e9
    assert offloaded.seconds.low == pytest.approx(ASSUMED.seconds(offloaded.work, teacher, heal=True).low + transfers)
    assert transfers > ASSUMED.seconds(offloaded.work, teacher, heal=True).low  # on this tiny model they outweigh the compute


def test_the_heals_memory_counts_every_kept_layer_s_weights_where_it_trains_them_all():
    model = tiny_model("llama", num_layers=8)
    layers = get_adapter(model).get_layers(model)
    removed = [1, 2, 5]

    def trained_bytes(trainable: str) -> float:  # the host holds two float32 copies of the trained state
        config = GradMAPConfig(layers_to_prune=removed, num_samples=8, seq_len=16, batch_size=4, heal_tokens=64,
                               heal_seq_len=16, heal_trainable=trainable)  # fmt: skip
        return plan_pruning(model.config, config, throughput=ASSUMED).stage("Heal").host_bytes

    every_kept = sum(parameter.numel() for index in (0, 3, 4, 6, 7) for parameter in layers[index].parameters())
    norms = 2 * model.config.hidden_size * (5 + 1)  # two per kept layer and the final one, each counted with a bias
    assert trained_bytes("all") - trained_bytes("norms") == 8 * (every_kept - norms)


def test_the_dense_models_own_text_is_planned_as_its_generation_and_its_targets_kept_twice():
    from optimum_gradmap.distillation import TOP_K

    model_config = tiny_model("llama", num_layers=6).config
    heal = dict(heal_tokens=640, heal_seq_len=16, heal_batch_size=2, heal_validation_sequences=2)
    corpus = plan_pruning(model_config, GradMAPConfig(**SMALL, **heal), throughput=ASSUMED).stage("Heal")
    generated = plan_pruning(model_config, GradMAPConfig(**SMALL, **heal, heal_dataset="generated"), throughput=ASSUMED)
    heal_stage = generated.stage("Heal")
    # the generated text's top-K targets are held twice (the text's and the heal's rows): one more copy on the host
    assert heal_stage.host_bytes - corpus.host_bytes == (40 + 2) * 15 * (TOP_K * 8 + 4)
    # its targets come with the generation (every sequence written, a position at a time): no teacher pass over them
    assert heal_stage.work.generated_tokens == Count.of((40 + 2) * 16)
    assert corpus.work.layer_forward.low - heal_stage.work.layer_forward.low == 6 * (40 + 2) * 16
    assert heal_stage.peak_bytes_in_memory.low > corpus.peak_bytes_in_memory.low  # the generation's KV cache and logits
    # writing a position at a time is slower than a pass: at a tenth of the forward rate, the heal takes longer...
    slow = DeviceThroughput(**{**ASSUMED.to_dict(), "generation_flops_per_second": ASSUMED.forward_flops_per_second / 10})
    slower = plan_pruning(model_config, GradMAPConfig(**SMALL, **heal, heal_dataset="generated"), throughput=slow)
    assert slower.stage("Heal").seconds.low > 3 * heal_stage.seconds.low
    # ... and the quality preset's `auto` budget buys fewer tokens in Stage 1's time
    quality = {**SMALL, "num_samples": 64, "heal_seq_len": 16, "heal_batch_size": 2, "heal_validation_sequences": 2}
    fast_plan = plan_pruning(model_config, GradMAPConfig.from_preset("quality", **quality), throughput=ASSUMED)
    slow_plan = plan_pruning(model_config, GradMAPConfig.from_preset("quality", **quality), throughput=slow)
    assert slow_plan.stage("Heal").tokens < fast_plan.stage("Heal").tokens


def test_the_throughput_of_a_70b_model_is_measured_on_a_narrower_layer_of_the_same_kind(monkeypatch):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from optimum_gradmap.planning import empty_model

    llama_70b = LlamaConfig(
        hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
        vocab_size=128256, max_position_embeddings=8192,
    )  # fmt: skip
    built, build = [], AutoModelForCausalLM.from_config

    class Built(Exception):
        pass

    def from_config(model_config, **kwargs):  # the meta device's models are built; the one with storage is only noted
        if torch.get_default_device().type == "meta":
            return build(model_config, **kwargs)
        built.append(model_config)
        raise Built

    monkeypatch.setattr(AutoModelForCausalLM, "from_config", from_config)
    with pytest.raises(Built):
        DeviceThroughput.measure(llama_70b, dtype=torch.float32)
    (measured,) = built
    full = get_adapter(llama_70b).get_layers(empty_model(llama_70b, torch.float32))[0]
    layer = get_adapter(measured).get_layers(empty_model(measured, torch.float32))[0]
    layer_bytes = 4 * sum(parameter.numel() for parameter in layer.parameters())
    assert layer_bytes <= 512 * 2**20 < 4 * sum(parameter.numel() for parameter in full.parameters())  # 3.4 GB in full
    assert type(layer) is type(full) and measured.head_dim == 128 and measured.num_key_value_heads < 8


def test_a_narrowed_measurement_gives_rates_for_the_full_layers_flops(monkeypatch):
    from optimum_gradmap.planning import shape

    config = GradMAPConfig(**SMALL)
    model_config = tiny_model("llama", num_layers=6).config
    full = DeviceThroughput.measure(model_config, batch_size=4, seq_len=16, min_seconds=0.01)
    monkeypatch.setattr(shape, "MEASURED_LAYER_BYTES", 16 * 1024)  # the tiny layer's 37 KB, measured at half its widths
    narrowed = DeviceThroughput.measure(model_config, batch_size=4, seq_len=16, min_seconds=0.01)
    assert "widths divided by 2" in narrowed.source and "divided" not in full.source
    plan = plan_pruning(model_config, config, throughput=narrowed)
    assert (
        plan.stage("Stage 1").seconds.low > 0
        and plan.stage("Stage 1").flops == plan_pruning(model_config, config, throughput=full).stage("Stage 1").flops
    )  # the plan's FLOPs are the full layers'; the narrowed layer gives only the rates


def test_a_whole_model_on_disk_is_planned_layer_streamed():
    """`device_map="auto"` with a small `max_memory` may put the whole model on disk, `{"": "disk"}`: every layer is
    offloaded there, and the plan streams the gradient passes as the run does."""
    from optimum_gradmap.planning.placement import offloaded_shares
    from optimum_gradmap.planning.shape import describe_model

    model_config = tiny_model("llama").config
    shape = describe_model(model_config, torch.float32, 4, 16, None, None, "tiny")
    assert offloaded_shares(shape, model_config, {"": "disk"}, None) == {"disk": 1.0}
    assert offloaded_shares(shape, model_config, {"model": "cpu", "lm_head": "cpu"}, None) == {"cpu": 1.0}
    assert offloaded_shares(shape, model_config, {"": 0}, None) == {}
    config = GradMAPConfig(num_layers_to_prune=2, num_samples=8, seq_len=16, batch_size=4)
    plan = GradMAPPruner.plan(model_config, config, throughput=ASSUMED, device_map={"": "disk"})
    assert plan.execution == "layer_streamed"
