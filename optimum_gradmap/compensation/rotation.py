# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""The orthogonal rotation of LinearPatch's form of W' (`compensation_form="rotated_diagonal"`): W' =
Q^T diag(s) Q, with Q a Hadamard matrix scaled to be orthogonal. A Hadamard matrix spreads every channel
over all of them with equal weight, so the few channels that carry massive activations no longer stand
alone (LinearPatch, Chen et al., NeurIPS 2025, Sec. 3.2; QuaRot, Ashkboos et al., 2024, for the same use).

Hadamard matrices of order d exist for d = 1, 2 and multiples of 4 (conjecturally all of them); this module
builds them as Kronecker products of Sylvester's 2^k with one of Paley's constructions (Paley, 1933):

- Paley I, order q + 1 for a prime q = 3 (mod 4): H = I + S, with S the skew conference matrix built from the
  quadratic residues mod q;
- Paley II, order 2(q + 1) for a prime q = 1 (mod 4), from the symmetric conference matrix.

That covers the hidden sizes of the models this library is measured on (576 = 8 x 72, Paley I with q = 71;
896 = 4 x 224, q = 223; every power of two). For a size none of these reach, [`rotation`] uses a fixed
random orthogonal matrix (the QR factor of a seeded Gaussian matrix), which spreads the channels too, and
says so in its log.
"""

from __future__ import annotations

import functools

import torch
from transformers.utils import logging

logger = logging.get_logger(__name__)


def _is_prime(number: int) -> bool:
    return number > 1 and all(number % divisor for divisor in range(2, int(number**0.5) + 1))


def _sylvester(order: int) -> torch.Tensor:
    matrix = torch.ones(1, 1, dtype=torch.float64)
    while matrix.shape[0] < order:
        matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)])
    return matrix


def _jacobsthal(prime: int) -> torch.Tensor:
    """Q[i, j] = the Legendre symbol of (j - i) mod `prime` (0 on the diagonal)."""
    residues = {(value * value) % prime for value in range(1, prime)}
    symbol = torch.tensor([0.0] + [1.0 if value in residues else -1.0 for value in range(1, prime)], dtype=torch.float64)
    index = torch.arange(prime)
    return symbol[(index[None, :] - index[:, None]) % prime]


def _conference(prime: int, skew: bool) -> torch.Tensor:
    """The conference matrix of order `prime` + 1: [[0, 1^T], [+-1, Q]]."""
    ones = torch.ones(prime, dtype=torch.float64)
    top = torch.cat([torch.zeros(1, dtype=torch.float64), ones])[None]
    bottom = torch.cat([(-ones if skew else ones)[:, None], _jacobsthal(prime)], 1)
    return torch.cat([top, bottom])


def _paley(order: int) -> torch.Tensor | None:
    """A Hadamard matrix of `order` by Paley's first or second construction, or `None`."""
    if _is_prime(order - 1) and (order - 1) % 4 == 3:
        return torch.eye(order, dtype=torch.float64) + _conference(order - 1, skew=True)
    if order % 2 == 0 and _is_prime(order // 2 - 1) and (order // 2 - 1) % 4 == 1:
        conference = _conference(order // 2 - 1, skew=False)
        plus = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
        minus = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
        return torch.kron(conference, plus) + torch.kron(torch.eye(order // 2, dtype=torch.float64), minus)
    return None


def hadamard_matrix(order: int) -> torch.Tensor | None:
    """A Hadamard matrix of `order` (entries +-1, H H^T = order I), as Sylvester's 2^k times a Paley matrix;
    `None` when no such product has that order."""
    power = 1
    while order % power == 0:
        rest = order // power
        if rest == 1:
            return _sylvester(power)
        paley = _paley(rest)
        if paley is not None:
            return torch.kron(_sylvester(power), paley)
        power *= 2
    return None


@functools.lru_cache(maxsize=8)
def rotation(size: int) -> torch.Tensor:
    """The orthogonal Q (float64, CPU) of `compensation_form="rotated_diagonal"`: the Hadamard matrix of
    order `size` divided by sqrt(size), or, for a size with no Hadamard matrix here, a fixed random
    orthogonal matrix (seed 0)."""
    hadamard = hadamard_matrix(size)
    if hadamard is not None:
        return hadamard / size**0.5
    logger.warning(f"No Hadamard matrix of order {size} is built here: rotating by a fixed random orthogonal matrix instead.")
    gaussian = torch.randn(size, size, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    orthogonal, upper = torch.linalg.qr(gaussian)
    return orthogonal * torch.sign(torch.diagonal(upper))[None]
