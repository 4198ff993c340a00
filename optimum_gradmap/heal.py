# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Heal, the optional third stage: distils the dense model's next-token distribution back into the pruned model.

Stage 2's d x d patch, fitted on a few thousand calibration tokens, brings the pruned model's answers only a little
back toward the dense model's. The field's answer is distillation from the dense model: ModelOpt's depth-pruning
recipe (Minitron, Muralidharan et al., 2024) trains the pruned student on the dense teacher's logits with the forward
KL divergence; LinearPatch (Chen et al., NeurIPS 2025, Sec. 3.3) fine-tunes its patch on the teacher's top-K
probabilities computed ahead; Shortened LLaMA (Kim et al., 2024) and SLEB (Song et al., ICML 2024) heal with LoRA
adapters merged into the weights.

**Teacher.** The dense model is the pruned one with its removed layers put back and every fold undone: the pruner's
snapshot holds the layers and the folds' backups hold the weights, so no second copy of the model is loaded
([`LayerSnapshot.dense_model`]); a checkpoint healed later takes its teacher as a separate model. The teacher runs once, before
training, over every training and held-out sequence, and keeps at each position its `TOP_K` most likely next tokens'
log-probabilities and the log of the probability left to all other tokens (LinearPatch's "offline" teacher: memory
and time go to the student alone during training, and any part of the student may be trained, the layers the
teacher shares included).

**Loss.** The forward KL divergence KL(p_dense || p_pruned) over `TOP_K + 1` outcomes: the teacher's top-K tokens
and "any other token", whose probabilities are the sums of the rest:

    sum_{k in top-K} p_k (log p_k - log q_k) + p_rest (log p_rest - log q_rest)

It is the full-vocabulary KL of the two distributions with the tail merged into one outcome: exact where the teacher
puts its mass on its top-K, never larger than the full KL, and, unlike the cross-entropy to the renormalised top-K
(`refinement_steps`), it also penalises a student that moves mass out of the top-K. Forward KL (the teacher's
distribution weighs the errors) is Minitron's and LinearPatch's choice: the student must cover what the dense model
predicts. The held-out KL reported beside it is the same quantity.

**What is trained** (`heal_trainable`): `lora` (default; LoRA adapters of rank `heal_lora_rank` on every linear map
of the kept layers, through PEFT, merged into the weights with `merge_and_unload`: the optimizer holds two small
matrices per map), `norms` (every normalisation weight), `down_projections` (the down projections of Stage 2's
compensated layers, where W' is folded), `before_removed` (every weight of the kept layer before each removed run),
`all` (every weight of the kept layers and the final norm: three copies of them with AdamW, for small models only).
Whatever is trained ends as plain weights: the checkpoint stays standard.

**Training.** AdamW, a linear warm-up over the first `WARMUP_FRACTION` of the steps, then a cosine decay to
`FINAL_LR_FRACTION` of the rate; gradients clipped to norm `MAX_GRAD_NORM`. The held-out KL is measured before
training and every `heal_check_every` steps, and the trained weights with the lowest one (the start included) are
the ones kept. Ctrl-C stops training and keeps that best state. A checkpoint file resumes an interrupted run. Under
`torch.distributed` every process takes its share of each batch and of the held-out sequences and the gradients are
averaged (data-parallel). Where the hardware computes bfloat16 natively and `heal_autocast` is on, the teacher's
passes and the student's forward and backward passes run under bfloat16 autocast; the log-softmax, the loss, the
optimizer and the weights stay in float32. The teacher's targets barely move: on SmolLM2-135M the KL divergence from
its float32 next-token distribution to its autocast one is below 0.001 nats per token on held-out text, about a
thousandth of a pruned model's, and its pass takes about a third of the time on an AVX512-BF16 CPU
(benchmarks/teacher_autocast.py).
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field
from typing import Any, get_args

import torch
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.pytorch_utils import Conv1D
from transformers.utils import logging

from . import distributed
from .adapters import DecoderAdapter, get_adapter, get_submodule
from .configuration import GradMAPConfig, HealTrainable
from .data import CalibrationData, calibration_sha256, prepare_heal_data
from .errors import InvalidInputError
from .passes import calibration_mode, input_device
from .precision import has_native_bfloat16
from .weights import is_offloaded_module

logger = logging.get_logger(__name__)

# The teacher's most likely next tokens kept at each position (LinearPatch keeps 64 as well).
TOP_K = 64
# The schedule: linear warm-up over this share of the steps, then a cosine decay to this share of the rate.
WARMUP_FRACTION = 0.05
FINAL_LR_FRACTION = 0.1
MAX_GRAD_NORM = 1.0
# The learning rate of each choice of `heal_trainable` when `heal_lr` is None. LoRA and the norms: the better of two
# rates measured on SmolLM2-135M 25% with 40,960 tokens (held-out Wikipedia KL from the dense model, lower is better:
# LoRA 0.869 at 1e-3 against 0.980 at 2e-4; norms 0.917 at 3e-3 against 0.958 at 1e-3; docs/benchmarks/heal.md).
DEFAULT_LEARNING_RATES: dict[str, float] = {
    "lora": 1e-3,
    "norms": 3e-3,
    "down_projections": 3e-5,
    "before_removed": 3e-5,
    "all": 3e-5,
}
HEAL_TRAINABLE_CHOICES: tuple[str, ...] = get_args(HealTrainable)
# The name of the heal stage's LoRA adapter (in its parameters' names).
LORA_ADAPTER = "heal"


# The GradMAPConfig fields the heal stage reads: the ones `GradMAPPruner.heal` may override.
HEAL_SETTINGS = (
    "heal_tokens",
    "heal_dataset",
    "heal_trainable",
    "heal_lr",
    "heal_batch_size",
    "heal_seq_len",
    "heal_lora_rank",
    "heal_validation_sequences",
    "heal_check_every",
    "heal_autocast",
)


def check_heal_settings(model: nn.Module, config: GradMAPConfig, compensated: Sequence[int] | None = None) -> None:
    """Refuses, before anything changes, a heal the model or the environment cannot run as `config` says.

    Args:
        model (`nn.Module`): The model to prune (or pruned).
        config ([`GradMAPConfig`]): Its `heal_*` settings are read.
        compensated (`Sequence[int]`, *optional*): For a model pruned already, the layers Stage 2 compensated; without
            it, `config.compensation` says whether Stage 2 will run.

    Raises:
        InvalidInputError: for `lora` without PEFT, `down_projections` without a compensated layer, full weights in
            bfloat16 or float16, or offloaded weights.
    """
    if config.heal_trainable == "lora":
        try:
            import peft  # noqa: F401
        except ImportError as error:
            raise InvalidInputError(
                "heal_trainable='lora' needs PEFT: `pip install peft` (or `pip install optimum-gradmap[heal]`), or choose "
                "heal_trainable='norms'."
            ) from error
    if config.heal_trainable == "down_projections" and not (config.compensation if compensated is None else compensated):
        raise InvalidInputError(
            "heal_trainable='down_projections' trains the down projections of Stage 2's compensated layers, and "
            + ("Stage 2 is off (`compensation=False`)" if compensated is None else "Stage 2 compensated no layer")
            + ": choose another `heal_trainable`."
        )
    dtype = next(model.parameters()).dtype
    if config.heal_trainable != "lora" and dtype in (torch.bfloat16, torch.float16):
        raise InvalidInputError(
            f"heal_trainable={config.heal_trainable!r} would train {str(dtype).replace('torch.', '')} weights in place, "
            "where AdamW's small steps round away: load the model in float32 (`--dtype float32`), or heal with "
            "heal_trainable='lora' (its adapters are float32 whatever the model's dtype)."
        )
    if any(is_offloaded_module(module) for module in model.modules()):
        raise InvalidInputError(
            "The heal stage trains the model and cannot train weights Accelerate offloaded to the CPU or disk: load the "
            "model on devices that hold it (a larger device, or `torchrun` with several), or set heal_tokens=0."
        )
    if config.heal_batch_size < distributed.world_size():
        raise InvalidInputError(
            f"heal_batch_size={config.heal_batch_size} cannot be shared by {distributed.world_size()} processes: use a "
            "batch at least as large as the number of processes."
        )


def heal_sequences(
    data: CalibrationData, tokenizer: PreTrainedTokenizerBase | None, config: GradMAPConfig
) -> tuple[torch.LongTensor, torch.LongTensor]:
    """The training and held-out sequences of a heal run as `config` says: `heal_tokens` worth of `heal_seq_len`-token
    windows of `data` (or `config.heal_dataset`) and `heal_validation_sequences` held out, shuffled with seed
    `seed + 2` ([`~optimum_gradmap.data.prepare_heal_data`]).

    Args:
        data: The heal text in any form calibration data takes, or `None` for `config.heal_dataset`.
        tokenizer (`PreTrainedTokenizerBase`, *optional*): Needed for text.
        config ([`GradMAPConfig`]): Its `heal_*` settings, `seed` and `text_column` are read.

    Returns:
        `tuple[torch.LongTensor, torch.LongTensor]`: the training and held-out sequences.
    """
    return prepare_heal_data(
        config.heal_dataset if data is None else data,
        tokenizer,
        -(-config.heal_tokens // config.heal_seq_len),
        config.heal_validation_sequences,
        config.heal_seq_len,
        config.seed + 2,
        config.text_column,
    )


@dataclass
class HealResult:
    """What the heal stage did.

    Attributes:
        trainable (`str`): What was trained (`heal_trainable`).
        num_trainable_parameters (`int`): How many parameters were trained (LoRA's adapters for `lora`).
        dataset (`str`): The text it was trained on.
        train_sha256 (`str`), validation_sha256 (`str`): The SHA-256 of the training and held-out token ids.
        budget_tokens (`int`): The budget (`heal_tokens`).
        trained_tokens (`int`): The tokens trained on (fewer after an interruption).
        steps (`int`), num_steps (`int`): Steps taken, of those planned.
        learning_rate (`float`), batch_size (`int`), seq_len (`int`): The settings.
        autocast (`bool`): Whether the passes ran under bfloat16 autocast.
        teacher_seconds (`float`): The teacher's pass over every sequence.
        seconds (`float`): The whole stage, teacher included.
        kl_curve (`list[list[float]]`): `[tokens trained, held-out KL]` at each check, the start included.
        start_kl (`float`), best_kl (`float`): The held-out KL before training and of the state kept.
        best_tokens (`int`): The tokens trained when the state kept was reached (0: the start).
        interrupted (`bool`): Whether training was stopped by Ctrl-C (the best state so far was kept).
    """

    trainable: str
    num_trainable_parameters: int
    dataset: str
    train_sha256: str
    validation_sha256: str
    budget_tokens: int
    trained_tokens: int = 0
    steps: int = 0
    num_steps: int = 0
    learning_rate: float = 0.0
    batch_size: int = 0
    seq_len: int = 0
    autocast: bool = False
    teacher_seconds: float = 0.0
    seconds: float = 0.0
    kl_curve: list[list[float]] = field(default_factory=list)
    start_kl: float = math.nan
    best_kl: float = math.nan
    best_tokens: int = 0
    interrupted: bool = False

    def to_dict(self) -> dict[str, Any]:
        """The result, JSON-serialisable."""
        return asdict(self)

    def summary(self) -> str:
        """One line: what was trained, on what, and the held-out KL before and after."""
        stopped = " (interrupted: the best state so far was kept)" if self.interrupted else ""
        kept = "" if self.best_tokens else " (no state beat the start: the model is as it came)"
        return (
            f"Healed {self.trainable} ({self.num_trainable_parameters:,} parameters) on {self.trained_tokens:,} tokens of "
            f"{self.dataset}{stopped}: held-out KL from the dense model {self.start_kl:.4f} -> {self.best_kl:.4f}{kept} "
            f"in {self.seconds:.0f} s."
        )


@dataclass
class TeacherTargets:
    """The teacher's next-token distribution at every position but the last of some sequences, as [`top_k_kl`]
    reads it.

    Attributes:
        indices (`torch.Tensor` of shape `(N, T - 1, TOP_K)`): Its most likely tokens (int32).
        log_probs (`torch.Tensor` of shape `(N, T - 1, TOP_K)`): Their log-probabilities (float32).
        rest_log_prob (`torch.Tensor` of shape `(N, T - 1)`): The log of the probability of every other token.
    """

    indices: torch.Tensor
    log_probs: torch.Tensor
    rest_log_prob: torch.Tensor

    def rows(self, rows: Sequence[int] | slice) -> TeacherTargets:
        """The targets of some of the sequences."""
        return TeacherTargets(self.indices[rows], self.log_probs[rows], self.rest_log_prob[rows])


def _rest_log_prob(log_probs: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """log of the total probability of the tokens not in `indices` (exact: a logsumexp over them, not 1 - sum)."""
    return log_probs.scatter(-1, indices.long(), float("-inf")).logsumexp(-1)


@torch.no_grad()
def teacher_targets(
    teacher: nn.Module,
    input_ids: torch.LongTensor,
    batch_size: int,
    progress_bar: bool = True,
    autocast: bool = False,
) -> TeacherTargets:
    """Runs `teacher` over `input_ids` and keeps its top-`TOP_K` next-token log-probabilities and the rest's.

    Args:
        teacher (`nn.Module`): The dense causal LM.
        input_ids (`torch.LongTensor` of shape `(N, T)`): The sequences.
        batch_size (`int`): Sequences per forward pass.
        progress_bar (`bool`, defaults to `True`): Show a progress bar.
        autocast (`bool`, defaults to `False`): Run the teacher under bfloat16 autocast (the log-softmax stays in
            float32).

    Returns:
        [`TeacherTargets`], on the CPU.
    """
    parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    if input_ids.shape[0] == 0:  # a process with no sequence of its own (torchrun): nothing to keep
        top_k = min(TOP_K, teacher.get_output_embeddings().weight.shape[0])
        shape = (0, max(0, input_ids.shape[1] - 1))
        return TeacherTargets(torch.zeros(*shape, top_k, dtype=torch.int32), torch.zeros(*shape, top_k), torch.zeros(*shape))
    device = input_device(teacher)
    with calibration_mode(teacher):
        for start in logging.tqdm(
            range(0, input_ids.shape[0], batch_size),
            desc="Heal: the dense model's targets",
            leave=False,
            disable=not progress_bar,
        ):
            batch = input_ids[start : start + batch_size].to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16) if autocast else nullcontext():
                logits = teacher(input_ids=batch, use_cache=False).logits[:, :-1]
            log_probs = torch.log_softmax(logits.float(), dim=-1)
            top = log_probs.topk(min(TOP_K, log_probs.shape[-1]), dim=-1)
            parts.append((top.indices.int().cpu(), top.values.cpu(), _rest_log_prob(log_probs, top.indices).cpu()))
    return TeacherTargets(*(torch.cat(tensors) for tensors in zip(*parts)))


def top_k_kl(logits: torch.Tensor, targets: TeacherTargets) -> torch.Tensor:
    """The forward KL divergence from the teacher's distribution to the student's over the teacher's top-K tokens and
    "any other token" (see the module docstring), per position.

    Args:
        logits (`torch.Tensor` of shape `(N, T - 1, V)`): The student's logits at the positions of `targets`.
        targets ([`TeacherTargets`]): The teacher's.

    Returns:
        `torch.Tensor` of shape `(N, T - 1)`: float32, >= 0 up to rounding.
    """
    log_q = torch.log_softmax(logits.float(), dim=-1)
    indices = targets.indices.to(log_q.device).long()
    log_p = targets.log_probs.to(log_q.device)
    log_p_rest = targets.rest_log_prob.to(log_q.device)
    log_q_top = log_q.gather(-1, indices)
    log_q_rest = _rest_log_prob(log_q, indices)
    top = (log_p.exp() * (log_p - log_q_top)).sum(-1)
    # a teacher with no mass outside its top-K (a vocabulary of at most K tokens) adds nothing for "any other token"
    rest = torch.where(log_p_rest > float("-inf"), log_p_rest.exp() * (log_p_rest - log_q_rest), torch.zeros_like(log_p_rest))
    return top + rest


def _linear_names(model: nn.Module, layers: Sequence[nn.Module]) -> list[str]:
    """The full names of the linear maps (`nn.Linear`, GPT-2's `Conv1D`) inside `layers`: LoRA's targets. (The experts
    of transformers' MoE blocks are 3-D parameters, not maps: LoRA leaves them and adapts the attention.)"""
    wanted = {id(module) for layer in layers for module in layer.modules() if isinstance(module, (nn.Linear, Conv1D))}
    return [name for name, module in model.named_modules() if id(module) in wanted]


def _is_norm(module: nn.Module) -> bool:
    return "norm" in type(module).__name__.lower()


def _norm_parameters(model: nn.Module, kept_layers: Sequence[nn.Module], adapter: DecoderAdapter) -> list[nn.Parameter]:
    """The weights of every normalisation inside the kept layers and of those beside the layer list (the final norm,
    whatever its name: `norm`, `ln_f`, `final_layer_norm`)."""
    holder = get_submodule(model, adapter.layers_path.rpartition(".")[0])
    modules = [module for layer in kept_layers for module in layer.modules() if _is_norm(module)]
    modules += [module for module in holder.children() if _is_norm(module)]
    return [parameter for module in modules for parameter in module.parameters(recurse=False)]


def _layer_before_each_run(kept: Sequence[int], num_layers: int) -> list[int]:
    """The original indices of the kept layers directly before a run of removed ones."""
    kept_set = set(kept)
    return [index for index in kept if index + 1 < num_layers and index + 1 not in kept_set]


@dataclass
class _Choice:
    """What `heal_trainable` names in a model, found without changing it: LoRA's target maps, or the parameters."""

    lora_targets: list[str]
    parameters: list[nn.Parameter]


def _choose(
    model: PreTrainedModel,
    adapter: DecoderAdapter,
    trainable: str,
    kept: Sequence[int],
    num_layers: int,
    compensated: Sequence[int],
) -> _Choice:
    """What to train, refused (before anything runs) where the model has nothing of that kind.

    Raises:
        InvalidInputError: nothing to train, a model that carries PEFT adapters already, or full weights in a dtype
            AdamW cannot update finely (bfloat16, float16).
    """
    if hasattr(model, "peft_config"):
        raise InvalidInputError(
            "The model carries PEFT adapters already: merge them first (`merge_and_unload`), then heal the plain model."
        )
    layers = list(adapter.get_layers(model))
    by_index = dict(zip(kept, layers))
    if trainable == "lora":
        choice = _Choice(_linear_names(model, layers), [])
    elif trainable == "norms":
        choice = _Choice([], _norm_parameters(model, layers, adapter))
    elif trainable == "down_projections":
        if not compensated:
            raise InvalidInputError(
                "heal_trainable='down_projections' trains the down projections of Stage 2's compensated layers, and no "
                "layer was compensated: turn Stage 2 on, or choose another `heal_trainable`."
            )
        choice = _Choice(
            [],
            [
                tensor
                for index in compensated
                for target in adapter.get_down_projections(by_index[index])
                for tensor in ([target] if isinstance(target, nn.Parameter) else [target.weight])
            ],
        )
    elif trainable == "before_removed":
        chosen = _layer_before_each_run(kept, num_layers)
        if not chosen:
            raise InvalidInputError(
                "heal_trainable='before_removed' trains the kept layer before each removed run, and every removed run "
                "starts at layer 0: choose another `heal_trainable`."
            )
        choice = _Choice([], [parameter for index in chosen for parameter in by_index[index].parameters()])
    else:  # "all"
        choice = _Choice([], [parameter for layer in layers for parameter in layer.parameters()])
        choice.parameters += _norm_parameters(model, [], adapter)
    if not choice.lora_targets and not choice.parameters:
        raise InvalidInputError(f"heal_trainable={trainable!r} finds nothing to train in this model: choose another.")
    low_precision = sorted({str(p.dtype) for p in choice.parameters if p.dtype in (torch.bfloat16, torch.float16)})
    if low_precision:
        raise InvalidInputError(
            f"heal_trainable={trainable!r} would train {', '.join(low_precision)} weights in place, where AdamW's small "
            "steps round away: load the model in float32 (`--dtype float32`), or heal with heal_trainable='lora' (its "
            "adapters are float32 whatever the model's dtype)."
        )
    return choice


class _Trainable:
    """The parameters the heal stage trains (LoRA's adapters, injected here, or the model's own) and how they end as
    plain weights.

    Args:
        model (`PreTrainedModel`): The model.
        choice (`_Choice`): From `_choose`.
        lora_rank (`int`): The adapters' rank.
        seed (`int`): LoRA's initialisation seed (the same on every process).
    """

    def __init__(self, model: PreTrainedModel, choice: _Choice, lora_rank: int, seed: int = 0):
        self.model, self.lora = model, None
        if choice.lora_targets:
            from peft import LoraConfig
            from peft.tuners.lora import LoraModel

            lora_config = LoraConfig(
                r=lora_rank,
                lora_alpha=2 * lora_rank,
                lora_dropout=0.0,
                target_modules=choice.lora_targets,
                bias="none",
                fan_in_fan_out=all(isinstance(model.get_submodule(name), Conv1D) for name in choice.lora_targets),  # GPT-2
            )
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                self.lora = LoraModel(model, lora_config, LORA_ADAPTER)
            marker = f".{LORA_ADAPTER}."
            self.parameters = [parameter for name, parameter in model.named_parameters() if "lora_" in name and marker in name]
        else:
            self.parameters = list(choice.parameters)
        for parameter in self.parameters:
            parameter.requires_grad_(True)

    def num_parameters(self) -> int:
        """How many parameters are trained."""
        return sum(parameter.numel() for parameter in self.parameters)

    def state(self) -> list[torch.Tensor]:
        """Copies of the trained parameters, on the CPU."""
        return [parameter.detach().to("cpu", copy=True) for parameter in self.parameters]

    @torch.no_grad()
    def load(self, state: Sequence[torch.Tensor]) -> None:
        """Writes `state` ([`state`]'s output) into the trained parameters."""
        for parameter, value in zip(self.parameters, state, strict=True):
            parameter.copy_(value)

    def finish(self, merge: bool) -> None:
        """Removes the LoRA adapters, merged into the weights (`merge`) or dropped; nothing to do for the others."""
        if self.lora is not None:
            self.lora.merge_and_unload() if merge else self.lora.unload()
            if hasattr(self.model, "peft_config"):  # left by PEFT versions that do not remove it
                del self.model.peft_config


def _learning_rate_factor(step: int, num_steps: int) -> float:
    """The share of the learning rate at `step` (1-based): linear warm-up, then a cosine decay to `FINAL_LR_FRACTION`."""
    warmup = max(1, round(WARMUP_FRACTION * num_steps))
    if step <= warmup:
        return step / warmup
    progress = (step - warmup) / max(1, num_steps - warmup)
    return FINAL_LR_FRACTION + (1 - FINAL_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * progress))


def _batch_rows(step: int, batch_size: int, num_train: int) -> list[int]:
    """This process's rows of the global batch of `step` (0-based): its contiguous share of the batch's rows."""
    start = step * batch_size
    rows = list(range(start, min(start + batch_size, num_train)))
    size, process = distributed.world_size(), distributed.rank()
    return rows[process * len(rows) // size : (process + 1) * len(rows) // size]


def heal(
    model: PreTrainedModel,
    adapter: DecoderAdapter,
    teacher: Callable[[], AbstractContextManager[nn.Module]],
    train_ids: torch.LongTensor,
    validation_ids: torch.LongTensor,
    trainable: str = "lora",
    learning_rate: float | None = None,
    batch_size: int = 8,
    check_every: int = 25,
    lora_rank: int = 8,
    autocast: bool = True,
    kept: Sequence[int] | None = None,
    num_layers: int | None = None,
    compensated: Sequence[int] = (),
    dataset: str = "",
    checkpoint: str | os.PathLike | None = None,
    progress_bar: bool = True,
) -> HealResult:
    """Distils the teacher into `model` (in place; see the module docstring).

    Args:
        model (`PreTrainedModel`): The pruned model.
        adapter (`DecoderAdapter`): Its family's adapter.
        teacher (`Callable`): Returns a context manager that gives the dense model for its block
            ([`LayerSnapshot.dense_model`], or `contextlib.nullcontext(dense_model)`).
        train_ids (`torch.LongTensor` of shape `(N, T)`): The training sequences, in the order they are trained on.
        validation_ids (`torch.LongTensor` of shape `(M, T)`): The held-out sequences.
        trainable (`str`, defaults to `"lora"`): What is trained, among `HEAL_TRAINABLE_CHOICES`.
        learning_rate (`float`, *optional*): AdamW's peak rate; defaults to `DEFAULT_LEARNING_RATES[trainable]`.
        batch_size (`int`, defaults to 8): Sequences per step (over all processes).
        check_every (`int`, defaults to 25): Steps between two held-out checks.
        lora_rank (`int`, defaults to 8): The rank of the LoRA adapters.
        autocast (`bool`, defaults to `True`): bfloat16 autocast where the hardware computes it natively.
        kept (`Sequence[int]`, *optional*): The original indices of the kept layers (for `before_removed` and
            `down_projections`); defaults to all the model's layers.
        num_layers (`int`, *optional*): The dense model's number of layers; defaults to `max(kept) + 1`.
        compensated (`Sequence[int]`, defaults to `()`): The original indices of Stage 2's compensated layers.
        dataset (`str`, defaults to `""`): The text's name, for the result.
        checkpoint (`str` or `os.PathLike`, *optional*): A file where the state is saved at every check, and from which
            an interrupted run with the same sequences and settings resumes.
        progress_bar (`bool`, defaults to `True`): Show progress bars.

    Returns:
        [`HealResult`]. The model holds the trained weights with the lowest held-out KL (the start's if none was
        lower), as plain weights.

    Raises:
        InvalidInputError: for an unknown `trainable`, nothing of that kind to train, full weights in bfloat16 or
            float16, a batch smaller than the number of processes, or a checkpoint file from another run, before the
            teacher runs. Any error once training was set up leaves the model as it was before the call; Ctrl-C during
            the training steps keeps the best state so far (`interrupted`), before them it propagates.
    """
    if trainable not in HEAL_TRAINABLE_CHOICES:
        raise InvalidInputError(f"`heal_trainable` must be one of {HEAL_TRAINABLE_CHOICES}, got {trainable!r}.")
    if batch_size < distributed.world_size():
        raise InvalidInputError(
            f"heal_batch_size={batch_size} cannot be shared by {distributed.world_size()} processes: every process takes "
            "at least one sequence of each step. Use a batch at least as large as the number of processes."
        )
    started = time.perf_counter()
    kept = list(range(adapter.num_layers(model))) if kept is None else list(kept)
    num_layers = num_layers if num_layers is not None else kept[-1] + 1
    learning_rate = learning_rate if learning_rate is not None else DEFAULT_LEARNING_RATES[trainable]
    choice = _choose(model, adapter, trainable, kept, num_layers, compensated)  # refusals before any compute
    num_train = train_ids.shape[0]
    num_steps = -(-num_train // batch_size)
    result = HealResult(
        trainable=trainable,
        num_trainable_parameters=0,
        dataset=dataset,
        train_sha256=calibration_sha256(train_ids),
        validation_sha256=calibration_sha256(validation_ids),
        budget_tokens=num_train * train_ids.shape[1],
        num_steps=num_steps,
        learning_rate=learning_rate,
        batch_size=batch_size,
        seq_len=train_ids.shape[1],
    )
    fingerprint = {
        "train_sha256": result.train_sha256,
        "validation_sha256": result.validation_sha256,
        "trainable": trainable,
        "learning_rate": learning_rate,
        "batch_size": batch_size,
        "lora_rank": lora_rank,
        "world_size": distributed.world_size(),
        "kept": kept,
        "num_layers": num_layers,
        "compensated": list(compensated),
        "weights": _weights_digest(model),  # the model the run started from: Stage 1 and 2 as they were
    }
    resumed = _load_checkpoint(checkpoint, fingerprint)  # a stale file is refused before the teacher runs
    my_rows = [row for step in range(num_steps) for row in _batch_rows(step, batch_size, num_train)]
    my_validation, _ = distributed.shard_any(validation_ids)
    device = input_device(model)
    result.autocast = bool(autocast) and has_native_bfloat16(device) and model.dtype == torch.float32
    with teacher() as dense_model:
        targets = teacher_targets(dense_model, train_ids[my_rows], batch_size, progress_bar, result.autocast)
        validation_targets = teacher_targets(dense_model, my_validation, batch_size, progress_bar, result.autocast)
    result.teacher_seconds = time.perf_counter() - started
    position = {row: index for index, row in enumerate(my_rows)}

    def passes() -> AbstractContextManager[None]:
        return torch.autocast(device.type, dtype=torch.bfloat16) if result.autocast else nullcontext()

    def held_out_kl() -> float:
        total = torch.zeros((), dtype=torch.float64)
        with torch.no_grad():
            for start in range(0, my_validation.shape[0], batch_size):
                batch = my_validation[start : start + batch_size].to(device)
                with passes():
                    logits = model(input_ids=batch, use_cache=False).logits[:, :-1]
                total += top_k_kl(logits, validation_targets.rows(slice(start, start + batch_size))).double().sum().cpu()
        count = validation_ids.shape[0] * (validation_ids.shape[1] - 1)
        return float(distributed.all_reduce_sum(total) / count)

    chosen = None
    with calibration_mode(model, grad=True, freeze_parameters=True):
        try:
            chosen = _Trainable(model, choice, lora_rank)
            result.num_trainable_parameters = chosen.num_parameters()
            start_state = best_state = chosen.state()
            optimizer = torch.optim.AdamW(chosen.parameters, lr=learning_rate, weight_decay=0.0)
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda done: _learning_rate_factor(done + 1, num_steps))
            first_step = 0
            if resumed is not None:
                if [tuple(value.shape) for value in resumed["state"]] != [tuple(value.shape) for value in start_state]:
                    raise InvalidInputError(f"The heal checkpoint {checkpoint} holds other tensors: delete it.")
                chosen.load(resumed["state"])
                optimizer.load_state_dict(resumed["optimizer"])
                scheduler.load_state_dict(resumed["scheduler"])
                best_state, first_step = resumed["best_state"], resumed["step"]
                for name in ("kl_curve", "start_kl", "best_kl", "best_tokens"):
                    setattr(result, name, resumed[name])
                logger.info(f"Heal: resumed from {checkpoint} at step {first_step} of {num_steps}.")
            else:
                result.start_kl = result.best_kl = held_out_kl()
                result.kl_curve.append([0, result.start_kl])
            bar = logging.tqdm(
                total=num_steps, initial=first_step, desc=f"Heal ({trainable})", leave=False, disable=not progress_bar
            )
            result.steps = first_step
            result.trained_tokens = min(num_train, first_step * batch_size) * train_ids.shape[1]
            seconds, tokens_timed = 0.0, 0
            try:
                for step in range(first_step, num_steps):
                    tick = time.perf_counter()
                    rows = _batch_rows(step, batch_size, num_train)
                    global_rows = min(batch_size, num_train - step * batch_size)
                    optimizer.zero_grad(set_to_none=True)
                    if rows:  # a last, short batch may leave a process none
                        batch = train_ids[rows].to(device)
                        with passes():
                            logits = model(input_ids=batch, use_cache=False).logits[:, :-1]
                        loss = top_k_kl(logits, targets.rows([position[row] for row in rows])).mean()
                        (loss * len(rows)).backward()
                    _average_gradients(chosen.parameters, global_rows)
                    torch.nn.utils.clip_grad_norm_(chosen.parameters, MAX_GRAD_NORM)
                    optimizer.step()
                    scheduler.step()
                    result.steps = step + 1
                    result.trained_tokens = min(num_train, (step + 1) * batch_size) * train_ids.shape[1]
                    seconds += time.perf_counter() - tick
                    tokens_timed += global_rows * train_ids.shape[1]
                    if result.steps % check_every == 0 or result.steps == num_steps:
                        kl = held_out_kl()
                        result.kl_curve.append([result.trained_tokens, kl])
                        if kl < result.best_kl:
                            result.best_kl, result.best_tokens, best_state = kl, result.trained_tokens, chosen.state()
                        bar.set_postfix(tokens_per_s=f"{tokens_timed / seconds:.0f}", held_out_kl=f"{kl:.4f}")
                        _save_checkpoint(checkpoint, fingerprint, chosen, optimizer, scheduler, best_state, result)
                    bar.update(1)
            except KeyboardInterrupt:
                result.interrupted = True
                logger.warning(
                    f"Heal interrupted at step {result.steps} of {num_steps}: the model keeps the state with the lowest "
                    f"held-out KL so far ({result.best_kl:.4f}, after {result.best_tokens} tokens)."
                )
            finally:
                bar.close()
            chosen.load(best_state)
        except BaseException:
            if chosen is not None:
                chosen.load(start_state)
                chosen.finish(merge=False)
            raise
        chosen.finish(merge=True)
    result.seconds = time.perf_counter() - started
    logger.info(result.summary())
    return result


def heal_as_configured(
    model: PreTrainedModel,
    teacher: Callable[[], AbstractContextManager[nn.Module]],
    train_ids: torch.LongTensor,
    validation_ids: torch.LongTensor,
    config: GradMAPConfig,
    kept: Sequence[int],
    num_layers: int,
    compensated: Sequence[int],
    dataset: str,
    checkpoint: str | os.PathLike | None = None,
    progress_bar: bool = True,
) -> HealResult:
    """[`heal`] with the `heal_*` settings of `config` (the pruner's, the CLI's and the benchmarks' one call).

    Args:
        model, teacher, train_ids, validation_ids, kept, num_layers, compensated, dataset, checkpoint, progress_bar:
            As in [`heal`].
        config ([`GradMAPConfig`]): Its `heal_trainable`, `heal_lr`, `heal_batch_size`, `heal_check_every`,
            `heal_lora_rank` and `heal_autocast` are read.

    Returns:
        [`HealResult`].
    """
    return heal(
        model,
        get_adapter(model),
        teacher,
        train_ids,
        validation_ids,
        trainable=config.heal_trainable,
        learning_rate=config.heal_lr,
        batch_size=config.heal_batch_size,
        check_every=config.heal_check_every,
        lora_rank=config.heal_lora_rank,
        autocast=config.heal_autocast,
        kept=kept,
        num_layers=num_layers,
        compensated=compensated,
        dataset=dataset,
        checkpoint=checkpoint,
        progress_bar=progress_bar,
    )


def _weights_digest(model: nn.Module) -> str:
    """A cheap fingerprint of every weight of `model`: the SHA-256 of their float64 sums and sums of squares."""
    with torch.no_grad():
        sums = torch.stack(
            [torch.stack([tensor.double().sum(), tensor.double().square().sum()]).cpu() for tensor in model.state_dict().values()]
        )
    return hashlib.sha256(sums.numpy().tobytes()).hexdigest()


def _average_gradients(parameters: Sequence[nn.Parameter], global_rows: int) -> None:
    """Turns each process's gradient of its rows' summed loss into the gradient of the mean over the global batch."""
    for parameter in parameters:
        if parameter.grad is None:
            parameter.grad = torch.zeros_like(parameter)
        parameter.grad = distributed.all_reduce_sum(parameter.grad) / global_rows


def _load_checkpoint(path: str | os.PathLike | None, fingerprint: dict[str, Any]) -> dict[str, Any] | None:
    if path is None or not os.path.isfile(path):
        return None
    saved = torch.load(path, map_location="cpu", weights_only=True)
    if saved.get("fingerprint") != fingerprint:
        differs = sorted(key for key in fingerprint if saved.get("fingerprint", {}).get(key) != fingerprint[key])
        raise InvalidInputError(
            f"The heal checkpoint {path} comes from another run (it differs in {', '.join(differs)}): delete it, or "
            "resume with the same model, pruning, text, settings and number of processes."
        )
    return saved


def _save_checkpoint(
    path: str | os.PathLike | None,
    fingerprint: dict[str, Any],
    chosen: _Trainable,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    best_state: list[torch.Tensor],
    result: HealResult,
) -> None:
    if path is None:
        return

    def save() -> None:
        temporary = f"{os.fspath(path)}.tmp"
        torch.save(
            {
                "fingerprint": fingerprint,
                "step": result.steps,
                "state": chosen.state(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "best_state": best_state,
                "kl_curve": result.kl_curve,
                "start_kl": result.start_kl,
                "best_kl": result.best_kl,
                "best_tokens": result.best_tokens,
            },
            temporary,
        )
        os.replace(temporary, path)

    distributed.on_main_process(save)
