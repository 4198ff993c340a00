# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""GradMAP's layer importance: per-sample gradient norms.

GradMAP's Stage 1 metric (Eq. 5 of the paper) is the trace of a layer's empirical Fisher:

    s_i = 1/N sum_j sum_{theta in W_i} || dL(x_j, y_j) / d theta ||_2^2

that is, for every calibration sample j separately, the squared L2 norm of the loss gradient over
all parameters of layer i, averaged over samples. It is a per-sample quantity: the norm of the
gradient of a batch is a different (smaller) number.

[`gradient_importance`] computes it exactly in batched passes without ever storing parameter
gradients: model parameters are frozen, the backward pass computes only input gradients, and each
parameter-holding module's per-sample gradient norm is computed from its captured input and output
gradient:

- `nn.Linear` y = W a over the T tokens of sample j has weight gradient G_j = sum_t g_t a_t^T with
  ||G_j||_F^2 = sum_{t,s} (g_t . g_s)(a_t . a_s) (the "ghost norm"); the Gram form costs
  T^2 (d_in + d_out) per sample, forming G_j costs T d_in d_out, and the cheaper one is used.
  The bias gradient is sum_t g_t.
  transformers' `Conv1D` (GPT-2) is the same map with its weight stored transposed.
- any other module with parameters (RMSNorm, LayerNorm, ...) gets its exact per-sample parameter
  gradient from `torch.func.vjp` under `torch.func.vmap`; these modules are small.
- blocks that regroup tokens across samples (mixture-of-experts routing) are scored as a unit: each
  sample's tokens are run through the block again and `torch.func.vjp` gives the gradient of all
  its parameters for that sample. Exact, but it forms one sample's gradient of the block at a time.

The per-sample loss is the mean next-token cross-entropy of the sample (what
`model(input_ids, labels=input_ids).loss` returns for one sequence): the paper's Eq. 4 sums
instead of averaging, which multiplies every score by the same constant (T-1)^2 and so does not
change which layers are removed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn

from .. import streaming
from ..adapters import DecoderAdapter, get_adapter
from ..errors import InvalidInputError
from ..objectives import causal_lm_loss_gradient, vocab_sliced_loss_gradient
from ..passes import calibration_batches
from ..weights import is_linear_map

# Forming per-sample weight gradients of a linear map is done in chunks of at most this many elements.
_MAX_MATERIALISED_ELEMENTS = 2**26


def uses_gram_form(tokens: int, d_in: int, d_out: int) -> bool:
    """Whether the Gram ("ghost norm") form is cheaper than forming per-sample weight gradients."""
    return tokens * (d_in + d_out) <= d_in * d_out


def per_sample_gram(tensor: torch.Tensor, batch_size: int) -> torch.Tensor:
    """The `(batch, T, T)` float32 Gram matrices of each sample's rows of `tensor` (`(batch, T, d)` or `(batch * T, d)`),
    in float32 under autocast too."""
    rows = tensor.reshape(batch_size, -1, tensor.shape[-1]).float()
    with torch.autocast(rows.device.type, enabled=False):
        return torch.bmm(rows, rows.transpose(1, 2))


def linear_per_sample_sq_norms(
    inputs: torch.Tensor, output_grads: torch.Tensor, has_bias: bool, batch_size: int | None = None
) -> torch.Tensor:
    """Per-sample squared Frobenius norm of the gradient of `nn.Linear` weight (and bias).

    Args:
        inputs (`torch.Tensor` of shape `(batch, ..., d_in)` or `(batch * tokens, d_in)`): The linear
            map's inputs, with the rows of each sample contiguous.
        output_grads (`torch.Tensor`, same leading shape, last dimension `d_out`): Loss gradient of its outputs.
        has_bias (`bool`): Whether to add the bias gradient's squared norm.
        batch_size (`int`, *optional*): Number of samples; defaults to the leading dimension.

    Returns:
        `torch.Tensor` of shape `(batch,)`, float32.
    """
    with torch.autocast(inputs.device.type, enabled=False):  # a statistic: float32 under autocast too
        return _linear_per_sample_sq_norms(inputs, output_grads, has_bias, batch_size)


def _linear_per_sample_sq_norms(
    inputs: torch.Tensor, output_grads: torch.Tensor, has_bias: bool, batch_size: int | None
) -> torch.Tensor:
    batch = batch_size or inputs.shape[0]
    a = inputs.reshape(batch, -1, inputs.shape[-1]).float()
    g = output_grads.reshape(batch, -1, output_grads.shape[-1]).float()
    tokens, d_in, d_out = a.shape[1], a.shape[2], g.shape[2]
    if uses_gram_form(tokens, d_in, d_out):
        sq_norms = (per_sample_gram(a, batch) * per_sample_gram(g, batch)).sum(dim=(1, 2))
    else:
        chunk = max(1, _MAX_MATERIALISED_ELEMENTS // (d_in * d_out))
        sq_norms = torch.cat(
            [torch.bmm(g[i : i + chunk].transpose(1, 2), a[i : i + chunk]).pow(2).sum(dim=(1, 2)) for i in range(0, batch, chunk)]
        )
    if has_bias:
        sq_norms = sq_norms + g.sum(dim=1).pow(2).sum(dim=-1)
    return sq_norms


def module_per_sample_sq_norms(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output_grads: torch.Tensor, batch_size: int
) -> torch.Tensor:
    """Per-sample squared norm of the gradient of `module`'s own parameters, for any module.

    Positional tensor arguments with the same leading dimension as the output are per-sample (rows
    are samples, or the tokens of the samples one after the other); other arguments are shared.
    Used for norms and other small parameter-holding modules.
    """
    rows = output_grads.shape[0]
    flattened = rows != batch_size  # (batch * tokens, ...) rows: each sample is a block of rows

    def per_sample(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.reshape(batch_size, -1, *tensor.shape[1:]) if flattened else tensor

    params = {name: parameter.detach() for name, parameter in module.named_parameters(recurse=False)}
    batched = [isinstance(arg, torch.Tensor) and arg.dim() > 0 and arg.shape[0] == rows for arg in args]
    args = tuple(per_sample(arg) if is_batched else arg for arg, is_batched in zip(args, batched))
    in_dims = (tuple(0 if is_batched else None for is_batched in batched), 0)

    def sample_sq_norm(sample_args: tuple[Any, ...], sample_grad: torch.Tensor) -> torch.Tensor:
        def restore(tensor: torch.Tensor) -> torch.Tensor:
            return tensor if flattened else tensor.unsqueeze(0)

        call_args = tuple(restore(arg) if is_batched else arg for arg, is_batched in zip(sample_args, batched))

        def forward(parameters: dict[str, torch.Tensor]) -> torch.Tensor:
            return torch.func.functional_call(module, parameters, call_args, kwargs)

        _, vjp_fn = torch.func.vjp(forward, params)
        (param_grads,) = vjp_fn(restore(sample_grad).to(dtype=next(iter(params.values())).dtype))
        return sum(grad.float().pow(2).sum() for grad in param_grads.values())

    return torch.func.vmap(sample_sq_norm, in_dims=in_dims)(args, per_sample(output_grads))


def broadcast_per_sample_sq_norms(
    module: nn.Module, inputs: torch.Tensor, output_grads: torch.Tensor, batch_size: int
) -> torch.Tensor:
    """Per-sample squared gradient norm of a module whose parameters are all vectors over the last
    dimension (RMSNorm and the like): each parameter is broadcast to one copy per sample, shape
    `(batch, 1, d)`, and one backward pass gives every sample's gradient. Much cheaper than `vmap`;
    [`PerSampleGradientNorms`] checks it against [`module_per_sample_sq_norms`] once per module class."""
    x = inputs.reshape(batch_size, -1, inputs.shape[-1]).detach()
    grads = output_grads.reshape(batch_size, -1, output_grads.shape[-1])
    copies = {
        name: parameter.detach().reshape(1, 1, -1).expand(batch_size, 1, -1).clone().requires_grad_(True)
        for name, parameter in module.named_parameters(recurse=False)
    }
    with torch.enable_grad():
        output = torch.func.functional_call(module, copies, (x,))
        per_sample = torch.autograd.grad(output, list(copies.values()), grads.to(output.dtype))
    return sum(grad.float().pow(2).sum(dim=(1, 2)) for grad in per_sample)


def unit_per_sample_sq_norms(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output_grads: torch.Tensor
) -> torch.Tensor:
    """Per-sample squared norm of the gradient of all parameters of `module` (recursively), one
    sample at a time. For blocks whose forward cannot be vectorised (data-dependent routing)."""
    batch = output_grads.shape[0]
    params = {name: parameter.detach() for name, parameter in module.named_parameters()}
    batched = [isinstance(arg, torch.Tensor) and arg.dim() > 0 and arg.shape[0] == batch for arg in args]
    sq_norms = []
    for sample in range(batch):
        call_args = tuple(arg[sample : sample + 1] if is_batched else arg for arg, is_batched in zip(args, batched))

        def forward(parameters: dict[str, torch.Tensor], call_args: tuple[Any, ...] = call_args) -> torch.Tensor:
            output = torch.func.functional_call(module, parameters, call_args, kwargs)
            return output[0] if isinstance(output, (tuple, list)) else output

        _, vjp_fn = torch.func.vjp(forward, params)
        (param_grads,) = vjp_fn(output_grads[sample : sample + 1].to(dtype=next(iter(params.values())).dtype))
        sq_norms.append(sum(grad.float().pow(2).sum() for grad in param_grads.values()))
    return torch.stack(sq_norms)


class PerSampleGradientNorms:
    """Hooks that accumulate, for each given layer, the per-sample squared norm of the loss gradient
    over all the layer's parameters, during ordinary batched forward/backward passes.

    Use as a context manager around the passes; call [`~PerSampleGradientNorms.start_batch`] before
    each forward and read [`~PerSampleGradientNorms.batch_sq_norms`] after its backward: a `(layers, batch)`
    float64 tensor on the device the norms were computed on (`None` when no layer has parameters).

    Args:
        layers (`Sequence[nn.Module]`): The decoder layers to score.
        units (`Sequence[nn.Module]`, *optional*): Modules inside the layers scored as a whole
            (see [`unit_per_sample_sq_norms`]); their submodules get no hooks of their own.
    """

    def __init__(self, layers: Sequence[nn.Module], units: Sequence[nn.Module] = ()):
        self.layers = list(layers)
        self.units = set(units)
        self._handles: list[Any] = []
        self._batch_size = 0
        self._seq_len = 0
        self._recomputing = False
        self._broadcast_ok: dict[type, bool] = {}  # module classes where `broadcast_per_sample_sq_norms` is exact
        self._last_input: torch.Tensor | None = None  # consecutive maps often share an input (q/k/v, gate/up)
        self._last_gram: torch.Tensor | None = None
        self.batch_sq_norms: torch.Tensor | None = None
        self.layers_seen: set[int] = set()

    def __enter__(self) -> "PerSampleGradientNorms":
        for layer_position, layer in enumerate(self.layers):
            inside_unit: set[nn.Module] = set()
            for module in layer.modules():
                if module in inside_unit:
                    continue
                if module in self.units:
                    inside_unit.update(module.modules())
                elif next(module.parameters(recurse=False), None) is None:
                    continue
                hook = partial(self._forward_hook, layer_position)
                self._handles.append(module.register_forward_hook(hook, with_kwargs=True))
        return self

    def __exit__(self, *exc_info: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        # The last batch's input holds its autograd graph, whose tensor hooks hold this object: a cycle through C++
        # that Python's collector cannot see, which kept every round's activations alive.
        self._last_input = self._last_gram = None

    def start_batch(self, batch_size: int, seq_len: int) -> None:
        self._batch_size = batch_size
        self._seq_len = seq_len
        self._last_input = self._last_gram = None
        self.batch_sq_norms = None

    def _accumulate(self, layer_position: int, sq_norms: torch.Tensor) -> None:
        """Adds a module's per-sample squared norms to its layer's, in float64 on the device they were
        computed on (the CPU for MPS, which has no float64): no host synchronisation in the backward pass."""
        if self.batch_sq_norms is None:
            device = sq_norms.device if sq_norms.device.type != "mps" else torch.device("cpu")
            self.batch_sq_norms = torch.zeros(len(self.layers), self._batch_size, dtype=torch.float64, device=device)
        self.batch_sq_norms[layer_position] += sq_norms.to(self.batch_sq_norms.device, torch.float64)

    def _forward_hook(self, layer_position: int, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if self._recomputing:  # our own per-sample re-evaluation of a module, see `_backward_hook`
            return
        self.layers_seen.add(layer_position)
        if module in self.units and isinstance(output, (tuple, list)):
            output = output[0]
        if not isinstance(output, torch.Tensor):
            raise NotImplementedError(
                f"{type(module).__name__} holds parameters and returns {type(output).__name__}: per-sample "
                "gradient norms need modules with one tensor output. Describe this family in an adapter."
            )
        if not output.requires_grad:
            return
        if output.shape[0] not in (self._batch_size, self._batch_size * self._seq_len):
            raise NotImplementedError(
                f"{type(module).__name__} sees {output.shape[0]} rows for {self._batch_size} samples of "
                f"{self._seq_len} tokens (tokens were regrouped across samples), so its per-sample gradients "
                "cannot be separated. Declare the enclosing block in the adapter's `per_sample_units`."
            )
        if is_linear_map(module) and module not in self.units:
            inputs = args[0]
            if uses_gram_form(inputs.numel() // (self._batch_size * inputs.shape[-1]), inputs.shape[-1], output.shape[-1]):
                # Keep only the small (batch, T, T) Gram of the inputs until the backward pass.
                if inputs is not self._last_input:
                    self._last_input, self._last_gram = inputs, per_sample_gram(inputs.detach(), self._batch_size)
                bias = module.bias is not None
                output.register_hook(partial(self._gram_backward_hook, layer_position, self._last_gram, bias))
                return
        saved_args = tuple(arg.detach() if isinstance(arg, torch.Tensor) else arg for arg in args)
        output.register_hook(partial(self._backward_hook, layer_position, module, saved_args, kwargs))

    @staticmethod
    def _may_broadcast(module: nn.Module, args: tuple, kwargs: dict) -> bool:
        params = list(module.parameters(recurse=False))
        return (
            len(args) == 1
            and not kwargs
            and isinstance(args[0], torch.Tensor)
            and all(p.dim() == 1 and p.shape[0] == args[0].shape[-1] for p in params)
        )

    def _broadcast_or_check(self, module: nn.Module, args: tuple, kwargs: dict, grad: torch.Tensor) -> torch.Tensor:
        reference = (
            None
            if type(module) in self._broadcast_ok
            else module_per_sample_sq_norms(module, args, kwargs, grad, self._batch_size)
        )
        try:
            sq_norms = broadcast_per_sample_sq_norms(module, args[0], grad, self._batch_size)
        except RuntimeError:
            sq_norms = None
        if reference is not None:  # first use for this module class: keep the fast path only if it is exact
            exact = (
                sq_norms is not None
                and sq_norms.shape == reference.shape
                and torch.allclose(sq_norms, reference, rtol=1e-4, atol=1e-12)
            )
            self._broadcast_ok[type(module)] = exact
            return reference
        return sq_norms

    def _gram_backward_hook(self, layer_position: int, input_gram: torch.Tensor, has_bias: bool, grad: torch.Tensor) -> None:
        with torch.no_grad():
            sq_norms = (input_gram * per_sample_gram(grad, self._batch_size)).sum(dim=(1, 2))
            if has_bias:
                sq_norms = sq_norms + grad.reshape(self._batch_size, -1, grad.shape[-1]).float().sum(dim=1).pow(2).sum(dim=-1)
        self._accumulate(layer_position, sq_norms)

    def _backward_hook(self, layer_position: int, module: nn.Module, args: tuple, kwargs: dict, grad: torch.Tensor) -> None:
        if is_linear_map(module) and module not in self.units:
            with torch.no_grad():
                sq_norms = linear_per_sample_sq_norms(args[0], grad, module.bias is not None, self._batch_size)
        else:
            self._recomputing = True
            try:
                if module in self.units:
                    sq_norms = unit_per_sample_sq_norms(module, args, kwargs, grad)
                elif self._broadcast_ok.get(type(module)) or (
                    type(module) not in self._broadcast_ok and self._may_broadcast(module, args, kwargs)
                ):
                    sq_norms = self._broadcast_or_check(module, args, kwargs, grad)
                else:
                    sq_norms = module_per_sample_sq_norms(module, args, kwargs, grad, self._batch_size)
            finally:
                self._recomputing = False
        self._accumulate(layer_position, sq_norms)


def loss_gradient_passes(
    model: nn.Module,
    adapter: DecoderAdapter,
    input_ids: torch.LongTensor,
    batch_size: int,
    description: str = "Scoring layers",
    progress_bar: bool = True,
    on_batch_start: Callable[[torch.LongTensor], None] | None = None,
    on_batch_end: Callable[[torch.LongTensor], None] | None = None,
    parameters: Sequence[nn.Parameter] = (),
    first_layer: nn.Module | None = None,
) -> None:
    """The passes every gradient score makes, batch by batch: a forward pass from the input
    embeddings to the final hidden states, the gradient of the sum of the per-sample losses there
    ([`~optimum_gradmap.objectives.causal_lm_loss_gradient`], a few logits at a time), and a backward pass.

    The model's parameters are frozen (the backward pass computes activation gradients only, which
    hooks read), except `parameters`, whose `.grad` accumulates; every flag is restored on exit.
    Under [`~optimum_gradmap.streaming.execution_mode`] `"layer_streamed"` (or `"auto"` with offloaded
    weights) the passes run one layer at a time ([`~optimum_gradmap.streaming.streamed_backward`]):
    the same hooks see the same computations, with one layer's weights and activations in memory.

    Args:
        model (`nn.Module`): A causal LM.
        adapter (`DecoderAdapter`): Its adapter (how to split off the head).
        input_ids (`torch.LongTensor` of shape `(num_samples, seq_len)`): Calibration sequences.
        batch_size (`int`): Sequences per pass.
        description (`str`), progress_bar (`bool`): The progress bar.
        on_batch_start, on_batch_end (`Callable`, *optional*): Called with each batch before its
            forward pass and after its backward pass.
        parameters (`Sequence[nn.Parameter]`, *optional*): Parameters whose gradient is accumulated.
        first_layer (`nn.Module`, *optional*): Where the backward pass may stop ([`DecoderGradient.backward`]).
    """
    with calibration_batches(
        model, input_ids, batch_size, description, progress_bar, grad=True, freeze_parameters=True
    ) as batches:
        for parameter in parameters:
            parameter.requires_grad_(True)
        gradient_pass = streaming.DecoderGradient(model, adapter, input_ids)
        if gradient_pass.layer_streamed and parameters and streaming.is_offloaded(model):
            raise NotImplementedError(
                "This score needs parameter gradients, which offloaded weights cannot accumulate (Accelerate "
                "brings a new copy of them for every forward pass). Load the model without CPU/disk offload, "
                "or use a score that needs no parameter gradient (gradmap, gradmap_bound_token, ...)."
            )
        for batch in batches:
            if on_batch_start is not None:
                on_batch_start(batch)
            loss_gradient = gradient_pass.loss_gradient(causal_lm_loss_gradient, vocab_sliced_loss_gradient, input_ids=batch)
            gradient_pass.backward(batch, loss_gradient, parameters, first_layer)
            if on_batch_end is not None:
                on_batch_end(batch)


def gradient_importance(
    model: nn.Module,
    layers: Sequence[nn.Module],
    input_ids: torch.LongTensor,
    batch_size: int,
    progress_bar: bool = True,
    description: str = "Scoring layers",
    units: Sequence[nn.Module] = (),
    adapter: DecoderAdapter | None = None,
) -> torch.Tensor:
    """GradMAP's Stage 1 score (Eq. 5) of each layer in `layers`.

    One batched forward pass and one backward pass that computes only input gradients per batch:
    hooks turn each module's captured inputs and output gradients into per-sample squared gradient
    norms (see [`PerSampleGradientNorms`]), and the loss gradient is formed a few logits at a time
    ([`~optimum_gradmap.objectives.causal_lm_loss_gradient`]).

    Args:
        model (`nn.Module`): A causal LM whose decoder stack contains `layers`.
        layers (`Sequence[nn.Module]`): The decoder layers to score.
        input_ids (`torch.LongTensor` of shape `(num_samples, seq_len)`): Calibration sequences.
        batch_size (`int`): Sequences per forward/backward pass. Memory grows with it (the
            activations autograd keeps for the backward pass); time per sample falls with it
            until the device is busy.
        progress_bar (`bool`, defaults to `True`): Show a progress bar over batches.
        description (`str`): Progress bar label.
        units (`Sequence[nn.Module]`, *optional*): Modules scored as a whole (mixture-of-experts blocks).
        adapter (`DecoderAdapter`, *optional*): How to split the model at its head; by default the
            adapter registered for its family.

    Returns:
        `torch.Tensor` of shape `(len(layers),)`, float64: the mean over samples of the per-sample
        squared gradient norm over all parameters of each layer.
    """
    adapter = adapter or get_adapter(model)
    order = {id(layer): position for position, layer in enumerate(adapter.get_layers(model))}
    in_stack = all(id(layer) in order for layer in layers)  # else the check below refuses them
    first_layer = min(layers, key=lambda layer: order[id(layer)]) if in_stack and layers else None
    totals = torch.zeros(len(layers), dtype=torch.float64)
    with PerSampleGradientNorms(layers, units) as collector:

        def collect(batch: torch.LongTensor) -> None:
            nonlocal totals
            if len(collector.layers_seen) != len(layers):
                missing = sorted(set(range(len(layers))) - collector.layers_seen)
                raise InvalidInputError(
                    f"Layers at positions {missing} of `layers` did not run in the model's forward pass: "
                    "pass the model's own layers."
                )
            if collector.batch_sq_norms is not None:  # on the device: summed there, brought back once
                totals = totals.to(collector.batch_sq_norms.device) + collector.batch_sq_norms.sum(dim=1)

        loss_gradient_passes(
            model,
            adapter,
            input_ids,
            batch_size,
            description,
            progress_bar,
            on_batch_start=lambda batch: collector.start_batch(batch.shape[0], batch.shape[1]),
            on_batch_end=collect,
            first_layer=first_layer,  # the backward pass stops at the first scored layer's input
        )
    return totals.cpu() / input_ids.shape[0]
