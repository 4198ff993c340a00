# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""The heal's training loop ([`heal`]): the teacher's targets, AdamW with a linear warm-up and a cosine decay, clipped
gradients averaged over processes, the held-out KL every `check_every` steps with the best state kept, the deadline of
a timed budget, Ctrl-C, and the checkpoint saved at every check."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.utils import logging

from .. import distributed, streaming
from ..adapters import get_adapter
from ..data import calibration_sha256
from ..distillation import teacher_targets
from ..errors import InvalidInputError
from ..objectives import TeacherTargets, chunked_top_k_kl, top_k_kl, top_k_kl_gradient, vocab_sliced_top_k_kl_gradient
from ..passes import calibration_mode, input_device
from ..precision import uses_bfloat16_autocast
from ..streaming import DecoderGradient
from ..vocabulary import vocabulary_head
from ..weights import weights_digest
from .checks import check_heal_arguments, check_heal_checkpoint
from .cost import num_batches
from .loss import (
    distillation_loss,
    no_seam_refusal,
    seam_indices,
    seam_layers,
    uses_layer_states,
)
from .result import HealResult
from .settings import HealSettings, PrunedLayout
from .state import fingerprint_before_pruning, load_heal_state, save_heal_state
from .trainable import Trainable, TrainableChoice, choose_trainable

logger = logging.get_logger(__name__)

# The schedule: linear warm-up over this share of the steps, then a cosine decay to this share of the rate.
WARMUP_FRACTION = 0.05
FINAL_LR_FRACTION = 0.1
MAX_GRAD_NORM = 1.0
# With a deadline, the schedule's length is fitted to the time left after this many steps, and again at every check
# from the steps since then (the first steps are slower: on SmolLM2-135M at 40%, rank 64, 2.6 s against 1.65 s
# later, and a schedule fitted to them alone stopped 400 s early).
REFIT_AFTER_STEPS = 5


def heal(
    model: PreTrainedModel,
    teacher: Callable[[], AbstractContextManager[nn.Module]],
    train_ids: torch.LongTensor,
    validation_ids: torch.LongTensor,
    settings: HealSettings,
    layout: PrunedLayout | None = None,
    dataset: str = "",
    checkpoint: str | os.PathLike | None = None,
    progress_bar: bool = True,
    deadline: float | None = None,
    spent_seconds: float = 0.0,
    targets: tuple[TeacherTargets, TeacherTargets] | None = None,
) -> HealResult:
    """Distils the teacher into `model` in place (see [`optimum_gradmap.heal`]); each training step runs
    layer-streamed ([`~optimum_gradmap.streaming.streamed_backward`]: the same gradients, one layer's weights in memory at
    a time) under execution mode `"layer_streamed"`, or `"auto"` on offloaded weights ([`heal_stage`] enters the mode
    `settings.execution` names).

    Args:
        model (`PreTrainedModel`): The pruned model.
        teacher (`Callable`): Returns a context manager that gives the dense model for its block.
        train_ids (`torch.LongTensor` of shape `(N, T)`), validation_ids (`torch.LongTensor` of shape `(M, T)`): The
            training sequences, in the order they are trained on, and the held-out ones.
        settings ([`HealSettings`]): Its `heal_trainable`, `heal_lr` (defaults to `DEFAULT_LEARNING_RATES`),
            `heal_batch_size` (sequences per step, over all processes), `heal_check_every`, `heal_loss` (the held-out
            check is the KL whatever it is), `heal_lora_rank`, `heal_autocast` and `seed` (LoRA's) are read.
        layout ([`PrunedLayout`], *optional*): The model's layers in the dense model; defaults to every layer kept.
        dataset (`str`): The text's name, for the result.
        checkpoint (`str` or `os.PathLike`, *optional*): A file saved at every check, from which an interrupted run
            with the same sequences and settings resumes (missing folders are created).
        progress_bar (`bool`): Show progress bars.
        deadline (`float`, *optional*): A `time.perf_counter()` value (the main process's decides): after
            `REFIT_AFTER_STEPS` steps and at every later check the schedule's length is fitted to the time left, and no
            step starts that would end, with a last check, after it (`stopped_at_budget`).
        spent_seconds (`float`): Seconds spent on the heal before this call, added to `seconds`.
        targets (`tuple[TeacherTargets, TeacherTargets]`, *optional*): The teacher's targets on both sets of sequences,
            kept while the dense model wrote them: no teacher pass, unless `heal_loss` needs states they lack.

    Returns:
        [`HealResult`]. The model holds the trained weights with the lowest held-out KL (the start's if none was
        lower), as plain weights.

    Raises:
        InvalidInputError: what [`check_heal_arguments`] refuses, nothing of that kind to train, weights it cannot train
            ([`choose_trainable`]), a checkpoint path that cannot be written or a checkpoint file from another run,
            before the teacher runs. Any other error once training was set up (the merge included) leaves the model as
            it was, without LoRA's wrappers; Ctrl-C during the steps keeps the best state so far (`interrupted`; every
            process stops after the same step), before them it propagates.
    """
    check_heal_arguments(model, validation_ids, settings)
    distributed.on_main_process(lambda: check_heal_checkpoint(checkpoint))  # the main process alone writes it
    started = time.perf_counter() - spent_seconds
    adapter = get_adapter(model)
    layout = layout if layout is not None else PrunedLayout.unpruned(adapter.num_layers(model))
    if uses_layer_states(settings.heal_loss) and not layout.seams():
        raise InvalidInputError(no_seam_refusal(layout.kept))
    choice = choose_trainable(model, adapter, settings.heal_trainable)  # refusals before any compute
    result = _new_result(train_ids, validation_ids, settings, dataset)
    training = _Training(model, train_ids, validation_ids, result, settings, deadline)
    resumed = training.resumable(checkpoint, layout)
    training.make_targets(teacher, targets, layout, progress_bar)
    result.teacher_seconds = time.perf_counter() - started - spent_seconds
    training.train(choice, resumed, progress_bar)
    result.seconds = time.perf_counter() - started
    logger.info(result.summary())
    return result


def _new_result(
    train_ids: torch.LongTensor, validation_ids: torch.LongTensor, settings: HealSettings, dataset: str
) -> HealResult:
    """The result of a heal on these sequences and settings, before it runs."""
    num_train = train_ids.shape[0]
    return HealResult(
        trainable=settings.heal_trainable,
        num_trainable_parameters=0,
        dataset=dataset,
        train_sha256=calibration_sha256(train_ids),
        validation_sha256=calibration_sha256(validation_ids),
        budget_tokens=num_train * train_ids.shape[1],
        num_steps=num_batches(num_train, settings.heal_batch_size),
        learning_rate=settings.learning_rate,
        batch_size=settings.heal_batch_size,
        seq_len=train_ids.shape[1],
        loss=settings.heal_loss,
    )


class _Training:
    """One heal's training on this process: its rows of each global batch and their teacher targets, the trained
    parameters, AdamW and its schedule, the held-out checks, the deadline, Ctrl-C and the checkpoint.

    Args:
        model, train_ids, validation_ids, settings, deadline: As in [`heal`].
        result ([`HealResult`]): Filled in as training goes.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        train_ids: torch.LongTensor,
        validation_ids: torch.LongTensor,
        result: HealResult,
        settings: HealSettings,
        deadline: float | None,
    ):
        self.model, self.adapter, self.result, self.settings = model, get_adapter(model), result, settings
        self.train_ids, self.validation_ids = train_ids, validation_ids
        self.batch_size, self.check_every, self.deadline = settings.heal_batch_size, settings.heal_check_every, deadline
        self.loss = settings.heal_loss
        self.num_train = train_ids.shape[0]
        self.num_steps = result.num_steps
        self.device = input_device(model)
        self.checkpoint: str | os.PathLike | None = None
        self.fingerprint: dict[str, Any] = {}

    def resumable(self, checkpoint: str | os.PathLike | None, layout: PrunedLayout) -> dict[str, Any] | None:
        """Fingerprints this run (what Stage 1 and 2 made included: the kept and compensated layers, and with a
        checkpoint the weights) and returns the state an interrupted run of it saved in `checkpoint`, if any."""
        result = self.result
        fingerprint = fingerprint_before_pruning(result.train_sha256, result.validation_sha256, self.settings, layout.num_layers)
        fingerprint.update(kept=list(layout.kept), compensated=list(layout.compensated))  # what Stage 1 and 2 made
        if checkpoint is not None:  # the model the run started from (Stage 1 and 2 as they were): only a resume compares it
            fingerprint["weights"] = weights_digest(self.model)
        self.checkpoint, self.fingerprint = checkpoint, fingerprint
        return load_heal_state(checkpoint, fingerprint)  # a stale file is refused before the teacher runs

    def make_targets(
        self,
        teacher: Callable[[], AbstractContextManager[nn.Module]],
        targets: tuple[TeacherTargets, TeacherTargets] | None,
        layout: PrunedLayout,
        progress_bar: bool,
    ) -> None:
        """This process's share of the teacher's targets: its rows of `targets` (kept while the dense model wrote the
        text) where they hold what the loss reads, else from a teacher pass over its rows."""
        model, loss, result = self.model, self.loss, self.result
        self.my_rows = [row for step in range(self.num_steps) for row in _batch_rows(step, self.batch_size, self.num_train)]
        self.position = {row: index for index, row in enumerate(self.my_rows)}
        self.my_validation, validation_start = distributed.shard_any(self.validation_ids)
        result.autocast = uses_bfloat16_autocast(self.settings.heal_autocast, model)
        self.seam_layers = seam_layers(model, self.adapter, loss, layout)
        seam_states = None if targets is None else targets[0].layer_states
        if targets is not None and self.seam_layers and (seam_states is None or seam_states.shape[-2] != len(self.seam_layers)):
            logger.info(
                f"Heal: heal_loss={loss!r} needs the dense model's hidden states, which its text's targets lack: the dense "
                "model runs over the text again to keep them."
            )
            targets = None
        if targets is not None:  # kept while the dense model wrote its text: this process's rows
            validation_rows = slice(validation_start, validation_start + self.my_validation.shape[0])
            self.targets, self.validation_targets = targets[0].rows(self.my_rows), targets[1].rows(validation_rows)
            self.validation_targets.layer_states = None  # the held-out check is the KL
        else:
            self.targets, self.validation_targets = self._teacher_pass(teacher, layout, progress_bar)

    def _teacher_pass(
        self,
        teacher: Callable[[], AbstractContextManager[nn.Module]],
        layout: PrunedLayout,
        progress_bar: bool,
    ) -> tuple[TeacherTargets, TeacherTargets]:
        """The teacher's targets on this process's training and held-out rows (with, on the training ones, its seam
        layers' outputs where the loss reads them). The teacher is bound here
        only, so that no reference to it outlives its block: a teacher loaded for the pass is freed before training
        starts."""
        batch_size, autocast = self.batch_size, self.result.autocast
        with teacher() as dense_model:
            layers = self.adapter.layers_at(dense_model, seam_indices(self.loss, layout))
            train_ids = self.train_ids[self.my_rows]
            train_targets = teacher_targets(dense_model, train_ids, batch_size, progress_bar, autocast, layers)
            del layers
            validation_targets = teacher_targets(dense_model, self.my_validation, batch_size, progress_bar, autocast)
            del dense_model  # before the context's cleanup runs: a teacher it loaded is freed there, not at a later collection
        return train_targets, validation_targets

    def train(self, choice: TrainableChoice, resumed: dict[str, Any] | None, progress_bar: bool) -> None:
        """Trains what `choice` names and leaves the best state as plain weights; any error once it is set up (the
        merge included) puts the model back as it came."""
        chosen = None
        with calibration_mode(self.model, grad=True, freeze_parameters=True):
            try:
                chosen = Trainable(self.model, choice, self.settings.heal_lora_rank, self.settings.seed)
                start_state = self.best_state = chosen.state()  # before anything else can fail: an error restores it
                self.result.num_trainable_parameters = chosen.num_parameters()
                self._set_up(chosen, resumed)
                self._report_end(self._run_steps(progress_bar))
                chosen.load(self.best_state)
                chosen.finish(merge=True)  # inside the try: an error in the merge puts the start back too
            except BaseException:
                if chosen is not None:
                    chosen.restore(start_state)
                raise

    def _set_up(self, chosen: Trainable, resumed: dict[str, Any] | None) -> None:
        """The optimizer and its schedule, then the resumed state, or the start's held-out KL."""
        result = self.result
        self.chosen = chosen
        # layer-streamed (offloaded weights, or `execution="layer_streamed"`): one layer's weights at a time
        self.streamed = DecoderGradient(self.model, self.adapter, self.train_ids) if streaming.streams(self.model) else None
        self.optimizer = torch.optim.AdamW(chosen.parameters, lr=result.learning_rate, weight_decay=0.0)
        self.schedule_steps = self.num_steps  # the schedule's length: with a deadline, fitted to the time left
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda done: _learning_rate_factor(done + 1, self.schedule_steps)
        )
        self.first_step = 0
        if resumed is not None:
            self._resume(resumed)
            self.check_seconds = 0.0  # no check was timed: the first one after the resume is
        else:
            tick = time.perf_counter()
            result.start_kl = result.best_kl = self._held_out_kl()
            result.kl_curve.append([0, result.start_kl])
            self.check_seconds = time.perf_counter() - tick

    def _resume(self, resumed: dict[str, Any]) -> None:
        """Loads the state an interrupted run saved: the trained parameters, the optimizer, the schedule, the best state
        and the held-out curve."""
        if [tuple(value.shape) for value in resumed["state"]] != [tuple(value.shape) for value in self.best_state]:
            raise InvalidInputError(f"The heal checkpoint {self.checkpoint} holds other tensors: delete it.")
        self.chosen.load(resumed["state"])
        self.optimizer.load_state_dict(resumed["optimizer"])
        self.scheduler.load_state_dict(resumed["scheduler"])
        self.best_state, self.first_step = resumed["best_state"], resumed["step"]
        for name in ("kl_curve", "start_kl", "best_kl", "best_tokens"):
            setattr(self.result, name, resumed[name])
        logger.info(f"Heal: resumed from {self.checkpoint} at step {self.first_step} of {self.num_steps}.")

    def _run_steps(self, progress_bar: bool) -> bool:
        """The training steps from the first one not taken, until the last, the deadline or Ctrl-C; returns whether
        Ctrl-C stopped them.

        One process stops where Ctrl-C comes. Several stop after the same step (a process stopping alone would leave
        the others waiting in a collective): SIGINT is deferred, and an interrupt travels with the step's gradients,
        or with the checkpoint write's outcome."""
        result = self.result
        self.bar = logging.tqdm(
            total=self.num_steps,
            initial=self.first_step,
            desc=f"Heal ({result.trainable})",
            leave=False,
            disable=not progress_bar,
        )
        result.steps = self.first_step
        result.trained_tokens = min(self.num_train, self.first_step * self.batch_size) * self.train_ids.shape[1]
        self.seconds, self.tokens_timed, self.warm_seconds = 0.0, 0, 0.0
        stop = False
        try:
            with distributed.interrupts_deferred() as deferred_interrupt:
                stop = self._steps(deferred_interrupt)
                if not stop:  # an interrupt after the last step's gradients
                    stop = distributed.any_process(deferred_interrupt())
                if result.stopped_at_budget and not stop and result.kl_curve[-1][0] != result.trained_tokens:
                    self._record_check(self._held_out_kl())  # the last steps' state, checked (its time was kept for it)
        except KeyboardInterrupt:  # one process: Ctrl-C outside its share of a step
            stop = True
        finally:
            self.bar.close()
        return stop

    def _steps(self, deferred_interrupt: Callable[[], bool]) -> bool:
        """Takes the steps; returns whether an interrupt stopped them (on every process)."""
        for step in range(self.first_step, self.num_steps):
            if self._out_of_time(step):
                self.result.stopped_at_budget = True
                return False
            tick = time.perf_counter()
            global_rows = min(self.batch_size, self.num_train - step * self.batch_size)
            if self._step(step, global_rows, deferred_interrupt):
                return True  # on every process: this step is not taken
            stop = self._after_step(step, tick, global_rows)
            self.bar.update(1)
            if stop:
                return True
        return False

    def _out_of_time(self, step: int) -> bool:
        """Whether the schedule ends before `step`, or, with a deadline, the step would end after it; the schedule's
        length is fitted to the time left after the first steps and at the checks after them."""
        taken = step - self.first_step
        if taken == REFIT_AFTER_STEPS:
            self.warm_seconds = self.seconds  # the first steps' time, left out of the later refits
        deadline = self.deadline
        if deadline is not None and (
            taken == REFIT_AFTER_STEPS or (taken > REFIT_AFTER_STEPS and step % self.check_every == 0)
        ):  # the first fit times the first steps, the later ones the steps since them
            recent = taken - REFIT_AFTER_STEPS
            step_seconds = (self.seconds - self.warm_seconds) / recent if recent else self.seconds / taken
            self.schedule_steps = _steps_that_fit(
                deadline, step, self.num_steps, step_seconds, self.check_seconds, self.check_every
            )
        return step >= self.schedule_steps or (
            deadline is not None and step > self.first_step and _past(deadline, self.seconds / taken + self.check_seconds)
        )

    def _step(self, step: int, global_rows: int, deferred_interrupt: Callable[[], bool]) -> bool:
        """One training step: this process's share of the gradients, averaged over processes, clipped, and AdamW's
        update. Returns whether an interrupt on any process stopped it before the update."""
        rows = _batch_rows(step, self.batch_size, self.num_train)
        stop = False
        try:  # this process's share of the step
            self.optimizer.zero_grad(set_to_none=True)
            if rows:  # a last, short batch may leave a process none
                self._backward(rows)
        except KeyboardInterrupt:
            stop = True
        if distributed.average_gradients(self.chosen.parameters, global_rows, stop or deferred_interrupt()):
            return True
        torch.nn.utils.clip_grad_norm_(self.chosen.parameters, MAX_GRAD_NORM)
        self.optimizer.step()
        self.scheduler.step()
        return False

    def _backward(self, rows: list[int]) -> None:
        """The gradients of the summed per-sequence losses of `rows` (layer-streamed, or by autograd)."""
        batch = self.train_ids[rows].to(self.device)
        batch_targets = self.targets.rows([self.position[row] for row in rows])
        if self.streamed is not None:  # the same gradients: the rows' summed per-sequence means
            with self._passes():
                gradient = self.streamed.loss_gradient(top_k_kl_gradient, vocab_sliced_top_k_kl_gradient, targets=batch_targets)
                self.streamed.backward(batch, gradient, self.chosen.parameters)
        else:
            step_loss = distillation_loss(self.model, batch, self.loss, batch_targets, self.seam_layers, self._passes)
            (step_loss * len(rows)).backward()

    def _after_step(self, step: int, tick: float, global_rows: int) -> bool:
        """Counts the step, and at a check measures the held-out KL, keeps the best state and saves the checkpoint.
        Returns whether Ctrl-C stopped the main process's write (on every process: all stop here)."""
        result = self.result
        result.steps = step + 1
        result.trained_tokens = min(self.num_train, (step + 1) * self.batch_size) * self.train_ids.shape[1]
        self.seconds += time.perf_counter() - tick
        self.tokens_timed += global_rows * self.train_ids.shape[1]
        if result.steps % self.check_every != 0 and result.steps != self.num_steps:
            return False
        check_tick = time.perf_counter()
        kl = self._held_out_kl()
        self.check_seconds = time.perf_counter() - check_tick
        self._record_check(kl)
        self.bar.set_postfix(tokens_per_s=f"{self.tokens_timed / self.seconds:.0f}", held_out_kl=f"{kl:.4f}")
        return not save_heal_state(self.checkpoint, self._saved_state)

    def _saved_state(self) -> dict[str, Any]:
        """What the checkpoint file holds: the fingerprint, the trained parameters, the optimizer, the schedule, the
        best state and the held-out curve."""
        result = self.result
        return {
            "fingerprint": self.fingerprint,
            "step": result.steps,
            "state": self.chosen.state(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "best_state": self.best_state,
            "kl_curve": result.kl_curve,
            "start_kl": result.start_kl,
            "best_kl": result.best_kl,
            "best_tokens": result.best_tokens,
            "budget_tokens": result.budget_tokens,  # what a resumed `heal_tokens="auto"` run trains again
        }

    def _record_check(self, kl: float) -> None:
        """Adds a held-out KL to the curve, and keeps the state if it is the lowest so far."""
        result = self.result
        result.kl_curve.append([result.trained_tokens, kl])
        if kl < result.best_kl:
            result.best_kl, result.best_tokens, self.best_state = kl, result.trained_tokens, self.chosen.state()

    def _report_end(self, stop: bool) -> None:
        """Logs why training ended early (the time was up, or Ctrl-C), and records an interruption."""
        result = self.result
        if result.stopped_at_budget:
            logger.info(
                f"Heal: the time was up after step {result.steps} of {self.num_steps}: the model keeps the state with the "
                f"lowest held-out KL ({result.best_kl:.4f}, after {result.best_tokens} tokens)."
            )
        if stop:
            result.interrupted = True
            logger.warning(
                f"Heal interrupted at step {result.steps} of {self.num_steps}: the model keeps the state with the lowest "
                f"held-out KL so far ({result.best_kl:.4f}, after {result.best_tokens} tokens)."
            )

    def _held_out_kl(self) -> float:
        count = self.validation_ids.shape[0] * (self.validation_ids.shape[1] - 1)
        return _held_out_kl(self.model, self.my_validation, self.validation_targets, self.batch_size, self._passes, count)

    def _passes(self) -> AbstractContextManager[None]:
        return torch.autocast(self.device.type, dtype=torch.bfloat16) if self.result.autocast else nullcontext()


def _learning_rate_factor(step: int, num_steps: int) -> float:
    """The share of the learning rate at `step` (1-based): linear warm-up, then a cosine decay to `FINAL_LR_FRACTION`."""
    warmup = max(1, round(WARMUP_FRACTION * num_steps))
    if step <= warmup:
        return step / warmup
    progress = (step - warmup) / max(1, num_steps - warmup)
    return FINAL_LR_FRACTION + (1 - FINAL_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * progress))


def _batch_rows(step: int, batch_size: int, num_train: int) -> list[int]:
    """This process's rows of the global batch of `step` (0-based): its contiguous share of the batch's rows."""
    start = step * batch_size
    rows = list(range(start, min(start + batch_size, num_train)))
    size, process = distributed.world_size(), distributed.rank()
    return rows[process * len(rows) // size : (process + 1) * len(rows) // size]


def _steps_that_fit(
    deadline: float, done: int, num_steps: int, step_seconds: float, check_seconds: float, check_every: int
) -> int:
    """The number of steps (at most `num_steps`) whose training ends by `deadline`, `done` of them taken, each of
    `step_seconds` with a held-out check of `check_seconds` every `check_every` and one at the end (the main process's
    clock decides, so that every process agrees)."""

    def fit() -> int:
        left = deadline - time.perf_counter() - check_seconds
        per_step = step_seconds + check_seconds / check_every
        return min(num_steps, done + max(0, math.floor(left / per_step)))

    return distributed.on_main_process(fit)


def _past(deadline: float, seconds_needed: float) -> bool:
    """Whether work of `seconds_needed` started now would end after `deadline` (the main process's clock decides, so
    that every process stops after the same step)."""
    return distributed.on_main_process(lambda: time.perf_counter() + seconds_needed > deadline)


def _held_out_kl(
    model: nn.Module,
    input_ids: torch.LongTensor,
    targets: TeacherTargets,
    batch_size: int,
    passes: Callable[[], AbstractContextManager[None]],
    num_positions: int,
) -> float:
    """The mean top-K KL of `model` over the held-out positions of every process (`num_positions` in all). The sum
    stays on the device and is read once, not once per batch."""
    device = input_device(model)
    total = None
    head = vocabulary_head(model)
    with torch.no_grad():
        for start in range(0, input_ids.shape[0], batch_size):
            batch = input_ids[start : start + batch_size].to(device)
            batch_targets = targets.rows(slice(start, start + batch_size))
            if head.final_hidden_states is None:
                with passes():
                    logits = model(input_ids=batch, use_cache=False).logits[:, :-1]
                part = top_k_kl(logits, batch_targets).double().sum()
            else:  # the logits a few at a time
                with passes():
                    hidden = head.final_hidden_states(batch)
                part = chunked_top_k_kl(hidden, batch_targets, head)
            total = part if total is None else total + part.to(total.device)
    if total is None:  # a process with no held-out sequence of its own (torchrun)
        total = torch.zeros((), dtype=torch.float64, device=device)
    return float(distributed.all_reduce_sum(total) / num_positions)
