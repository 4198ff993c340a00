"""Fidelity to the dense model (Dutta et al., "Accuracy is Not All You Need", NeurIPS 2024): the next-token KL
divergence checked against `torch.nn.functional.kl_div` on full logits, flips and answer changes against hand counts,
the paired comparison of two models' flips, the JSON round trip (old files still load), the command line, the pruning
report and model card, the KL divergence shared by two processes, and the flips split by the dense model's margins
(issue 65: quartiles cut within each task that add up to the pooled flips, the confident questions by hand, a
question confident relative to its own task, ties, older records)."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from optimum_gradmap import GradMAPPruner, load_report
from optimum_gradmap.cli import main
from optimum_gradmap.errors import InvalidInputError
from optimum_gradmap.evaluation import (
    EvaluationResult,
    FlipsResult,
    MarginFlips,
    PerplexityResult,
    QuestionRecord,
    TaskFlips,
    TaskResult,
    ZeroShotResult,
    answer_shares,
    compare_zero_shot,
    evaluate,
    evaluation_segments,
    flips,
    load_evaluation_segments,
    margin_quartiles,
    margin_quartiles_by_task,
    next_token_kl,
    next_token_kl_per_segment,
    question_margin,
)
from optimum_gradmap.evaluation.zero_shot import scored_split_and_source

from .conftest import random_ids, small_config, tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The evaluation each process of tests/integration/fidelity_worker.py runs: 5 segments over 2 processes, shares of 2 and 3.
SHARED_EVALUATION = dict(perplexity_datasets=("offline:wikipedia",), max_segments=5, batch_size=2, progress_bar=False)


def changed_copy(model: torch.nn.Module, layer: int = 1, scale: float = 4.0) -> torch.nn.Module:
    """A copy of `model` whose decoder layer `layer` has every weight matrix multiplied by `scale`."""
    changed = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in changed.model.layers[layer].parameters():
            if parameter.dim() == 2:
                parameter.mul_(scale)
    return changed


def _peaked_model(num_layers: int = 3) -> torch.nn.Module:
    """A tiny Llama whose next-token distributions are far from uniform (its head's weights scaled up), so that a
    changed layer moves them measurably."""
    model = tiny_model("llama", num_layers=num_layers)
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    return model


def _kl_by_kl_div(model: torch.nn.Module, reference: torch.nn.Module, segments: torch.LongTensor) -> torch.Tensor:
    """Each segment's mean KL(p_reference || p_model) over its predicted positions, from both models' full logits in one
    pass each, with `torch.nn.functional.kl_div` (input: the model's log-probabilities, target: the reference's)."""
    with torch.no_grad():
        log_q = torch.log_softmax(model(segments).logits[:, :-1].float(), dim=-1)
        log_p = torch.log_softmax(reference(segments).logits[:, :-1].float(), dim=-1)
    return F.kl_div(log_q, log_p, reduction="none", log_target=True).sum(dim=-1).double().mean(dim=-1)


# ------------------------------------------------------------------------------------------ KL divergence
def test_the_kl_divergence_of_a_model_from_itself_is_zero():
    model = _peaked_model()
    segments = random_ids(5, 16)
    alone = next_token_kl(model, model, segments, batch_size=2, progress_bar=False)
    assert alone.mean == 0.0 and alone.stderr == 0.0
    twin = next_token_kl(model, copy.deepcopy(model), segments, batch_size=3, progress_bar=False)
    assert twin.mean == pytest.approx(0.0, abs=1e-7) and twin.stderr == pytest.approx(0.0, abs=1e-7)
    assert (twin.num_segments, twin.num_predicted_tokens) == (5, 5 * 15)


def test_the_kl_divergence_from_a_model_with_one_changed_layer_is_kl_div_on_full_logits_with_its_standard_error():
    reference = _peaked_model()
    model = changed_copy(reference)
    model.train()  # run in eval mode, and its mode given back
    segments = random_ids(7, 16, seed=3)
    found = next_token_kl(model, reference, segments, batch_size=3, progress_bar=False)  # batches of 3, 3 and 1
    assert model.training and not reference.training
    model.eval()
    per_segment = _kl_by_kl_div(model, reference, segments)
    assert found.mean > 0.01  # a real divergence, not rounding
    assert found.mean == pytest.approx(float(per_segment.mean()), rel=1e-5)
    sd = math.sqrt(sum((value - per_segment.mean().item()) ** 2 for value in per_segment.tolist()) / 6)
    assert found.stderr == pytest.approx(sd / math.sqrt(7), rel=1e-5)
    assert (found.num_segments, found.num_predicted_tokens) == (7, 7 * 15)
    torch.testing.assert_close(
        next_token_kl_per_segment(model, reference, segments, batch_size=2, progress_bar=False), per_segment, rtol=1e-5, atol=0
    )
    # the direction: KL(p_reference || p_model), not KL(p_model || p_reference)
    reverse = next_token_kl(reference, model, segments, progress_bar=False)
    assert reverse.mean == pytest.approx(float(_kl_by_kl_div(reference, model, segments).mean()), rel=1e-5)
    assert reverse.mean != pytest.approx(found.mean, rel=1e-3)  # close (KL is nearly symmetric here), but not the same
    assert torch.is_grad_enabled()


def test_the_kl_divergence_refuses_other_vocabularies_and_segments_with_nothing_to_predict():
    model = tiny_model("llama", num_layers=2)
    other = tiny_model("llama", num_layers=2, vocab_size=300)
    with pytest.raises(InvalidInputError, match="the same vocabulary"):
        next_token_kl(model, other, random_ids(2, 8), progress_bar=False)
    with pytest.raises(InvalidInputError, match="at least one segment of two tokens"):
        next_token_kl(model, model, random_ids(2, 1), progress_bar=False)


def test_evaluate_reports_the_kl_divergence_beside_every_perplexity_on_the_same_segments(byte_tokenizer):
    reference = tiny_model("llama", num_layers=3)
    model = changed_copy(reference)
    settings = dict(segment_length=32, max_segments=3, batch_size=2, progress_bar=False)
    result = evaluate(
        model, byte_tokenizer, ("offline:wikipedia", "offline:web_text"), **settings, reference_model=reference,
        reference_model_name="dense",
    )  # fmt: skip
    for entry in result.perplexities:
        segments = load_evaluation_segments(entry.dataset, byte_tokenizer, 32, 3)
        expected = float(_kl_by_kl_div(model, reference, segments).mean())
        assert entry.kl_to_reference == pytest.approx(expected, rel=1e-5) and entry.kl_to_reference > 0
        assert entry.kl_stderr == pytest.approx(float(next_token_kl(model, reference, segments, progress_bar=False).stderr))
        assert entry.reference == "dense"
    assert "offline:web_text perplexity" in result.summary() and "KL from dense" in result.summary()
    plain = evaluate(model, byte_tokenizer, ("offline:wikipedia",), **settings)
    assert plain.perplexities[0].kl_to_reference is None and "KL" not in plain.summary()


# ------------------------------------------------------------------------------------------ flips
def _answered(answers: dict[str, list[tuple[int, int]]], split: str = "validation", source: str = "test") -> ZeroShotResult:
    """A result from each question's (chosen answer, right answer), ids 0, 1, ..."""
    tasks = []
    for task, questions in answers.items():
        records = [
            QuestionRecord(i, [0.0, -1.0, -2.0], choice, None, gold, int(choice == gold))
            for i, (choice, gold) in enumerate(questions)
        ]
        acc = sum(record.acc for record in records) / len(records)
        tasks.append(TaskResult(task, split, source, len(records), acc, split_size=len(records), questions=records))
    result = ZeroShotResult(tasks=tasks)
    result.update_averages()
    return result


def _right(answers: dict[str, list[int]]) -> ZeroShotResult:
    """A result from right (1) / wrong (0) answers: a right one chooses 0, a wrong one 1 (the right answer is 0)."""
    return _answered({task: [(0 if right else 1, 0) for right in flags] for task, flags in answers.items()})


REFERENCE_ANSWERS = {
    "piqa": [(0, 0), (1, 0), (0, 0), (1, 0), (2, 0)],  # right, wrong, right, wrong, wrong
    "arc_easy": [(0, 1), (1, 1), (1, 1)],  # wrong, right, right
}
MODEL_ANSWERS = {
    "piqa": [
        (1, 0),
        (0, 0),
        (0, 0),
        (2, 0),
        (2, 0),
    ],  # right -> wrong, wrong -> right, same, wrong -> wrong with another answer, same
    "arc_easy": [(0, 1), (0, 1), (1, 1)],  # same, right -> wrong, same
}


def test_flips_count_right_wrong_changes_apart_from_answer_changes():
    found = flips(_answered(MODEL_ANSWERS), _answered(REFERENCE_ANSWERS), names=("pruned", "dense"))
    piqa, arc_easy = found.tasks
    assert (piqa.task, piqa.num_questions, piqa.flips, piqa.answer_changes) == ("piqa", 5, 2 / 5, 3 / 5)
    assert (piqa.right_to_wrong, piqa.wrong_to_right) == (1, 1)
    assert (arc_easy.num_questions, arc_easy.flips, arc_easy.answer_changes) == (3, 1 / 3, 1 / 3)
    assert (arc_easy.right_to_wrong, arc_easy.wrong_to_right) == (1, 0)
    pooled = found.pooled
    assert (pooled.task, pooled.num_questions, pooled.flips, pooled.answer_changes) == ("pooled", 8, 3 / 8, 4 / 8)
    assert (pooled.right_to_wrong, pooled.wrong_to_right, found.reference) == (2, 1, "dense")
    # the accuracies are the same on piqa (2 of 5 right each), yet 2 of 5 answers flipped
    assert _answered(MODEL_ANSWERS).tasks[0].acc == _answered(REFERENCE_ANSWERS).tasks[0].acc
    itself = flips(_answered(REFERENCE_ANSWERS), _answered(REFERENCE_ANSWERS))
    assert itself.pooled.flips == itself.pooled.answer_changes == 0
    # tasks paired by name, in the model's order; the reference may answer more questions
    reordered = flips(_answered(MODEL_ANSWERS), _answered(dict(reversed(list(REFERENCE_ANSWERS.items())))), ("pruned", "dense"))
    assert reordered == found
    fewer = flips(_answered({"piqa": MODEL_ANSWERS["piqa"][:2]}), _answered(REFERENCE_ANSWERS))
    assert (fewer.pooled.num_questions, fewer.pooled.flips) == (2, 1.0)


def test_flips_refuse_another_split_or_source_missing_questions_and_results_without_records():
    model = _answered(MODEL_ANSWERS)
    for field_name in ("split", "source"):
        other = _answered(REFERENCE_ANSWERS)
        setattr(other.tasks[1], field_name, "elsewhere")
        with pytest.raises(InvalidInputError, match=rf"arc_easy: pruned was scored on {field_name} .*, dense on 'elsewhere'"):
            flips(model, other, names=("pruned", "dense"))
    short = _answered({"piqa": REFERENCE_ANSWERS["piqa"][:3], "arc_easy": REFERENCE_ANSWERS["arc_easy"]})
    with pytest.raises(InvalidInputError, match="dense has no answers to 2 of the 5 piqa questions pruned was evaluated on"):
        flips(model, short, names=("pruned", "dense"))
    with pytest.raises(InvalidInputError, match="dense has no answers to 3 of the 3 arc_easy questions"):
        flips(model, _answered({"piqa": REFERENCE_ANSWERS["piqa"]}), names=("pruned", "dense"))
    no_records = ZeroShotResult(tasks=[TaskResult("piqa", "validation", "test", 5, 0.4)])
    with pytest.raises(InvalidInputError, match="dense has no per-question records for piqa"):
        flips(model, no_records, names=("pruned", "dense"))


def test_compare_tests_two_models_flips_against_the_same_reference():
    dense = _right({"piqa": [1, 1, 1, 0, 0, 1], "arc_easy": [1, 0, 1, 1]})
    a = _right({"piqa": [1, 0, 1, 0, 1, 1], "arc_easy": [1, 0, 1, 1]})  # flips: piqa [0,1,0,0,1,0], arc_easy none
    b = _right({"piqa": [0, 0, 1, 1, 1, 1], "arc_easy": [0, 1, 1, 1]})  # flips: piqa [1,1,0,1,1,0], arc_easy [1,1,0,0]
    comparison = compare_zero_shot(a, b, reference=dense, names=("a", "b", "dense"))
    piqa, arc_easy = comparison.flips
    assert (piqa.task, piqa.num_questions, piqa.flips_a, piqa.flips_b) == ("piqa", 6, 2 / 6, 4 / 6)
    assert (piqa.only_a, piqa.only_b, piqa.difference) == (0, 2, pytest.approx(2 / 6))
    differences = [1, 0, 0, 1, 0, 0]  # b's flags - a's, by hand
    mean = 2 / 6
    assert piqa.stderr == pytest.approx(math.sqrt(sum((d - mean) ** 2 for d in differences) / 5 / 6))
    assert piqa.p_value == pytest.approx(2 * 0.5**2)  # McNemar: 2 * P(X <= 0), X ~ Binomial(2, 1/2)
    assert (arc_easy.flips_a, arc_easy.flips_b, arc_easy.only_b, arc_easy.p_value) == (0.0, 0.5, 2, pytest.approx(0.5))
    pooled = comparison.pooled_flips
    assert (pooled.num_questions, pooled.flips_a, pooled.flips_b, pooled.only_a, pooled.only_b) == (10, 0.2, 0.6, 0, 4)
    assert pooled.p_value == pytest.approx(2 * 0.5**4)
    # the flips of each model agree with `flips`, and the table prints them
    assert pooled.flips_b == flips(b, dense).pooled.flips and pooled.flips_a == flips(a, dense).pooled.flips
    summary = comparison.summary()
    assert "flips against dense" in summary and "flips A" in summary
    without = compare_zero_shot(a, b)
    assert without.flips == [] and without.pooled_flips is None and "flips against" not in without.summary()


# ------------------------------------------------------------------------------------------ JSON
def test_the_new_fields_round_trip_through_json_and_old_files_still_load(tmp_path):
    found = flips(_answered(MODEL_ANSWERS), _answered(REFERENCE_ANSWERS), names=("pruned", "dense"))
    perplexity = PerplexityResult("offline:wikipedia", "non-overlapping 32-token segments", 32, 3, 93, 12.5, 0.25, 0.01, "dense")
    result = EvaluationResult("pruned", perplexities=[perplexity], zero_shot=_answered(MODEL_ANSWERS), flips=found)
    result.to_json(str(tmp_path / "new.json"))
    again = EvaluationResult.from_json(str(tmp_path / "new.json"))
    assert again == result and again.flips == found and isinstance(again.flips, FlipsResult)
    assert again.perplexities[0].kl_to_reference == 0.25 and again.perplexities[0].reference == "dense"
    written = json.loads((tmp_path / "new.json").read_text())
    assert written["flips"]["pooled"]["flips"] == 3 / 8 and written["perplexities"][0]["kl_stderr"] == 0.01
    assert "flips:" in result.summary() and "piqa: 40.00% of 5 questions flipped against dense" in result.summary()
    # a file written before these fields existed
    old = {
        "model": "old",
        "perplexities": [
            {k: v for k, v in written["perplexities"][0].items() if k not in ("kl_to_reference", "kl_stderr", "reference")}
        ],
        "zero_shot": None,
        "speed": None,
    }
    loaded = EvaluationResult.from_dict(old)
    assert loaded.flips is None and loaded.perplexities[0].kl_to_reference is None and loaded.perplexities[0].perplexity == 12.5
    assert "KL" not in loaded.summary()
    without = EvaluationResult("m", perplexities=[PerplexityResult("d", "p", 32, 3, 93, 12.5)])
    assert EvaluationResult.from_dict(json.loads(without.to_json())) == without


# ------------------------------------------------------------------------------------------ evaluate with tasks
@pytest.fixture(scope="module")
def task_tokenizer():
    from .conftest import byte_tokenizer

    tokenizer = byte_tokenizer.__wrapped__()
    tokenizer.eos_token = "!"  # lm-eval needs an end-of-text token (a byte here)
    return tokenizer


def test_evaluate_counts_flips_against_the_dense_evaluation_and_checks_it_before_running(task_tokenizer, monkeypatch):
    dense_model = tiny_model("llama", num_layers=3, max_position_embeddings=1024)
    pruned_model = changed_copy(dense_model, scale=-3.0)
    settings = dict(tasks=["piqa", "arc_easy"], task_limit=6, task_data="offline", progress_bar=False)
    dense = evaluate(dense_model, task_tokenizer, (), **settings, model_name="dense")
    result = evaluate(pruned_model, task_tokenizer, (), **settings, model_name="pruned", reference=dense)
    assert result.flips == flips(result.zero_shot, dense.zero_shot, names=("pruned", "dense"))
    assert result.flips.reference == "dense" and result.flips.pooled.num_questions == 12
    assert evaluate(dense_model, task_tokenizer, (), **settings, reference=dense).flips.pooled.flips == 0.0

    # checked before anything runs: no perplexity, no task is scored
    def forbidden(*args, **kwargs):
        raise AssertionError("ran before the reference was checked")

    monkeypatch.setattr("optimum_gradmap.evaluation.suite.perplexity", forbidden)
    monkeypatch.setattr("optimum_gradmap.evaluation.suite.zero_shot_accuracy", forbidden)
    datasets = ("offline:wikipedia",)
    with pytest.raises(InvalidInputError, match="dense has no answers to 4 of the piqa questions this evaluation scores"):
        evaluate(pruned_model, task_tokenizer, datasets, **{**settings, "task_limit": 10}, reference=dense)
    with pytest.raises(InvalidInputError, match="dense has no per-question records for boolq"):
        evaluate(pruned_model, task_tokenizer, datasets, **{**settings, "tasks": ["boolq"]}, reference=dense)
    hub_split, hub_source = scored_split_and_source("arc_easy", "hub")
    with pytest.raises(
        InvalidInputError, match=f"arc_easy: dense was scored on split 'validation' .* this evaluation scores split '{hub_split}'"
    ):
        evaluate(
            pruned_model, task_tokenizer, datasets, **{**settings, "task_data": "hub", "tasks": ["arc_easy"]}, reference=dense
        )
    with pytest.raises(InvalidInputError, match="no `tasks` are run"):
        evaluate(pruned_model, task_tokenizer, datasets, progress_bar=False, reference=dense)
    perplexities_only = EvaluationResult("dense", perplexities=[])
    with pytest.raises(InvalidInputError, match="dense has no zero-shot results to count flips against"):
        evaluate(pruned_model, task_tokenizer, datasets, **settings, reference=perplexities_only)
    assert hub_source != dense.zero_shot.tasks[0].source


# ------------------------------------------------------------------------------------------ command line
def test_evaluate_command_with_a_reference_model_writes_the_kl_divergence(tiny_checkpoint, byte_tokenizer, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    dense = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    changed = changed_copy(dense)
    changed.save_pretrained(tmp_path / "changed")
    byte_tokenizer.save_pretrained(tmp_path / "changed")
    output = tmp_path / "evaluation.json"
    argv = ["evaluate", str(tmp_path / "changed"), "--perplexity-datasets", "offline:wikipedia", "--segment-length", "32"]
    assert main([*argv, "--max-segments", "3", "--reference-model", tiny_checkpoint, "-o", str(output), "-q"]) == 0
    assert f"KL from {tiny_checkpoint}:" in capsys.readouterr().out
    (entry,) = json.loads(output.read_text())["perplexities"]
    segments = load_evaluation_segments("offline:wikipedia", byte_tokenizer, 32, 3)
    assert entry["kl_to_reference"] == pytest.approx(float(_kl_by_kl_div(changed, dense, segments).mean()), rel=1e-5)
    assert entry["reference"] == tiny_checkpoint and entry["kl_stderr"] > 0


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--reference", "REFERENCE"], "--reference REFERENCE gives the zero-shot flips, and no --tasks are run"),
        (["--tasks", "piqa", "--reference", "MISSING"], "--reference MISSING: no such file"),
        (["--tasks", "piqa", "--task-data", "offline", "--reference", "REFERENCE"], "has no zero-shot results to count flips"),
        (["--perplexity-datasets", "--speed", "--reference-model", "MODEL"], "--perplexity-datasets is empty"),
        (["--reference-model", "./no/such/folder"], "./no/such/folder is not a folder"),
    ],
)
def test_evaluate_command_refuses_a_reference_it_cannot_use_before_loading_the_model(
    tiny_checkpoint, tmp_path, capsys, monkeypatch, extra, message
):
    from optimum_gradmap.loading import ModelLoading

    def forbidden(*args, **kwargs):
        raise AssertionError("a model was loaded before the reference was checked")

    monkeypatch.setattr(ModelLoading, "load", forbidden)
    reference = tmp_path / "reference.json"
    EvaluationResult("dense", perplexities=[PerplexityResult("d", "p", 32, 3, 93, 12.5)]).to_json(str(reference))
    names = {"REFERENCE": str(reference), "MISSING": str(tmp_path / "missing.json"), "MODEL": tiny_checkpoint}
    argv = ["evaluate", tiny_checkpoint, "--perplexity-datasets", "offline:wikipedia", *[names.get(arg, arg) for arg in extra]]
    assert main([*argv, "-q"]) == 2
    assert (
        message.replace("REFERENCE", str(reference)).replace("MISSING", str(tmp_path / "missing.json")) in capsys.readouterr().err
    )


def test_compare_command_prints_and_writes_the_flips_against_the_reference(tmp_path, capsys):
    dense = _right({"piqa": [1, 1, 1, 0, 0, 1]})
    paths = {}
    for name, answers in (("dense", [1, 1, 1, 0, 0, 1]), ("a", [1, 0, 1, 0, 1, 1]), ("b", [0, 0, 1, 1, 1, 1])):
        paths[name] = str(tmp_path / f"{name}.json")
        EvaluationResult(name, zero_shot=_right({"piqa": answers})).to_json(paths[name])
    output = tmp_path / "comparison.json"
    assert main(["compare", paths["a"], paths["b"], "--reference", paths["dense"], "-o", str(output), "-q"]) == 0
    assert "flips against dense" in capsys.readouterr().out
    written = json.loads(output.read_text())
    assert written["pooled_flips"]["flips_b"] == pytest.approx(4 / 6) and written["flips"][0]["only_b"] == 2
    assert written["pooled_flips"]["flips_a"] == flips(_right({"piqa": [1, 0, 1, 0, 1, 1]}), dense).pooled.flips


# ------------------------------------------------------------------------------------------ report and card
def _card_rows(folder) -> dict[str, list[str]]:
    card = (folder / "README.md").read_text(encoding="utf-8")
    rows = [line for line in card.splitlines() if line.startswith("| ") and not line.startswith("| |")]
    return {cells[0]: cells[1:] for cells in ([cell.strip() for cell in row.strip("|").split("|")] for row in rows)}


def test_the_report_and_the_model_card_show_the_kl_divergence_and_the_flips_against_dense(tmp_path, capsys):
    pruner = GradMAPPruner(small_config(num_layers_to_prune=1, compensation=False), progress_bar=False)
    pruner.prune(tiny_model("llama", num_layers=4), random_ids(8, 16))
    perplexity = PerplexityResult(
        "offline:wikipedia", "non-overlapping 32-token segments", 32, 3, 93, 12.5, 0.1234, 0.0056, "dense"
    )
    dense_perplexity = PerplexityResult("offline:wikipedia", "non-overlapping 32-token segments", 32, 3, 93, 10.0)
    model, reference = _answered(MODEL_ANSWERS), _answered(REFERENCE_ANSWERS)
    # the evaluation carries no flips: the report counts them from both evaluations' records
    pruner.save_pretrained(
        tmp_path / "counted",
        evaluation=EvaluationResult("pruned", perplexities=[perplexity], zero_shot=model),
        dense_evaluation=EvaluationResult("dense", perplexities=[dense_perplexity], zero_shot=reference),
    )
    report = load_report(tmp_path / "counted")
    assert report["flips_against_dense"] == flips(model, reference, names=("pruned", "dense")).to_dict()
    assert report["evaluation"]["perplexities"][0]["kl_to_reference"] == 0.1234
    rows = _card_rows(tmp_path / "counted")
    kl_row = rows["offline:wikipedia KL divergence from dense (non-overlapping 32-token segments)"]
    assert kl_row == ["", "0.1234 ± 0.0056"]
    assert rows["zero-shot flips against dense (2 tasks, 8 questions)"] == [
        "",
        "37.50% (2 right → wrong, 1 wrong → right; answer changed on 50.00%)",
    ]
    card = (tmp_path / "counted" / "README.md").read_text(encoding="utf-8")
    assert "Accuracy is Not All You Need" in card
    assert main(["inspect", str(tmp_path / "counted")]) == 0
    printed = capsys.readouterr().out
    assert "KL from dense: 0.1234 +/- 0.0056 nats/token" in printed and "zero-shot flips:     37.50% of 8 questions" in printed
    # the dense evaluation without zero-shot records: the flips the evaluation carries
    carried = flips(model, reference, names=("pruned", "the dense model"))
    pruner.save_pretrained(
        tmp_path / "carried",
        evaluation=EvaluationResult("pruned", zero_shot=model, flips=carried),
        dense_evaluation=EvaluationResult("dense", perplexities=[dense_perplexity]),
    )
    assert load_report(tmp_path / "carried")["flips_against_dense"] == carried.to_dict()
    assert "zero-shot flips against the dense model (2 tasks, 8 questions)" in _card_rows(tmp_path / "carried")
    # neither: no row, no note
    pruner.save_pretrained(tmp_path / "none", evaluation=EvaluationResult("pruned", perplexities=[dense_perplexity]))
    assert load_report(tmp_path / "none")["flips_against_dense"] is None
    assert "Accuracy is Not All You Need" not in (tmp_path / "none" / "README.md").read_text(encoding="utf-8")


# ------------------------------------------------------------------------------------------ two processes
def test_two_processes_share_the_segments_of_the_kl_divergence_and_each_gets_all_of_it(tmp_path):
    from tests.distributed_cases import evaluation_inputs

    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += [os.path.join(ROOT, "tests", "integration", "fidelity_worker.py"), str(tmp_path)]
    environment = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    completed = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in (0, 1)]
    # 5 segments: each process ran its share (2 and 3) through each model once, for the perplexity and the KL divergence
    assert [found["rows"] for found in ranks] == [{"model": 2, "reference": 2}, {"model": 3, "reference": 3}]
    assert ranks[0]["evaluation"] == ranks[1]["evaluation"]
    model, tokenizer = evaluation_inputs()
    reference = changed_copy(model)
    alone = evaluate(model, tokenizer, **SHARED_EVALUATION, reference_model=reference)
    (shared,), (single,) = ranks[0]["evaluation"]["perplexities"], alone.perplexities
    assert shared["kl_to_reference"] == pytest.approx(single.kl_to_reference, rel=1e-6) and single.kl_to_reference > 0
    assert shared["kl_stderr"] == pytest.approx(single.kl_stderr, rel=1e-6)
    assert shared["perplexity"] == pytest.approx(single.perplexity, rel=1e-6)
    segments = load_evaluation_segments(*SHARED_EVALUATION["perplexity_datasets"], tokenizer, 128, 5)
    assert single.kl_to_reference == pytest.approx(float(_kl_by_kl_div(model, reference, segments).mean()), rel=1e-5)


def test_segments_cut_from_a_stream_give_the_kl_divergence_of_each(byte_tokenizer):
    """`evaluation_segments` and the KL divergence agree on what a segment is: the divergence of one segment alone is
    its entry in the per-segment means."""
    reference = _peaked_model(2)
    model = changed_copy(reference)
    segments = evaluation_segments(random_ids(1, 100, seed=5).view(-1), segment_length=20)
    per_segment = next_token_kl_per_segment(model, reference, segments, batch_size=4, progress_bar=False)
    for index in range(segments.shape[0]):
        alone = next_token_kl(model, reference, segments[index : index + 1], progress_bar=False)
        assert alone.mean == pytest.approx(float(per_segment[index]), rel=1e-5) and alone.stderr is None


def test_perplexity_and_kl_from_one_pass_equal_the_two_measured_apart():
    from optimum_gradmap.evaluation import next_token_kl, perplexity, perplexity_and_kl

    from .conftest import random_ids, tiny_model

    model, reference = tiny_model("llama", num_layers=4, seed=1), tiny_model("llama", num_layers=4, seed=2)
    segments = random_ids(5, 16, seed=3)
    value, kl = perplexity_and_kl(model, reference, segments, batch_size=2, progress_bar=False)
    assert value == perplexity(model, segments, batch_size=2, progress_bar=False)  # the same sums, in the same order
    assert kl == next_token_kl(model, reference, segments, batch_size=2, progress_bar=False)


# ------------------------------------------------------------------------------------------ which flips (issue 65)
def _margined(questions: list[tuple[float | None, bool, int]], choices: int = 3) -> list[QuestionRecord]:
    """Records from each question's (margin, right, gold): the chosen answer (gold if right, else the next one) has
    log-likelihood 0, the next best -margin, the others -5; no log-likelihoods for a margin of `None`."""
    records = []
    for i, (margin, right, gold) in enumerate(questions):
        choice = gold if right else (gold + 1) % choices
        loglikelihoods = [-5.0] * choices
        loglikelihoods[choice], loglikelihoods[(choice + 1) % choices] = 0.0, -(margin or 0.0)
        records.append(QuestionRecord(i, [] if margin is None else loglikelihoods, choice, None, gold, int(right)))
    return records


def _margined_result(tasks: dict[str, list[tuple[float | None, bool, int]]], choices: int = 3) -> ZeroShotResult:
    result = ZeroShotResult(
        tasks=[
            TaskResult(task, "validation", "test", len(records), sum(r.acc for r in records) / len(records), questions=records)
            for task, records in ((task, _margined(questions, choices)) for task, questions in tasks.items())
        ]
    )
    result.update_averages()
    return result


# The dense model's margins and right/wrong, and the model's right/wrong, question by question. Each task's margins,
# sorted, and its quartile edges (linear interpolation): piqa 0.1 0.5 | 2.0 3.0, edges 0.1, 0.4, 1.25, 2.25, 3.0;
# arc_easy 0.2 1.0 | 1.5 4.0, edges 0.2, 0.8, 1.25, 2.125, 4.0 (both medians 1.25).
DENSE_MARGINS = {
    "piqa": [(0.1, True, 0), (2.0, True, 1), (0.5, False, 0), (3.0, True, 2)],
    "arc_easy": [(1.0, True, 0), (0.2, True, 1), (4.0, False, 2), (1.5, True, 0)],
}
MODEL_RIGHT = {
    "piqa": [False, False, True, True],  # right -> wrong (Q1), right -> wrong (Q3, confident), wrong -> right (Q2), same (Q4)
    "arc_easy": [True, False, True, True],  # same (Q2), right -> wrong (Q1), wrong -> right (Q4, confident), same (Q3)
}


def _model_of(dense: dict, right: dict, choices: int = 3) -> ZeroShotResult:
    """The model's records: the dense questions' golds, right or wrong as `right` says, no log-likelihoods."""
    return _margined_result(
        {task: [(None, r, gold) for (_, _, gold), r in zip(dense[task], right[task])] for task in dense}, choices
    )


def test_flips_split_by_the_dense_margin_add_up_to_the_pooled_flips_and_match_hand_counts():
    dense, model = _margined_result(DENSE_MARGINS), _model_of(DENSE_MARGINS, MODEL_RIGHT)
    found = flips(model, dense, names=("pruned", "dense"))
    pooled = found.pooled
    assert (pooled.num_questions, pooled.flips, pooled.right_to_wrong, pooled.wrong_to_right) == (8, 5 / 8, 3, 2)
    assert list(found.margin_edges) == ["piqa", "arc_easy"]
    assert found.margin_edges["piqa"] == pytest.approx([0.1, 0.4, 1.25, 2.25, 3.0])
    assert found.margin_edges["arc_easy"] == pytest.approx([0.2, 0.8, 1.25, 2.125, 4.0])
    import numpy as np

    for task, questions in DENSE_MARGINS.items():  # each task's own quantiles, numpy's default
        margins = [m for m, _, _ in questions]
        assert found.margin_edges[task] == pytest.approx(list(np.quantile(margins, [0, 0.25, 0.5, 0.75, 1.0])))
    assert all(entry.cut == "within task" for entry in found.by_margin)
    # quartile q pools both tasks' quartile q
    counts = [(e.quartile, e.num_questions, e.num_flips, e.flips, e.right_to_wrong, e.wrong_to_right) for e in found.by_margin]
    assert counts == [(1, 2, 2, 1.0, 2, 0), (2, 2, 1, 0.5, 0, 1), (3, 2, 1, 0.5, 1, 0), (4, 2, 1, 0.5, 0, 1)]
    # the quartiles add up to the pooled questions and flips
    assert sum(e.num_questions for e in found.by_margin) == pooled.num_questions
    assert sum(e.num_flips for e in found.by_margin) == round(pooled.flips * pooled.num_questions)
    assert sum(e.right_to_wrong for e in found.by_margin) == pooled.right_to_wrong
    assert sum(e.wrong_to_right for e in found.by_margin) == pooled.wrong_to_right
    # confident: margin above its task's median 1.25 (piqa 2.0 and 3.0, arc_easy 4.0 and 1.5): 2 flips, one each way
    confident = found.confident
    assert (confident.task, confident.num_questions, confident.flips, confident.answer_changes) == ("confident", 4, 0.5, 0.5)
    assert (confident.right_to_wrong, confident.wrong_to_right) == (1, 1)
    assert confident.num_questions == found.by_margin[2].num_questions + found.by_margin[3].num_questions
    lines = found.summary_lines()
    assert "confident questions (dense's margin above its task's median): 50.00% of 4 flipped (1 right -> wrong" in lines[-3]
    assert "within each task" in lines[-2] and "within-task Q1 100.00% of 2; within-task Q2 50.00% of 2" in lines[-2]
    assert lines[-1].endswith("per task (nats): piqa 0.1, 0.4, 1.25, 2.25, 3; arc_easy 0.2, 0.8, 1.25, 2.12, 4")
    # the margins are the dense model's: swapping the roles moves the split (the model has no log-likelihoods)
    assert flips(dense, model).by_margin is None


def test_ties_at_the_median_stay_below_it_and_every_question_is_in_one_quartile():
    # margins 0.5, 1, 1, 1, 1, 2, 3, 4: the median is 1 (a tie of four), the first quartile's edge 1 too
    dense = _margined_result({"piqa": [(m, True, 0) for m in (0.5, 1.0, 1.0, 1.0, 1.0, 2.0, 3.0, 4.0)]})
    # flips on two tied questions (margin 1) and on the margin-3 question
    model = _model_of({"piqa": [(None, True, 0)] * 8}, {"piqa": [True, False, False, True, True, True, False, True]})
    found = flips(model, dense)
    assert [(e.num_questions, e.num_flips) for e in found.by_margin] == [(5, 2), (0, 0), (1, 0), (2, 1)]
    assert found.by_margin[1].flips == 0.0 and found.margin_edges["piqa"][1:3] == [1.0, 1.0]
    assert (found.confident.num_questions, found.confident.right_to_wrong, found.confident.flips) == (3, 1, pytest.approx(1 / 3))
    # every margin tied (0, the two best answers equal): all in the first quartile, none confident
    tied = _margined_result({"piqa": [(0.0, True, 0)] * 4})
    assert [e.num_questions for e in flips(tied, tied).by_margin] == [4, 0, 0, 0]
    assert flips(tied, tied).confident == TaskFlips("confident", 0, 0.0, 0.0, 0, 0)


def test_records_without_log_likelihoods_give_no_margin_split():
    old = _margined_result({"piqa": [(None, True, 0), (None, False, 1)]})
    found = flips(old, old)
    assert found.by_margin is None and found.confident is None and found.margin_edges is None
    assert found.pooled.num_questions == 2
    assert not any("confident" in line or "quartile" in line for line in found.summary_lines())
    one_answer = _margined_result({"piqa": [(1.0, True, 0)]})
    one_answer.tasks[0].questions[0].loglikelihoods = [0.0]
    assert question_margin(one_answer.tasks[0].questions[0]) is None
    mixed = _margined_result(DENSE_MARGINS)
    mixed.tasks[1].questions[2].loglikelihoods = []  # one older record among the pooled questions
    assert flips(_model_of(DENSE_MARGINS, MODEL_RIGHT), mixed).by_margin is None
    with pytest.raises(InvalidInputError, match="No margins"):
        margin_quartiles([])
    with pytest.raises(InvalidInputError, match="No margins"):
        margin_quartiles_by_task([], [])
    with pytest.raises(InvalidInputError, match="one task per margin"):
        margin_quartiles_by_task(["piqa"], [1.0, 2.0])


def test_a_question_is_confident_relative_to_its_own_task_not_to_the_pooled_margins():
    # HellaSwag's margins are large, WinoGrande's small (SmolLM2-135M's dense medians: 13.2 and 0.80 nats): the
    # pooled median (5.2) would put every HellaSwag question above it and no WinoGrande one
    dense = _margined_result(
        {
            "hellaswag": [(10.0, True, 0), (12.0, True, 0), (14.0, True, 0), (16.0, True, 0)],
            "winogrande": [(0.1, True, 0), (0.2, True, 0), (0.3, True, 0), (0.4, True, 0)],
        },
        choices=2,  # two answers: the other one is the next best, margins above 5 nats kept
    )
    # the model flips HellaSwag's 12-nat question (below its task's median 13) and WinoGrande's 0.4-nat one (above 0.25)
    right = {"hellaswag": [True, False, True, True], "winogrande": [True, True, True, False]}
    model = _model_of({task: [(None, True, 0)] * 4 for task in right}, right, choices=2)
    found = flips(model, dense)
    assert found.margin_edges["hellaswag"] == pytest.approx([10.0, 11.5, 13.0, 14.5, 16.0])
    assert found.margin_edges["winogrande"] == pytest.approx([0.1, 0.175, 0.25, 0.325, 0.4])
    # each quartile holds one question of each task; HellaSwag's flip is in Q2, WinoGrande's in Q4
    assert [(e.num_questions, e.num_flips) for e in found.by_margin] == [(2, 0), (2, 1), (2, 0), (2, 1)]
    assert sum(e.num_flips for e in found.by_margin) == found.pooled.right_to_wrong + found.pooled.wrong_to_right == 2
    # confident: 14 and 16 nats on HellaSwag, 0.3 and 0.4 on WinoGrande; the one flip among them is WinoGrande's
    assert (found.confident.num_questions, found.confident.right_to_wrong, found.confident.flips) == (4, 1, 0.25)
    # cut over the pooled margins (median 5.2), WinoGrande's 0.4 would be in the second quartile, HellaSwag's 12 in the
    # third (confident)
    tasks = ["hellaswag"] * 4 + ["winogrande"] * 4
    margins = [10.0, 12.0, 14.0, 16.0, 0.1, 0.2, 0.3, 0.4]
    assert margin_quartiles(margins)[1] == [3, 3, 4, 4, 1, 1, 2, 2]
    assert margin_quartiles_by_task(tasks, margins)[1] == [1, 2, 3, 4, 1, 2, 3, 4]
    # the paired comparison cuts the same way
    comparison = compare_zero_shot(model, dense, reference=dense)
    assert comparison.margin_edges == found.margin_edges
    assert (comparison.confident_flips.num_questions, comparison.confident_flips.flips_a) == (4, 0.25)
    assert [entry.flips_a for entry in comparison.flips_by_margin] == [0.0, 0.5, 0.0, 0.5]


def test_the_margin_split_round_trips_through_json_and_old_dicts_still_load(tmp_path):
    dense, model = _margined_result(DENSE_MARGINS), _model_of(DENSE_MARGINS, MODEL_RIGHT)
    found = flips(model, dense, names=("pruned", "dense"))
    assert FlipsResult.from_dict(json.loads(json.dumps(found.to_dict()))) == found
    assert isinstance(FlipsResult.from_dict(found.to_dict()).by_margin[0], MarginFlips)
    result = EvaluationResult("pruned", zero_shot=model, flips=found)
    result.to_json(str(tmp_path / "pruned.json"))
    again = EvaluationResult.from_json(str(tmp_path / "pruned.json"))
    assert again.flips == found and again.flips.confident.num_questions == 4
    assert "flips: confident questions (dense's margin above its task's median): 50.00% of 4" in again.summary()
    old = {key: value for key, value in found.to_dict().items() if key not in ("by_margin", "confident", "margin_edges")}
    loaded = FlipsResult.from_dict(old)
    assert loaded.by_margin is None and loaded.confident is None and loaded.pooled == found.pooled
    # a split cut over the pooled margins (quartiles with a low and high edge, no `cut`) is left out
    pooled_cut = found.to_dict()
    pooled_cut.pop("margin_edges")
    for entry in pooled_cut["by_margin"]:
        entry.pop("cut")
        entry.update(low=0.0, high=1.0)
    loaded = FlipsResult.from_dict(pooled_cut)
    assert (loaded.by_margin, loaded.confident, loaded.margin_edges) == (None, None, None)


def test_answer_shares_give_each_answers_share():
    questions = [(1.0, True, 1), (1.0, False, 1), (1.0, True, 1), (1.0, True, 0)]
    boolq = _margined_result({"boolq": questions}, choices=2)  # choices 1, 0 (wrong: the other answer), 1, 0
    assert answer_shares(boolq, "boolq") == {0: 0.5, 1: 0.5}
    three = _margined_result({"boolq": questions}, choices=3)  # choices 1, 2, 1, 0
    assert answer_shares(three, "boolq") == {0: 0.25, 1: 0.5, 2: 0.25}
    two = ZeroShotResult(tasks=[TaskResult("boolq", "validation", "test", 3, 1.0, questions=[
        QuestionRecord(i, [], choice, None, choice, 1) for i, choice in enumerate((1, 1, 0))
    ])])  # fmt: skip
    assert answer_shares(two, "boolq") == {0: pytest.approx(1 / 3), 1: pytest.approx(2 / 3)}
    with pytest.raises(InvalidInputError, match="no per-question records for piqa"):
        answer_shares(boolq, "piqa")


def test_compare_splits_both_models_flips_by_the_reference_margin(tmp_path, capsys):
    dense = _margined_result(DENSE_MARGINS)
    a = _model_of(DENSE_MARGINS, MODEL_RIGHT)
    b = _model_of(DENSE_MARGINS, {"piqa": [True, True, False, True], "arc_easy": [True, True, False, False]})  # 1 flip
    comparison = compare_zero_shot(a, b, reference=dense, names=("a", "b", "dense"))
    assert comparison.margin_edges == flips(a, dense).margin_edges
    assert comparison.margin_edges["arc_easy"] == pytest.approx([0.2, 0.8, 1.25, 2.125, 4.0])
    assert [entry.task for entry in comparison.flips_by_margin] == [f"within-task Q{q}" for q in range(1, 5)]
    for entry, expected in zip(comparison.flips_by_margin, flips(a, dense).by_margin):
        assert (entry.num_questions, entry.flips_a) == (expected.num_questions, expected.flips)
    # b flips only arc_easy's margin-1.5 question (confident, its task's Q3)
    assert [entry.flips_b for entry in comparison.flips_by_margin] == [0.0, 0.0, 0.5, 0.0]
    confident = comparison.confident_flips
    assert (confident.num_questions, confident.flips_a, confident.flips_b) == (4, 0.5, 0.25)
    assert (confident.only_a, confident.only_b) == (2, 1)
    summary = comparison.summary()
    assert "within-task Q4" in summary and "confident: margin above its task's median" in summary
    assert "edges per task: piqa 0.1, 0.4, 1.25, 2.25, 3; arc_easy 0.2, 0.8, 1.25, 2.12, 4" in summary
    assert compare_zero_shot(a, b, reference=_model_of(DENSE_MARGINS, MODEL_RIGHT)).confident_flips is None
    # the command prints them
    paths = {}
    for name, result in (("dense", dense), ("a", a), ("b", b)):
        paths[name] = str(tmp_path / f"{name}.json")
        EvaluationResult(name, zero_shot=result).to_json(paths[name])
    assert main(["compare", paths["a"], paths["b"], "--reference", paths["dense"], "-q"]) == 0
    printed = capsys.readouterr().out
    assert "within-task Q1" in printed and "confident" in printed


def test_the_model_card_and_inspect_show_the_confident_flips(tmp_path, capsys):
    pruner = GradMAPPruner(small_config(num_layers_to_prune=1, compensation=False), progress_bar=False)
    pruner.prune(tiny_model("llama", num_layers=4), random_ids(8, 16))
    dense, model = _margined_result(DENSE_MARGINS), _model_of(DENSE_MARGINS, MODEL_RIGHT)
    pruner.save_pretrained(
        tmp_path / "card",
        evaluation=EvaluationResult("pruned", zero_shot=model),
        dense_evaluation=EvaluationResult("dense", zero_shot=dense),
    )
    assert load_report(tmp_path / "card")["flips_against_dense"]["confident"]["num_questions"] == 4
    rows = _card_rows(tmp_path / "card")
    assert rows["zero-shot flips on confident questions (dense margin above its task's median)"] == [
        "",
        "50.00% of 4 (1 right → wrong, 1 wrong → right)",
    ]
    assert rows["zero-shot flips by within-task quartile of dense margin (Q1: smallest)"] == [
        "",
        "Q1 100.0% of 2, Q2 50.0% of 2, Q3 50.0% of 2, Q4 50.0% of 2",
    ]
    card = (tmp_path / "card" / "README.md").read_text()
    assert "confident questions are those whose margin is above their own task's median" in card
    assert main(["inspect", str(tmp_path / "card")]) == 0
    assert "confident flips:     50.00% of 4 questions (dense margin above its task's median)" in capsys.readouterr().out
    # flips without the split (older records): no confident row
    old = _margined_result({task: [(None, r, g) for _, r, g in questions] for task, questions in DENSE_MARGINS.items()})
    pruner.save_pretrained(
        tmp_path / "old",
        evaluation=EvaluationResult("pruned", zero_shot=model),
        dense_evaluation=EvaluationResult("dense", zero_shot=old),
    )
    assert not any("confident" in name for name in _card_rows(tmp_path / "old"))


def _heal_record(heal_benchmark) -> tuple[dict, ZeroShotResult, ZeroShotResult]:
    """A heal benchmark record of a dense and a `stage1` row on DENSE_MARGINS' tasks and BoolQ, not counted yet, and
    the two rows' full results."""
    dense_result, model_result = _margined_result(DENSE_MARGINS), _model_of(DENSE_MARGINS, MODEL_RIGHT)
    boolq = {"boolq": [(1.0, True, 1), (2.0, True, 0), (3.0, False, 1), (4.0, True, 1)]}  # dense picks 1, 0, 0, 1
    dense_result.tasks.append(_margined_result(boolq, choices=2).tasks[0])
    model_result.tasks.append(_model_of(boolq, {"boolq": [True, True, True, True]}, choices=2).tasks[0])  # picks 1, 0, 1, 1

    def row(variant: str, result: ZeroShotResult) -> dict:
        perplexities = [{"perplexity": 10.0}, {"perplexity": 20.0}]
        zero_shot = {"answers": heal_benchmark.compact(result)}
        provenance = {"quiet": True, "commit": "0123456789"}
        return {
            "variant": variant,
            "evaluation": {"perplexities": perplexities, "zero_shot": zero_shot},
            "provenance": provenance,
        }

    record = {
        "model": "m", "ratio": 0.25, "selection": "gradmap", "protocol": "screening", "removed_layers": [1],
        "layers_from": "x", "calibration": "c", "calibration_sha256": "0" * 64,
        "rows": [row("dense", dense_result), row("stage1", model_result)],
    }  # fmt: skip
    return record, dense_result, model_result


def test_the_heal_benchmark_keeps_margins_counts_confident_flips_and_recounts_old_rows(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import heal as heal_benchmark

    record, dense_result, model_result = _heal_record(heal_benchmark)
    assert record["rows"][0]["evaluation"]["zero_shot"]["answers"]["piqa"]["margin"] == [0.1, 2.0, 0.5, 3.0]
    heal_benchmark.recount(record)
    dense, stage1 = record["rows"]
    # counted by the library from the full records: with BoolQ, and without (piqa and arc_easy alone)
    with_boolq = flips(model_result, dense_result)
    without = flips(_model_of(DENSE_MARGINS, MODEL_RIGHT), _margined_result(DENSE_MARGINS))
    assert stage1["confident_flips_without_boolq"] == dataclasses.asdict(without.confident)
    assert stage1["confident_flips"] == dataclasses.asdict(with_boolq.confident)
    # with BoolQ, cut within each task: BoolQ's margins 1, 2, 3, 4 (median 2.5) add 3 and 4 to the 4 confident
    # questions of piqa and arc_easy, and one flip (margin 3, wrong -> right): 3 flips among the 6
    assert (with_boolq.confident.num_questions, with_boolq.confident.flips) == (6, 0.5)
    assert with_boolq.margin_edges["boolq"] == pytest.approx([1.0, 1.75, 2.5, 3.25, 4.0])
    assert (dense["boolq_yes"], stage1["boolq_yes"]) == (0.5, 0.75) and "confident_flips" not in dense
    assert stage1["flips_without_boolq"]["flips"] == 0.625 and stage1["flips"]["flips"] == 0.5
    assert heal_benchmark.has_margins(dense)
    # a record from before the margins: counted again without the confident flips, which need the dense margins
    for kept in record["rows"]:
        for answers in kept["evaluation"]["zero_shot"]["answers"].values():
            del answers["margin"]
        for key in ("boolq_yes", "confident_flips", "confident_flips_without_boolq"):
            kept.pop(key, None)
    assert not heal_benchmark.has_margins(record["rows"][0])
    heal_benchmark.recount(record)
    assert "confident_flips" not in record["rows"][1] and record["rows"][1]["boolq_yes"] == 0.75


def test_the_heal_benchmark_counts_again_without_measuring(monkeypatch, tmp_path, capsys):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import heal as heal_benchmark

    record, dense_result, model_result = _heal_record(heal_benchmark)
    record["rows"][1]["confident_flips"] = {"flips": 0.9}  # a count from before: replaced
    path = tmp_path / "heal-m-0.25-gradmap-screening.json"
    path.write_text(json.dumps(record))
    monkeypatch.setattr(heal_benchmark, "RESULTS", str(tmp_path))
    monkeypatch.setattr(heal_benchmark, "layers_of", lambda *args: ([1], "x"))
    monkeypatch.setattr(heal_benchmark, "load_model", None)  # nothing is loaded, nothing measured
    monkeypatch.setattr(sys, "argv", ["heal.py", "--model", "m", "--ratio", "0.25", "--recount-only"])
    heal_benchmark.main()
    again = heal_benchmark.records.read(str(path))
    assert again["rows"][1]["confident_flips"] == dataclasses.asdict(flips(model_result, dense_result).confident)
    assert again["rows"][1]["flips"] == dataclasses.asdict(flips(model_result, dense_result).pooled)
    # every row keeps its answers (packed in the file); the margins only the dense row, which the others count against
    assert "question_ids" in json.loads(path.read_text())
    dense_answers, model_answers = (row["evaluation"]["zero_shot"]["answers"] for row in again["rows"])
    assert dense_answers == record["rows"][0]["evaluation"]["zero_shot"]["answers"]
    kept = record["rows"][1]["evaluation"]["zero_shot"]["answers"]
    assert model_answers == {task: {key: value[key] for key in ("doc_ids", "acc", "choice")} for task, value in kept.items()}
    assert "counted again, nothing measured" in capsys.readouterr().out


def test_the_heal_benchmark_s_answer_drift_compares_centred_log_likelihoods_question_by_question(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import heal as heal_benchmark

    mine = {
        "piqa": {"doc_ids": [0, 1, 7], "loglikelihoods": [[-1.0, -2.0], [-3.0, -3.0], [-1.0, -9.0]]},
        "boolq": {"doc_ids": [0], "loglikelihoods": [[-1.0, -5.0]]},
        "arc_easy": {"doc_ids": [0], "choice": [0]},  # a row from before the log-likelihoods: left out
    }
    dense = {
        "piqa": {"doc_ids": [1, 0], "loglikelihoods": [[-13.0, -14.0], [-5.0, -6.0]]},  # question 7: not scored
        "boolq": {"doc_ids": [0], "loglikelihoods": [[-1.0, -1.0]]},
        "arc_easy": {"doc_ids": [0], "loglikelihoods": [[-1.0, -2.0]]},
    }
    # piqa: question 0 differs by a shift only (0), question 1 by [-0.5, +0.5] (0.5); BoolQ's by [2, -2] (2.0)
    assert heal_benchmark.answer_drift(mine, dense, skip=("boolq",)) == pytest.approx(0.25)
    assert heal_benchmark.answer_drift(mine, dense) == pytest.approx((0 + 0.5 + 2.0) / 3)
    assert heal_benchmark.answer_drift({"arc_easy": mine["arc_easy"]}, dense) is None
