"""One process of the data-parallel check of Stage 2's held-out decisions (tests/test_distributed.py): run under
`python -m torch.distributed.run --nproc-per-node 2 tests/integration/stage2_worker.py OUTPUT`.

For every case of `STAGE2_CASES` each process prunes the same tiny model on its share of the calibration sequences
(gloo backend on CPU) and writes to OUTPUT/CASE/rank-R.json what Stage 2 decided (the refinement's held-out losses,
the validation perplexities and whether the compensation was kept), the logits of the pruned model, and which
validation sequences this process ran through the model while validating (as indices into the validation set):
each process must score its own share of them, and all must take the same decision.
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from optimum_gradmap import GradMAPConfig, GradMAPPruner, distributed  # noqa: E402
from optimum_gradmap.compensation import stage2  # noqa: E402
from tests.conftest import random_ids, tiny_model, use_float32_passes  # noqa: E402

# A fixed lambda and the hidden-state selection: what is checked here is the refinement and the validation.
_FIT = dict(layers_to_prune=[3], reg_lambda=1e-3, compensation_selection="hidden_state", outlier_tokens="keep")
# case -> (config settings, calibration sequences, validation sequences or None)
STAGE2_CASES = {
    # 6 sequences on 2 processes: shares 0-2 and 3-5, and the held-out fold (j mod 4 == 3) is sequence 3 alone, on rank 1
    "refinement_held_out_on_one_process": (dict(_FIT, refinement_steps=10, refinement_lr=1e-2), 6, None),
    "validation_shares_of_two_and_three": (_FIT, 8, 5),
    "validation_share_of_none_on_rank_0": (_FIT, 8, 1),
}


def stage2_case_inputs(case: str) -> tuple[torch.nn.Module, GradMAPConfig, torch.LongTensor, torch.LongTensor | None]:
    """The model, config, calibration sequences and validation sequences (or `None`) of `case`."""
    settings, num_samples, num_validation = STAGE2_CASES[case]
    config = GradMAPConfig(**settings, num_samples=num_samples, seq_len=16, batch_size=2)
    validation = random_ids(num_validation, 16, seed=2) if num_validation else None
    return tiny_model("llama", num_layers=6), config, random_ids(num_samples, 16), validation


def main() -> None:
    use_float32_passes()
    output = sys.argv[1]
    assert distributed.init_from_environment(), "run me with torchrun --nproc-per-node 2"
    keep_if_validated = stage2._Stage2Run.keep_if_validated
    seen: list[list[int]] = []

    def recording_what_is_validated(run, folds, validation_ids, *args, **kwargs):
        rows = {tuple(row.tolist()): index for index, row in enumerate(validation_ids)}

        def record(module, args, kwargs):
            batch = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
            seen.append([rows[tuple(row.tolist())] for row in batch])

        handle = run.dense.model.register_forward_pre_hook(record, with_kwargs=True)
        try:
            return keep_if_validated(run, folds, validation_ids, *args, **kwargs)
        finally:
            handle.remove()

    stage2._Stage2Run.keep_if_validated = recording_what_is_validated
    probe_ids = random_ids(2, 16, seed=1)
    for case in STAGE2_CASES:
        folder = os.path.join(output, case)
        os.makedirs(folder, exist_ok=True)
        model, config, calibration_ids, validation_ids = stage2_case_inputs(case)
        seen.clear()
        result = GradMAPPruner(config, progress_bar=False).prune(model, calibration_ids, validation_data=validation_ids)
        with torch.no_grad():
            logits = result.model(probe_ids).logits
        found = {
            "refinement": result.compensation.refinement,
            "validation": result.compensation.validation,
            "validated_sequences": sorted(index for batch in seen for index in batch),
            "compensated_layers": result.compensated_layers,
            "logits": logits.flatten().tolist(),
            "world_size": distributed.world_size(),
        }
        with open(os.path.join(folder, f"rank-{distributed.rank()}.json"), "w", encoding="utf-8") as file:
            json.dump(found, file)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
