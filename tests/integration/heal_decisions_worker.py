"""One process of the heal's decisions under torchrun (tests/test_distributed.py): run under
`python -m torch.distributed.run --nproc-per-node 2 tests/integration/heal_decisions_worker.py OUTPUT`.

Each rank writes what it found to OUTPUT/CASE/rank-R.json:

- `auto_tokens`: a `heal_tokens="auto"` heal whose Stage 1 time differs between the ranks (each measured its own: here
  2 s on rank 0 and 20 s on rank 1), as the ranks' clocks do: the tokens chosen, the steps taken and the held-out curve.
- `generated_text`: the dense model's own text (`generate_sequences`) with one cache path on every rank: whether the rank
  sampled text or wrote the cache, and a digest of the sequences and targets it got.

The process group times out in 60 seconds, so that ranks that part (the failures checked for) fail rather than hang.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from optimum_gradmap import GradMAPConfig, distributed  # noqa: E402
from optimum_gradmap.heal import HealSettings, PrunedLayout, generation, heal_stage  # noqa: E402
from optimum_gradmap.surgery import remove_layers  # noqa: E402
from tests.conftest import random_ids, tiny_model, use_float32_passes  # noqa: E402


def write(folder: str, found: dict) -> None:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"rank-{distributed.rank()}.json"), "w", encoding="utf-8") as file:
        json.dump(found, file)


def peaked(num_layers: int) -> torch.nn.Module:
    model = tiny_model("llama", num_layers=num_layers)
    with torch.no_grad():
        model.lm_head.weight.mul_(30)
    return model


def auto_tokens(folder: str) -> None:
    teacher = peaked(4)
    student = peaked(4)
    remove_layers(student, [2, 3])
    config = GradMAPConfig(
        num_layers_to_prune=2, heal_tokens="auto", heal_seq_len=8, heal_validation_sequences=4, heal_batch_size=4,
        heal_check_every=2, heal_autocast=False, heal_lr=1e-3,
    )  # fmt: skip
    stage1_seconds = 2.0 if distributed.rank() == 0 else 20.0
    result = heal_stage(
        student,
        lambda: contextlib.nullcontext(teacher),
        HealSettings.from_config(config),
        None,
        PrunedLayout((0, 1), 4),
        data=random_ids(20_000, 8, seed=1),
        stage1_seconds=stage1_seconds,
        progress_bar=False,
    )
    found = {"budget_tokens": result.budget_tokens, "steps": result.steps, "kl_curve": result.kl_curve}
    write(folder, found)


def generated_text(folder: str, output: str) -> None:
    sampled, written = [], []
    sample_batch, write_cache = generation.sample_batch, generation._write_cache
    generation.sample_batch = lambda *args, **kwargs: sampled.append(1) or sample_batch(*args, **kwargs)
    generation._write_cache = lambda *args, **kwargs: written.append(1) or write_cache(*args, **kwargs)
    try:
        model = tiny_model("llama", num_layers=2)
        documents = [random_ids(1, 10 + index, seed=index)[0] for index in range(5)]
        settings = generation.GenerationSettings(seq_len=12, prompt_tokens=4, bos_every=4, batch_size=4, seed=3, start_token=1)
        cache = os.path.join(output, "text-cache.pt")
        teacher = lambda: contextlib.nullcontext(model)  # noqa: E731
        text = generation.generate_sequences(teacher, documents, 8, settings, cache, progress_bar=False)
    finally:
        generation.sample_batch, generation._write_cache = sample_batch, write_cache
    digest = hashlib.sha256(text.input_ids.numpy().tobytes() + text.targets.log_probs.numpy().tobytes()).hexdigest()
    write(folder, {"sampled": len(sampled), "written": len(written), "digest": digest, "rows": text.input_ids.shape[0]})


def main() -> None:
    use_float32_passes()
    output = sys.argv[1]
    torch.distributed.init_process_group(backend="gloo", timeout=datetime.timedelta(seconds=60))
    assert distributed.init_from_environment(), "run me with torchrun --nproc-per-node 2"
    generated_text(os.path.join(output, "generated_text"), output)
    auto_tokens(os.path.join(output, "auto_tokens"))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
