"""One process of the shared KL divergence check (tests/test_fidelity.py): run under
`python -m torch.distributed.run --nproc-per-node 2 tests/integration/fidelity_worker.py OUTPUT`.

Every process calls `evaluate(..., reference_model=..., shared_by_processes=True)` on the same 5 held-out segments
(gloo backend on CPU): each must run its share of the segments through both models (the rows each model ran) and get
the perplexity and the KL divergence of all of them, written to OUTPUT/rank-R.json.
"""

from __future__ import annotations

import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from optimum_gradmap import distributed  # noqa: E402
from optimum_gradmap.evaluation import evaluate  # noqa: E402
from tests.conftest import use_float32_passes  # noqa: E402
from tests.distributed_cases import evaluation_inputs  # noqa: E402
from tests.test_fidelity import SHARED_EVALUATION, changed_copy  # noqa: E402


def main() -> None:
    use_float32_passes()
    output = sys.argv[1]
    torch.distributed.init_process_group(backend="gloo", timeout=datetime.timedelta(seconds=300))
    assert distributed.init_from_environment(), "run me with torchrun --nproc-per-node 2"
    model, tokenizer = evaluation_inputs()
    reference = changed_copy(model)
    rows = {"model": 0, "reference": 0}
    for name, module in (("model", model), ("reference", reference)):
        module.register_forward_pre_hook(
            lambda module, args, kwargs, name=name: rows.__setitem__(name, rows[name] + kwargs["input_ids"].shape[0]),
            with_kwargs=True,
        )
    result = evaluate(model, tokenizer, **SHARED_EVALUATION, reference_model=reference, shared_by_processes=True)
    os.makedirs(output, exist_ok=True)
    with open(os.path.join(output, f"rank-{distributed.rank()}.json"), "w", encoding="utf-8") as file:
        json.dump({"evaluation": result.to_dict(), "rows": rows}, file)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
