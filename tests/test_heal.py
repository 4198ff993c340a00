"""The heal stage: distillation from the dense model into the pruned one (optimum_gradmap.heal)."""

import contextlib
import copy
import dataclasses

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from optimum_gradmap import GradMAPConfig, GradMAPPruner
from optimum_gradmap.adapters import get_adapter
from optimum_gradmap.distillation import TOP_K, teacher_targets
from optimum_gradmap.errors import InvalidInputError
from optimum_gradmap.heal import HealSettings, PrunedLayout, heal
from optimum_gradmap.heal.text import prepare_heal_data
from optimum_gradmap.objectives import TeacherTargets, rest_log_prob, top_k_kl

from .conftest import random_ids, small_config, tiny_model

HEAL = dict(heal_seq_len=16, heal_validation_sequences=8, heal_batch_size=4, heal_check_every=4, heal_autocast=False)


def heal_settings(**fields) -> HealSettings:
    """A small config's heal settings with `fields` (`GradMAPConfig`'s names) set as given, unchecked: what `heal`
    refuses reaches it."""
    return dataclasses.replace(HealSettings.from_config(small_config()), **fields)


def peaked_model(num_layers: int = 6, seed: int = 0) -> nn.Module:
    """A tiny Llama whose next-token distributions are far from uniform (its head scaled up), so that removing
    layers moves them."""
    model = tiny_model("llama", num_layers=num_layers, seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(30)
    return model


def held_out_kl(model: nn.Module, teacher: nn.Module, ids: torch.LongTensor) -> float:
    """The mean over positions of the top-K-and-rest KL, computed here from both models' logits."""
    targets = teacher_targets(teacher, ids, batch_size=64, progress_bar=False)
    with torch.no_grad():
        return float(top_k_kl(model(input_ids=ids).logits[:, :-1], targets).double().mean())


def full_kl(model: nn.Module, teacher: nn.Module, ids: torch.LongTensor) -> float:
    with torch.no_grad():
        log_p = torch.log_softmax(teacher(input_ids=ids).logits[:, :-1].double(), -1)
        log_q = torch.log_softmax(model(input_ids=ids).logits[:, :-1].double(), -1)
    return float((log_p.exp() * (log_p - log_q)).sum(-1).mean())


def test_teacher_targets_under_autocast_run_in_bfloat16_and_stay_close_to_float32():
    teacher = peaked_model()
    ids = random_ids(4, 16, seed=3)
    exact = teacher_targets(teacher, ids, batch_size=2, progress_bar=False)
    fast = teacher_targets(teacher, ids, batch_size=2, progress_bar=False, autocast=True)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = torch.log_softmax(teacher(input_ids=ids).logits[:, :-1].float(), -1).topk(TOP_K, -1).values
    torch.testing.assert_close(fast.log_probs, expected)  # the bfloat16 pass, log-softmax in float32
    assert not torch.equal(fast.log_probs, exact.log_probs)
    assert fast.log_probs.dtype == torch.float32
    torch.testing.assert_close(fast.log_probs[..., 0], exact.log_probs[..., 0], rtol=0.05, atol=0.05)


def test_top_k_kl_is_the_kl_of_the_top_k_and_the_rest_and_at_most_the_full_kl():
    torch.manual_seed(0)
    teacher_logits, student_logits = torch.randn(2, 5, 200) * 3, torch.randn(2, 5, 200) * 3
    log_p, log_q = torch.log_softmax(teacher_logits, -1), torch.log_softmax(student_logits, -1)
    top = log_p.topk(TOP_K, -1)
    mask = torch.zeros_like(log_p, dtype=torch.bool).scatter(-1, top.indices, True)
    p_rest, q_rest = log_p.exp().masked_fill(mask, 0).sum(-1), log_q.exp().masked_fill(mask, 0).sum(-1)
    p_top, q_top = log_p.exp().gather(-1, top.indices), log_q.exp().gather(-1, top.indices)
    expected = (p_top * (p_top / q_top).log()).sum(-1) + p_rest * (p_rest / q_rest).log()
    targets = TeacherTargets(top.indices.int(), top.values, rest_log_prob(log_p, top.indices))
    kl = top_k_kl(student_logits, targets)
    torch.testing.assert_close(kl, expected, rtol=1e-4, atol=1e-6)
    full = (log_p.exp() * (log_p - log_q)).sum(-1)
    assert torch.all(kl <= full + 1e-5) and torch.all(kl >= -1e-6)
    assert float(top_k_kl(teacher_logits, targets).abs().max()) < 1e-5  # the teacher against itself


@pytest.mark.parametrize("compensate_each_round", [False, True])
def test_the_teacher_is_the_dense_model_with_the_removed_layers_back_and_the_folds_undone(compensate_each_round):
    model = peaked_model()
    dense = copy.deepcopy(model)
    ids = random_ids(16, 16)
    config = small_config(num_samples=16, compensate_each_round=compensate_each_round, reg_lambda=1e-3)
    pruner = GradMAPPruner(config, model, progress_bar=False)
    result = pruner.select_layers(model, ids)
    pruner.compensate(result)
    assert result.compensated_layers or result.compensated_during_stage1  # folds to undo
    backups = [done.backup for done in pruner._run.run_compensations] + [result.compensation.backup]
    probe = random_ids(4, 16, seed=3)
    before = model(input_ids=probe).logits
    student = {id(parameter) for parameter in model.parameters()}
    with pruner._run.dense.dense_model(backups) as teacher:
        torch.testing.assert_close(teacher(input_ids=probe).logits, dense(input_ids=probe).logits, rtol=0, atol=0)
        # no second copy: the teacher is the student's own modules, the removed layers put back among them
        assert teacher is model and student <= {id(parameter) for parameter in teacher.parameters()}
        removed = {id(p) for index in result.removed_layers for p in pruner._run.dense.layers[index].parameters()}
        assert {id(p) for p in teacher.parameters()} == student | removed
    torch.testing.assert_close(model(input_ids=probe).logits, before, rtol=0, atol=0)  # the pruned model is back


@pytest.mark.parametrize("trainable, learning_rate", [("lora", 1e-4), ("norms", 1e-3), ("all", 1e-4)])
def test_heal_lowers_the_held_out_kl_and_keeps_the_best_state_as_plain_weights(trainable, learning_rate):
    model = peaked_model()
    dense = copy.deepcopy(model)
    heal_ids = random_ids(64, 16, seed=1)
    config = small_config(
        num_samples=16, num_layers_to_prune=3, heal_tokens=48 * 16, heal_trainable=trainable, heal_lr=learning_rate, **HEAL
    )
    result = GradMAPPruner(config, model, progress_bar=False).prune(model, random_ids(16, 16), heal_data=heal_ids)
    healed = result.heal
    assert healed.trainable == trainable and healed.steps == healed.num_steps == 12
    assert healed.best_kl < healed.start_kl
    assert healed.kl_curve[0] == [0, healed.start_kl] and min(kl for _, kl in healed.kl_curve) == healed.best_kl
    # the held-out sequences are the ones prepare_heal_data holds out; the model holds the best state
    _, validation = prepare_heal_data(heal_ids, None, 48, 8, 16, config.seed + 2)
    assert held_out_kl(model, dense, validation) == pytest.approx(healed.best_kl, rel=1e-4)
    assert not any("lora" in name for name, _ in model.named_parameters())
    assert all(type(module) is nn.Linear for name, module in model.named_modules() if name.endswith("proj"))
    assert result.timings["heal"] == healed.seconds and result.to_dict()["heal"]["best_kl"] == healed.best_kl


def test_heal_trains_only_what_it_names():
    model = peaked_model()
    config = small_config(
        num_samples=16, num_layers_to_prune=3, heal_tokens=16 * 16, heal_trainable="norms", heal_lr=1e-2, **HEAL
    )
    pruner = GradMAPPruner(config, model, progress_bar=False)
    result = pruner.select_layers(model, random_ids(16, 16))
    pruner.compensate(result)
    before = {name: parameter.detach().clone() for name, parameter in model.named_parameters()}
    pruner.heal(result, heal_data=random_ids(64, 16, seed=1))
    changed = {name for name, parameter in model.named_parameters() if not torch.equal(parameter, before[name])}
    assert changed and all("norm" in name for name in changed)


def test_a_healed_checkpoint_is_standard(tmp_path, byte_tokenizer):
    model = peaked_model()
    config = small_config(num_samples=16, heal_tokens=16 * 16, heal_lr=1e-4, **HEAL)
    pruner = GradMAPPruner(config, model, tokenizer=byte_tokenizer, progress_bar=False)
    result = pruner.prune(model, random_ids(16, 16), heal_data=random_ids(64, 16, seed=1))
    result.save_pretrained(tmp_path / "healed")  # checked by validate_checkpoint
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "healed")
    probe = random_ids(2, 16, seed=5)
    torch.testing.assert_close(reloaded(input_ids=probe).logits, model(input_ids=probe).logits, rtol=0, atol=0)
    assert set(reloaded.state_dict()) == set(model.state_dict())
    assert not [name for name in reloaded.state_dict() if "lora" in name or "base_layer" in name or "heal" in name]
    assert result.heal.trainable == "lora" and result.heal.best_tokens > 0  # LoRA trained, and its merge was saved


def test_ctrl_c_keeps_the_best_state_so_far_and_a_checkpoint_resumes_to_the_uninterrupted_result(tmp_path, monkeypatch):
    def pruned():
        model = peaked_model()
        teacher = copy.deepcopy(model)
        config = small_config(num_samples=16, num_layers_to_prune=3, compensation=False)
        result = GradMAPPruner(config, model, progress_bar=False).prune(model, random_ids(16, 16))
        return model, teacher, result.kept_layers

    train, validation = random_ids(40, 16, seed=1), random_ids(8, 16, seed=2)

    def run(model, teacher, kept, checkpoint=None):
        settings = heal_settings(heal_trainable="all", heal_lr=1e-4, heal_batch_size=4, heal_check_every=2, heal_autocast=False)
        layout = PrunedLayout(kept, 6)
        teacher_context = lambda: contextlib.nullcontext(teacher)  # noqa: E731
        return heal(model, teacher_context, train, validation, settings, layout, checkpoint=checkpoint, progress_bar=False)

    model, teacher, kept = pruned()
    uninterrupted = run(model, teacher, kept)
    expected = copy.deepcopy(model.state_dict())

    model, teacher, kept = pruned()
    calls = {"steps": 0}
    clip = torch.nn.utils.clip_grad_norm_

    def interrupt_at_step_7(*args, **kwargs):
        calls["steps"] += 1
        if calls["steps"] == 7:
            raise KeyboardInterrupt
        return clip(*args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", interrupt_at_step_7)
    interrupted = run(model, teacher, kept, tmp_path / "heal.pt")
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)
    assert interrupted.interrupted and interrupted.steps == 6
    assert held_out_kl(model, teacher, validation) == pytest.approx(interrupted.best_kl, rel=1e-4)

    model, teacher, kept = pruned()
    resumed = run(model, teacher, kept, tmp_path / "heal.pt")
    assert not resumed.interrupted and resumed.steps == uninterrupted.steps == 10
    assert [tokens for tokens, _ in resumed.kl_curve] == [tokens for tokens, _ in uninterrupted.kl_curve]
    assert [kl for _, kl in resumed.kl_curve] == pytest.approx([kl for _, kl in uninterrupted.kl_curve], rel=1e-5)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-7)


def test_heal_data_holds_out_windows_that_training_never_sees(byte_tokenizer):
    text = [" ".join(f"word{i}" for i in range(3000))]
    train, validation = prepare_heal_data(text, byte_tokenizer, 100, 10, 32, seed=0)
    assert train.shape == (100, 32) and validation.shape == (10, 32)
    held_out = {tuple(row.tolist()) for row in validation}
    assert not held_out & {tuple(row.tolist()) for row in train}
    with pytest.raises(InvalidInputError, match=r"the budget needs 110 \(100 to train on, 10 held out\)"):
        prepare_heal_data(["short text"], byte_tokenizer, 100, 10, 32, seed=0)


def test_refusals_leave_the_model_untouched():
    model = peaked_model()
    state = copy.deepcopy(model.state_dict())
    with pytest.raises(InvalidInputError, match="heal stage is off"):
        GradMAPPruner(small_config(), model, progress_bar=False).prune(model, random_ids(), heal_data=random_ids(32, 16))
    for retired in ("down_projections", "before_removed"):
        with pytest.raises(InvalidInputError, match=f"heal_trainable='{retired}'` was retired: .*heal_trainable='lora'"):
            small_config(heal_tokens=256, heal_trainable=retired, **HEAL)
    with pytest.raises(InvalidInputError, match="The setting `heal_prompts` was retired"):
        small_config(heal_tokens=256, heal_dataset="generated", heal_prompts="chat", **HEAL)
    with pytest.raises(InvalidInputError, match="heal_lr"):
        small_config(heal_lr=-1.0)
    with pytest.raises(InvalidInputError, match="heal_tokens"):
        small_config(heal_tokens=-1)
    for heal_data, message in ((None, "Unknown calibration dataset .no-such-text."), (random_ids(20, 16), "budget needs 40")):
        config = small_config(heal_tokens=32 * 16, heal_dataset="no-such-text", **HEAL)
        with pytest.raises(InvalidInputError, match=message):  # read and checked before Stage 1
            GradMAPPruner(config, model, progress_bar=False).prune(model, random_ids(), heal_data=heal_data)
    with pytest.raises(InvalidInputError, match="heal_trainable"):
        small_config(heal_trainable="everything")
    assert all(torch.equal(value, state[name]) for name, value in model.state_dict().items())
    assert len(model.model.layers) == 6

    config = small_config(num_samples=16, heal_tokens=16 * 16, heal_trainable="norms", **HEAL)
    pruner = GradMAPPruner(config, model, progress_bar=False)
    result = pruner.select_layers(model, random_ids(16, 16))
    with pytest.raises(InvalidInputError, match="not heal settings"):
        pruner.heal(result, heal_data=random_ids(32, 16), reg_lambda=1.0)
    pruner.heal(result, heal_data=random_ids(32, 16))
    with pytest.raises(InvalidInputError, match="healed already"):
        pruner.heal(result, heal_data=random_ids(32, 16))
    with pytest.raises(InvalidInputError, match="was healed"):
        pruner.compensate(result)
    other = GradMAPPruner(config, peaked_model(), progress_bar=False)
    released = other.select_layers(other.model, random_ids(16, 16))
    other.release()
    with pytest.raises(InvalidInputError, match="teacher="):
        other.heal(released, heal_data=random_ids(32, 16))


def test_heal_settings_are_config_fields_and_cli_options():
    from optimum_gradmap.heal import HEAL_SETTINGS, HEAL_TRAINABLE_CHOICES

    fields = set(GradMAPConfig.__dataclass_fields__)
    assert set(HEAL_SETTINGS) <= fields and {name for name in fields if name.startswith("heal_")} == set(HEAL_SETTINGS)
    assert GradMAPConfig(pruning_ratio=0.25).heal_tokens == 0  # off by default
    assert set(HEAL_TRAINABLE_CHOICES) == {"lora", "norms", "all"}


def test_the_refinement_distils_from_the_dense_model_not_from_the_folded_one(monkeypatch):
    """`refinement_steps`'s teacher is the dense model, without Stage 2's folds."""
    from optimum_gradmap.compensation import refinement

    model = peaked_model()
    dense = copy.deepcopy(model)
    ids = random_ids(8, 16)
    seen = {}
    dense_top_k = refinement.dense_top_k

    def record(*args, **kwargs):
        seen["targets"] = dense_top_k(*args, **kwargs)
        return seen["targets"]

    monkeypatch.setattr(refinement, "dense_top_k", record)
    config = small_config(refinement_steps=2, reg_lambda=0.0, num_layers_to_prune=3, compensation_selection="hidden_state")
    result = GradMAPPruner(config, model, progress_bar=False).prune(model, ids)
    assert result.compensated_layers
    with torch.no_grad():
        log_probs = torch.log_softmax(dense(input_ids=ids).logits[:, :-1], -1)
    top = log_probs.topk(refinement.TOP_K, -1)
    torch.testing.assert_close(seen["targets"][1], torch.softmax(top.values, -1))
    assert torch.equal(seen["targets"][0], top.indices)


def test_prune_command_heals_and_the_heal_command_heals_a_saved_checkpoint(tiny_checkpoint, tmp_path, capsys):
    import os
    import shlex

    from optimum_gradmap import load_report
    from optimum_gradmap.cli import main

    common = ["--dataset", "offline:wikipedia", "--num-samples", "16", "--seq-len", "16", "-q"]
    heal_options = ["--heal-tokens", "512", "--heal-dataset", "offline:web_text", "--heal-seq-len", "16",
                    "--heal-validation-sequences", "8", "--heal-batch-size", "4", "--heal-check-every", "2",
                    "--heal-trainable", "norms", "--no-heal-autocast"]  # fmt: skip
    healed = str(tmp_path / "healed")
    assert main(["prune", tiny_checkpoint, "--num-layers-to-prune", "2", *common, *heal_options, "--output", healed]) == 0
    report = load_report(healed)
    assert report["heal"]["trainable"] == "norms" and report["heal"]["trained_tokens"] == 512
    assert report["gradmap_config"]["heal_tokens"] == 512 and "heal" in report["timings"]
    assert os.path.isfile(os.path.join(healed, "heal_kl.png"))
    assert "heal stage distilled the dense model" in open(os.path.join(healed, "README.md"), encoding="utf-8").read()
    printed = capsys.readouterr().out
    assert "Healed norms (" in printed and "on 512 tokens" in printed
    assert not os.path.exists(os.path.join(tmp_path, ".healed.heal.pt"))  # the default heal checkpoint is removed

    pruned, later = str(tmp_path / "pruned"), str(tmp_path / "healed-later")
    assert main(["prune", tiny_checkpoint, "--num-layers-to-prune", "2", *common, "--output", pruned]) == 0
    argv = ["heal", pruned, "--teacher", tiny_checkpoint, *heal_options, "--output", later]
    assert main(argv) == 0
    report, before = load_report(later), load_report(pruned)
    assert report["removed_layers"] == before["removed_layers"] and report["heal"]["dataset"].startswith(
        "dataset 'offline:web_text'"
    )
    assert report["heal"]["best_kl"] <= report["heal"]["start_kl"]
    prune_command = shlex.join(
        ["optimum-gradmap", "prune", tiny_checkpoint, "--num-layers-to-prune", "2", *common, "--output", pruned]
    )
    heal_command = shlex.join(["optimum-gradmap", *argv])  # the heal's command, after the pruning's it started from
    assert (report["reproduce"]["step"], report["reproduce"]["command"]) == ("heal", heal_command)
    assert report["reproduce"]["earlier"] == before["reproduce"] and before["reproduce"]["command"] == prune_command
    card = open(os.path.join(later, "README.md"), encoding="utf-8").read().split("## Reproduce\n", 1)[1]
    assert card.index(f"```bash\n{prune_command}\n```") < card.index(f"```bash\n{heal_command}\n```")
    assert "Made in 2 runs" in card and "Healed with optimum-gradmap" in card
    assert AutoModelForCausalLM.from_pretrained(later).config.num_hidden_layers == 4
    assert main(["heal", later, "--teacher", tiny_checkpoint, *heal_options, "--output", str(tmp_path / "twice")]) == 2
    assert "healed already" in capsys.readouterr().err
    other = str(tmp_path / "other-teacher")
    tiny_model("llama", num_layers=5).save_pretrained(other)
    assert main(["heal", pruned, "--teacher", other, *heal_options, "--output", str(tmp_path / "x")]) == 2
    assert "pruned from a model of 6" in capsys.readouterr().err


def test_a_refused_checkpoint_file_leaves_no_lora_wrapper_and_the_model_as_it_was(tmp_path):
    model = peaked_model()
    GradMAPPruner(small_config(num_samples=16, compensation=False), model, progress_bar=False).prune(model, random_ids(16, 16))
    state = copy.deepcopy(model.state_dict())
    train, validation = random_ids(16, 16, seed=1), random_ids(4, 16, seed=2)
    torch.save({"fingerprint": {"trainable": "lora"}}, tmp_path / "other.pt")
    with pytest.raises(InvalidInputError, match="comes from another run"):
        teacher = lambda: contextlib.nullcontext(peaked_model())  # noqa: E731
        heal(model, teacher, train, validation, heal_settings(), checkpoint=tmp_path / "other.pt", progress_bar=False)
    assert all(type(module) is nn.Linear for name, module in model.named_modules() if name.endswith("proj"))
    assert not hasattr(model, "peft_config") and set(model.state_dict()) == set(state)
    assert all(torch.equal(value, state[name]) for name, value in model.state_dict().items())
    assert not any(parameter.requires_grad is False for parameter in model.parameters())  # flags as they came


@pytest.mark.parametrize("family", ["gpt2", "opt"])
def test_lora_finds_gpt2s_conv1d_maps_and_norms_include_the_final_norm_whatever_its_name(family):
    from optimum_gradmap.heal.trainable import _norm_parameters, choose_trainable

    model = tiny_model(family, num_layers=4)
    adapter = get_adapter(model)
    final = model.transformer.ln_f if family == "gpt2" else model.model.decoder.final_layer_norm
    assert {id(p) for p in final.parameters()} <= {id(p) for p in _norm_parameters(model, [], adapter)}
    targets = choose_trainable(model, adapter, "lora").lora_targets
    assert len(targets) == 4 * (4 if family == "gpt2" else 6)  # GPT-2: c_attn, c_proj, c_fc, mlp.c_proj; OPT: q k v out fc1 fc2
    teacher = lambda: contextlib.nullcontext(copy.deepcopy(model))  # noqa: E731
    settings = heal_settings(heal_lr=1e-4, heal_batch_size=4, heal_check_every=1, heal_autocast=False)
    result = heal(model, teacher, random_ids(8, 16, seed=1), random_ids(4, 16, seed=2), settings, progress_bar=False)
    assert result.num_trainable_parameters > 0 and not hasattr(model, "peft_config")


def test_full_weights_in_bfloat16_are_refused_before_stage_1_and_lora_is_not():
    model = peaked_model().to(torch.bfloat16)
    config = small_config(num_samples=16, heal_tokens=256, heal_trainable="norms", **HEAL)
    with pytest.raises(InvalidInputError, match="round away"):
        GradMAPPruner(config, model, progress_bar=False).prune(model, random_ids(16, 16), heal_data=random_ids(32, 16))
    assert len(model.model.layers) == 6


def test_pruner_heal_keeps_the_results_stage2_settings():
    model = peaked_model()
    pruner = GradMAPPruner(small_config(num_samples=16, compensation=False, **HEAL), model, progress_bar=False)
    result = pruner.select_layers(model, random_ids(16, 16))
    pruner.compensate(result, reg_lambda=0.5)
    assert result.compensated_layers
    pruner.heal(result, heal_data=random_ids(32, 16), heal_tokens=128, heal_trainable="norms", heal_lr=1e-4)
    assert result.config.reg_lambda == 0.5 and result.config.compensation and result.config.heal_tokens == 128


# --- the teacher, the adapters' dtype, the checkpoint, the digest, the merge, the checks, the seed ----------------------


def heal_tiny(model, teacher=None, trainable="norms", train=None, validation=None, checkpoint=None, **fields):
    """`heal` on a tiny Llama of two layers, its teacher another one unless given (no pruning needed); `fields` are heal
    settings (`GradMAPConfig`'s names)."""
    if teacher is None:
        teacher = lambda: contextlib.nullcontext(peaked_model(num_layers=2, seed=1))  # noqa: E731
    fields = dict(heal_trainable=trainable, heal_lr=1e-2, heal_batch_size=4, heal_check_every=1, heal_autocast=False) | fields
    train = random_ids(8, 16, seed=1) if train is None else train
    validation = random_ids(4, 16, seed=2) if validation is None else validation
    return heal(model, teacher, train, validation, heal_settings(**fields), checkpoint=checkpoint, progress_bar=False)


def test_no_reference_to_the_teacher_outlives_its_pass(monkeypatch):
    """No name bound in `heal` keeps the `heal` command's teacher alive through training."""
    import gc
    import weakref

    references = []

    @contextlib.contextmanager
    def teacher():
        dense = peaked_model(num_layers=2, seed=1)
        references.append(weakref.ref(dense))
        yield dense

    alive = []
    clip = torch.nn.utils.clip_grad_norm_

    def check_then_clip(*args, **kwargs):
        gc.collect()
        alive.append(references[0]() is not None)
        return clip(*args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", check_then_clip)
    heal_tiny(peaked_model(num_layers=2), teacher)
    assert alive and not any(alive)


def test_the_teacher_is_freed_by_its_own_context_cleanup():
    """The `heal` command frees the teacher in its context's cleanup (`del`, `gc.collect()`); a name still bound
    to it while that cleanup ran left it to a later collection (an offloaded teacher is held in cycles by its hooks)."""
    import gc
    import weakref

    freed = []

    @contextlib.contextmanager
    def teacher():
        dense = peaked_model(num_layers=2, seed=1)
        reference = weakref.ref(dense)
        try:
            yield dense
        finally:
            del dense
            gc.collect()
            freed.append(reference() is None)

    heal_tiny(peaked_model(num_layers=2), teacher)
    assert freed == [True]


def test_lora_adapters_are_float32_on_a_bfloat16_model_and_merge_into_its_bfloat16_weights(monkeypatch):
    """LoRA's adapters are float32 whatever the model's dtype, so AdamW's steps keep their bits."""
    model = peaked_model(num_layers=2).to(torch.bfloat16)
    seen = {}
    adamw = torch.optim.AdamW

    def record(parameters, *args, **kwargs):
        parameters = list(parameters)
        seen["dtypes"] = {parameter.dtype for parameter in parameters}
        return adamw(parameters, *args, **kwargs)

    monkeypatch.setattr(torch.optim, "AdamW", record)
    result = heal_tiny(model, trainable="lora", heal_lr=1e-3)
    assert seen["dtypes"] == {torch.float32} and result.num_trainable_parameters > 0
    assert {parameter.dtype for parameter in model.parameters()} == {torch.bfloat16} and not hasattr(model, "peft_config")


def test_a_heal_checkpoint_is_written_in_folders_that_do_not_exist_yet(tmp_path):
    """The first save creates the checkpoint's missing folders."""
    checkpoint = tmp_path / "new" / "deeper" / "heal.pt"
    heal_tiny(peaked_model(num_layers=2), checkpoint=checkpoint)
    assert checkpoint.is_file() and [path.name for path in checkpoint.parent.iterdir()] == ["heal.pt"]


def test_a_heal_checkpoint_that_cannot_be_written_is_refused_before_the_teacher_runs(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    model = peaked_model(num_layers=2)
    state = copy.deepcopy(model.state_dict())

    def teacher():
        raise AssertionError("the teacher ran")

    for path, message in ((tmp_path / "file" / "heal.pt", "is a file, not a folder"), (tmp_path, "is a folder")):
        with pytest.raises(InvalidInputError, match=message):
            heal_tiny(model, teacher, checkpoint=path)
    assert all(torch.equal(value, state[name]) for name, value in model.state_dict().items())


def test_a_failed_checkpoint_write_leaves_no_temporary_file_and_the_model_as_it_came(tmp_path, monkeypatch):
    def write_part_then_fail(value, path, *args, **kwargs):
        with open(path, "wb") as file:
            file.write(b"half")
        raise OSError("No space left on device")

    model = peaked_model(num_layers=2)
    state = copy.deepcopy(model.state_dict())
    monkeypatch.setattr(torch, "save", write_part_then_fail)
    with pytest.raises(OSError, match="No space left"):
        heal_tiny(model, checkpoint=tmp_path / "heal.pt")
    assert list(tmp_path.iterdir()) == []
    assert all(torch.equal(value, state[name]) for name, value in model.state_dict().items())


def test_the_weights_digest_is_made_only_for_a_checkpoint_chunk_by_chunk_and_tells_weights_apart(tmp_path, monkeypatch):
    """The weights' digest runs only for a checkpoint, chunk by chunk (no float64 copy of a whole tensor)."""
    from optimum_gradmap import weights as weights_module
    from optimum_gradmap.heal import loop as heal_loop

    digest, calls = weights_module.weights_digest, []
    monkeypatch.setattr(heal_loop, "weights_digest", lambda model: calls.append(model) or digest(model))
    heal_tiny(peaked_model(num_layers=2))
    assert calls == []
    heal_tiny(peaked_model(num_layers=2), checkpoint=tmp_path / "heal.pt")
    assert len(calls) == 1

    monkeypatch.setattr(weights_module, "DIGEST_CHUNK", 1000)
    sizes, double = [], torch.Tensor.double
    monkeypatch.setattr(torch.Tensor, "double", lambda self, *args, **kwargs: sizes.append(self.numel()) or double(self))
    model = tiny_model("llama", num_layers=2)
    first = digest(model)
    assert 0 < max(sizes) <= 1000 < model.model.embed_tokens.weight.numel()
    assert digest(model) == first == digest(copy.deepcopy(model))
    with torch.no_grad():
        model.model.embed_tokens.weight[3, 5] += 1e-3
    assert digest(model) != first


def test_an_error_in_the_merge_puts_the_model_back_as_it_came_without_lora_wrappers(monkeypatch):
    """An error in the merge leaves neither a half-merged model nor LoRA's wrappers."""
    from peft.tuners.lora import layer as lora_layer

    model = peaked_model(num_layers=2)
    state = copy.deepcopy(model.state_dict())
    merge, updates = lora_layer.Linear.merge, []

    def merge_twice_then_fail(self, *args, **kwargs):
        if len(updates) == 2:
            raise RuntimeError("the merge failed")
        updates.append(float(self.get_delta_weight("heal").detach().abs().max()))
        return merge(self, *args, **kwargs)

    monkeypatch.setattr(lora_layer.Linear, "merge", merge_twice_then_fail)
    with pytest.raises(RuntimeError, match="the merge failed"):
        heal_tiny(model, trainable="lora", heal_lr=1e-2)
    assert len(updates) == 2 and min(updates) > 0  # two layers had a trained update merged before the error
    assert not hasattr(model, "peft_config") and set(model.state_dict()) == set(state)
    assert all(type(module) is nn.Linear for name, module in model.named_modules() if name.endswith("proj"))
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, state[name])


def test_no_held_out_sequence_and_a_check_every_below_1_are_refused_before_the_teacher_runs():
    """No held-out sequence (a NaN KL) and check_every=0 (a division by zero) are refused up front."""
    model = peaked_model(num_layers=2)

    def teacher():
        raise AssertionError("the teacher ran")

    with pytest.raises(InvalidInputError, match="0 held-out sequence"):
        heal_tiny(model, teacher, validation=random_ids(4, 16)[:0])
    with pytest.raises(InvalidInputError, match="heal_check_every=0"):
        heal_tiny(model, teacher, heal_check_every=0)


def test_the_held_out_kl_reads_the_device_once_per_check_not_once_per_batch(monkeypatch):
    """The held-out sums stay on the device: one read per check."""
    from optimum_gradmap.heal import loop as heal_loop

    held_out_kl, reads = heal_loop._held_out_kl, []
    names = ("cpu", "item", "tolist", "__float__")

    def counted(*args, **kwargs):
        count, originals = [0], {name: getattr(torch.Tensor, name) for name in names}

        def counting(name):
            def method(self, *method_args, **method_kwargs):
                count[0] += 1
                return originals[name](self, *method_args, **method_kwargs)

            return method

        with monkeypatch.context() as patch:
            for name in names:
                patch.setattr(torch.Tensor, name, counting(name))
            value = held_out_kl(*args, **kwargs)
        reads.append(count[0])
        return value

    monkeypatch.setattr(heal_loop, "_held_out_kl", counted)
    result = heal_tiny(peaked_model(num_layers=2), heal_batch_size=2, validation=random_ids(8, 16, seed=2))
    assert len(reads) == len(result.kl_curve) >= 2 and set(reads) == {1}


def test_lora_initialisation_follows_the_configs_seed(monkeypatch):
    """LoRA's initialisation follows `seed`."""
    from optimum_gradmap.heal.trainable import Trainable

    init, seeds = Trainable.__init__, []

    def record(self, model, choice, lora_rank, seed=0):
        seeds.append(seed)
        init(self, model, choice, lora_rank, seed)

    monkeypatch.setattr(Trainable, "__init__", record)
    heal_tiny(peaked_model(num_layers=2), trainable="lora", seed=7)
    assert seeds == [7]


def test_the_report_says_whose_weights_a_heal_that_beat_nothing_kept():
    """A heal that beat nothing names whose weights the model keeps (not Stage 2's when Stage 2 changed nothing)."""
    from optimum_gradmap.report.model_card import heal_sentence

    healed = dict(trainable="norms", num_trainable_parameters=10, trained_tokens=64, dataset="d", train_sha256="0" * 64,
                  start_kl=1.0, best_kl=1.0, best_tokens=0)  # fmt: skip
    assert heal_sentence({"heal": healed, "compensation": {"compensated_layers": [2]}}).endswith("the weights are Stage 2's.")
    assert heal_sentence({"heal": healed, "compensation": None}).endswith("Stage 1's (Stage 2 was not run).")
    no_layer = {"heal": healed, "compensation": {"compensated_layers": []}}
    assert heal_sentence(no_layer).endswith("Stage 1's (Stage 2 compensated no layer).")


# --- heal refusals inside `prune` come before Stage 1 ----------------------------------------------------------------


@pytest.fixture
def no_stage_1(monkeypatch):
    """Fails the test if `prune` starts Stage 1 (every refusal below must come before it)."""

    def started(*args, **kwargs):
        raise AssertionError("Stage 1 started: the refusal came after it")

    monkeypatch.setattr("optimum_gradmap.pipeline.SelectLayers.run", started)


def without_norms(model: nn.Module) -> nn.Module:
    """`model` (a tiny Llama) with every normalisation replaced by the identity: `norms` finds nothing to train."""
    for layer in model.model.layers:
        layer.input_layernorm, layer.post_attention_layernorm = nn.Identity(), nn.Identity()
    model.model.norm = nn.Identity()
    return model


@pytest.mark.parametrize(
    "case, settings, message",
    [
        ("peft_config", dict(heal_trainable="lora"), "carries PEFT adapters"),
        ("no_norms", dict(heal_trainable="norms"), "finds nothing to train"),
        ("stale_checkpoint", dict(heal_trainable="norms"), "comes from another run .*trainable.*before pruning started"),
        ("checkpoint_under_a_file", dict(heal_trainable="norms"), "is a file, not a folder"),
    ],
)
def test_heal_refusals_inside_prune_come_before_stage_1_and_leave_the_model_untouched(
    no_stage_1, tmp_path, case, settings, message
):
    model = without_norms(peaked_model()) if case == "no_norms" else peaked_model()
    if case == "peft_config":
        model.peft_config = {}
    state = copy.deepcopy(model.state_dict())
    checkpoint = tmp_path / "heal.pt"
    if case == "checkpoint_under_a_file":
        (tmp_path / "file").write_text("not a folder")
        checkpoint = tmp_path / "file" / "heal.pt"
    if case == "stale_checkpoint":  # another run's: LoRA, 1e-4
        torch.save({"fingerprint": {"trainable": "lora", "learning_rate": 1e-4}}, checkpoint)
    layers = {"num_layers_to_prune": None} if "layers_to_prune" in settings else {}
    config = small_config(num_samples=16, heal_tokens=256, heal_lr=1e-3, **layers, **settings, **HEAL)
    with pytest.raises(InvalidInputError, match=message):
        GradMAPPruner(config, model, progress_bar=False).prune(
            model, random_ids(16, 16), heal_data=random_ids(32, 16), heal_checkpoint=checkpoint
        )
    assert len(model.model.layers) == 6 and all(torch.equal(value, state[name]) for name, value in model.state_dict().items())


def test_an_interrupted_heal_keeps_stage_1s_checkpoint_and_the_same_command_resumes_both(
    tiny_checkpoint, tmp_path, monkeypatch, capsys
):
    from optimum_gradmap import load_report
    from optimum_gradmap.cli import main

    output = tmp_path / "healed"
    stage1, heal_state = tmp_path / ".healed.stage1.json", tmp_path / ".healed.heal.pt"
    argv = ["prune", tiny_checkpoint, "--num-layers-to-prune", "2", "--dataset", "offline:wikipedia", "--num-samples", "16",
            "--seq-len", "16", "-q", "--heal-tokens", "512", "--heal-dataset", "offline:web_text", "--heal-seq-len", "16",
            "--heal-validation-sequences", "8", "--heal-batch-size", "4", "--heal-check-every", "2",
            "--heal-trainable", "norms", "--no-heal-autocast", "--output", str(output)]  # fmt: skip
    clip, calls = torch.nn.utils.clip_grad_norm_, {"steps": 0}

    def interrupt_at_step_3(*args, **kwargs):
        calls["steps"] += 1
        if calls["steps"] == 3:
            raise KeyboardInterrupt
        return clip(*args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", interrupt_at_step_3)
    assert main(argv) == 0
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)
    interrupted = load_report(output)["heal"]
    assert interrupted["interrupted"] and interrupted["steps"] == 2
    assert stage1.is_file() and heal_state.is_file()  # both kept for the resume
    assert f"Stage 1's rounds are kept in {stage1}" in capsys.readouterr().out

    assert main([*argv, "--overwrite"]) == 0  # the resume: Stage 1 replayed from its file, the heal from step 2
    report = load_report(output)
    assert report["timings"]["stage1_resumed"] > 0
    assert not report["heal"]["interrupted"] and report["heal"]["steps"] == report["heal"]["num_steps"] == 8
    assert report["heal"]["kl_curve"][:2] == interrupted["kl_curve"]  # the checks before the interrupt, resumed
    assert not stage1.exists() and not heal_state.exists()


def test_parameters_trained_without_lora_keep_no_gradient_after_the_heal():
    """A trained weight's `.grad` is a weight-sized tensor: it is dropped once the heal ends."""
    model = peaked_model(num_layers=2)
    result = heal_tiny(model, trainable="norms")
    assert result.steps > 0 and result.num_trainable_parameters > 0
    assert all(parameter.grad is None for parameter in model.parameters())


def test_a_peft_failure_part_way_leaves_the_model_exactly_as_it_was(monkeypatch):
    """PEFT raising after it wrapped some maps: no wrapper, adapter, PEFT config or changed flag stays on the model."""
    from peft.tuners.lora import LoraModel

    model = peaked_model(num_layers=2)
    model.model.layers[0].mlp.up_proj.weight.requires_grad_(False)  # flags as a user left them
    state = copy.deepcopy(model.state_dict())
    modules = [(name, type(module)) for name, module in model.named_modules()]
    flags = {name: parameter.requires_grad for name, parameter in model.named_parameters()}
    create, calls = LoraModel._create_and_replace, []

    def fail_on_the_third_map(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("PEFT failed")
        return create(self, *args, **kwargs)

    monkeypatch.setattr(LoraModel, "_create_and_replace", fail_on_the_third_map)
    with pytest.raises(RuntimeError, match="PEFT failed"):
        heal_tiny(model, trainable="lora")
    assert len(calls) == 3  # two maps were wrapped before the failure
    assert [(name, type(module)) for name, module in model.named_modules()] == modules
    assert not hasattr(model, "peft_config")
    assert {name: parameter.requires_grad for name, parameter in model.named_parameters()} == flags
    assert model.state_dict().keys() == state.keys()
    assert all(torch.equal(value, state[name]) for name, value in model.state_dict().items())


def test_the_heal_commands_evaluation_frees_the_teacher_in_its_cleanup_before_the_checkpoint_is_saved(byte_tokenizer):
    """The `heal` command saves after its evaluation: the teacher loaded for the KL is freed by its context's cleanup."""
    import gc
    import weakref

    from optimum_gradmap.commands.heal import healed_evaluation

    freed = []

    @contextlib.contextmanager
    def teacher():  # as the command's: loaded for the block, freed by its cleanup
        dense = peaked_model(num_layers=2, seed=1)
        alive = weakref.ref(dense)
        try:
            yield dense
        finally:
            del dense
            gc.collect()
            freed.append(alive() is None)

    entry = {"dataset": "offline:wikipedia", "segment_length": 16, "num_segments": 2, "kl_to_reference": 1.0}
    report = {"evaluation": {"perplexities": [entry]}}
    result = healed_evaluation(report, peaked_model(num_layers=2), byte_tokenizer, teacher, "dense", progress_bar=False)
    assert freed == [True]
    assert result.perplexities[0].kl_to_reference > 0 and result.perplexities[0].num_segments == 2
