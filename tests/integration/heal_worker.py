"""One process of the heal's data-parallel checks (tests/test_distributed.py): run under
`python -m torch.distributed.run --nproc-per-node 2 tests/integration/heal_worker.py OUTPUT`.

Each rank writes what it found to OUTPUT/CASE/rank-R.json (and the healed weights to OUTPUT/CASE/rank-R.pt):

- `buckets`: the gradient averaging (`distributed.average_gradients`) of tensors of two dtypes, one gradient missing on rank 1:
  how many all-reduces it made, and whether each gradient equals a per-tensor all-reduce of its own, with the default
  bucket size and with 64-byte buckets; and whether an interrupt on rank 1 reached both ranks.
- `uninterrupted`: a LoRA heal, and the all-reduces `distributed.average_gradients` made at each step;
- `interrupt_on_rank_1`: the same heal, rank 1 raising `KeyboardInterrupt` in its third training forward pass, with a
  heal checkpoint rank 0 writes and rank 1 cannot see (its path names a folder that exists on rank 0 alone);
- `resume_from_rank_0s_file`: the same heal again with those paths: every rank must resume from rank 0's file;
- `sigint_on_rank_1`: rank 1 sends itself SIGINT (Ctrl-C) in its third training forward pass;
- `interrupt_in_rank_0s_save`: rank 0's second checkpoint write raises `KeyboardInterrupt`.

The process group times out in two minutes, so that ranks that part (the failures checked for) fail rather than hang.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import signal
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from optimum_gradmap import distributed  # noqa: E402
from optimum_gradmap import heal as heal_module  # noqa: E402
from tests.conftest import random_ids, small_config, tiny_model  # noqa: E402

TRAIN, VALIDATION = random_ids(24, 16, seed=1), random_ids(3, 16, seed=2)  # 6 steps of 4 rows, checks every 2
BUCKET_SHAPES = [((3, 5), torch.float32), ((7,), torch.float32), ((2, 2, 2), torch.float32), ((11, 4), torch.float32)]
BUCKET_SHAPES += [((4,), torch.float64)]


def peaked(seed: int) -> nn.Module:
    model = tiny_model("llama", num_layers=4, seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(30)
    return model


def run_heal(checkpoint: str | None = None, hook=None) -> tuple[heal_module.HealResult, nn.Module]:
    model, teacher = peaked(1), peaked(0)
    if hook is not None:
        model.register_forward_pre_hook(hook)
    settings = dataclasses.replace(
        heal_module.HealSettings.from_config(small_config()),
        heal_trainable="lora",
        heal_lr=1e-3,
        heal_batch_size=4,
        heal_check_every=2,
        heal_autocast=False,
    )
    teacher_context = lambda: contextlib.nullcontext(teacher)  # noqa: E731
    result = heal_module.heal(model, teacher_context, TRAIN, VALIDATION, settings, checkpoint=checkpoint, progress_bar=False)
    return result, model


def at_third_training_pass(action):
    """A forward pre-hook that calls `action` at the third forward pass with gradients (a training step's)."""
    passes = {"count": 0}

    def hook(module, args):
        if torch.is_grad_enabled():
            passes["count"] += 1
            if passes["count"] == 3:
                action()

    return hook


def write(folder: str, found: dict, model: nn.Module | None = None) -> None:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"rank-{distributed.rank()}.json"), "w", encoding="utf-8") as file:
        json.dump(found, file)
    if model is not None:
        torch.save(model.state_dict(), os.path.join(folder, f"rank-{distributed.rank()}.pt"))


def summary(result: heal_module.HealResult) -> dict:
    return {"interrupted": result.interrupted, "steps": result.steps, "kl_curve": result.kl_curve}


def count_all_reduces() -> tuple[list[int], contextlib.AbstractContextManager]:
    """Counts the calls of `distributed.all_reduce_sum` inside each call of `distributed.average_gradients`."""
    counts: list[int] = []
    all_reduce_sum, average_gradients = distributed.all_reduce_sum, distributed.average_gradients
    inside = {"now": False}

    def counted_all_reduce_sum(tensor):
        if inside["now"]:
            counts[-1] += 1
        return all_reduce_sum(tensor)

    def counted_average_gradients(*args, **kwargs):
        counts.append(0)
        inside["now"] = True
        try:
            return average_gradients(*args, **kwargs)
        finally:
            inside["now"] = False

    @contextlib.contextmanager
    def patched():
        distributed.all_reduce_sum, distributed.average_gradients = counted_all_reduce_sum, counted_average_gradients
        try:
            yield
        finally:
            distributed.all_reduce_sum, distributed.average_gradients = all_reduce_sum, average_gradients

    return counts, patched()


def buckets(folder: str) -> None:
    found = {}
    for name, bucket_bytes in (("default", distributed.GRADIENT_BUCKET_BYTES), ("64_bytes", 64)):
        generator = torch.Generator().manual_seed(10 + distributed.rank())
        parameters = [nn.Parameter(torch.zeros(shape, dtype=dtype)) for shape, dtype in BUCKET_SHAPES]
        for index, parameter in enumerate(parameters):
            if not (index == 1 and distributed.rank() == 1):  # a missing gradient counts zero
                parameter.grad = torch.randn(parameter.shape, generator=generator).to(parameter.dtype)
        expected = [distributed.all_reduce_sum(p.grad if p.grad is not None else torch.zeros_like(p)) / 3 for p in parameters]
        counts, patched = count_all_reduces()
        saved, distributed.GRADIENT_BUCKET_BYTES = distributed.GRADIENT_BUCKET_BYTES, bucket_bytes
        try:
            with patched:
                stop = distributed.average_gradients(parameters, 3, stop=distributed.rank() == 1)
        finally:
            distributed.GRADIENT_BUCKET_BYTES = saved
        found[name] = {
            "all_reduces": counts,
            "equal": [torch.equal(p.grad, value) for p, value in zip(parameters, expected)],
            "stop": stop,
        }
    write(folder, found)


def interrupts(output: str) -> None:
    counts, patched = count_all_reduces()
    with patched:
        result, model = run_heal()
    write(os.path.join(output, "uninterrupted"), {**summary(result), "all_reduces": counts}, model)

    # rank 0's checkpoint, in a folder rank 1 does not have (as on another node without a shared file system)
    folder = os.path.join(output, "checkpoint-of-rank-0")
    for name in ("checkpoint-of-rank-0", "interrupted-save"):
        if distributed.rank() == 0:
            os.makedirs(os.path.join(output, name))
    checkpoint = os.path.join(folder if distributed.rank() == 0 else os.path.join(output, "not-on-rank-1"), "heal.pt")

    def interrupt():
        raise KeyboardInterrupt

    hook = at_third_training_pass(interrupt) if distributed.rank() == 1 else None
    result, model = run_heal(checkpoint, hook)
    write(os.path.join(output, "interrupt_on_rank_1"), summary(result), model)

    result, model = run_heal(checkpoint)
    found = {**summary(result), "rank_1_saw_a_file": distributed.rank() == 1 and os.path.exists(checkpoint)}
    write(os.path.join(output, "resume_from_rank_0s_file"), found, model)

    hook = at_third_training_pass(lambda: os.kill(os.getpid(), signal.SIGINT)) if distributed.rank() == 1 else None
    result, model = run_heal(None, hook)
    write(os.path.join(output, "sigint_on_rank_1"), summary(result), model)

    checkpoint = os.path.join(output, "interrupted-save", "heal.pt")
    save, calls = torch.save, {"count": 0}

    def interrupted_second_save(*args, **kwargs):
        calls["count"] += 1
        if calls["count"] == 2:
            raise KeyboardInterrupt
        return save(*args, **kwargs)

    if distributed.rank() == 0:
        torch.save = interrupted_second_save
    try:
        result, model = run_heal(checkpoint)
        error = None
    except BaseException as failure:  # noqa: BLE001 - what each rank saw
        result, model, error = None, None, f"{type(failure).__name__}: {failure}"
    finally:
        torch.save = save
    found = {**(summary(result) if result is not None else {}), "error": error}
    if distributed.rank() == 0:
        found["saved_step"] = torch.load(checkpoint, weights_only=True)["step"]
        found["left_over"] = sorted(os.listdir(os.path.dirname(checkpoint)))
    write(os.path.join(output, "interrupt_in_rank_0s_save"), found, model)


def main() -> None:
    output = sys.argv[1]
    torch.distributed.init_process_group(backend="gloo", timeout=datetime.timedelta(seconds=120))
    assert distributed.init_from_environment(), "run me with torchrun --nproc-per-node 2"
    buckets(os.path.join(output, "buckets"))
    interrupts(output)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
