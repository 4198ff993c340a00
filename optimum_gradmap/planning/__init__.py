# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""The cost of a run, told before the run: [`PruningPlan`], what [`GradMAPPruner.plan`] and `optimum-gradmap prune
--dry-run` (`heal --dry-run`, `quantize --dry-run`) print. The [`Planner`] holds one plan's model shape, placement and
device rates; each step of the pipeline adds its stage to it ([`~optimum_gradmap.pipeline.plan_pruning`]).

Like Accelerate's `accelerate estimate-memory`, the plan builds the model from its config alone on the meta device
(no weight is read, none is allocated) and counts the parameters of every module. It then goes past the memory of the
weights: it counts the passes each stage makes for the configured method, and from them the tokens, the FLOPs, the
peak memory (in memory and layer-streamed), the disk the output takes and the seconds each stage is expected to take.

**What is counted.** Every pass of the library runs decoder layers over tokens, and most form logits. The plan counts,
per stage, the *layer-tokens* each pass runs (a layer run over one token; a pass of the whole model over N x T
tokens is L x N x T of them), split into those run without gradients and those run with gradients and then
differentiated, and the *head tokens* whose logits are formed (with or without gradients). The counts follow the code
path by path (the instrumented runs of tests/test_planning.py check them against forward hooks on every layer and the
head). Where a count depends on what the run finds (which layers a shortlist holds, which runs of layers Stage 1
removes, how many strengths the golden-section search scores), the plan gives its range.

**FLOPs.** Each decoder layer is run once on the meta device under `torch.utils.flop_counter.FlopCounterMode`, for one
calibration batch: its forward FLOPs (its matrix products, 2 x parameters per token, and attention's T^2 terms) and
those of its input-gradient backward (the parameters are frozen in every gradient pass but the heal's). Stage 1's
per-sample gradient norms (GradMAP's score) add, for each linear map, the Gram matrices of its inputs and output
gradients (2 T^2 (d_in + d_out) per sample) or the per-sample weight gradient (2 T d_in d_out), whichever the code
uses. The head's logits cost 2 x vocabulary x hidden per token, as many again for their gradient. Stage 2's
statistics are float64 products on the device (4 d^2 per token), its solves float64 eigendecompositions and products
on the host CPU.

**Time.** [`DeviceThroughput`] says how fast the device runs each kind of work, in FLOP/s: measured in a few seconds
by building one decoder layer of the model's family from its config (random weights, the compute dtype; a layer
over 512 MiB narrowed, its widths divided) on the device and timing its forward, its gradient pass with and without
the per-sample norms, a generation step and the head's logits on one calibration batch
([`DeviceThroughput.measure`]); or stated for a device one does not have
([`DeviceThroughput.assumed`]: its peak FLOP/s times an assumed efficiency, labelled as such). Each stage's seconds
are its FLOPs of each kind divided by that kind's rate.

**Memory.** The weights (the dense model's for the whole run: the layers Stage 1 removes stay referenced for Stage 2,
the same tensors, not copies), plus what each stage holds at its peak: the activations autograd keeps for one batch
(measured on the meta device with `saved_tensors_hooks`, so an attention kernel that keeps less than the T^2
scores of the math path, as flash attention does, makes this an over-estimate), the per-sample norms' Gram
matrices, the logits formed at once (a chunk of at most `MAX_LOGIT_ELEMENTS`: the losses over the vocabulary are
computed a few tokens at a time, [`optimum_gradmap.vocabulary`], but in the in-memory heal's training step),
Stage 2's recorded hidden states and float64 statistics, the heal's teacher targets, adapters and optimizer state.
Layer-streamed, the device holds one layer's weights at a time and the layer inputs of a batch (layers x batch x
tokens x hidden).
"""

from .counts import ZERO, Count, Work, flops
from .heal import plan_heal
from .layers import LayerCost
from .placement import HOST_ALLOCATOR_OVERHEAD
from .plan import PruningPlan, StagePlan
from .pruning import Planner
from .quantization import plan_quantization
from .shape import ModelShape, describe_model, empty_model, load_model_config
from .stage1 import Stage1Outline
from .stage2 import Stage2Outline, golden_search_evaluations
from .throughput import DeviceThroughput

__all__ = [
    "HOST_ALLOCATOR_OVERHEAD",
    "ZERO",
    "Count",
    "DeviceThroughput",
    "LayerCost",
    "ModelShape",
    "Planner",
    "PruningPlan",
    "Stage1Outline",
    "Stage2Outline",
    "StagePlan",
    "Work",
    "describe_model",
    "empty_model",
    "flops",
    "golden_search_evaluations",
    "load_model_config",
    "plan_heal",
    "plan_quantization",
]
