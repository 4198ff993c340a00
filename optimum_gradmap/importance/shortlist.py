# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""The verified shortlist (`verify_top_k`): the calibration loss without each of Stage 1's k lowest-scored layers
(SLEB's criterion, [`~optimum_gradmap.importance.metrics.removal_losses`]), every candidate on every sequence or raced
by successive halving (`verify_halving`), and the layer whose removal raises it least."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch
from transformers import PreTrainedModel

from .. import distributed
from ..adapters import DecoderAdapter
from ..errors import InvalidInputError
from .metrics import removal_losses


def halving_rungs(num_candidates: int, num_samples: int) -> int:
    """The number of rungs successive halving ([`verify_shortlist`]) splits the calibration sequences into.

    Args:
        num_candidates (`int`): k, the size of the shortlist.
        num_samples (`int`): The number of calibration sequences.

    Returns:
        `int`: ceil(log2 k), so that halving after every rung but the last leaves two finalists for the last
        (1 for k <= 2: plain verification), and never more rungs than sequences.
    """
    return max(1, min(math.ceil(math.log2(max(num_candidates, 1))), num_samples))


def verify_shortlist(
    model: PreTrainedModel,
    adapter: DecoderAdapter,
    calibration_ids: torch.LongTensor,
    batch_size: int,
    positions: list[int],
    halving: bool = False,
    progress_bar: bool = True,
    description: str = "Verifying removals",
) -> tuple[dict[int, float], int, list[int]]:
    """The calibration loss without each shortlisted layer ([`removal_losses`], SLEB's criterion), the
    layer to remove, and the finalists it was chosen among.

    With `halving=False`, every candidate is measured on every calibration sequence. With `halving=True`,
    successive halving (Jamieson & Talwalkar, AISTATS 2016, "Non-stochastic Best Arm Identification and
    Hyperparameter Optimization", Algorithm 1, after Karnin et al., ICML 2013): the sequences are split into
    R = [`halving_rungs`] contiguous rungs; every candidate still in the race is measured on the next rung,
    and after each rung but the last only the better half (by its mean loss over every rung it has seen)
    goes on. The finalists (two, unless there are fewer rungs than halvings) are measured on every
    sequence, and the one with the lowest loss is removed. A candidate dropped earlier keeps its mean over
    the sequences it was measured on; that mean is not comparable with the finalists' (rungs differ in how
    hard their text is), so it is never the one removed. For a shortlist of 8, the candidates are measured
    on 8 + 4 + 2 thirds of the sequences: 58% of measuring all 8 on all of them (more where a rung ends in
    a part-filled batch; the layers before the deepest candidate still run once per sequence).

    Args:
        model (`PreTrainedModel`): The model as it is now.
        adapter (`DecoderAdapter`): Its adapter.
        calibration_ids (`torch.LongTensor` of shape `(num_samples, seq_len)`): Calibration sequences.
        batch_size (`int`): Sequences per pass.
        positions (`list[int]`): Positions, in the current stack, of the shortlisted layers.
        halving (`bool`, defaults to `False`): Use successive halving.
        progress_bar (`bool`, defaults to `True`): Show a progress bar per rung.
        description (`str`, defaults to `"Verifying removals"`): The progress bar's label.

    Returns:
        `tuple[dict[int, float], int, list[int]]`: Position -> mean calibration loss without that layer (over the
        sequences it was measured on), the position of the layer to remove (the lowest loss over every
        sequence; ties go to the lower position), and the positions measured on every sequence (the finalists).

    Raises:
        ValueError: with several processes, when a rung has fewer sequences than there are processes.
    """
    num_rungs = halving_rungs(len(positions), calibration_ids.shape[0]) if halving else 1
    rungs = torch.tensor_split(calibration_ids, num_rungs)
    race = _Race(model, adapter, rungs, batch_size, progress_bar)
    if len(race.rungs) == 1:  # every candidate on every sequence: the losses as measured
        losses = race.measure(0, positions, description)
        return losses, min(positions, key=lambda position: (losses[position], position)), list(positions)
    return race.run(positions, description)


@dataclass(frozen=True)
class _Race:
    """The calibration sequences split into rungs, and how a candidate's loss is measured on one of them; refuses
    rungs the processes cannot share.

    Args:
        model (`PreTrainedModel`), adapter (`DecoderAdapter`): As in [`verify_shortlist`].
        rungs (`tuple[torch.LongTensor, ...]`): The calibration sequences, split into [`halving_rungs`] contiguous
            rungs (one without `halving`).
        batch_size (`int`), progress_bar (`bool`): As in [`verify_shortlist`].
    """

    model: PreTrainedModel
    adapter: DecoderAdapter
    rungs: tuple[torch.LongTensor, ...]
    batch_size: int
    progress_bar: bool

    def __post_init__(self) -> None:
        num_rungs, world_size = len(self.rungs), distributed.world_size()
        if world_size > self.rungs[-1].shape[0]:
            raise InvalidInputError(
                f"verify_halving splits the {sum(rung.shape[0] for rung in self.rungs)} calibration sequences into "
                f"{num_rungs} rungs of {self.rungs[-1].shape[0]} or more, fewer than the {world_size} processes that "
                f"share each rung: use at least {num_rungs * world_size} calibration sequences, or fewer processes."
            )

    def measure(self, rung_index: int, candidates: list[int], label: str) -> dict[int, float]:
        """The loss without each of `candidates`, over the sequences of rung `rung_index` (shared among the processes)."""
        return distributed.mean_over_samples(
            partial(
                removal_losses,
                self.model,
                self.adapter,
                batch_size=self.batch_size,
                positions=candidates,
                progress_bar=self.progress_bar,
                description=label,
            ),
            self.rungs[rung_index],
        )

    def run(self, positions: list[int], description: str) -> tuple[dict[int, float], int, list[int]]:
        """Successive halving over the rungs: after every rung but the last, the better half (by the mean loss over
        every rung seen) goes on; the finalist with the lowest loss over every sequence is the one removed."""
        totals = dict.fromkeys(positions, 0.0)
        counts = dict.fromkeys(positions, 0)
        racing = list(positions)
        num_rungs = len(self.rungs)
        for rung_index, rung in enumerate(self.rungs):
            for position, loss in self.measure(rung_index, racing, f"{description}, rung {rung_index + 1}/{num_rungs}").items():
                totals[position] += loss * rung.shape[0]
                counts[position] += rung.shape[0]
            if rung_index < num_rungs - 1:
                ranked = sorted(racing, key=lambda position: (totals[position] / counts[position], position))
                racing = ranked[: max(2, math.ceil(len(racing) / 2))]
        means = {position: totals[position] / counts[position] for position in positions}
        return means, min(racing, key=lambda position: (means[position], position)), racing
