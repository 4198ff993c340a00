"""What the heal stage minimises (`heal_loss`): the top-K KL, or the KL with the hidden states at the seams
(optimum_gradmap.heal.loss, optimum_gradmap.heal)."""

import contextlib
import copy
import dataclasses

import pytest
import torch

from optimum_gradmap import GradMAPPruner, streaming
from optimum_gradmap.distillation import layer_outputs, targets_from_logits, teacher_targets, the_layer_outputs
from optimum_gradmap.errors import InvalidInputError
from optimum_gradmap.heal import PrunedLayout, heal, measure_heal_costs
from optimum_gradmap.heal import loss as heal_losses
from optimum_gradmap.heal.generation import GenerationSettings, generate_sequences
from optimum_gradmap.heal.loss import heal_loss, hidden_state_mse
from optimum_gradmap.objectives import TeacherTargets, top_k_kl
from optimum_gradmap.surgery import remove_layers

from .conftest import random_ids, small_config
from .test_heal import HEAL, heal_settings, peaked_model


def test_the_kl_heal_loss_is_the_top_k_kl_averaged_over_the_predicting_positions():
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 40, bias=False)
    with torch.no_grad():
        targets = targets_from_logits(head(torch.randn(2, 6, 8))[:, :-1])
    student_hidden = torch.randn(2, 6, 8, requires_grad=True)
    logits = head(student_hidden)[:, :-1]
    kl = heal_loss("kl", logits, targets)
    torch.testing.assert_close(kl, top_k_kl(logits, targets).mean())
    assert float(kl.detach()) > 0.1  # two different hidden states: a loss far from 0
    (gradient,) = torch.autograd.grad(kl, student_hidden)
    assert float(gradient[:, :-1].abs().sum()) > 0 and float(gradient[:, -1].abs().sum()) == 0  # the last predicts nothing


@pytest.mark.parametrize("loss", ["logit_mse", "kl_logit_mse"])
def test_a_retired_or_unknown_loss_is_refused_with_what_to_use_and_the_model_untouched(loss):
    model = peaked_model()
    state = copy.deepcopy(model.state_dict())
    with pytest.raises(InvalidInputError, match=f"heal_loss='{loss}'` was retired: .*Use heal_loss='kl'"):
        small_config(heal_tokens=256, heal_loss=loss, **HEAL)
    with pytest.raises(InvalidInputError, match="heal_loss"):
        small_config(heal_loss="cross_entropy")
    ids = random_ids(8, 16)
    with pytest.raises(InvalidInputError, match="must be one of"):
        heal(model, lambda: contextlib.nullcontext(model), ids, ids, heal_settings(heal_loss="cross_entropy"))
    with pytest.raises(InvalidInputError, match="was retired"):
        heal(model, lambda: contextlib.nullcontext(model), ids, ids, heal_settings(heal_loss=loss))
    with streaming.execution_mode("layer_streamed"), pytest.raises(InvalidInputError, match="layer-streamed"):
        heal(model, lambda: contextlib.nullcontext(model), ids, ids, heal_settings(heal_loss="kl_hidden_mse"))
    assert all(torch.equal(value, state[name]) for name, value in model.state_dict().items())


def test_a_checkpoint_names_its_loss_and_one_written_before_heal_loss_existed_resumes_as_the_kl(tmp_path, monkeypatch):
    train, validation = random_ids(16, 16, seed=1), random_ids(8, 16, seed=2)
    checkpoint = tmp_path / "heal.pt"

    def run(loss, steps_before_interrupt=None):
        model = peaked_model()
        teacher = copy.deepcopy(model)
        clip, calls = torch.nn.utils.clip_grad_norm_, []

        def interrupt(*args, **kwargs):
            calls.append(1)
            if len(calls) == steps_before_interrupt:
                raise KeyboardInterrupt
            return clip(*args, **kwargs)

        monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", interrupt)
        try:
            settings = heal_settings(
                heal_trainable="norms", heal_lr=1e-3, heal_batch_size=4, heal_check_every=1, heal_loss=loss, heal_autocast=False
            )
            teacher_context = lambda: contextlib.nullcontext(teacher)  # noqa: E731
            return heal(model, teacher_context, train, validation, settings, checkpoint=checkpoint, progress_bar=False)
        finally:
            monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)

    assert run("kl", steps_before_interrupt=3).interrupted
    saved = torch.load(checkpoint, weights_only=True)
    assert saved["fingerprint"]["loss"] == "kl"
    torch.save({**saved, "fingerprint": {**saved["fingerprint"], "loss": "kl_hidden_mse"}}, checkpoint)
    with pytest.raises(InvalidInputError, match="differs in loss"):  # a checkpoint of another loss
        run("kl")
    del saved["fingerprint"]["loss"]  # as a checkpoint written before `heal_loss` existed
    torch.save(saved, checkpoint)
    steps_after_resume, adamw_step = [], torch.optim.AdamW.step

    def counted_step(self, *args, **kwargs):
        steps_after_resume.append(1)
        return adamw_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", counted_step)
    resumed = run("kl")
    assert not resumed.interrupted and resumed.steps == 4 and len(steps_after_resume) == 2  # resumed after step 2


def test_the_hidden_state_mse_is_each_seam_s_squared_distance_relative_to_both_norms_averaged():
    torch.manual_seed(0)
    teacher = torch.randn(2, 5, 3, 8)
    teacher[0, 0] *= 1000  # a position whose state is far larger (an attention sink) weighs the same
    student = teacher + 0.1 * torch.randn(2, 5, 3, 8)
    student[1, 2, 0] *= 1000  # a sink the teacher does not make: bounded by 2
    double = student.double(), teacher.double()
    expected = ((double[0] - double[1]) ** 2).sum(-1) / ((double[0] ** 2).sum(-1) + (double[1] ** 2).sum(-1))
    mse = hidden_state_mse(student, teacher.to(torch.bfloat16))
    assert mse.shape == (2, 5) and mse.dtype == torch.float32
    torch.testing.assert_close(mse.double(), expected.mean(-1), rtol=0.05, atol=1e-3)  # the teacher's bfloat16 rounding
    assert 0.3 < float(mse[1, 2]) < 2 / 3 and float(mse[0, 0]) < 1e-4  # one seam of three near 1; the sink as any other
    torch.testing.assert_close(hidden_state_mse(3 * student, 3 * teacher), hidden_state_mse(student, teacher))
    assert float(hidden_state_mse(teacher, teacher).abs().max()) == 0.0
    # in the heal's loss, added to the KL over the predicting positions, weighted to equal it
    head = torch.nn.Linear(8, 40, bias=False)
    targets = targets_from_logits(head(teacher[..., -1, :]).detach()[:, :-1])
    targets.layer_states = teacher[:, :-1].to(torch.bfloat16)
    states = student.clone().requires_grad_(True)
    logits = head(states[..., -1, :])[:, :-1]
    total = heal_loss("kl_hidden_mse", logits, targets, states)
    kl, distance = top_k_kl(logits, targets).mean(), hidden_state_mse(states[:, :-1], targets.layer_states).mean()
    torch.testing.assert_close(total, 2 * kl)
    (gradient,) = torch.autograd.grad(total, states, retain_graph=True)
    (expected_gradient,) = torch.autograd.grad(kl + float((kl / distance).detach()) * distance, states)
    torch.testing.assert_close(gradient, expected_gradient)  # the weight is a constant to the gradient
    # every seam gets a gradient, the last position none
    assert float(gradient[:, :-1, :2].abs().sum()) > 0 and float(gradient[:, -1].abs().sum()) == 0


def test_the_seams_are_the_kept_layers_right_after_a_removed_run():
    assert PrunedLayout((0, 1, 3, 4, 7), 8).seams() == [2, 4]  # positions (among the kept layers) of layers 3 and 7
    assert PrunedLayout((1, 2, 5), 6).seams() == [0, 2]  # layer 0 removed: layer 1 follows a removed run
    assert PrunedLayout((0, 1, 2), 6).seams() == [] and PrunedLayout.unpruned(6).seams() == []  # the last removed, or none


def test_the_layer_outputs_kept_are_the_teacher_s_and_follow_rows_and_concatenation():
    teacher = peaked_model(num_layers=5)
    ids = random_ids(4, 8, seed=5)
    layers = [teacher.model.layers[1], teacher.model.layers[3]]
    with torch.no_grad():
        hidden_states = teacher(input_ids=ids, output_hidden_states=True).hidden_states  # [j + 1]: layer j's output
    hooks = [dict(layer._forward_hooks) for layer in layers]  # transformers' own, installed by the pass above
    targets = teacher_targets(teacher, ids, batch_size=3, progress_bar=False, layers=layers)
    expected = torch.stack([hidden_states[2], hidden_states[4]], dim=2)[:, :-1].to(torch.bfloat16)
    assert targets.layer_states.shape == (4, 7, 2, teacher.config.hidden_size)
    torch.testing.assert_close(targets.layer_states, expected)
    assert teacher_targets(teacher, ids, 3, progress_bar=False).layer_states is None
    assert torch.equal(targets.rows([2, 0]).layer_states, targets.layer_states[[2, 0]])
    both = TeacherTargets.concatenate([targets.rows(slice(0, 1)), targets.rows(slice(1, 4))])
    assert torch.equal(both.layer_states, targets.layer_states)
    assert [dict(layer._forward_hooks) for layer in layers] == hooks  # its hooks are gone after the pass
    with pytest.raises(InvalidInputError, match="gave 1"):
        with torch.no_grad(), layer_outputs(layers[:1]) as outputs:
            teacher(input_ids=ids)
        the_layer_outputs(outputs, 2)


def test_a_heal_on_the_seams_brings_them_closer_to_the_dense_model_on_unseen_text_than_the_kl_alone():
    dense = peaked_model()
    probe = random_ids(8, 16, seed=9)

    def healed(loss):
        model = copy.deepcopy(dense)
        config = small_config(num_samples=16, num_layers_to_prune=2, heal_tokens=48 * 16, heal_lr=1e-4, heal_loss=loss, **HEAL)
        pruner = GradMAPPruner(config, model, progress_bar=False)
        result = pruner.select_layers(model, random_ids(16, 16))
        pruner.compensate(result)
        positions = PrunedLayout(result.kept_layers, 6).seams()
        assert positions  # GradMAP kept a layer after a removed one
        teacher_layers = [dense.model.layers[result.kept_layers[position]] for position in positions]
        teacher = teacher_targets(dense, probe, batch_size=8, progress_bar=False, layers=teacher_layers)

        def probe_distance() -> float:
            with torch.no_grad(), layer_outputs([model.model.layers[position] for position in positions]) as outputs:
                model(input_ids=probe)
            states = the_layer_outputs(outputs, len(positions))[:, :-1]
            return float(hidden_state_mse(states, teacher.layer_states).mean())

        before = probe_distance()
        heal_result = pruner.heal(result, heal_data=random_ids(64, 16, seed=1)).heal
        assert heal_result.loss == loss and (loss == "kl") != (f"heal_loss={loss!r}" in heal_result.summary())
        assert heal_result.best_kl < heal_result.start_kl  # the state kept is chosen by the held-out KL
        return before, probe_distance()

    before, after_kl = healed("kl")
    same_start, after_seams = healed("kl_hidden_mse")
    assert same_start == before
    assert after_seams < 0.95 * before and after_seams < after_kl  # closer at the seams, on text the heal never saw


def test_the_seams_loss_is_refused_where_it_has_no_seam_or_no_weights_in_memory_and_its_step_is_timed(monkeypatch):
    model = peaked_model()
    state = copy.deepcopy(model.state_dict())
    config = small_config(heal_tokens=256, heal_loss="kl_hidden_mse", num_layers_to_prune=None, layers_to_prune=[4, 5], **HEAL)
    with pytest.raises(InvalidInputError, match="kl_hidden_mse.*leave none"):  # before Stage 1
        GradMAPPruner(config, model, progress_bar=False).prune(model, random_ids(), heal_data=random_ids(32, 16))
    streamed = small_config(heal_tokens=256, heal_loss="kl_hidden_mse", execution="layer_streamed", **HEAL)
    with pytest.raises(InvalidInputError, match="kl_hidden_mse.*hidden states.*layer-streamed"):
        GradMAPPruner(streamed, model, progress_bar=False).prune(model, random_ids(), heal_data=random_ids(32, 16))
    assert all(torch.equal(value, state[name]) for name, value in model.state_dict().items())
    ids = random_ids(8, 16)
    with pytest.raises(InvalidInputError, match="leave none"):  # every layer kept: no seam
        heal(model, lambda: contextlib.nullcontext(model), ids, ids, heal_settings(heal_loss="kl_hidden_mse"))
    assert all(torch.equal(value, state[name]) for name, value in model.state_dict().items())
    remove_layers(model, [2, 3])
    seams_measured = []

    def counted(states, teacher_states):
        seams_measured.append(states.shape[-2])
        return hidden_state_mse(states, teacher_states)

    monkeypatch.setattr(heal_losses, "hidden_state_mse", counted)
    costs = measure_heal_costs(model, heal_settings(heal_loss="kl_hidden_mse", **HEAL), PrunedLayout((0, 1, 4, 5), 6))
    assert costs.step_seconds > 0 and seams_measured == [1, 1]  # the step (warm-up, timed) with the one seam, layer 4


def test_the_generated_text_keeps_the_seams_outputs_a_teacher_pass_would_and_its_cache_is_told_apart(tmp_path):
    teacher = peaked_model(num_layers=4)
    documents = [random_ids(1, 8 + index, seed=index)[0] for index in range(4)]
    plain = GenerationSettings(seq_len=10, seed=3, prompt_tokens=3, bos_every=4, batch_size=4, start_token=1)
    settings = dataclasses.replace(plain, keep_layers=(1, 3))
    cache = tmp_path / "text.pt"

    def generated(settings):
        return generate_sequences(lambda: contextlib.nullcontext(teacher), documents, 8, settings, cache, progress_bar=False)

    without = generated(plain)
    assert without.targets.layer_states is None
    first = generated(settings)
    assert first.from_cache == 0 and torch.equal(first.input_ids, without.input_ids)  # another fingerprint, same text
    layers = [teacher.model.layers[1], teacher.model.layers[3]]
    again = teacher_targets(teacher, first.input_ids, 4, progress_bar=False, layers=layers)
    assert first.targets.layer_states.shape == again.layer_states.shape == (8, 9, 2, teacher.config.hidden_size)
    torch.testing.assert_close(first.targets.layer_states.float(), again.layer_states.float(), rtol=0.02, atol=0.02)
    read = generated(settings)
    assert read.from_cache == 8 and torch.equal(read.targets.layer_states, first.targets.layer_states)


def test_a_heal_on_the_dense_model_s_own_text_keeps_the_seams_outputs_as_it_writes(tmp_path, byte_tokenizer, monkeypatch):
    from optimum_gradmap.heal import loop as heal_loop

    from .test_generation import _text_file

    passes = []
    teacher_pass = heal_loop._Training._teacher_pass
    monkeypatch.setattr(
        heal_loop._Training, "_teacher_pass", lambda *args, **kwargs: passes.append(1) or teacher_pass(*args, **kwargs)
    )
    model = peaked_model()
    config = small_config(
        num_samples=16, dataset=_text_file(tmp_path, byte_tokenizer), heal_dataset="generated", heal_tokens=16 * 16,
        heal_lr=1e-4, heal_loss="kl_hidden_mse", **HEAL,
    )  # fmt: skip
    pruner = GradMAPPruner(config, model, tokenizer=byte_tokenizer, progress_bar=False)
    result = pruner.prune(model, random_ids(16, 16), heal_text_cache=tmp_path / "cache.pt")
    assert result.heal.loss == "kl_hidden_mse" and result.heal.steps == result.heal.num_steps
    assert passes == []  # no second pass of the dense model over its text
    saved = torch.load(tmp_path / "cache.pt", weights_only=True)
    seams = [result.kept_layers[position] for position in PrunedLayout(result.kept_layers, 6).seams()]
    assert saved["fingerprint"]["keep_layers"] == seams and saved["layer_states"].shape[2] == len(seams)
