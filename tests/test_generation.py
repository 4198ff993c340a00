"""The dense model's own heal text (optimum_gradmap.heal.generation, `heal_dataset="generated"`)."""

import contextlib
import copy
import dataclasses

import pytest
import torch

from optimum_gradmap import GradMAPConfig, GradMAPPruner
from optimum_gradmap.data import calibration_sha256
from optimum_gradmap.errors import InvalidInputError
from optimum_gradmap.heal import HealSettings, PrunedLayout, heal_sequences
from optimum_gradmap.heal.generation import GenerationSettings, draw_tokens, generate_sequences, sample_batch, sequence_prompt

from .conftest import VOCAB_SIZE, random_ids, small_config, tiny_model
from .test_heal import HEAL, peaked_model

SETTINGS = GenerationSettings(seq_len=12, temperature=1.0, seed=3, prompt_tokens=4, bos_every=4, batch_size=4, start_token=1)


def documents(count: int = 5) -> list[torch.LongTensor]:
    return [random_ids(1, 10 + index, seed=index)[0] for index in range(count)]


def counting(model: torch.nn.Module) -> list[int]:
    """Counts the model's forward passes."""
    calls: list[int] = []
    model.register_forward_hook(lambda *args: calls.append(1))
    return calls


def generate(model, num_sequences, settings=SETTINGS, cache=None, docs=None):
    teacher = lambda: contextlib.nullcontext(model)  # noqa: E731
    return generate_sequences(teacher, docs or documents(), num_sequences, settings, cache, progress_bar=False)


def test_generation_is_deterministic_under_a_seed_and_starts_from_the_prompts(tmp_path):
    model = tiny_model("llama", num_layers=2)
    first = generate(model, 8, cache=tmp_path / "a.pt").input_ids
    again = generate(model, 8, cache=tmp_path / "b.pt").input_ids
    other_seed = generate(model, 8, dataclasses.replace(SETTINGS, seed=4), cache=tmp_path / "c.pt").input_ids
    assert first.shape == (8, 12) and torch.equal(first, again)
    assert not torch.equal(first, other_seed)
    prompts = [document[:4] for document in documents()]
    for index, row in enumerate(first):
        if index % 4 == 3:  # one in `bos_every` starts from the start token alone
            assert row[0] == 1
        else:
            assert any(torch.equal(row[:4], prompt) for prompt in prompts)
    assert len({tuple(row[:4].tolist()) for index, row in enumerate(first) if index % 4 != 3}) == 5  # cycled prompts


def test_the_kv_cache_samples_what_full_forward_passes_would():
    model = tiny_model("llama", num_layers=2)
    prompts = [sequence_prompt(index, [d[:4] for d in documents()], SETTINGS) for index in range(4)]
    sampled, _ = sample_batch(model, prompts, 12, 0.7, torch.Generator().manual_seed(0))
    generator = torch.Generator().manual_seed(0)
    expected = torch.zeros(4, 12, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        expected[row, : prompt.numel()] = prompt
    with torch.no_grad():
        for position in range(11):  # the whole prefix each step, no cache
            logits = model(input_ids=expected[:, : position + 1]).logits[:, -1]
            drawn = draw_tokens(logits, 0.7, generator)
            for row, prompt in enumerate(prompts):
                if position + 1 >= prompt.numel():
                    expected[row, position + 1] = drawn[row]
    assert torch.equal(sampled, expected)


def test_draw_tokens_samples_the_tempered_distribution_and_never_a_token_of_probability_zero():
    probabilities = torch.tensor([0.1, 0.0, 0.2, 0.7, 0.0])
    logits = probabilities.log().repeat(100_000, 1)  # log(0) = -inf: probability 0
    drawn = draw_tokens(logits, 1.0, torch.Generator().manual_seed(0))
    shares = torch.bincount(drawn, minlength=5) / drawn.numel()
    assert shares[1] == 0 and shares[4] == 0
    assert torch.allclose(shares, probabilities, atol=0.005)
    hotter = torch.bincount(draw_tokens(logits, 2.0, torch.Generator().manual_seed(1)), minlength=5) / drawn.numel()
    tempered = probabilities.sqrt() / probabilities.sqrt().sum()  # softmax(log p / 2)
    assert torch.allclose(hotter, tempered, atol=0.005)
    again = draw_tokens(logits[:7], 1.0, torch.Generator().manual_seed(0))
    assert torch.equal(again, drawn[:7])  # the same seed, the same draws


def test_the_cache_is_reused_extended_and_invalidated_by_the_fingerprint(tmp_path):
    model = tiny_model("llama", num_layers=2)
    cache = tmp_path / "text.pt"
    calls = counting(model)
    first = generate(model, 6, cache=cache)
    assert first.from_cache == 0 and calls and first.seconds_per_sequence > 0
    calls.clear()
    again = generate(model, 6, cache=cache)  # the same fingerprint: read, not generated
    assert calls == [] and again.from_cache == 6 and torch.equal(again.input_ids, first.input_ids)
    assert again.seconds_per_sequence == first.seconds_per_sequence  # what more would cost, from the cache's record
    fewer = generate(model, 3, cache=cache)
    assert calls == [] and torch.equal(fewer.input_ids, first.input_ids[:3])
    more = generate(model, 10, cache=cache)  # extended: the first ones stay, the same as a fresh run's
    assert calls and torch.equal(more.input_ids[:6], first.input_ids)
    assert torch.equal(more.input_ids, generate(model, 10, cache=tmp_path / "fresh.pt").input_ids)
    calls.clear()
    hotter = generate(model, 6, dataclasses.replace(SETTINGS, temperature=2.0), cache=cache)  # other settings
    assert calls and not torch.equal(hotter.input_ids, first.input_ids)
    calls.clear()
    with torch.no_grad():
        model.lm_head.weight[0, 0] += 1.0  # another teacher
    generate(model, 6, dataclasses.replace(SETTINGS, temperature=2.0), cache=cache)
    assert calls
    calls.clear()
    generate(model, 6, cache=cache, docs=documents(4))  # other prompts
    assert calls


def test_bad_generation_settings_are_refused_before_the_model_runs(tmp_path):
    model = tiny_model("llama", num_layers=2)
    calls = counting(model)
    for settings in (dataclasses.replace(SETTINGS, temperature=0.0), dataclasses.replace(SETTINGS, seq_len=1)):
        with pytest.raises(InvalidInputError):
            generate(model, 4, settings, cache=tmp_path / "x.pt")
    with pytest.raises(InvalidInputError, match="prompts"):
        teacher = lambda: contextlib.nullcontext(model)  # noqa: E731
        unprompted = dataclasses.replace(SETTINGS, start_token=None)
        generate_sequences(teacher, [torch.tensor([1, 2])], 4, unprompted, tmp_path / "y.pt", progress_bar=False)
    assert calls == []
    with pytest.raises(InvalidInputError, match="heal_temperature"):
        GradMAPConfig(pruning_ratio=0.25, heal_temperature=-1.0)


def _text_file(tmp_path, byte_tokenizer) -> str:
    path = tmp_path / "documents.txt"
    path.write_text("\n\n".join(f"Document number {index} says something about topic {index}." for index in range(20)))
    return str(path)


def test_generated_and_corpus_text_come_in_equal_parts(tmp_path, byte_tokenizer):
    model = tiny_model("llama", num_layers=2, vocab_size=VOCAB_SIZE)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(f"word{index}" for index in range(3000)))
    config = small_config(
        dataset=_text_file(tmp_path, byte_tokenizer),
        heal_dataset=f"generated+{corpus}",
        heal_tokens=10 * 16,
        heal_seq_len=16,
        heal_validation_sequences=4,
        heal_autocast=False,
    )
    teacher = lambda: contextlib.nullcontext(model)  # noqa: E731
    settings = HealSettings.from_config(config)
    text = heal_sequences(None, byte_tokenizer, settings, teacher, tmp_path / "cache.pt", progress_bar=False)
    generated_only = heal_sequences(
        None, byte_tokenizer, dataclasses.replace(settings, heal_dataset="generated"), teacher, tmp_path / "cache.pt"
    )
    assert text.train_ids.shape == (10, 16) and text.validation_ids.shape == (4, 16)
    assert text.generation_seconds > 0 and "generated" in text.source and str(corpus) in text.source
    corpus_rows = [row for row in text.train_ids if "word" in byte_tokenizer.decode(row)]
    assert len(corpus_rows) == 5  # half of the training sequences are corpus windows
    shared = {tuple(row.tolist()) for row in generated_only.train_ids} | {
        tuple(r.tolist()) for r in generated_only.validation_ids
    }
    assert sum(tuple(row.tolist()) in shared for row in text.train_ids) == 5  # the other half, the dense model's text
    from optimum_gradmap.distillation import teacher_targets

    for ids, targets in ((text.train_ids, text.train_targets), (text.validation_ids, text.validation_targets)):
        again = teacher_targets(model, ids, 4, progress_bar=False)  # each row's targets, in the rows' order
        torch.testing.assert_close(targets.log_probs, again.log_probs, rtol=1e-4, atol=1e-4)
    with pytest.raises(InvalidInputError, match="dense model"):
        heal_sequences(None, byte_tokenizer, settings)


def test_prune_heals_on_the_dense_model_s_own_text_and_counts_its_time(tmp_path, byte_tokenizer):
    model = peaked_model()
    config = small_config(
        num_samples=16, dataset=_text_file(tmp_path, byte_tokenizer), heal_dataset="generated", heal_tokens=32 * 16,
        heal_lr=1e-3, **HEAL,
    )  # fmt: skip
    pruner = GradMAPPruner(config, model, tokenizer=byte_tokenizer, progress_bar=False)
    result = pruner.prune(model, random_ids(16, 16), heal_text_cache=tmp_path / "cache.pt")
    assert (tmp_path / "cache.pt").is_file()
    assert result.heal.dataset.startswith("generated") and result.heal.generation_seconds > 0
    assert result.heal.seconds >= result.heal.generation_seconds + result.heal.teacher_seconds
    cached = torch.load(tmp_path / "cache.pt", weights_only=True)["input_ids"]  # the held-out sequences first
    assert result.heal.validation_sha256 == calibration_sha256(cached[:8])
    assert result.heal.train_sha256 == calibration_sha256(cached[8 : 8 + 32])  # it trained on the cached text
    assert result.heal.steps == result.heal.num_steps == 8


class FakeClock:
    """`time.perf_counter` that moves only when a model runs: `cost` seconds per forward pass of a watched model."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def watch(self, model: torch.nn.Module, cost: float) -> None:
        model.register_forward_hook(lambda *args: setattr(self, "now", self.now + cost))


def _auto_heal(monkeypatch, budget: float, slow_down: float = 1.0, warm_up: float = 0.0, checkpoint=None, interrupt_at: int = 0):
    """A `heal_tokens="auto"` heal of a tiny pruned model with a teacher beside it, on a fake clock: each forward pass
    of the student costs 1 s, the teacher's 2 s; `slow_down` makes the measured step that much faster than the real
    one (a device that slows down after the measurement); `interrupt_at` > 0 stops the heal by Ctrl-C in its step of
    that number."""
    from optimum_gradmap.heal import budget as heal_budget
    from optimum_gradmap.heal import heal_stage
    from optimum_gradmap.heal import loop as heal_loop
    from optimum_gradmap.surgery import remove_layers

    clock = FakeClock()
    monkeypatch.setattr(heal_loop.time, "perf_counter", clock)
    teacher_model = tiny_model("llama", num_layers=4)
    with torch.no_grad():
        teacher_model.lm_head.weight.mul_(30)
    student = copy.deepcopy(teacher_model)
    remove_layers(student, [2, 3])
    clock.watch(student, 1.0)
    clock.watch(teacher_model, 2.0)
    measure = heal_budget.measure_heal_costs

    def measured(*args, **kwargs):
        costs = measure(*args, **kwargs)
        return dataclasses.replace(costs, step_seconds=costs.step_seconds / slow_down)

    monkeypatch.setattr(heal_budget, "measure_heal_costs", measured)
    losses = heal_loop.distillation_loss
    calls = []

    def loss(*args, **kwargs):  # the measurement's two steps, then the heal's first ones, `warm_up` s slower each
        calls.append(1)
        if 2 < len(calls) <= 2 + heal_loop.REFIT_AFTER_STEPS:
            clock.now += warm_up
        if interrupt_at and len(calls) == 2 + interrupt_at:
            raise KeyboardInterrupt
        return losses(*args, **kwargs)

    monkeypatch.setattr(heal_loop, "distillation_loss", loss)
    monkeypatch.setattr(heal_budget, "distillation_loss", loss)
    config = small_config(
        heal_tokens="auto", heal_seq_len=16, heal_validation_sequences=4, heal_batch_size=4, heal_check_every=2,
        heal_autocast=False, heal_lr=1e-3,
    )  # fmt: skip
    start = clock()
    result = heal_stage(
        student,
        lambda: contextlib.nullcontext(teacher_model),
        HealSettings.from_config(config),
        None,
        PrunedLayout((0, 1), 4),
        data=random_ids(400, 16, seed=1),
        stage1_seconds=budget,
        checkpoint=checkpoint,
    )
    return result, clock() - start


def test_auto_tokens_fill_the_stage1_time_from_the_measured_costs(monkeypatch):
    result, elapsed = _auto_heal(monkeypatch, budget=200.0)
    # The measurement: 7 forward passes of the student (7 s). Then per step of 4 sequences: the student's forward (1 s),
    # the teacher's pass over them (2 s), a check every 2 steps (one forward over the 4 held-out sequences, 1 s): 3.5
    # s. Once: the teacher's pass over the held-out sequences (2 s) and the first check (1 s): (200 - 7 - 3) / 3.5 = 54
    # whole steps.
    assert result.budget_seconds == 200.0
    assert result.budget_tokens == 54 * 4 * 16 and result.steps == result.num_steps == 54
    assert not result.stopped_at_budget and elapsed <= 200.0
    assert result.seconds == pytest.approx(elapsed)
    assert "chose" in result.summary()


def test_auto_tokens_stop_within_the_time_given_when_the_steps_are_slower_than_measured(monkeypatch):
    result, elapsed = _auto_heal(monkeypatch, budget=200.0, slow_down=3.0)
    assert result.stopped_at_budget and result.steps < result.num_steps
    assert elapsed <= 200.0 and elapsed >= 195.0  # the schedule, fitted after the first steps, uses the time left
    assert result.kl_curve[-1][0] == result.trained_tokens  # the last state was checked before it stopped
    assert result.best_kl <= min(kl for _, kl in result.kl_curve)


def test_auto_tokens_fill_the_time_when_the_first_steps_are_slower(monkeypatch):
    # the heal's first 5 steps take 4 s more each (a warm-up): a schedule fitted to them alone would stop early
    result, elapsed = _auto_heal(monkeypatch, budget=200.0, warm_up=4.0)
    assert result.stopped_at_budget and elapsed <= 200.0
    assert elapsed >= 195.0  # refitted at the checks from the steps after the first ones: the time is used


def test_auto_tokens_need_a_stage1_time(monkeypatch):
    from optimum_gradmap.heal import heal_stage

    model = tiny_model("llama", num_layers=2)
    config = small_config(heal_tokens="auto", heal_seq_len=16, heal_validation_sequences=4, heal_autocast=False)
    settings, teacher = HealSettings.from_config(config), lambda: contextlib.nullcontext(model)
    with pytest.raises(InvalidInputError, match="Stage 1"):
        heal_stage(model, teacher, settings, None, PrunedLayout.unpruned(2), data=random_ids(40, 16))
    assert GradMAPConfig(pruning_ratio=0.25, heal_tokens="auto").heal_tokens == "auto"
    with pytest.raises(InvalidInputError, match="heal_tokens"):
        GradMAPConfig(pruning_ratio=0.25, heal_tokens="many")


def test_the_targets_kept_while_generating_are_the_teacher_pass_s():
    from optimum_gradmap.distillation import teacher_targets

    model = tiny_model("llama", num_layers=2)
    generated = generate(model, 6)
    again = teacher_targets(model, generated.input_ids, 4, progress_bar=False)
    assert generated.targets.indices.shape == again.indices.shape == (6, 11, again.indices.shape[-1])
    torch.testing.assert_close(generated.targets.log_probs, again.log_probs, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(generated.targets.rest_log_prob, again.rest_log_prob, rtol=1e-4, atol=1e-4)
    assert (generated.targets.indices == again.indices).float().mean() > 0.99  # ties may order differently


def test_an_interrupted_auto_heal_resumes_with_the_tokens_it_chose(monkeypatch, tmp_path):
    """The resumed run would time the heal anew and choose another number of tokens, which its checkpoint refuses: it
    trains the count the interrupted run chose (the checkpoint keeps it) from where it stopped."""
    checkpoint = tmp_path / "heal.pt"
    first, _ = _auto_heal(monkeypatch, budget=200.0, checkpoint=checkpoint, interrupt_at=6)
    assert first.interrupted and first.steps == 5 and first.budget_tokens == 54 * 4 * 16
    monkeypatch.undo()
    again, _ = _auto_heal(monkeypatch, budget=100.0, checkpoint=checkpoint)  # timed anew: about 25 steps would fit
    assert again.budget_tokens == first.budget_tokens and again.budget_basis == "resumed"
    assert again.kl_curve[:3] == first.kl_curve[:3] and again.steps > 4  # the checks to step 4, then on from there
    assert "interrupted run it resumed" in again.summary()


def test_auto_tokens_after_given_layers_are_sized_by_stage_1s_predicted_time(monkeypatch):
    """`layers_to_prune` (or `--cut-from`) runs no Stage 1 round: its removal takes milliseconds, which sized the heal
    to one batch. The heal is sized by the plan's time for a Stage 1 that removes as many layers, and says so."""
    from optimum_gradmap.pipeline import heal as heal_step

    predicted, predict = [], heal_step.predicted_stage1_seconds

    def recorded(*args, **kwargs):
        predicted.append(predict(*args, **kwargs))
        return predicted[-1]

    monkeypatch.setattr(heal_step, "predicted_stage1_seconds", recorded)
    model = peaked_model(num_layers=4)
    config = small_config(
        num_layers_to_prune=None, layers_to_prune=[1, 2], heal_tokens="auto", heal_lr=1e-3, **HEAL
    )  # fmt: skip
    pruner = GradMAPPruner(config, model, progress_bar=False)
    result = pruner.prune(model, random_ids(16, 16), heal_data=random_ids(8000, 16, seed=1))
    assert len(predicted) == 1 and predicted[0] > result.timings["stage1"]
    assert result.heal.budget_basis == "predicted" and result.heal.budget_seconds == pytest.approx(predicted[0])
    assert "Stage 1's predicted time" in result.heal.summary()


def test_the_heal_command_sizes_auto_tokens_after_given_layers_by_the_same_prediction(monkeypatch, tmp_path):
    """`optimum-gradmap heal` on a checkpoint pruned with `layers_to_prune` plans Stage 1 from the teacher's folder,
    through the prediction the pruner uses; with a measured Stage 1 it keeps the measured time."""
    from optimum_gradmap.commands import heal as heal_command
    from optimum_gradmap.pipeline import heal as heal_step

    predicted, predict = [], heal_step.predicted_stage1_seconds

    def recorded(dense_model, config, num_removed, parameter):
        predicted.append((dense_model, parameter.dtype, predict(dense_model, config, num_removed, parameter)))
        return predicted[-1][-1]

    monkeypatch.setattr(heal_step, "predicted_stage1_seconds", recorded)
    teacher = tiny_model("llama", num_layers=4)
    teacher.save_pretrained(tmp_path / "teacher")
    config = small_config(num_layers_to_prune=None, layers_to_prune=[1, 2], heal_tokens="auto")
    report = {"timings": {"stage1": 0.01}, "removed_layers": [1, 2]}
    seconds, basis = heal_command._stage1_seconds(report, config, str(tmp_path / "teacher"), teacher)
    assert basis == "predicted" and predicted == [(str(tmp_path / "teacher"), torch.float32, seconds)] and seconds > 0.01
    measured = dataclasses.replace(config, layers_to_prune=None, num_layers_to_prune=2)
    assert heal_command._stage1_seconds(report, measured, str(tmp_path / "teacher"), teacher) == (0.01, "measured")
    assert len(predicted) == 1


def _stage1_refused(*args, **kwargs):
    raise AssertionError("Stage 1 ran")


@pytest.mark.parametrize("heal", [dict(heal_tokens="auto"), dict(heal_tokens=64, heal_dataset="generated")])
def test_a_heal_checkpoint_from_another_run_is_refused_before_stage_1_with_auto_tokens_or_generated_text(
    tmp_path, byte_tokenizer, monkeypatch, heal
):
    """Their sequences are made when the heal starts: the settings, the processes and the model's layers are compared
    before Stage 1 all the same."""
    monkeypatch.setattr("optimum_gradmap.pipeline.stage1.remove_by_importance", _stage1_refused)
    checkpoint = tmp_path / "heal.pt"
    torch.save({"fingerprint": {"trainable": "all", "learning_rate": 1.0}}, checkpoint)
    model = peaked_model()
    state = copy.deepcopy(model.state_dict())
    config = small_config(dataset=_text_file(tmp_path, byte_tokenizer), heal_lr=1e-3, **HEAL, **heal)
    pruner = GradMAPPruner(config, model, tokenizer=byte_tokenizer, progress_bar=False)
    with pytest.raises(InvalidInputError, match="comes from another run .*Refused before pruning started"):
        pruner.prune(model, random_ids(16, 16), heal_checkpoint=checkpoint)
    assert all(torch.equal(value, state[name]) for name, value in model.state_dict().items())


def test_prompts_longer_than_the_heal_sequences_are_refused_before_any_work(tmp_path, byte_tokenizer, monkeypatch):
    monkeypatch.setattr("optimum_gradmap.pipeline.stage1.remove_by_importance", _stage1_refused)
    model = peaked_model()
    state = copy.deepcopy(model.state_dict())
    seq_len = 4
    settings = {**HEAL, "heal_seq_len": seq_len}
    config = small_config(dataset=_text_file(tmp_path, byte_tokenizer), heal_dataset="generated", heal_tokens=64, **settings)
    with pytest.raises(InvalidInputError, match=f"heal_seq_len={seq_len} is shorter than the dense model's prompts"):
        GradMAPPruner(config, model, tokenizer=byte_tokenizer, progress_bar=False).prune(model, random_ids(16, 16))
    assert all(torch.equal(value, state[name]) for name, value in model.state_dict().items())

    def teacher():
        raise AssertionError("the teacher ran")

    short = dataclasses.replace(SETTINGS, seq_len=3)  # 4-token prompts
    with pytest.raises(InvalidInputError, match="more than the 3"):
        generate_sequences(teacher, documents(), 4, short, tmp_path / "cache.pt", progress_bar=False)
