# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""The search over the grid of ridge strengths that the next-token selection scores
([`~optimum_gradmap.compensation.next_token.learn_by_next_token_loss`]): a golden-section search, or every strength
(`SEARCH`); and the choice among the losses, ties up to float rounding going to the stronger lambda."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .solvers import RidgeChoice

# Held-out losses closer than this (relative) are a tie, decided for the stronger lambda: a float32 model's loss
# moves by about this much with the order of its sums (another batch split, another number of processes).
LOSS_TIE_TOLERANCE = 1e-6

# How the next-token selection searches the grid ([`searched_losses`]): "golden", what every run does. "grid" scores
# every strength: the reference the golden-section search is checked against, which the tests and
# benchmarks/precision_bound.py set here. It left the settings (`lambda_search`) when it chose as "golden" on every
# fit measured (docs/benchmarks/stage1-cost.md).
SEARCH = "golden"

# The share of a bracket that a golden-section step cuts off: 1 - 1 / golden ratio.
GOLDEN_SECTION = (3 - 5**0.5) / 2


def searched_losses(loss_of: Callable[[float], float], grid: Sequence[float], search: str = "grid") -> dict[float, float]:
    """The held-out losses of the strengths of `grid` (increasing) that `search` scores ([`SEARCH`]):

    - `"grid"`: every strength;
    - `"golden"`: a golden-section search over the grid's indices (the grid is log-spaced: a search over log lambda),
      which keeps the bracket around the lower of two inner points until at most three strengths remain, all
      scored; then, from the strongest strength whose loss is the lowest up to `LOSS_TIE_TOLERANCE`, the next stronger
      ones while they stay within it (the tie [`learn_by_next_token_loss`] decides for the stronger lambda). Where the
      loss has a single minimum over the grid it finds the choice of `"grid"` with about five of its nine passes.

    Args:
        loss_of (`Callable`): A strength -> its held-out loss (one pass of the model each).
        grid (`Sequence[float]`): The strengths, increasing.
        search (`str`, defaults to `"grid"`): `"grid"` or `"golden"`.

    Returns:
        `dict[float, float]`: The loss of each strength scored, in the order they were scored.
    """
    losses: dict[float, float] = {}

    def at(index: int) -> float:
        if grid[index] not in losses:
            losses[grid[index]] = loss_of(grid[index])
        return losses[grid[index]]

    if search == "grid":
        for index in range(len(grid)):
            at(index)
        return losses
    if search != "golden":
        raise ValueError(f"search={search!r}: expected 'grid' or 'golden'.")
    low, high = 0, len(grid) - 1
    while high - low > 2:
        step = round((high - low) * GOLDEN_SECTION)
        left, right = low + step, max(high - step, low + step + 1)
        if at(left) <= at(right):
            high = right
        else:
            low = left
    for index in range(low, high + 1):
        at(index)
    lowest = min(losses.values())
    strongest = max(index for index in range(len(grid)) if grid[index] in losses and _tied(losses[grid[index]], lowest))
    while strongest + 1 < len(grid) and _tied(at(strongest + 1), lowest):
        strongest += 1
    return losses


def _tied(loss: float, lowest: float) -> bool:
    """Whether `loss` is the lowest loss up to float rounding (`LOSS_TIE_TOLERANCE`)."""
    return loss <= lowest + LOSS_TIE_TOLERANCE * abs(lowest)


def choose_strength(losses: dict[float, float], identity_loss: float) -> RidgeChoice:
    """The strongest lambda among those whose held-out loss is the lowest up to float rounding (processes that sum
    the loss in another order, [`optimum_gradmap.distributed`], then choose alike); `None` unless it beats W' = I."""
    lowest = min(losses.values())
    best = max(alpha for alpha in losses if _tied(losses[alpha], lowest))
    return RidgeChoice(best if losses[best] < identity_loss else None, losses, identity_loss)
