# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""The layer-importance interface ([`ImportanceMetric`]) and its registry: metric name -> class, fed by
[`register_importance_metric`] and read by `GradMAPConfig`, the command line and
[`~optimum_gradmap.importance.metrics.get_importance_metric`]. The metrics themselves are in
[`optimum_gradmap.importance.metrics`].

A leaf: it imports nothing from the package, and the configuration checks a metric's name here without loading
Stage 1. The built-in metrics' names are listed ([`BUILTIN_METRIC_NAMES`]) so that the check needs no metric class;
`optimum_gradmap.importance.metrics` registers exactly these (a test holds the two together)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar, TypeVar

import torch
from transformers import PreTrainedModel

if TYPE_CHECKING:
    from ..adapters import DecoderAdapter


class ImportanceMetric:
    """Scores the decoder layers currently in a model; the lowest-scoring layers are removed first.

    Subclasses set `name`, `iterative` (whether their paper re-scores after each removal),
    `mean_over_samples` (whether the score is a mean over calibration sequences of per-sequence values, so
    that processes can score shares of them and average, see [`optimum_gradmap.distributed`]) and
    implement [`~ImportanceMetric.score`]. Register a subclass with [`register_importance_metric`] to
    make its name usable in `GradMAPConfig(importance=...)` and on the command line, or pass an
    instance directly: `GradMAPConfig(importance=MyMetric())`.

    Args:
        seed (`int`, defaults to 0): For metrics that draw random numbers.
    """

    name: ClassVar[str]
    iterative: ClassVar[bool] = False
    mean_over_samples: ClassVar[bool] = False
    # whether a layer's score is the calibration loss of the model without it (SLEB): the loss after a removal
    # is then known without another pass
    scores_are_losses: ClassVar[bool] = False
    # How far (relative) a score computed in bfloat16 passes may lie from its float32 value, where it was measured
    # ([`optimum_gradmap.precision`]): under `precision="auto"` the metric then scores in bfloat16 and a round whose margin
    # lies within it is recomputed in float32. None (not measured): the metric scores in the model's dtype.
    precision_bound: ClassVar[float | None] = None
    # The device types ("cuda", "cpu") where its bfloat16 passes pay for the float32 recomputations its bound leaves;
    # elsewhere it scores in float32 under `precision="auto"` too.
    bfloat16_devices: ClassVar[tuple[str, ...]] = ("cuda", "cpu")
    # What one scoring pass runs, for the cost told before a run ([`optimum_gradmap.planning`]): "per_sample_gradient"
    # (a forward and an input-gradient backward pass with per-sample gradient norms, GradMAP's), "gradient" (a forward and
    # an input-gradient backward pass), "parameter_gradient" (a forward and a backward pass that forms the parameters'
    # gradients), "forward" (the whole model's forward pass), "removal_losses" (SLEB's loss without each candidate),
    # "none" (no pass). None (a metric of your own that does not say): the plan says its scoring is not counted.
    scoring_pass: ClassVar[str | None] = None

    def __init__(self, seed: int = 0):
        self.seed = seed

    def score(
        self,
        model: PreTrainedModel,
        adapter: DecoderAdapter,
        input_ids: torch.LongTensor,
        batch_size: int,
        progress_bar: bool = True,
        description: str = "Scoring layers",
    ) -> list[float]:
        """Scores every layer of `adapter.get_layers(model)`, in model order.

        Args:
            model (`PreTrainedModel`): The model as it is now (some layers may already be removed).
            adapter (`DecoderAdapter`): Its architecture adapter.
            input_ids (`torch.LongTensor` of shape `(num_samples, seq_len)`): Calibration sequences.
            batch_size (`int`): Sequences per forward pass.
            progress_bar (`bool`, defaults to `True`): Show a progress bar.
            description (`str`): Progress bar label.

        Returns:
            `list[float]`: One score per layer; lower means less important.
        """
        raise NotImplementedError

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
        """Scores at least the layers at `positions` (positions in the current stack). Stage 1 calls
        this; a metric whose cost grows with the number of layers it scores (SLEB) scores only those,
        the others score every layer with [`~ImportanceMetric.score`].

        Returns:
            `dict[int, float]`: Position -> score, for every position in `positions` (and maybe others).
        """
        return dict(enumerate(self.score(model, adapter, input_ids, batch_size, progress_bar, description)))

    def protected_layers(self, num_layers: int) -> set[int]:
        """Layers (original indices) the method's paper never removes. None by default;
        `GradMAPConfig(protected_layers=...)` overrides it."""
        return set()


# The names of the metrics `optimum_gradmap.importance.metrics` registers, in its order: known before it is loaded.
# Each has its reason to be public: the paper's score (`gradmap`, the default and the `paper` preset); a named peer's
# (`block_influence`: ShortGPT; `sleb`: SLEB; `taylor`: Shortened LLaMA's Taylor+; `relative_magnitude`: Subcloning's
# magnitude, the `fast` preset); or a preset's and a best row (`gradmap_bound_token`: the `quality` preset, the best
# perplexity of docs/benchmarks/layer-selection.md's shortlists on SmolLM2-135M at 25%).
BUILTIN_METRIC_NAMES: tuple[str, ...] = (
    "gradmap",
    "block_influence",
    "sleb",
    "taylor",
    "relative_magnitude",
    "gradmap_bound_token",
)

# The registry: metric name -> class. Fed by `register_importance_metric`, read by `GradMAPConfig`,
# the command line and `get_importance_metric`.
IMPORTANCE_METRICS: dict[str, type[ImportanceMetric]] = {}

MetricClass = TypeVar("MetricClass", bound=type[ImportanceMetric])


def register_importance_metric(cls: MetricClass) -> MetricClass:
    """Class decorator that registers an [`ImportanceMetric`] subclass under its `name`.

    ```python
    @register_importance_metric
    class LastTokenNorm(ImportanceMetric):
        name = "last_token_norm"

        def score(self, model, adapter, input_ids, batch_size, progress_bar=True, description="Scoring layers"):
            ...
    ```
    """
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"{cls.__name__} needs a class attribute `name` (a non-empty string) to be registered.")
    IMPORTANCE_METRICS[name] = cls
    return cls


def importance_metric_names() -> list[str]:
    """The metrics' names: the built-in ones ([`BUILTIN_METRIC_NAMES`]), then those registered with
    [`register_importance_metric`], in registration order."""
    return list(dict.fromkeys([*BUILTIN_METRIC_NAMES, *IMPORTANCE_METRICS]))
