"""No per-batch host synchronisation in a Stage 1 round or in the KL divergence pass (issue 55, issue 64 6.10).

A `.item()`, `.cpu()`, `.tolist()` or `float(tensor)` per batch makes the host wait for the device after every
batch. The passes sum on the device and bring their results back once. Each test runs the same work on 2 and on 6
batches with every host-sync method of `torch.Tensor` counted where the library's own code calls it: the counts
must be equal (a sync per layer or per round is fine, one per batch is not).
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch

import optimum_gradmap
from optimum_gradmap import GradMAPPruner
from optimum_gradmap.evaluation import perplexity_and_kl

from .conftest import random_ids, small_config, tiny_model

# what makes the host wait for a device tensor's value
SYNC_METHODS = ("item", "cpu", "tolist", "numpy", "__float__", "__int__", "__index__", "__bool__")
PACKAGE_DIR = os.path.dirname(optimum_gradmap.__file__) + os.sep
TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
BATCH_SIZE = 2


@contextmanager
def counted_host_syncs() -> Iterator[Counter]:
    """Counts, by method and line, the calls of `SYNC_METHODS` made from optimum_gradmap's code (directly, or through
    torch's own Python code such as `Tensor.__format__`); calls from other libraries (transformers) are not counted."""
    counts: Counter = Counter()

    def counting(name: str, original: Callable) -> Callable:
        def wrapper(self, *args, **kwargs):
            frame = sys._getframe(1)
            while frame is not None and frame.f_code.co_filename.startswith(TORCH_DIR):
                frame = frame.f_back
            if frame is not None and frame.f_code.co_filename.startswith(PACKAGE_DIR):
                where = os.path.relpath(frame.f_code.co_filename, PACKAGE_DIR)
                counts[f"Tensor.{name} at {where}:{frame.f_lineno}"] += 1
            return original(self, *args, **kwargs)

        return wrapper

    own = {name: vars(torch.Tensor)[name] for name in SYNC_METHODS if name in vars(torch.Tensor)}
    for name in SYNC_METHODS:
        setattr(torch.Tensor, name, counting(name, getattr(torch.Tensor, name)))
    try:
        yield counts
    finally:
        for name in SYNC_METHODS:
            if name in own:
                setattr(torch.Tensor, name, own[name])
            else:
                delattr(torch.Tensor, name)


def _assert_no_sync_per_batch(run: Callable[[int], object]) -> None:
    """`run(num_batches)` on 2 and on 6 batches makes the same host syncs."""
    counts = {}
    for num_batches in (2, 6):
        with counted_host_syncs() as counted:
            run(num_batches)
        counts[num_batches] = counted
    grown = {site: (counts[2][site], counts[6][site]) for site in counts[6] if counts[6][site] != counts[2][site]}
    assert not grown, f"host syncs that grow with the number of batches (2 batches, 6 batches): {grown}"


def test_the_counter_sees_a_sync_per_batch():
    """The check itself: a pass that calls `.item()` per batch fails it."""
    from optimum_gradmap import passes

    def per_batch_item(num_batches: int) -> None:
        passes_item = compile("torch.ones(()).item()", passes.__file__, "exec")  # as if passes.py called it
        for _ in range(num_batches):
            exec(passes_item, {"torch": torch})

    with pytest.raises(AssertionError, match="grow with the number of batches"):
        _assert_no_sync_per_batch(per_batch_item)


STAGE1_ROUNDS = {
    "gradmap": {},
    "gradmap_bound_token": {"importance": "gradmap_bound_token"},
    "block_influence": {"importance": "block_influence"},
    "relative_magnitude": {"importance": "relative_magnitude"},
    "taylor": {"importance": "taylor", "protected_layers": []},
    "sleb": {"importance": "sleb"},
    "verified_halving": {"importance": "gradmap_bound_token", "verify_top_k": 3, "verify_halving": True},
    "loss_curve": {"loss_curve": True},
}


@pytest.mark.parametrize("settings", STAGE1_ROUNDS.values(), ids=STAGE1_ROUNDS.keys())
def test_a_stage1_round_makes_no_host_sync_per_batch(settings):
    def stage1_round(num_batches: int) -> None:
        model, ids = tiny_model("llama", num_layers=4), random_ids(num_batches * BATCH_SIZE, 8)
        config = small_config(
            num_layers_to_prune=1, num_samples=ids.shape[0], seq_len=ids.shape[1], batch_size=BATCH_SIZE, **settings
        )
        GradMAPPruner(config, progress_bar=False).select_layers(model, ids)

    _assert_no_sync_per_batch(stage1_round)


def test_the_kl_pass_makes_no_host_sync_per_batch():
    model, reference = tiny_model("llama", num_layers=3, seed=1), tiny_model("llama", num_layers=3)

    def kl_pass(num_batches: int) -> None:
        perplexity_and_kl(model, reference, random_ids(num_batches * BATCH_SIZE, 8), BATCH_SIZE, progress_bar=False)

    _assert_no_sync_per_batch(kl_pass)
