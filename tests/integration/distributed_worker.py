"""One process of the data-parallel check (tests/test_distributed.py): run under
`python -m torch.distributed.run --nproc-per-node 2 tests/integration/distributed_worker.py OUTPUT`.

Every process prunes the same tiny model on its share of the calibration sequences (gloo backend on
CPU) for every case of tests/distributed_cases.py; each rank writes what it found (removed layers,
Stage 1 scores, Stage 2 lambdas, logits of the pruned model) to OUTPUT/CASE/rank-R.json, and the
checkpoint is saved to OUTPUT/CASE/checkpoint (by rank 0 alone), so the test can check that all
processes agree with one another and with a single process. No process may gather Python objects
(`all_gather_object` pickles: the norm-in-the-loop fit sends its activations as tensors).

Then what happens when the main process fails, in OUTPUT/failures/rank-R.json: a save that fails on
rank 0 (its output is an existing file) must raise on every rank, none waiting for the others; and
`push_to_hub` must upload once, from rank 0, every rank getting its URL.

Then `prune --evaluate`'s perplexity, in OUTPUT/evaluation/rank-R.json: every rank must evaluate its share of
the segments (the rows its model ran) and get the perplexity of all of them. Last, in
OUTPUT/stage1-checkpoint/rank-R.json: a Stage 1 checkpoint that rank 0 cannot write must raise on every rank
(the others must not run on into the next round's collective and wait there for rank 0).
"""

from __future__ import annotations

import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from optimum_gradmap import GradMAPConfig, GradMAPPruner, distributed  # noqa: E402
from tests.conftest import use_float32_passes  # noqa: E402
from tests.distributed_cases import CASES, EVALUATION, case_heal_data, case_inputs, evaluation_inputs  # noqa: E402


def _forbidden(*args, **kwargs):
    raise AssertionError("all_gather_object pickles what it sends: gather tensors instead")


def main() -> None:
    use_float32_passes()
    output = sys.argv[1]
    # a rank left waiting for another (the failure this checks for) fails in minutes, not the default half hour
    torch.distributed.init_process_group(backend="gloo", timeout=datetime.timedelta(seconds=300))
    assert distributed.init_from_environment(), "run me with torchrun --nproc-per-node 2"
    torch.distributed.all_gather_object = _forbidden
    for case in CASES:
        folder = os.path.join(output, case)
        os.makedirs(folder, exist_ok=True)
        model, config, calibration_ids, probe_ids = case_inputs(case)
        result = GradMAPPruner(config, progress_bar=False).prune(model, calibration_ids, heal_data=case_heal_data(case))
        with torch.no_grad():
            logits = result.model(probe_ids).logits
        found = {
            "removed_layers": result.removed_layers,
            "scores": [{str(k): v for k, v in round_scores.items()} for round_scores in result.scores],
            "compensated_layers": result.compensated_layers,
            "compensation_lambda": {str(k): v for k, v in result.compensation.reg_lambda.items()},
            "logits": logits.flatten().tolist(),
            "world_size": distributed.world_size(),
            "heal_kl_curve": result.heal.kl_curve if result.heal is not None else None,
        }
        with open(os.path.join(folder, f"rank-{distributed.rank()}.json"), "w", encoding="utf-8") as file:
            json.dump(found, file)
        result.save_pretrained(os.path.join(folder, "checkpoint"))
    failures(os.path.join(output, "failures"), result)
    shared_evaluation(os.path.join(output, "evaluation"))
    stage1_checkpoint_failure(os.path.join(output, "stage1-checkpoint"))  # last: without the fix, the ranks part here
    torch.distributed.destroy_process_group()


def _write(folder: str, found: dict) -> None:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"rank-{distributed.rank()}.json"), "w", encoding="utf-8") as file:
        json.dump(found, file)


def shared_evaluation(folder: str) -> None:
    """`prune --evaluate`'s perplexity on each rank, with the rows of segments this rank's model ran."""
    from optimum_gradmap.pipeline import Evaluate, Run

    model, tokenizer = evaluation_inputs()
    rows = []
    model.register_forward_pre_hook(lambda module, args, kwargs: rows.append(kwargs["input_ids"].shape[0]), with_kwargs=True)
    run = Run(model, GradMAPConfig(pruning_ratio=0.25), tokenizer=tokenizer, progress_bar=False)
    result = Evaluate((EVALUATION["dataset"],), EVALUATION["max_segments"]).measure(run)
    _write(folder, {"evaluation": result.to_dict() if result is not None else None, "rows": sum(rows)})


def stage1_checkpoint_failure(folder: str) -> None:
    """A Stage 1 checkpoint that rank 0 cannot write (its folder is a file): what each rank raised."""
    os.makedirs(folder, exist_ok=True)
    blocked = os.path.join(folder, "a-file")
    if distributed.is_main_process():
        with open(blocked, "w") as file:
            file.write("in the way")
    distributed.barrier()
    model, config, calibration_ids, _ = case_inputs("gradmap_default_stage2")
    try:
        GradMAPPruner(config, progress_bar=False).prune(
            model, calibration_ids, stage1_checkpoint=os.path.join(blocked, "s1.json")
        )
        found = {"error": None}
    except Exception as error:  # noqa: BLE001
        found = {"error": f"{type(error).__name__}: {error}"}
    _write(folder, found)


def failures(folder: str, result) -> None:
    """A save that fails on the main process, and an upload: what each rank saw."""
    import optimum_gradmap.hub

    os.makedirs(folder, exist_ok=True)
    blocked = os.path.join(folder, "a-file")
    if distributed.is_main_process():
        with open(blocked, "w") as file:
            file.write("in the way")
    distributed.barrier()
    found = {}
    try:
        result.save_pretrained(blocked)  # rank 0: FileExistsError before it writes anything
    except Exception as error:  # noqa: BLE001
        found["save_error"] = f"{type(error).__name__}: {error}"
    uploads = []

    def upload_checkpoint(checkpoint_folder, repo_id, **kwargs):
        uploads.append(sorted(os.listdir(checkpoint_folder)))
        return f"https://huggingface.co/{repo_id}/commit/0"

    optimum_gradmap.hub.upload_checkpoint = upload_checkpoint
    found["url"] = result.push_to_hub("me/tiny-pruned")
    found["uploads"] = uploads
    with open(os.path.join(folder, f"rank-{distributed.rank()}.json"), "w", encoding="utf-8") as file:
        json.dump(found, file)


if __name__ == "__main__":
    main()
