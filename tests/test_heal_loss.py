"""What the heal stage minimises (`heal_loss`): the top-K KL, the centred-logit MSE over the whole vocabulary, or both
(optimum_gradmap.distillation, optimum_gradmap.heal)."""

import contextlib
import copy

import pytest
import torch

from optimum_gradmap import GradMAPPruner, streaming
from optimum_gradmap.distillation import (
    TeacherTargets,
    centred_logit_gram,
    head_inputs,
    heal_loss,
    logit_mse,
    targets_from_logits,
    teacher_targets,
    the_head_input,
    top_k_kl,
)
from optimum_gradmap.errors import InvalidInputError
from optimum_gradmap.generation import GenerationSettings, generate_sequences
from optimum_gradmap.heal import heal

from .conftest import random_ids, small_config
from .test_heal import HEAL, peaked_model


def centred(logits: torch.Tensor) -> torch.Tensor:
    logits = logits.double()
    return logits - logits.mean(-1, keepdim=True)


def test_logit_mse_through_the_gram_matrix_is_the_mean_squared_centred_logit_difference():
    student, teacher = peaked_model(num_layers=3, seed=1), peaked_model(num_layers=3, seed=2)
    with torch.no_grad():
        student.lm_head.weight.copy_(teacher.lm_head.weight)  # the pruned model's head is the dense model's
        student.lm_head.weight.add_(0.5)  # a mean row far from 0: the centring matters
        teacher.lm_head.weight.add_(0.5)
    ids = random_ids(3, 10, seed=4)
    targets = teacher_targets(teacher, ids, batch_size=2, progress_bar=False, keep_hidden=True)
    with torch.no_grad(), head_inputs(student.lm_head) as inputs:
        logits = student(input_ids=ids).logits[:, :-1]
        teacher_logits = teacher(input_ids=ids).logits[:, :-1]
    gram = centred_logit_gram(student.lm_head.weight, rows_at_once=7)  # rows summed a few at a time
    mse = logit_mse(inputs[-1][:, :-1], targets.hidden, gram)
    expected = ((centred(logits) - centred(teacher_logits)) ** 2).mean(-1)
    assert mse.shape == (3, 9)
    # the teacher's head input is kept in bfloat16: its rounding is the only difference
    torch.testing.assert_close(mse.double(), expected, rtol=0.02, atol=1e-3)
    assert float(expected.mean()) > 1.0  # two different models: a loss far from 0


def test_the_heal_loss_is_the_kl_the_logit_mse_or_their_sum_and_its_gradient_reaches_the_head_input():
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 40, bias=False)
    teacher_hidden = torch.randn(2, 6, 8)
    with torch.no_grad():
        teacher_logits = head(teacher_hidden)[:, :-1]
    targets = targets_from_logits(teacher_logits)
    targets.hidden = teacher_hidden[:, :-1].to(torch.bfloat16)
    gram = centred_logit_gram(head.weight)
    student_hidden = torch.randn(2, 6, 8, requires_grad=True)
    logits = head(student_hidden)[:, :-1]
    kl = top_k_kl(logits, targets).mean()
    mse = logit_mse(student_hidden[:, :-1], targets.hidden, gram).mean()
    torch.testing.assert_close(heal_loss("kl", logits, None, targets, None), kl)
    torch.testing.assert_close(heal_loss("logit_mse", logits, student_hidden, targets, gram), mse)
    total = heal_loss("kl_logit_mse", logits, student_hidden, targets, gram)
    torch.testing.assert_close(total, kl + mse)
    (gradient,) = torch.autograd.grad(heal_loss("logit_mse", logits.detach(), student_hidden, targets, gram), student_hidden)
    assert float(gradient[:, :-1].abs().sum()) > 0 and float(gradient[:, -1].abs().sum()) == 0  # the last predicts nothing
    with pytest.raises(InvalidInputError, match="called it 2 times"):
        the_head_input([student_hidden, student_hidden])


def test_the_head_inputs_kept_are_the_teacher_s_and_follow_rows_and_concatenation():
    teacher = peaked_model(num_layers=2)
    ids = random_ids(4, 8, seed=5)
    targets = teacher_targets(teacher, ids, batch_size=3, progress_bar=False, keep_hidden=True)
    with torch.no_grad(), head_inputs(teacher.lm_head) as inputs:
        teacher(input_ids=ids)
    torch.testing.assert_close(targets.hidden, inputs[0][:, :-1].to(torch.bfloat16))
    assert teacher_targets(teacher, ids, batch_size=3, progress_bar=False).hidden is None  # only when asked
    assert torch.equal(targets.rows([2, 0]).hidden, targets.hidden[[2, 0]])
    both = TeacherTargets.concatenate([targets.rows(slice(0, 2)), targets.rows(slice(2, 4))])
    assert torch.equal(both.hidden, targets.hidden)
    plain = TeacherTargets(targets.indices, targets.log_probs, targets.rest_log_prob)
    assert TeacherTargets.concatenate([targets, plain]).hidden is None  # kept only where every part has them
    assert not teacher.lm_head._forward_pre_hooks  # the hook is gone after the pass


def test_the_generated_text_keeps_the_head_inputs_a_teacher_pass_would():
    teacher = peaked_model(num_layers=2)
    settings = GenerationSettings(seq_len=10, seed=3, prompt_tokens=3, bos_every=4, batch_size=4, keep_hidden=True)
    documents = [random_ids(1, 8 + index, seed=index)[0] for index in range(4)]
    generated = generate_sequences(lambda: contextlib.nullcontext(teacher), documents, 1, 6, settings, progress_bar=False)
    again = teacher_targets(teacher, generated.input_ids, 4, progress_bar=False, keep_hidden=True)
    assert generated.targets.hidden.shape == again.hidden.shape == (6, 9, teacher.config.hidden_size)
    torch.testing.assert_close(generated.targets.hidden.float(), again.hidden.float(), rtol=0.02, atol=0.02)


@pytest.mark.parametrize("loss", ["logit_mse", "kl_logit_mse"])
def test_a_heal_on_the_logit_loss_lowers_it_and_the_held_out_kl(loss):
    model = peaked_model()
    dense = copy.deepcopy(model)
    heal_ids = random_ids(64, 16, seed=1)
    config = small_config(num_samples=16, num_layers_to_prune=3, heal_tokens=48 * 16, heal_lr=1e-4, heal_loss=loss, **HEAL)
    pruner = GradMAPPruner(config, model, progress_bar=False)
    result = pruner.select_layers(model, random_ids(16, 16))
    pruner.compensate(result)
    probe = random_ids(8, 16, seed=9)
    gram = centred_logit_gram(model.lm_head.weight)
    teacher = teacher_targets(dense, probe, batch_size=8, progress_bar=False, keep_hidden=True)

    def probe_mse() -> float:
        with torch.no_grad(), head_inputs(model.lm_head) as inputs:
            model(input_ids=probe)
        return float(logit_mse(inputs[-1][:, :-1], teacher.hidden, gram).mean())

    before = probe_mse()
    healed = pruner.heal(result, heal_data=heal_ids).heal
    assert healed.loss == loss and f"heal_loss={loss!r}" in healed.summary()
    assert healed.best_kl < healed.start_kl  # the state kept is still chosen by the held-out KL
    assert probe_mse() < before  # and the logits came closer to the dense model's on text it never saw


def test_a_logit_loss_needs_the_weights_in_memory_and_an_unknown_loss_is_refused():
    model = peaked_model()
    state = copy.deepcopy(model.state_dict())
    config = small_config(heal_tokens=256, heal_loss="logit_mse", execution="layer_streamed", **HEAL)
    with pytest.raises(InvalidInputError, match="heal_loss='logit_mse'.*layer-streamed"):  # before Stage 1
        GradMAPPruner(config, model, progress_bar=False).prune(model, random_ids(), heal_data=random_ids(32, 16))
    assert all(torch.equal(value, state[name]) for name, value in model.state_dict().items())
    with pytest.raises(InvalidInputError, match="heal_loss"):
        small_config(heal_loss="cross_entropy")
    ids = random_ids(8, 16)
    with pytest.raises(InvalidInputError, match="heal_loss"):
        heal(model, None, lambda: contextlib.nullcontext(model), ids, ids, loss="cross_entropy")
    with streaming.execution_mode("layer_streamed"), pytest.raises(InvalidInputError, match="layer-streamed"):
        heal(model, None, lambda: contextlib.nullcontext(model), ids, ids, loss="kl_logit_mse")
    assert all(torch.equal(value, state[name]) for name, value in model.state_dict().items())


def test_a_checkpoint_names_its_loss_and_one_written_before_heal_loss_existed_resumes_as_the_kl(tmp_path, monkeypatch):
    from optimum_gradmap.adapters import get_adapter

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
            return heal(
                model, get_adapter(model), lambda: contextlib.nullcontext(teacher), train, validation, "norms", 1e-3, 4, 1,
                loss=loss, autocast=False, num_layers=6, checkpoint=checkpoint, progress_bar=False,
            )  # fmt: skip
        finally:
            monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)

    assert run("kl", steps_before_interrupt=3).interrupted
    saved = torch.load(checkpoint, weights_only=True)
    assert saved["fingerprint"]["loss"] == "kl"
    with pytest.raises(InvalidInputError, match="differs in loss"):
        run("logit_mse")
    del saved["fingerprint"]["loss"]  # as a checkpoint written before `heal_loss` existed
    torch.save(saved, checkpoint)
    steps_after_resume, adamw_step = [], torch.optim.AdamW.step

    def counted_step(self, *args, **kwargs):
        steps_after_resume.append(1)
        return adamw_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", counted_step)
    resumed = run("kl")
    assert not resumed.interrupted and resumed.steps == 4 and len(steps_after_resume) == 2  # resumed after step 2
