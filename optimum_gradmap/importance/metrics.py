# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Layer-importance metrics behind one interface, selected by `GradMAPConfig(importance=...)`.

Every metric scores the decoder layers currently in the model; Stage 1 removes the lowest-scoring
layer (and re-scores, for iterative metrics) until K layers are gone. Each follows its paper, and each has its
reason to be public:

| name | method | score of layer i | iterative | public as |
|---|---|---|---|---|
| `"gradmap"` | GradMAP, Eq. 5 | mean over samples of the squared norm of the per-sample gradient | yes | paper, default |
| `"gradmap_bound_token"` | GradMAP's bound, Eq. 9-11 | mean of sum_t norm(dL/dH_i,t) norm(f_i,t) | yes | preset, best row |
| `"block_influence"` | ShortGPT (Men et al., 2024), Eq. 1 | 1 - mean over tokens of cos(x_i, x_{i+1}) | no | peer |
| `"sleb"` | SLEB (Song et al., 2024), Sec. 4 | calibration loss of the model without layer i | yes | peer |
| `"taylor"` | Shortened LLaMA (Kim et al., 2024), Taylor+ | sum over the layer's weights of abs(w * dL/dw) | no | peer |
| `"relative_magnitude"` | Subcloning (Samragh et al., 2023) | mean over tokens of norm(f(x)) / norm(x+f(x)) | no | peer, preset |

The presets: `paper` (gradmap), `quality` (gradmap_bound_token), `fast` (relative_magnitude). "Best row":
`gradmap_bound_token` with a verified shortlist of 8 has the lowest perplexity of the layer-selection
page's shortlists on SmolLM2-135M at 25% (docs/benchmarks/layer-selection.md). The retired metrics, and the figures
that retired them, are in `optimum_gradmap.retired.RETIRED_METRICS`; `random`, the tables' baseline, lives in
[`optimum_gradmap.experimental`].

f_i = H_i - H_{i-1} is what layer i adds to the residual stream; the residual-branch score needs one
forward and one activation-gradient backward pass per round (see [`optimum_gradmap.importance.residual`]).

`GradMAPConfig(iterative=...)` overrides the method's own choice. A metric of your own: subclass
[`ImportanceMetric`] and register it with [`register_importance_metric`] (its name then works in
`GradMAPConfig(importance=...)` and on the command line), or pass an instance to `GradMAPConfig`.
The removal loop that calls the metrics is [`optimum_gradmap.importance.selection`].
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.utils import logging

from .. import surgery
from ..adapters import DecoderAdapter
from ..errors import InvalidInputError
from ..metric_registry import IMPORTANCE_METRICS, ImportanceMetric, register_importance_metric
from ..objectives import summed_loss
from ..passes import (
    calibration_batches,
    forward_hooks,
    forward_pre_hooks,
    layer_input,
    layer_output,
    run_model,
    stop_after,
)
from ..precision import LOSS_BOUND, SCORE_BOUND
from ..retired import RETIRED_METRICS, retired_metric_message
from ..vocabulary import vocabulary_head
from . import residual
from .gradient import gradient_importance, loss_gradient_passes
from .residual import residual_branch_scores

logger = logging.get_logger(__name__)


@register_importance_metric
class GradMAPImportance(ImportanceMetric):
    """GradMAP, Eq. 5: the trace of each layer's empirical Fisher, i.e. the mean over calibration
    samples of the squared L2 norm of the per-sample loss gradient over all the layer's parameters.
    Iterative (Algorithm 1). See [`gradient_importance`]."""

    name = "gradmap"
    mean_over_samples = True
    iterative = True
    precision_bound = SCORE_BOUND
    # On a CPU a bfloat16 round took 0.69 of a float32 one (AVX512-BF16, no AMX), and the bound left 7 of the main
    # job's 8 rounds to recompute (about 0.7 of a round each): slower than float32 (docs/benchmarks/stage1-cost.md).
    bfloat16_devices = ("cuda",)
    scoring_pass = "per_sample_gradient"

    def score(
        self,
        model: PreTrainedModel,
        adapter: DecoderAdapter,
        input_ids: torch.LongTensor,
        batch_size: int,
        progress_bar: bool = True,
        description: str = "Scoring layers",
    ) -> list[float]:
        positions = range(adapter.num_layers(model))
        scores = self.score_layers(model, adapter, input_ids, batch_size, positions, progress_bar, description)
        return [scores[position] for position in positions]

    def score_layers(
        self,
        model: PreTrainedModel,
        adapter: DecoderAdapter,
        input_ids: torch.LongTensor,
        batch_size: int,
        positions: Sequence[int],
        progress_bar: bool = True,
        description: str = "Scoring layers",
    ) -> dict[int, float]:
        """The layers at `positions` only: hooks on those, and a backward pass that stops at the first of them."""
        layers = [adapter.get_layers(model)[position] for position in positions]
        units = [unit for layer in layers for unit in adapter.get_per_sample_units(layer)]
        scores = gradient_importance(model, layers, input_ids, batch_size, progress_bar, description, units, adapter)
        return dict(zip(positions, scores.tolist()))


class _MeanOverTokens(ImportanceMetric):
    """A one-shot metric whose score of a layer is the mean over every calibration token of [`per_token`] of the hidden
    state entering the layer and the one leaving it, from one forward pass."""

    mean_over_samples = True
    scoring_pass = "forward"

    @staticmethod
    def per_token(hidden_in: torch.Tensor, hidden_out: torch.Tensor) -> torch.Tensor:
        """Each token's value, from the hidden states entering and leaving the layer (float64)."""
        raise NotImplementedError

    def score(
        self,
        model: PreTrainedModel,
        adapter: DecoderAdapter,
        input_ids: torch.LongTensor,
        batch_size: int,
        progress_bar: bool = True,
        description: str = "Scoring layers",
    ) -> list[float]:
        layers = adapter.get_layers(model)
        inputs: dict[int, torch.Tensor] = {}
        sums: list[torch.Tensor] = []  # on the model's device: no host synchronisation per batch

        def remember_input(position: int, module: nn.Module, args: tuple, kwargs: dict) -> None:
            inputs[position] = layer_input(args, kwargs)

        def accumulate(position: int, module: nn.Module, args: tuple, output: object) -> None:
            values = self.per_token(inputs.pop(position).double(), layer_output(output).double())
            if not sums:
                sums.extend(torch.zeros((), dtype=torch.float64, device=values.device) for _ in layers)
            sums[position] += values.sum()

        pre_hooks = [(layer, lambda m, a, k, p=p: remember_input(p, m, a, k)) for p, layer in enumerate(layers)]
        hooks = [(layer, lambda m, a, o, p=p: accumulate(p, m, a, o)) for p, layer in enumerate(layers)]
        with calibration_batches(model, input_ids, batch_size, description, progress_bar) as batches:
            with forward_pre_hooks(pre_hooks), forward_hooks(hooks):
                for batch in batches:
                    model(input_ids=batch, use_cache=False)
        return (torch.stack(sums).cpu() / input_ids.numel()).tolist()


@register_importance_metric
class BlockInfluence(_MeanOverTokens):
    """ShortGPT's Block Influence (Men et al., 2024, "ShortGPT: Layers in Large Language Models are
    More Redundant Than You Expect", Eq. 1):

        BI_i = 1 - E_{X, t} [ X_{i,t}^T X_{i+1,t} / (||X_{i,t}||_2 ||X_{i+1,t}||_2) ]

    where X_{i,t} is the hidden state entering layer i at token t and X_{i+1,t} the one leaving it;
    the expectation runs over every calibration token. Scored once (one-shot), as in the paper.
    """

    name = "block_influence"

    @staticmethod
    def per_token(hidden_in: torch.Tensor, hidden_out: torch.Tensor) -> torch.Tensor:
        return 1.0 - F.cosine_similarity(hidden_in, hidden_out, dim=-1)


def removal_losses(
    model: PreTrainedModel,
    adapter: DecoderAdapter,
    input_ids: torch.LongTensor,
    batch_size: int,
    positions: Sequence[int],
    progress_bar: bool = True,
    description: str = "Verifying removals",
) -> dict[int, float]:
    """The calibration loss (mean next-token cross-entropy over all calibration tokens) of the model
    without the layer at each of `positions`, one layer at a time: SLEB's criterion.

    Exact, with less work than one full forward pass per candidate: the layers before a candidate
    compute the same thing with or without it, so one pass per batch records each candidate's input
    (and stops after the deepest one), and the model without the candidate starts from its recorded
    input (a stand-in module at the head of the layer list returns it) and runs only the layers after it.

    Args:
        model (`PreTrainedModel`): The model as it is now.
        adapter (`DecoderAdapter`): Its adapter.
        input_ids (`torch.LongTensor` of shape `(num_samples, seq_len)`): Calibration sequences.
        batch_size (`int`): Sequences per pass.
        positions (`Sequence[int]`): Positions, in the current stack, of the layers to try removing.

    Returns:
        `dict[int, float]`: Position -> loss without that layer.
    """
    stack = surgery.snapshot(model, adapter)
    positions = sorted(set(positions))
    deepest = positions[-1]
    totals: dict[int, torch.Tensor] = {}
    inputs: dict[int, torch.Tensor] = {}
    returns_tuple: list[bool] = []

    def remember_input(position: int, module: nn.Module, args: tuple, kwargs: dict) -> None:
        inputs[position] = layer_input(args, kwargs)

    def note_output(module: nn.Module, args: tuple, output: object) -> None:
        returns_tuple.append(isinstance(output, (tuple, list)))  # the stand-in returns what a layer returns

    pre_hooks = [(stack.layers[p], lambda m, a, k, p=p: remember_input(p, m, a, k)) for p in positions]
    head = vocabulary_head(model)
    with calibration_batches(model, input_ids, batch_size, description, progress_bar) as batches:
        for batch in batches:
            with forward_pre_hooks(pre_hooks), forward_hooks([(stack.layers[deepest], note_output)]):
                with stop_after(stack.layers[deepest]):
                    run_model(model, batch)
            for position in positions:
                # run layers position+1.. from the recorded input of the layer at `position`
                with stack.replaying(position, inputs[position], returns_tuple[0]):
                    loss = summed_loss(model, batch, head)  # the logits a few at a time
                totals[position] = loss if position not in totals else totals[position] + loss
            inputs.clear()
    num_predicted = input_ids.shape[0] * (input_ids.shape[1] - 1)
    return {position: float(totals[position]) / num_predicted for position in positions}


@register_importance_metric
class SLEBImportance(ImportanceMetric):
    """SLEB (Song et al., 2024, "SLEB: Streamlining LLMs through Redundancy Verification and
    Elimination of Transformer Blocks", Sec. 4 and Algorithm 1): the score of block i is the
    calibration loss (mean next-token cross-entropy over all calibration tokens, the log of the
    perplexity SLEB measures) of the current model with block i removed; the block whose removal
    raises the loss least goes first, and every block is re-verified after each removal (iterative).
    As in SLEB's code (`early_barrier=1, latter_barrier=1`), the first and the last block are never
    candidates. Computed by [`removal_losses`], for the candidates only.
    """

    name = "sleb"
    mean_over_samples = True
    iterative = True
    scores_are_losses = True
    precision_bound = LOSS_BOUND
    scoring_pass = "removal_losses"

    def protected_layers(self, num_layers: int) -> set[int]:
        return {0, num_layers - 1}

    def score(
        self,
        model: PreTrainedModel,
        adapter: DecoderAdapter,
        input_ids: torch.LongTensor,
        batch_size: int,
        progress_bar: bool = True,
        description: str = "Scoring layers",
    ) -> list[float]:
        positions = range(adapter.num_layers(model))
        losses = removal_losses(model, adapter, input_ids, batch_size, positions, progress_bar, description)
        return [losses[position] for position in positions]

    def score_layers(
        self,
        model: PreTrainedModel,
        adapter: DecoderAdapter,
        input_ids: torch.LongTensor,
        batch_size: int,
        positions: Sequence[int],
        progress_bar: bool = True,
        description: str = "Scoring layers",
    ) -> dict[int, float]:
        return removal_losses(model, adapter, input_ids, batch_size, positions, progress_bar, description)


@register_importance_metric
class TaylorImportance(ImportanceMetric):
    """Taylor+ from Shortened LLaMA (Kim et al., 2024, "Shortened LLaMA: Depth Pruning for LLMs with
    Comparison of Retraining Methods", Sec. 3.2): the first-order Taylor estimate of the loss change
    when a block's weights are zeroed,

        I_i = sum_{W in block i} sum_k | W_k * dL/dW_k |

    with L the calibration loss (mean next-token cross-entropy over all calibration sequences) and
    the gradient of that loss over the whole set. "+": the first `protect_first` (4) and last
    `protect_last` (2) blocks are never removed, which the paper found necessary because Taylor
    scores rank the early blocks low although removing them is harmful. Scored once (one-shot).

    Args:
        seed (`int`, defaults to 0): Unused.
        protect_first (`int`, defaults to 4), protect_last (`int`, defaults to 2): Blocks kept out of the candidates.
    """

    name = "taylor"
    scoring_pass = "parameter_gradient"

    def __init__(self, seed: int = 0, protect_first: int = 4, protect_last: int = 2):
        super().__init__(seed)
        self.protect_first = protect_first
        self.protect_last = protect_last

    def protected_layers(self, num_layers: int) -> set[int]:
        return set(range(min(self.protect_first, num_layers))) | set(range(max(0, num_layers - self.protect_last), num_layers))

    def score(
        self,
        model: PreTrainedModel,
        adapter: DecoderAdapter,
        input_ids: torch.LongTensor,
        batch_size: int,
        progress_bar: bool = True,
        description: str = "Scoring layers",
    ) -> list[float]:
        parameters = [list(layer.parameters()) for layer in adapter.get_layers(model)]
        saved_grads = {id(p): p.grad for group in parameters for p in group}
        for group in parameters:
            for parameter in group:
                parameter.grad = None
        try:
            # the gradient of the sum of per-sample mean losses; / num_samples below gives the mean
            loss_gradient_passes(
                model, adapter, input_ids, batch_size, description, progress_bar, parameters=[p for g in parameters for p in g]
            )
            return [
                sum((p.detach().double() * p.grad.double()).abs().sum().item() for p in group if p.grad is not None)
                / input_ids.shape[0]
                for group in parameters
            ]
        finally:
            for group in parameters:
                for parameter in group:
                    parameter.grad = saved_grads[id(parameter)]


@register_importance_metric
class RelativeMagnitude(_MeanOverTokens):
    """Relative magnitude of a layer's update (Samragh et al., 2023, "Weight subcloning: direct
    initialization of transformers using larger pretrained ones", Sec. 3):

        score_i = E_{X, t} [ ||f_i(x_t)||_2 / ||x_t + f_i(x_t)||_2 ]

    where x_t is the hidden state entering layer i and x_t + f_i(x_t) the one leaving it (the
    residual stream), so f_i(x_t) is what the layer adds. Scored once (one-shot).
    """

    name = "relative_magnitude"

    @staticmethod
    def per_token(hidden_in: torch.Tensor, hidden_out: torch.Tensor) -> torch.Tensor:
        return (hidden_out - hidden_in).norm(dim=-1) / hidden_out.norm(dim=-1).clamp_min(1e-12)


class ResidualBranchMetric(ImportanceMetric):
    """A score from each layer's residual contribution f_i and the loss gradient g_i at its output, per
    sample, averaged over samples: one forward and one activation-gradient backward pass per round,
    nothing per parameter (see [`optimum_gradmap.importance.residual`]). Subclasses set `statistic`."""

    iterative = True
    mean_over_samples = True
    scoring_pass = "gradient"
    statistic: ClassVar[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]

    def score(
        self,
        model: PreTrainedModel,
        adapter: DecoderAdapter,
        input_ids: torch.LongTensor,
        batch_size: int,
        progress_bar: bool = True,
        description: str = "Scoring layers",
    ) -> list[float]:
        layers = adapter.get_layers(model)
        statistic = type(self).statistic
        return residual_branch_scores(
            model, adapter, layers, input_ids, batch_size, statistic, progress_bar, description
        ).tolist()


@register_importance_metric
class GradMAPBoundPerToken(ResidualBranchMetric):
    """The bound GradMAP derives for its score (Eq. 9-11), with the factor the paper drops kept, applied token by
    token: |dL| <= sum_t ||dL/dH_{i,t}|| ||f_{i,t}||, f_i = H_i - H_{i-1} the layer's residual contribution (the paper
    drops M_i = max ||f_i|| as not depending on the pruning decision; it varies across layers by orders of
    magnitude). Score: the mean over samples j of sum_t ||dL_j/dH_{i,t}|| ||f_{i,t}(x_j)||. Iterative (Algorithm 1).
    Not the paper's score (that is `"gradmap"`): the `quality` preset's, with a verified shortlist."""

    name = "gradmap_bound_token"
    statistic = staticmethod(residual.token_norm_product)


def get_importance_metric(name_or_metric: str | ImportanceMetric, seed: int = 0) -> ImportanceMetric:
    """The metric registered under a name (see [`register_importance_metric`]), or the given instance itself.

    Raises:
        ValueError: for a name that no metric is registered under; the message lists the registered ones.
    """
    if isinstance(name_or_metric, ImportanceMetric):
        return name_or_metric
    if name_or_metric in RETIRED_METRICS and name_or_metric not in IMPORTANCE_METRICS:
        raise InvalidInputError(retired_metric_message(name_or_metric))
    if name_or_metric not in IMPORTANCE_METRICS:
        raise InvalidInputError(
            f"Unknown importance metric {name_or_metric!r}. Available: {', '.join(IMPORTANCE_METRICS)}. "
            "A metric of your own: subclass `ImportanceMetric` and register it with `@register_importance_metric`, "
            "or pass an instance."
        )
    return IMPORTANCE_METRICS[name_or_metric](seed=seed)
