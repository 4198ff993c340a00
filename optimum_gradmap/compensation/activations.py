# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Stage 2's calibration passes: the mean hidden states behind the drift (Eq. 10), the dense outputs a layer
is fitted to, and, batch by batch, what the fit of one kept layer needs ([`CompensationBatch`]: the MLP's
output, the residual stream it is added to, the dense hidden state to match, and each token's weight)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .. import distributed
from ..adapters import DecoderAdapter
from ..passes import (
    calibration_batches,
    for_each_layer_output,
    forward_hooks,
    layer_input,
    layer_output,
    run_model,
    stop_after,
)


def hidden_state_means(
    model: nn.Module,
    layers: Sequence[nn.Module],
    input_ids: torch.LongTensor,
    batch_size: int,
    progress_bar: bool = True,
    description: str = "Measuring hidden states",
) -> torch.Tensor:
    """Mean output hidden state of each layer over all calibration tokens.

    Returns:
        `torch.Tensor` of shape `(len(layers), hidden_size)`, float64, on CPU.
    """
    return hidden_state_means_and_outputs(model, layers, input_ids, batch_size, (), progress_bar, description)[0]


def hidden_state_means_and_outputs(
    model: nn.Module,
    layers: Sequence[nn.Module],
    input_ids: torch.LongTensor,
    batch_size: int,
    record: Sequence[int],
    progress_bar: bool = True,
    description: str = "Measuring hidden states",
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """In one pass, [`hidden_state_means`] and the whole output of the layers at positions `record` of `layers` (what
    [`record_layer_outputs`] gives).

    Returns:
        `tuple[torch.Tensor, list[torch.Tensor]]`: The means, `(len(layers), hidden_size)` in float64 on CPU, and the
        recorded outputs, `(num_samples, seq_len, hidden_size)` each in float32 on CPU, in the order of `record`.
    """
    sums: list[torch.Tensor | None] = [None] * len(layers)
    outputs: dict[int, list[torch.Tensor]] = {position: [] for position in record}

    def accumulate(position: int, hidden: torch.Tensor) -> None:
        total = hidden.reshape(-1, hidden.shape[-1]).sum(dim=0, dtype=torch.float64)
        sums[position] = total if sums[position] is None else sums[position] + total
        if position in outputs:
            outputs[position].append(hidden.float().cpu())

    for_each_layer_output(model, layers, input_ids, batch_size, accumulate, description, progress_bar)
    means = torch.stack([total.cpu() for total in sums]) / input_ids.numel()
    return means, [torch.cat(outputs[position]) for position in record]


def record_layer_outputs(
    model: nn.Module,
    layers: Sequence[nn.Module],
    input_ids: torch.LongTensor,
    batch_size: int,
    progress_bar: bool = True,
    description: str = "Recording original outputs",
) -> list[torch.Tensor]:
    """Output hidden states of the given layers on all calibration tokens, in float32 on CPU.

    Returns:
        `list[torch.Tensor]`, one tensor of shape `(num_samples, seq_len, hidden_size)` per layer.
    """
    outputs: list[list[torch.Tensor]] = [[] for _ in layers]
    store = lambda position, hidden: outputs[position].append(hidden.float().cpu())  # noqa: E731
    for_each_layer_output(model, layers, input_ids, batch_size, store, description, progress_bar)
    return [torch.cat(chunks) for chunks in outputs]


# A token whose dense hidden state's norm exceeds this many times the median norm over the calibration set is an outlier.
OUTLIER_NORM_FACTOR = 5.0


def median_token_norm(original: torch.Tensor) -> float:
    """The median norm of the dense hidden states over every calibration token: the scale of [`outlier_tokens`] and
    the clipped weights, a property of the calibration set. With several processes ([`optimum_gradmap.distributed`]),
    `original` is this process's share, and the median is taken over every process's tokens (their norms gathered),
    so that neither the batch size nor the number of processes changes it.

    Args:
        original (`torch.Tensor` of shape `(samples, tokens, d)`): The dense hidden states (this process's share).

    Returns:
        `float`: The median (the lower middle value for an even count, as `torch.median` takes it).
    """
    norms = original.reshape(-1, original.shape[-1]).double().norm(dim=-1)
    return float(distributed.gather_rows(norms).median())


def outlier_tokens(original: torch.Tensor, median_norm: float | None = None, factor: float = OUTLIER_NORM_FACTOR) -> torch.Tensor:
    """The tokens that carry massive activations (Sun et al., COLM 2024, "Massive Activations in Large
    Language Models"; LinearPatch, Chen et al., NeurIPS 2025, Sec. 3.1): the first token of every sequence,
    and every token whose dense hidden state's norm exceeds `factor` times the median norm over the calibration set.
    Measured on SmolLM2-135M's calibration windows: the first token's norm is about 150 times the median
    from layer 14 on, so in an L2 fit one such token weighs as much as 20,000 others.

    Args:
        original (`torch.Tensor` of shape `(samples, tokens, d)`): The dense hidden states.
        median_norm (`float`, *optional*): The median norm over the whole calibration set ([`median_token_norm`]);
            defaults to the median over `original`'s tokens (then `original` should be the whole set).
        factor (`float`, defaults to `OUTLIER_NORM_FACTOR`): How many times the median norm makes an outlier.

    Returns:
        `torch.Tensor` of shape `(samples, tokens)`, bool: True for an outlier.
    """
    norms = original.double().norm(dim=-1)
    median_norm = float(norms.median()) if median_norm is None else median_norm
    outliers = norms > factor * median_norm
    outliers[:, 0] = True
    return outliers


def outlier_token_weights(
    original: torch.Tensor, handling: str, median_norm: float | None = None, factor: float = OUTLIER_NORM_FACTOR
) -> torch.Tensor | None:
    """Each token's weight in Stage 2's fit under `Stage2Settings.outlier_tokens`.

    Args:
        original (`torch.Tensor` of shape `(samples, tokens, d)`): The dense hidden states.
        handling (`str`): `"keep"` (every token weighs 1: the paper) or `"exclude"` (0 for the [`outlier_tokens`], 1
            for the others).
        median_norm (`float`, *optional*): As in [`outlier_tokens`].
        factor (`float`, defaults to `OUTLIER_NORM_FACTOR`): As in [`outlier_tokens`].

    Returns:
        `torch.Tensor` of shape `(samples, tokens)`, float64, or `None` for `"keep"`.
    """
    if handling == "keep":
        return None
    if handling != "exclude":
        raise ValueError(
            f"outlier_tokens={handling!r}: expected 'keep' or 'exclude' ('auto' is resolved first, by `resolve_selection`)."
        )
    return (~outlier_tokens(original, median_norm, factor)).double()


@dataclass(frozen=True)
class FitData:
    """What W' for one kept layer is fitted on: the layer in the pruned model, and the dense hidden states it is
    fitted to on this process's calibration sequences.

    Args:
        model (`nn.Module`): The pruned model.
        adapter (`DecoderAdapter`): Its family's adapter.
        layer (`nn.Module`): The kept layer to fit.
        original_outputs (`torch.Tensor` of shape `(num_samples, seq_len, d)`): X_O, the target hidden states on
            `input_ids`: the dense model's output of the same layer, or of the last layer of the span removed after it.
        input_ids (`torch.LongTensor` of shape `(num_samples, seq_len)`): Calibration sequences: with several
            processes, this process's share of them ([`optimum_gradmap.distributed`]).
        first_sample (`int`, defaults to 0): The index of `input_ids[0]` in the whole calibration set, which sets the
            cross-validation folds (sequence j in fold j mod the number of folds).
    """

    model: nn.Module
    adapter: DecoderAdapter
    layer: nn.Module
    original_outputs: torch.Tensor
    input_ids: torch.LongTensor
    first_sample: int = 0


@dataclass
class CompensationBatch:
    """One batch of Stage 2's data for a kept layer, each tensor `(samples, tokens, d)` in float64 on the
    model's device.

    Args:
        mlp_output (`torch.Tensor`): Y, the MLP's output, which W' multiplies.
        ffn_input (`torch.Tensor`): X_F, the residual stream the MLP's contribution is added to.
        original (`torch.Tensor`): X_O, the dense hidden state the layer's output should match.
        first_sample (`int`): The index of the batch's first sequence in the calibration sequences given.
        weight (`torch.Tensor` of shape `(samples, tokens)`, *optional*): Each token's weight in the fit, float64 (0
            leaves a token out; every token weighs 1 when `None`); see [`outlier_token_weights`].
        layer_input (`torch.Tensor`, *optional*): The hidden states the layer received, as it received them (the
            model's dtype): the next-token selection runs the model from this layer on from them.
        layer_returns_tuple (`bool`, *optional*): Whether the layer returns a tuple (what a stand-in must return).
    """

    mlp_output: torch.Tensor
    ffn_input: torch.Tensor
    original: torch.Tensor
    first_sample: int
    weight: torch.Tensor | None = None
    layer_input: torch.Tensor | None = None
    layer_returns_tuple: bool | None = None

    @property
    def target(self) -> torch.Tensor:
        """R = X_O - X_F, the target of the MLP's residual contribution."""
        return self.original - self.ffn_input


def for_each_compensation_batch(
    data: FitData, batch_size: int, progress_bar: bool, consume: Callable[[CompensationBatch], None], outliers: str = "keep"
) -> None:
    """Runs the pruned model of `data` and calls `consume` with each batch's [`CompensationBatch`], its tokens weighed by
    [`outlier_token_weights`] under `outliers` (`Stage2Settings.outlier_tokens`), against the median norm of the whole
    calibration set ([`median_token_norm`]: neither the batch size nor the number of processes changes a weight).
    Each forward pass ends after `layer`:
    the layers after it and the head are not run."""
    model, adapter, layer, original_outputs = data.model, data.adapter, data.layer, data.original_outputs
    captured: dict[str, object] = {}
    mlp = adapter.get_mlp(layer)
    contribution_module = adapter.get_mlp_output_norm(layer) or mlp  # its output is what the layer adds to the residual

    def capture_layer(module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        captured["layer_input"] = layer_input(args, kwargs)
        captured["layer_output"] = layer_output(output)
        captured["returns_tuple"] = isinstance(output, (tuple, list))

    hooks = [
        (mlp, lambda m, a, o: captured.__setitem__("mlp_output", layer_output(o))),
        (contribution_module, lambda m, a, o: captured.__setitem__("contribution", layer_output(o))),
    ]
    median_norm = median_token_norm(original_outputs) if outliers != "keep" else None
    start = 0
    description = "Collecting compensation data"
    handle = layer.register_forward_hook(capture_layer, with_kwargs=True)
    try:
        with calibration_batches(model, data.input_ids, batch_size, description, progress_bar) as batches, forward_hooks(hooks):
            with stop_after(layer):
                for batch in batches:
                    run_model(model, batch)
                    pruned_output = captured["layer_output"].double()
                    # some families run the MLP on token-flattened rows: align with the layer output
                    contribution = captured["contribution"].double().reshape(pruned_output.shape)
                    ffn_input = pruned_output - contribution  # X_F
                    original = original_outputs[start : start + batch.shape[0]].to(ffn_input)
                    mlp_output = captured["mlp_output"].double().reshape(original.shape)
                    weight = outlier_token_weights(original, outliers, median_norm)
                    consume(
                        CompensationBatch(
                            mlp_output,
                            ffn_input,
                            original,
                            start,
                            weight,
                            layer_input=captured["layer_input"],
                            layer_returns_tuple=captured["returns_tuple"],
                        )
                    )
                    start += batch.shape[0]
    finally:
        handle.remove()
