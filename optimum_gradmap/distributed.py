# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Data-parallel calibration over `torch.distributed`: several processes share the calibration sequences.

Launch the same script (or `optimum-gradmap prune`) with `torchrun --nproc-per-node N` or
`accelerate launch --num-processes N`; each process holds the model (or its own device map) and
works on its contiguous share of the calibration sequences ([`shard`]). Everything the method
accumulates over sequences is summed across processes with all-reduce, so every process takes the
same decisions and ends with the same pruned model, identical (up to the order of float sums) to one
process on all the sequences:

- Stage 1: the scores of every metric that is a mean over calibration sequences
  (`ImportanceMetric.mean_over_samples`: GradMAP, the bound and Taylor-gate scores, Block Influence,
  relative magnitude, SLEB's losses and the verified shortlists) as weighted means ([`average`]);
  other metrics (Taylor+, random) are computed by every process on all sequences;
- Stage 2: the mean hidden states (drift), the sufficient statistics of the fit (A, C, ||r||^2 and
  token counts, per cross-validation fold), the median token norm behind the outlier threshold (the norms
  gathered), the held-out next-token losses of the lambda candidates, the refinement's held-out loss and the
  validation perplexity (summed losses and token counts: a process whose share holds none of those sequences adds
  zero), and, where a norm follows the MLP (Gemma2/3, OLMo2), the fit's stored activations, gathered as tensors
  ([`gather_rows`]);
- the CLI's `--evaluate` perplexity: each process scores its share of the segments;
- the heal's training steps: each process's gradient of its rows, averaged in flat buckets ([`average_gradients`]).

Only the main process ([`is_main_process`]) writes files and uploads, through [`on_main_process`], which
hands its result, or its failure, to every process. Without an initialised process group of
more than one process every function here is the identity.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .errors import InvalidInputError

T = TypeVar("T")
# The gradients of a data-parallel training step are averaged in flat buckets of at most this many bytes, one
# all-reduce each (25 MiB: DistributedDataParallel's default `bucket_cap_mb`), not one all-reduce per trained tensor.
GRADIENT_BUCKET_BYTES = 25 * 2**20


def is_distributed() -> bool:
    """Whether a `torch.distributed` process group of more than one process is running."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    """The number of processes (1 without a process group)."""
    return dist.get_world_size() if is_distributed() else 1


def is_main_process() -> bool:
    """Whether this process writes files and prints results (rank 0, or the only process)."""
    return rank() == 0


def init_from_environment() -> bool:
    """Joins the process group described by the launcher's environment (`torchrun`, `accelerate launch`:
    `WORLD_SIZE`, `RANK`, `MASTER_ADDR`, ...), with the NCCL backend when CUDA is available, else gloo.
    Does nothing when the group exists already or the environment names one process.

    Returns:
        `bool`: Whether this process is one of several.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and dist.is_available() and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend)
    return is_distributed()


def barrier() -> None:
    """Waits until every process gets here (nothing without a process group)."""
    if is_distributed():
        dist.barrier()


def on_main_process(function: Callable[[], T]) -> T:
    """Runs `function` on the main process alone (to write a file, to upload, to read a file only it may see: nodes
    need not share a file system) and gives every process its result, pickled (`broadcast_object_list`). If it raises
    on the main process, it raises there, and every other process raises a `RuntimeError` that says so: no process is
    left waiting for the others. (Only the result, or the error's message, is sent; `function` itself must not wait for
    the other processes.)"""
    if not is_distributed():
        return function()
    outcome: list[Any] = [None, None]  # [result, error message]
    failure = None
    if is_main_process():
        try:
            outcome[0] = function()
        except BaseException as error:  # noqa: BLE001 - every error must reach the other processes, then itself
            failure, outcome[1] = error, f"{type(error).__name__}: {error}"
    dist.broadcast_object_list(outcome, src=0)
    if failure is not None:
        raise failure
    if outcome[1] is not None:
        raise RuntimeError(f"The main process (rank 0) failed: {outcome[1]}")
    return outcome[0]


def any_process(flag: bool) -> bool:
    """Whether `flag` is true on at least one process (one all-reduce; every process must call it)."""
    if not is_distributed():
        return flag
    return bool(all_reduce_sum(torch.tensor([float(flag)])) > 0)


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[Callable[[], bool]]:
    """Under a process group of several processes, turns Ctrl-C into a request the processes agree on.

    `torchrun` and a terminal send SIGINT to every process, and each would raise `KeyboardInterrupt` wherever it is:
    one in a collective, another writing a file, and the ones that go on wait for it. Inside this block SIGINT raises
    nothing and is recorded instead; the function it yields says whether one came. The caller shares that answer with
    the other processes at a point every process reaches ([`any_process`], or a flag added to a tensor it all-reduces
    anyway), and all of them stop there. With one process, or outside the main thread (where no handler can be set),
    SIGINT raises `KeyboardInterrupt` as usual and the function always returns `False`.

    Yields:
        `Callable[[], bool]`: Whether SIGINT came since the block started.
    """
    received: list[int] = []
    if not is_distributed() or threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return
    previous = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield lambda: bool(received)
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)


def _communication_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def shard_bounds(num_samples: int) -> tuple[int, int]:
    """`(start, stop)` of this process's contiguous share of `num_samples` sequences (sizes differ by at most one)."""
    size, process = world_size(), rank()
    if num_samples < size:
        raise InvalidInputError(f"{num_samples} calibration sequences cannot be shared by {size} processes: use at least {size}.")
    return process * num_samples // size, (process + 1) * num_samples // size


def shard(input_ids: torch.LongTensor) -> tuple[torch.LongTensor, int]:
    """This process's share of the sequences `input_ids` and the index of its first one in `input_ids`."""
    start, stop = shard_bounds(input_ids.shape[0])
    return input_ids[start:stop], start


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """The sum over processes of `tensor` (a new tensor on `tensor`'s device)."""
    if not is_distributed():
        return tensor
    total = tensor.detach().to(_communication_device(), copy=True)
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total.to(tensor.device)


def average(local_mean: torch.Tensor, local_count: int) -> torch.Tensor:
    """The mean over all processes' items of a quantity each process averaged over its `local_count` items."""
    if not is_distributed():
        return local_mean
    total = all_reduce_sum(local_mean.double() * local_count)
    count = all_reduce_sum(torch.tensor(float(local_count), dtype=torch.float64))
    return (total / count).to(local_mean.dtype)


def mean_from_sums(total: torch.Tensor, count: int) -> float:
    """`total / count` over every process's sum and count (one all-reduce): a process with nothing to add (an empty
    share, [`shard_any`]) gives 0 and 0, and must still call it."""
    sums = all_reduce_sum(torch.stack([total.detach().double().cpu(), torch.tensor(float(count), dtype=torch.float64)]))
    return float(sums[0] / sums[1])


def gather_rows(tensor: torch.Tensor) -> torch.Tensor:
    """Every process's `tensor` (the same trailing shape, any number of rows), concatenated along the first
    dimension in rank order: with contiguous shards, the order of the sequences. Sent as tensors (rows
    padded to the longest share), never pickled; the result is on `tensor`'s device."""
    if not is_distributed():
        return tensor
    device = _communication_device()
    counts = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(world_size())]
    dist.all_gather(counts, torch.tensor([tensor.shape[0]], dtype=torch.long, device=device))
    counts = [int(count) for count in counts]
    padded = torch.zeros((max(counts), *tensor.shape[1:]), dtype=tensor.dtype, device=device)
    padded[: tensor.shape[0]] = tensor
    parts = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(parts, padded)
    return torch.cat([part[:count] for part, count in zip(parts, counts)]).to(tensor.device)


def mean_over_samples(compute: Callable[[torch.LongTensor], dict[int, float]], input_ids: torch.LongTensor) -> dict[int, float]:
    """`compute(input_ids)` for a `compute` that returns means over the sequences it is given, with each
    process computing it on its share and the results averaged (weighted by share size)."""
    if not is_distributed():
        return compute(input_ids)
    local, _ = shard(input_ids)
    values = compute(local)
    keys = sorted(values)
    means = average(torch.tensor([values[key] for key in keys], dtype=torch.float64), local.shape[0])
    return dict(zip(keys, means.tolist()))


def shard_any(input_ids: torch.LongTensor) -> tuple[torch.LongTensor, int]:
    """Like [`shard`], for sequences that may be fewer than the processes (held-out or validation sequences): this
    process's contiguous share, possibly empty, and the index of its first sequence in `input_ids`. What a process
    computes on it must add up over processes with an empty share counting zero ([`all_reduce_sum`] of sums and
    counts), and every process must still take part in that all-reduce."""
    size, process, num_samples = world_size(), rank(), input_ids.shape[0]
    start, stop = process * num_samples // size, (process + 1) * num_samples // size
    return input_ids[start:stop], start


def average_gradients(parameters: Sequence[nn.Parameter], global_rows: int, stop: bool = False) -> bool:
    """Turns each process's gradient of its rows' summed loss into the gradient of the mean over the global batch, and
    tells every process whether one of them was interrupted.

    Under `torch.distributed` the gradients travel flattened, in buckets of at most `GRADIENT_BUCKET_BYTES` of one
    dtype and device, one all-reduce each (LoRA on a 30-layer model trains 420 tensors: one all-reduce each would
    cost 420 latencies per step), and `stop` rides in the first bucket. Each gradient gets the same sums as an
    all-reduce of its own.

    Args:
        parameters (`Sequence[nn.Parameter]`): The trained parameters; a missing gradient counts zero.
        global_rows (`int`): The rows of the global batch.
        stop (`bool`, defaults to `False`): Whether this process was interrupted during its share of the step.

    Returns:
        `bool`: Whether any process was interrupted (every process gets the same answer).
    """
    gradients = []
    for parameter in parameters:
        if parameter.grad is None:
            parameter.grad = torch.zeros_like(parameter)
        gradients.append(parameter.grad)
    if not is_distributed():
        for gradient in gradients:
            gradient.div_(global_rows)
        return stop
    buckets = gradient_buckets(gradients)
    if not buckets:
        return any_process(stop)
    interrupted = False
    for index, bucket in enumerate(buckets):
        flat = _flatten_dense_tensors(bucket)
        if index == 0:
            flat = torch.cat([flat, flat.new_full((1,), float(stop))])
        total = all_reduce_sum(flat)
        if index == 0:
            interrupted, total = bool(total[-1] > 0), total[:-1]
        total.div_(global_rows)
        for gradient, averaged in zip(bucket, _unflatten_dense_tensors(total, bucket)):
            gradient.copy_(averaged)
    return interrupted


def gradient_buckets(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`tensors` in order, cut into runs of one dtype and device of at most `GRADIENT_BUCKET_BYTES` (a larger tensor
    alone)."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if (
            not buckets
            or (tensor.dtype, tensor.device) != (buckets[-1][0].dtype, buckets[-1][0].device)
            or size + nbytes > GRADIENT_BUCKET_BYTES
        ):
            buckets.append([])
            size = 0
        buckets[-1].append(tensor)
        size += nbytes
    return buckets
