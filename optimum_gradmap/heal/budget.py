# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""`heal_tokens="auto"`: the heal's time is a share `AUTO_TIME_SHARE` of Stage 1's, and the number of tokens is the
one whose heal fits in it ([`choose_heal_tokens`]), from the costs of the heal's parts measured on the pruned model
([`measure_heal_costs`]) and the cost model of [`~optimum_gradmap.heal.cost`]."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
from transformers import PreTrainedModel

from .. import distributed, streaming
from ..adapters import get_adapter
from ..distillation import teacher_targets
from ..passes import calibration_mode, input_device
from ..precision import uses_bfloat16_autocast
from .cost import HealCosts, num_batches
from .loop import MAX_GRAD_NORM
from .loss import distillation_loss, seam_layers
from .settings import HealSettings, PrunedLayout
from .trainable import Trainable, choose_trainable


def measure_heal_costs(model: PreTrainedModel, settings: HealSettings, layout: PrunedLayout) -> HealCosts:
    """Times the heal's parts on one batch of random tokens, each after one warm-up run, under the heal's autocast
    rule: the pruned model's forward pass as it is (the teacher's pass is that, scaled by the dense model's layers),
    and, with what `heal_trainable` trains set up as the heal sets it up (LoRA's adapters injected), a held-out
    forward pass and a whole training step (`heal_loss` against targets of the same shape, the backward pass,
    clipping and an AdamW step at a rate of 0). The model is put back as it came. A layer-streamed model's step is
    taken as three forward passes; the heal corrects the number of steps after its first ones in any case.

    Args:
        model (`PreTrainedModel`): The pruned model.
        settings ([`HealSettings`]): The heal's settings.
        layout ([`PrunedLayout`]): The model's layers in the dense model.

    Returns:
        [`HealCosts`] (without the generation's seconds).
    """
    device = input_device(model)
    autocast = uses_bfloat16_autocast(settings.heal_autocast, model)
    vocab_size = model.config.get_text_config(decoder=True).vocab_size
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size, (settings.heal_batch_size, settings.heal_seq_len), generator=generator)
    batch = ids.to(device)

    def passes() -> AbstractContextManager[None]:
        return torch.autocast(device.type, dtype=torch.bfloat16) if autocast else nullcontext()

    def forward() -> None:
        with torch.no_grad(), passes():
            model(input_ids=batch, use_cache=False)

    def timed(work: Callable[[], None]) -> float:
        work()  # warm-up
        tick = time.perf_counter()
        work()
        return time.perf_counter() - tick

    with calibration_mode(model):
        teacher_forward = timed(forward)
    adapter = get_adapter(model)
    layers = seam_layers(model, adapter, settings.heal_loss, layout)
    # a stand-in for the teacher's targets (the pruned model's own, of the same shapes)
    targets = teacher_targets(model, ids, settings.heal_batch_size, False, autocast, layers)
    choice = choose_trainable(model, adapter, settings.heal_trainable)
    streamed = streaming.streams(model)
    with calibration_mode(model, grad=True, freeze_parameters=True):
        chosen = Trainable(model, choice, settings.heal_lora_rank, settings.seed)
        start = chosen.state()
        try:
            optimizer = torch.optim.AdamW(chosen.parameters, lr=0.0, weight_decay=0.0)

            def step() -> None:
                optimizer.zero_grad(set_to_none=True)
                distillation_loss(model, batch, settings.heal_loss, targets, layers, passes).backward()
                torch.nn.utils.clip_grad_norm_(chosen.parameters, MAX_GRAD_NORM)
                optimizer.step()

            forward_seconds = timed(forward)
            step_seconds = 3 * forward_seconds if streamed else timed(step)
        finally:
            chosen.restore(start)
    return HealCosts(
        forward_seconds=forward_seconds,
        step_seconds=step_seconds,
        teacher_seconds=teacher_forward * layout.num_layers / max(1, len(layout.kept)),
        check_seconds=forward_seconds * num_batches(settings.heal_validation_sequences, settings.heal_batch_size),
    )


def choose_heal_tokens(
    model: PreTrainedModel,
    settings: HealSettings,
    layout: PrunedLayout,
    budget_seconds: float,
    generation_seconds_per_sequence: float = 0.0,
) -> tuple[int, HealCosts]:
    """`heal_tokens="auto"`: the tokens whose heal fits in `budget_seconds`, from [`measure_heal_costs`] (the
    measurement's own seconds count against the budget). Under `torch.distributed` the main process measures and
    decides, and every process gets its answer: the processes train the same number of steps.

    Args:
        model (`PreTrainedModel`): The pruned model.
        settings ([`HealSettings`]): The heal's settings.
        layout ([`PrunedLayout`]): The model's layers in the dense model.
        budget_seconds (`float`): The heal's time.
        generation_seconds_per_sequence (`float`, defaults to 0): Seconds per sequence of the dense model's own text,
            for `generated` in `heal_dataset`.

    Returns:
        `tuple[int, HealCosts]`: the tokens (whole `heal_seq_len` sequences, at least one batch) and the costs.
    """

    def choose() -> tuple[int, HealCosts]:
        started = time.perf_counter()
        costs = measure_heal_costs(model, settings, layout)
        costs.generation_seconds = generation_seconds_per_sequence
        remaining = budget_seconds - (time.perf_counter() - started)
        return costs.sequences_within(remaining, settings) * settings.heal_seq_len, costs

    return distributed.on_main_process(choose)
