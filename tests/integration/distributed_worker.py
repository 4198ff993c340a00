"""One process of the data-parallel check (tests/test_distributed.py): run under
`python -m torch.distributed.run --nproc-per-node 2 tests/integration/distributed_worker.py OUTPUT`.

Every process prunes the same tiny model on its share of the calibration sequences (gloo backend on
CPU) for every case of tests/distributed_cases.py; each rank writes what it found (removed layers,
Stage 1 scores, Stage 2 lambdas, logits of the pruned model) to OUTPUT/CASE/rank-R.json, and the
checkpoint is saved to OUTPUT/CASE/checkpoint (by rank 0 alone), so the test can check that all
processes agree with one another and with a single process.
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from optimum_gradmap import GradMAPPruner, distributed  # noqa: E402
from tests.distributed_cases import CASES, case_inputs  # noqa: E402


def main() -> None:
    output = sys.argv[1]
    assert distributed.init_from_environment(), "run me with torchrun --nproc-per-node 2"
    for case in CASES:
        folder = os.path.join(output, case)
        os.makedirs(folder, exist_ok=True)
        model, config, calibration_ids, probe_ids = case_inputs(case)
        result = GradMAPPruner(config, progress_bar=False).prune(model, calibration_ids)
        with torch.no_grad():
            logits = result.model(probe_ids).logits
        found = {
            "removed_layers": result.removed_layers,
            "scores": [{str(k): v for k, v in round_scores.items()} for round_scores in result.scores],
            "compensated_layers": result.compensated_layers,
            "compensation_lambda": {str(k): v for k, v in result.compensation_lambda.items()},
            "logits": logits.flatten().tolist(),
            "world_size": distributed.world_size(),
        }
        with open(os.path.join(folder, f"rank-{distributed.rank()}.json"), "w", encoding="utf-8") as file:
            json.dump(found, file)
        result.save_pretrained(os.path.join(folder, "checkpoint"))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
