"""Data-parallel calibration (optimum_gradmap.distributed): two processes on the gloo backend (CPU)
prune every case of tests/distributed_cases.py and must agree with each other and with one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from optimum_gradmap import GradMAPPruner, distributed
from optimum_gradmap.evaluation import evaluate
from tests.distributed_cases import CASES, EVALUATION, case_heal_data, case_inputs, evaluation_inputs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory) -> str:
    output = str(tmp_path_factory.mktemp("distributed"))
    run_two_processes([os.path.join(ROOT, "tests", "integration", "distributed_worker.py"), output])
    return output


def run_two_processes(arguments: list[str]) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node 2 ARGUMENTS` (gloo on CPU), which must succeed."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *arguments]
    environment = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    completed = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    return completed


@pytest.mark.parametrize("case", sorted(CASES))
def test_two_processes_prune_like_one(two_process_run, case):
    ranks = []
    for rank in (0, 1):
        with open(os.path.join(two_process_run, case, f"rank-{rank}.json"), encoding="utf-8") as file:
            ranks.append(json.load(file))
    assert [found["world_size"] for found in ranks] == [2, 2]
    assert ranks[0] == {**ranks[1], "world_size": 2}  # every process took the same decisions, bit for bit

    model, config, calibration_ids, probe_ids = case_inputs(case)
    single = GradMAPPruner(config, progress_bar=False).prune(model, calibration_ids, heal_data=case_heal_data(case))
    found = ranks[0]
    assert found["removed_layers"] == single.removed_layers
    assert found["compensated_layers"] == single.compensated_layers
    for shared_round, single_round in zip(found["scores"], single.scores):
        assert set(map(int, shared_round)) == set(single_round)
        for index, score in single_round.items():
            assert shared_round[str(index)] == pytest.approx(score, rel=1e-6, abs=1e-12)  # float32 sums, other order
    assert {int(k): v for k, v in found["compensation_lambda"].items()} == pytest.approx(single.compensation.reg_lambda, rel=1e-6)
    if single.heal is not None:  # data-parallel heal: the same steps as one process, and they lowered the held-out KL
        assert single.heal.best_tokens > 0
        assert [tokens for tokens, _ in found["heal_kl_curve"]] == [tokens for tokens, _ in single.heal.kl_curve]
        assert [kl for _, kl in found["heal_kl_curve"]] == pytest.approx([kl for _, kl in single.heal.kl_curve], rel=1e-4)
    with torch.no_grad():
        single_logits = single.model(probe_ids).logits
    torch.testing.assert_close(torch.tensor(found["logits"]).view_as(single_logits), single_logits, rtol=1e-5, atol=1e-5)

    # rank 0 alone saved, and the checkpoint is the pruned model
    checkpoint = os.path.join(two_process_run, case, "checkpoint")
    saved = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(saved(probe_ids).logits, torch.tensor(found["logits"]).view_as(single_logits))
    leftovers = [name for name in os.listdir(os.path.join(two_process_run, case)) if name.startswith(".")]
    assert leftovers == []


def test_a_failed_save_on_the_main_process_raises_on_every_rank_and_only_the_main_process_uploads(two_process_run):
    ranks = []
    for rank in (0, 1):
        with open(os.path.join(two_process_run, "failures", f"rank-{rank}.json"), encoding="utf-8") as file:
            ranks.append(json.load(file))
    assert ranks[0]["save_error"].startswith("FileExistsError") and "is a file, not a folder" in ranks[0]["save_error"]
    assert ranks[1]["save_error"].startswith("RuntimeError: The main process (rank 0) failed: FileExistsError")
    assert len(ranks[0]["uploads"]) == 1 and "pruning_report.json" in ranks[0]["uploads"][0]  # the whole checkpoint
    assert ranks[1]["uploads"] == []  # no upload of an empty folder from another rank
    assert ranks[0]["url"] == ranks[1]["url"] == "https://huggingface.co/me/tiny-pruned/commit/0"


def _ranks(folder: str) -> list[dict]:
    found = []
    for rank in (0, 1):
        with open(os.path.join(folder, f"rank-{rank}.json"), encoding="utf-8") as file:
            found.append(json.load(file))
    return found


def test_prune_evaluate_shares_the_segments_among_the_processes_and_each_gets_the_whole_perplexity(two_process_run):
    ranks = _ranks(os.path.join(two_process_run, "evaluation"))
    assert [found["rows"] for found in ranks] == [2, 3]  # 5 segments: each process ran its share, none waited idle
    assert ranks[0]["evaluation"] is not None and ranks[0]["evaluation"] == ranks[1]["evaluation"]
    model, tokenizer = evaluation_inputs()
    single = evaluate(model, tokenizer, [EVALUATION["dataset"]], max_segments=EVALUATION["max_segments"], progress_bar=False)
    (shared,), (alone,) = ranks[0]["evaluation"]["perplexities"], single.perplexities
    assert shared["num_segments"] == alone.num_segments == 5 and shared["protocol"] == alone.protocol
    assert shared["num_predicted_tokens"] == alone.num_predicted_tokens
    assert shared["perplexity"] == pytest.approx(alone.perplexity, rel=1e-6)  # float sums in another order


def test_a_stage1_checkpoint_the_main_process_cannot_write_raises_on_every_rank(two_process_run):
    ranks = _ranks(os.path.join(two_process_run, "stage1-checkpoint"))
    assert ranks[0]["error"] is not None and ranks[0]["error"].split(":")[0] in ("FileExistsError", "NotADirectoryError")
    assert ranks[1]["error"].startswith(f"RuntimeError: The main process (rank 0) failed: {ranks[0]['error']}")


def test_one_process_is_the_identity():
    ids = torch.arange(12).view(6, 2)
    assert not distributed.is_distributed()
    shared, first = distributed.shard(ids)
    assert first == 0 and torch.equal(shared, ids)
    assert distributed.mean_over_samples(lambda part: {0: float(part.sum())}, ids) == {0: float(ids.sum())}
    rows = torch.arange(6.0).view(3, 2)
    assert distributed.gather_rows(rows) is rows
    assert distributed.on_main_process(lambda: "done") == "done"


def test_command_line_under_torchrun(tiny_checkpoint, tmp_path):
    text = tmp_path / "calibration.txt"
    text.write_text(" ".join(f"sentence {i} of the calibration text, with some words in it." for i in range(200)))
    output = tmp_path / "pruned"
    arguments = ["-m", "optimum_gradmap.cli", "prune", tiny_checkpoint, "--num-layers-to-prune", "2", "--dataset", str(text)]
    arguments += ["--num-samples", "8", "--seq-len", "16", "--batch-size", "2", "--reg-lambda", "auto", "--output", str(output)]
    arguments += ["--evaluate", "offline:wikipedia", "--max-segments", "3"]  # shares of 1 and 2 segments
    completed = run_two_processes(arguments)
    assert completed.stdout.count("Removed layers") == 1  # the main process reports, once
    assert completed.stdout.count("dense model: offline:wikipedia perplexity") == 1
    with open(output / "pruning_report.json", encoding="utf-8") as file:
        report = json.load(file)
    assert len(report["removed_layers"]) == 2
    for evaluation in (report["dense_evaluation"], report["evaluation"]):
        assert [(e["dataset"], e["num_segments"]) for e in evaluation["perplexities"]] == [("offline:wikipedia", 3)]
    pruned = AutoModelForCausalLM.from_pretrained(str(output))
    assert pruned.config.num_hidden_layers == 4
    alone = evaluate(
        pruned, AutoTokenizer.from_pretrained(str(output)), ["offline:wikipedia"], max_segments=3, progress_bar=False
    )
    assert report["evaluation"]["perplexities"][0]["perplexity"] == pytest.approx(alone.perplexities[0].perplexity, rel=1e-5)


# --- Stage 2's held-out decisions over processes ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_process_stage2_run(tmp_path_factory) -> str:
    output = str(tmp_path_factory.mktemp("distributed_stage2"))
    run_two_processes([os.path.join(ROOT, "tests", "integration", "stage2_worker.py"), output])
    return output


def _stage2_ranks(output: str, case: str) -> list[dict]:
    ranks = []
    for rank in (0, 1):
        with open(os.path.join(output, case, f"rank-{rank}.json"), encoding="utf-8") as file:
            ranks.append(json.load(file))
    assert [found["world_size"] for found in ranks] == [2, 2]
    return ranks


def test_refinement_with_the_held_out_fold_on_one_process_means_over_every_held_out_sequence(two_process_stage2_run):
    """6 sequences on 2 processes: rank 0's share holds no held-out sequence. It adds nothing to the held-out loss, which
    is the mean over the one held-out sequence there is, as with one process."""
    from tests.integration.stage2_worker import stage2_case_inputs

    case = "refinement_held_out_on_one_process"
    ranks = _stage2_ranks(two_process_stage2_run, case)
    assert ranks[0] == ranks[1]  # every process took the same steps and kept the same one
    model, config, calibration_ids, _ = stage2_case_inputs(case)
    single = GradMAPPruner(config, progress_bar=False).prune(model, calibration_ids).compensation.refinement
    refined = ranks[0]["refinement"]
    assert refined["start"] == pytest.approx(single["start"], rel=1e-5)
    assert refined["refined"] <= refined["start"] and 0 <= refined["step"] <= config.refinement_steps


@pytest.mark.parametrize("case", ["validation_shares_of_two_and_three", "validation_share_of_none_on_rank_0"])
def test_each_process_validates_its_share_and_all_take_the_decision_of_one_process(two_process_stage2_run, case):
    """Validation perplexity under torchrun: each process scores its contiguous share of the validation sequences (none,
    for rank 0 with one sequence), the losses are combined over processes, and every process keeps or undoes the
    compensation alike, as one process on all the sequences does."""
    from tests.conftest import random_ids
    from tests.integration.stage2_worker import stage2_case_inputs

    ranks = _stage2_ranks(two_process_stage2_run, case)
    model, config, calibration_ids, validation_ids = stage2_case_inputs(case)
    num_validation = validation_ids.shape[0]
    for rank, found in enumerate(ranks):
        share = list(range(rank * num_validation // 2, (rank + 1) * num_validation // 2))
        assert found["validated_sequences"] == sorted(share * 2)  # with the compensation and without it
    assert ranks[0] == {**ranks[1], "validated_sequences": ranks[0]["validated_sequences"]}  # the same decision
    single = GradMAPPruner(config, progress_bar=False).prune(model, calibration_ids, validation_data=validation_ids)
    shared, alone = ranks[0]["validation"], single.compensation.validation
    assert shared["kept"] is alone["kept"] and ranks[0]["compensated_layers"] == single.compensated_layers
    assert shared["with"] == pytest.approx(alone["with"], rel=1e-5)
    assert shared["without"] == pytest.approx(alone["without"], rel=1e-5)
    with torch.no_grad():
        logits = single.model(random_ids(2, 16, seed=1)).logits
    torch.testing.assert_close(torch.tensor(ranks[0]["logits"]).view_as(logits), logits, rtol=1e-5, atol=1e-5)


# --- the heal stage under torchrun: Ctrl-C, resume, gradient buckets ----------------------------------------------------


@pytest.fixture(scope="module")
def two_process_heal_run(tmp_path_factory) -> str:
    output = str(tmp_path_factory.mktemp("distributed_heal"))
    run_two_processes([os.path.join(ROOT, "tests", "integration", "heal_worker.py"), output])
    return output


def _heal_case(output: str, case: str) -> tuple[list[dict], list[dict]]:
    """The JSON each rank wrote for `case`, and the weights it ended with (when it wrote them)."""
    ranks, weights = _ranks(os.path.join(output, case)), []
    for rank in (0, 1):
        path = os.path.join(output, case, f"rank-{rank}.pt")
        weights.append(torch.load(path, weights_only=True) if os.path.exists(path) else None)
    return ranks, weights


def _assert_same_weights(weights: list[dict]) -> None:
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0])


def test_gradients_are_averaged_in_buckets_with_one_all_reduce_each_and_the_per_tensor_result(two_process_heal_run):
    found = _ranks(os.path.join(two_process_heal_run, "buckets"))
    for rank in found:
        # float32 tensors of 60 + 28 + 32 + 176 bytes and a float64 one: two buckets by dtype, four of at most 64 bytes
        assert rank["default"]["all_reduces"] == [2] and rank["64_bytes"]["all_reduces"] == [4]
        assert all(rank["default"]["equal"]) and all(rank["64_bytes"]["equal"])  # bit for bit, a missing gradient as zero
        assert rank["default"]["stop"] is True and rank["64_bytes"]["stop"] is True  # rank 1's interrupt reached rank 0
    ranks, _ = _heal_case(two_process_heal_run, "uninterrupted")
    # a LoRA heal of 4 layers trains 56 tensors: one all-reduce per step, not 56
    assert [rank["all_reduces"] for rank in ranks] == [[1] * 6, [1] * 6]


@pytest.mark.parametrize("case", ["interrupt_on_rank_1", "sigint_on_rank_1"])
def test_ctrl_c_on_one_rank_stops_every_rank_after_the_same_step_with_the_same_weights(two_process_heal_run, case):
    ranks, weights = _heal_case(two_process_heal_run, case)
    assert [(rank["interrupted"], rank["steps"]) for rank in ranks] == [(True, 2), (True, 2)]  # the third step not taken
    assert ranks[0]["kl_curve"] == ranks[1]["kl_curve"]
    _assert_same_weights(weights)


def test_an_interrupt_in_rank_0s_checkpoint_write_stops_every_rank_and_rolls_nothing_back(two_process_heal_run):
    ranks, weights = _heal_case(two_process_heal_run, "interrupt_in_rank_0s_save")
    assert [rank["error"] for rank in ranks] == [None, None]  # rank 1 did not raise (and undo Stage 1 and 2)
    assert [(rank["interrupted"], rank["steps"]) for rank in ranks] == [(True, 4), (True, 4)]
    assert ranks[0]["saved_step"] == 2 and ranks[0]["left_over"] == ["heal.pt"]  # the last complete file, no .tmp
    _assert_same_weights(weights)


def test_every_rank_resumes_from_rank_0s_checkpoint_which_rank_1_cannot_see(two_process_heal_run):
    ranks, weights = _heal_case(two_process_heal_run, "resume_from_rank_0s_file")
    alone, uninterrupted = _heal_case(two_process_heal_run, "uninterrupted")
    assert not ranks[1]["rank_1_saw_a_file"]
    assert [(rank["interrupted"], rank["steps"]) for rank in ranks] == [(False, 6), (False, 6)]
    assert ranks[0]["kl_curve"] == ranks[1]["kl_curve"]
    assert [tokens for tokens, _ in ranks[0]["kl_curve"]] == [tokens for tokens, _ in alone[0]["kl_curve"]]
    assert [kl for _, kl in ranks[0]["kl_curve"]] == pytest.approx([kl for _, kl in alone[0]["kl_curve"]], rel=1e-5)
    _assert_same_weights(weights)
    for name, value in weights[0].items():
        torch.testing.assert_close(value, uninterrupted[0][name], rtol=1e-5, atol=1e-6)


# --- the heal's decisions under torchrun: one process decides, the others follow -------------------------------------


@pytest.fixture(scope="module")
def two_process_heal_decisions(tmp_path_factory) -> str:
    output = str(tmp_path_factory.mktemp("distributed_heal_decisions"))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += [os.path.join(ROOT, "tests", "integration", "heal_decisions_worker.py"), output]
    environment = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # ranks that part would wait in a collective: the process group's timeout (60 s) turns that into a failure
    completed = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    return output


def test_auto_heal_tokens_are_chosen_once_by_the_main_process_and_every_rank_trains_them(two_process_heal_decisions):
    ranks = _ranks(os.path.join(two_process_heal_decisions, "auto_tokens"))
    assert ranks[0]["budget_tokens"] == ranks[1]["budget_tokens"] > 0  # rank 1's own Stage 1 time did not count
    assert ranks[0]["steps"] == ranks[1]["steps"] >= 1
    assert ranks[0]["kl_curve"] == ranks[1]["kl_curve"]


def test_the_dense_models_text_is_generated_and_cached_by_the_main_process_alone(two_process_heal_decisions):
    ranks = _ranks(os.path.join(two_process_heal_decisions, "generated_text"))
    assert ranks[0]["sampled"] == 2 and ranks[0]["written"] == 1  # two batches of 4, one cache write
    assert ranks[1]["sampled"] == ranks[1]["written"] == 0  # rank 1 waited and got rank 0's text
    assert ranks[0]["digest"] == ranks[1]["digest"] and ranks[1]["rows"] == 8
    assert sorted(os.listdir(two_process_heal_decisions)).count("text-cache.pt") == 1
