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
log-probabilities and the log of the probability left to all other tokens ([`~optimum_gradmap.distillation`];
LinearPatch's "offline" teacher). No reference to the teacher outlives its pass, so a teacher loaded on its own (the
`heal` command's) is freed before training, which holds the student, its optimizer state and these targets; and any
part of the student may be trained, the layers the teacher shares included.

**Loss.** The forward KL divergence KL(p_dense || p_pruned) over `TOP_K + 1` outcomes
([`~optimum_gradmap.distillation.top_k_kl`]): the teacher's top-K tokens and "any other token", whose probabilities
are the sums of the rest:

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
averaged (data-parallel), in flat buckets of at most `GRADIENT_BUCKET_BYTES`, one all-reduce each; Ctrl-C on any
process stops every process after the same step, and a resume reads the main process's checkpoint file alone and
sends it to the others (nodes need not share a file system). Where the hardware computes bfloat16 natively and
`heal_autocast` is on, the teacher's passes and the student's forward and backward passes run under bfloat16
autocast; the log-softmax, the loss, the optimizer and the weights stay in float32. The teacher's targets barely
move: on SmolLM2-135M the KL divergence from its float32 next-token distribution to its autocast one is below 0.001
nats per token on held-out text, about a thousandth of a pruned model's, and its pass takes about a third of the time
on an AVX512-BF16 CPU (benchmarks/teacher_autocast.py).

**Offloaded models.** On a model whose weights Accelerate offloaded to the CPU or disk (`GradMAPConfig.execution`
`"auto"`), or always under `"layer_streamed"`, each training step runs layer-streamed
([`~optimum_gradmap.streaming.streamed_backward`]): one decoder layer's weights in memory at a time, the loss gradient
at the final hidden states formed through an offloaded head a slice of the vocabulary at a time
([`~optimum_gradmap.distillation.vocab_sliced_top_k_kl_gradient`]). The gradients are those of the in-memory step. LoRA's
adapters live in memory, on the device each map computes on, and the merge writes each merged weight where it lives
([`~optimum_gradmap.weights.materialized`]: the CPU copy, or the offload folder, never the model's own files). The
other choices would train offloaded weights, which accumulate no gradient: they are refused. The teacher's pass and
the held-out KL are forward passes, which Accelerate's hooks already run one module at a time.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any, get_args

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.pytorch_utils import Conv1D
from transformers.utils import logging

from . import distributed, streaming
from .adapters import DecoderAdapter, get_adapter, get_submodule
from .configuration import GradMAPConfig, HealLoss, HealTrainable
from .data import (
    CalibrationData,
    calibration_sha256,
    check_dataset_name,
    describe_calibration_data,
    is_text_data,
    prepare_calibration_data,
    prepare_heal_data,
    text_documents,
    tokenize_documents,
)
from .distillation import (
    TeacherTargets,
    centred_logit_gram,
    distillation_loss,
    reads_hidden_states,
    teacher_targets,
    top_k_kl,
    top_k_kl_gradient,
    uses_head_inputs,
    uses_layer_states,
    vocab_sliced_top_k_kl_gradient,
)
from .errors import InvalidInputError
from .generation import (
    GENERATED,
    GENERATION_BATCH_SIZE,
    GeneratedText,
    GenerationSettings,
    chat_prompt,
    corpus_part,
    generate_sequences,
    is_generated,
    start_token_of,
)
from .importance.gradient import DecoderGradient
from .passes import calibration_mode, input_device
from .precision import uses_bfloat16_autocast
from .weights import execution_device, is_offloaded_module, materialized, weights_digest

logger = logging.get_logger(__name__)

# The schedule: linear warm-up over this share of the steps, then a cosine decay to this share of the rate.
WARMUP_FRACTION = 0.05
FINAL_LR_FRACTION = 0.1
MAX_GRAD_NORM = 1.0
# Under torch.distributed the gradients are averaged in flat buckets of at most this many bytes, one all-reduce each
# (25 MiB: DistributedDataParallel's default `bucket_cap_mb`), not one all-reduce per trained tensor.
GRADIENT_BUCKET_BYTES = 25 * 2**20
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
HEAL_LOSS_CHOICES: tuple[str, ...] = get_args(HealLoss)
# The name of the heal stage's LoRA adapter (in its parameters' names).
LORA_ADAPTER = "heal"
# `heal_tokens="auto"`: the heal's time (the dense model's text included) as a share of Stage 1's measured time.
AUTO_TIME_SHARE = 1.0
# With a deadline, the schedule's length is fitted to the time left after this many steps, and again at every check
# from the steps since then (the first steps are slower: on SmolLM2-135M at 40%, rank 64, 2.6 s against 1.65 s
# later, and a schedule fitted to them alone stopped 400 s early).
REFIT_AFTER_STEPS = 5


# The GradMAPConfig fields the heal stage reads: the ones `GradMAPPruner.heal` may override.
HEAL_SETTINGS = (
    "heal_tokens",
    "heal_dataset",
    "heal_prompts",
    "heal_temperature",
    "heal_trainable",
    "heal_loss",
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

    Before pruning (`compensated` not given) it also refuses what would leave the heal nothing to train, where the
    dense model and `config` tell it already: no linear map for `lora`, no normalisation for `norms`, and for
    `before_removed` a `layers_to_prune` whose removed runs all start at layer 0. Which layers Stage 1 removes and Stage 2
    compensates is known only once they ran: `before_removed` when Stage 1 removes only a run from layer 0 (possible
    where layer 0 is not protected), and `down_projections` when Stage 2 compensates no layer (its compensation undone
    by `validation_data`, or `span_end` with no kept layer before a removed run), are refused when the heal starts.

    Raises:
        InvalidInputError: for a model that carries PEFT adapters, `lora` without PEFT, `down_projections` without a
            compensated layer, full weights in bfloat16 or float16, a choice other than `lora` on a model with offloaded
            weights, a loss that reads hidden states layer-streamed, `kl_hidden_mse` with a `layers_to_prune` that
            leaves no kept layer after a removed run, or nothing to train.
    """
    _check_no_peft_adapters(model)
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
    if config.heal_trainable != "lora" and streaming.is_offloaded(model):
        raise InvalidInputError(_offloaded_refusal(config.heal_trainable))
    if reads_hidden_states(config.heal_loss) and (config.execution == "layer_streamed" or streaming.is_offloaded(model)):
        raise InvalidInputError(_streamed_loss_refusal(config.heal_loss))
    if config.execution == "in_memory" and streaming.is_offloaded(model):
        raise InvalidInputError(
            "execution='in_memory' with offloaded weights: the heal's backward pass would keep every weight Accelerate "
            "brings in until it runs, a whole copy of the model. Use execution='auto' (layer-streamed), or load the "
            "model without offload."
        )
    if config.heal_batch_size < distributed.world_size():
        raise InvalidInputError(
            f"heal_batch_size={config.heal_batch_size} cannot be shared by {distributed.world_size()} processes: use a "
            "batch at least as large as the number of processes."
        )
    if compensated is None:  # before pruning: what the dense model already shows there will be nothing to train
        adapter = get_adapter(model)
        num_layers = adapter.num_layers(model)
        if config.heal_trainable in ("lora", "norms", "all"):  # the kept layers are of the dense model's kinds
            _choose(model, adapter, config.heal_trainable, list(range(num_layers)), num_layers, [])
        elif config.heal_trainable == "before_removed" and config.layers_to_prune is not None:
            kept = [index for index in range(num_layers) if index not in set(config.layers_to_prune)]
            if not _layer_before_each_run(kept, num_layers):
                raise InvalidInputError(
                    f"heal_trainable='before_removed' trains the kept layer before each removed run, and "
                    f"layers_to_prune={config.layers_to_prune} removes only a run that starts at layer 0: choose another "
                    "`heal_trainable`."
                )
        if uses_layer_states(config.heal_loss) and config.layers_to_prune is not None:
            kept = [index for index in range(num_layers) if index not in set(config.layers_to_prune)]
            if not _seams(kept):
                raise InvalidInputError(_no_seam_refusal(kept))


def _fingerprint_before_pruning(
    train_sha256: str,
    validation_sha256: str,
    trainable: str,
    learning_rate: float,
    batch_size: int,
    lora_rank: int,
    num_layers: int,
    loss: str = "kl",
) -> dict[str, Any]:
    """The part of a heal checkpoint's fingerprint known before Stage 1 (see [`check_heal_checkpoint_origin`]): the
    heal's text, its settings, the number of processes and the dense model's number of layers."""
    return {
        "train_sha256": train_sha256,
        "validation_sha256": validation_sha256,
        "trainable": trainable,
        "learning_rate": learning_rate,
        "batch_size": batch_size,
        "lora_rank": lora_rank,
        "loss": loss,
        "world_size": distributed.world_size(),
        "num_layers": num_layers,
    }


def check_heal_checkpoint_origin(
    checkpoint: str | os.PathLike | None,
    model: nn.Module,
    train_ids: torch.LongTensor,
    validation_ids: torch.LongTensor,
    config: GradMAPConfig,
) -> None:
    """Refuses, before pruning starts, a heal checkpoint file that comes from another run.

    A heal checkpoint's fingerprint has two parts. The first is known before Stage 1: the heal's training and held-out
    sequences, its settings (`heal_trainable`, the learning rate, `heal_batch_size`, `heal_lora_rank`), the number of
    processes and the dense model's number of layers. The second is what Stage 1 and 2 made: the kept and compensated
    layers and a digest of the weights. This compares the first part: a file that differs in it is refused here, before
    anything changes. A file that matches it is taken as this run's own, left by an interrupted run of the same command
    (what the file is for), and [`heal`] compares the second part when it starts: a file from a run with the same heal
    but another pruning (other calibration text or Stage 1 settings, the same output) is refused only then, after Stage
    1 and 2, which `prune` undoes. The file is read by the main process alone (the others need not see it).

    Args:
        checkpoint (`str` or `os.PathLike`, *optional*): The heal checkpoint file; nothing is checked without one, or
            when it does not exist.
        model (`nn.Module`): The dense model to prune.
        train_ids (`torch.LongTensor`), validation_ids (`torch.LongTensor`): The heal's sequences ([`heal_sequences`]).
        config ([`GradMAPConfig`]): Its `heal_*` settings are read.

    Raises:
        InvalidInputError: for a path that cannot be written ([`check_heal_checkpoint`]), a file that cannot be read, or
            that differs in the first part, saying where.
    """
    if checkpoint is None:
        return
    distributed.on_main_process(lambda: check_heal_checkpoint(checkpoint))  # a path it cannot write: refused here too

    def read_fingerprint() -> dict[str, Any] | None:  # None: no file
        if not os.path.isfile(checkpoint):
            return None
        try:  # mapped, not read: only the fingerprint is needed
            saved = torch.load(checkpoint, map_location="cpu", weights_only=True, mmap=True)
        except Exception as error:
            raise InvalidInputError(
                f"The heal checkpoint {checkpoint} cannot be read ({type(error).__name__}: {error}): delete it."
            ) from error
        return _with_default_loss((saved.get("fingerprint") if isinstance(saved, dict) else None) or {})

    saved = distributed.on_main_process(read_fingerprint)
    if saved is None:
        return
    expected = _fingerprint_before_pruning(
        calibration_sha256(train_ids),
        calibration_sha256(validation_ids),
        config.heal_trainable,
        config.heal_lr if config.heal_lr is not None else DEFAULT_LEARNING_RATES[config.heal_trainable],
        config.heal_batch_size,
        config.heal_lora_rank,
        get_adapter(model).num_layers(model),
        config.heal_loss,
    )
    differs = [key for key, value in expected.items() if saved.get(key) != value]
    if differs:
        raise InvalidInputError(
            f"The heal checkpoint {checkpoint} comes from another run (it differs in {', '.join(differs)}): delete it, or "
            "resume with the same model, text, heal settings and number of processes. Refused before pruning started."
        )


def check_heal_dataset_name(name: str) -> None:
    """Refuses a `heal_dataset` that names no text, before anything loads: the corpus names in it are checked as
    calibration datasets (or paths); `generated` (the dense model's own text) needs no check.

    Raises:
        InvalidInputError: for an unknown name, saying which are available.
    """
    corpus = corpus_part(name) if is_generated(name) else name
    if corpus is not None and not os.path.exists(corpus):
        check_dataset_name(corpus, "calibration")


@dataclass
class HealCosts:
    """The seconds of the heal's parts, measured on the pruned model before an `auto` budget is chosen
    ([`choose_heal_tokens`]).

    Attributes:
        forward_seconds (`float`): The pruned model's forward pass over one batch.
        step_seconds (`float`): One training step over one batch (forward and backward).
        teacher_seconds (`float`): The dense model's forward pass over one batch: `forward_seconds` times its number
            of layers over the pruned model's.
        check_seconds (`float`): One held-out check.
        generation_seconds (`float`): One sequence of the dense model's own text (0 for corpus text).
    """

    forward_seconds: float
    step_seconds: float
    teacher_seconds: float
    check_seconds: float
    generation_seconds: float = 0.0

    def sequences_within(self, seconds: float, config: GradMAPConfig, generated_share: float) -> int:
        """The training sequences whose heal fits in `seconds`: per sequence its share of a step, of the held-out
        checks, and of the teacher's pass (corpus text) or its generation (the dense model's own text, a
        `generated_share` of them, whose targets come with it); once, the held-out sequences' and the first check.
        Whole batches, at least one."""
        batch = config.heal_batch_size
        corpus_share = 1.0 - generated_share  # the dense model's own text comes with its targets: no teacher pass
        fixed = (
            self.check_seconds
            + self.teacher_seconds * corpus_share * -(-config.heal_validation_sequences // batch)
            + self.generation_seconds * math.ceil(generated_share * config.heal_validation_sequences)
        )
        per_sequence = (
            (self.step_seconds + self.teacher_seconds * corpus_share) / batch
            + self.check_seconds / (batch * config.heal_check_every)
            + self.generation_seconds * generated_share
        )
        return max(1, math.floor((seconds - fixed) / per_sequence) // batch) * batch


def measure_heal_costs(
    model: PreTrainedModel,
    config: GradMAPConfig,
    kept: Sequence[int],
    num_layers: int,
    compensated: Sequence[int] = (),
) -> HealCosts:
    """Times the heal's parts on one batch of random tokens, each after one warm-up run, under the heal's autocast
    rule: the pruned model's forward pass as it is (the teacher's pass is that, scaled by the dense model's layers),
    and, with what `heal_trainable` trains set up as the heal sets it up (LoRA's adapters injected), a held-out
    forward pass and a whole training step (`heal_loss` against targets of the same shape, the backward pass,
    clipping and an AdamW step at a rate of 0). The model is put back as it came. A layer-streamed model's step is
    taken as three forward passes; the heal corrects the number of steps after its first ones in any case.

    Args:
        model (`PreTrainedModel`): The pruned model.
        config ([`GradMAPConfig`]): Its `heal_*` settings are read.
        kept (`Sequence[int]`), num_layers (`int`), compensated (`Sequence[int]`): As in [`heal`].

    Returns:
        [`HealCosts`] (without the generation's seconds).
    """
    device = input_device(model)
    autocast = uses_bfloat16_autocast(config.heal_autocast, model)
    vocab_size = model.config.get_text_config(decoder=True).vocab_size
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size, (config.heal_batch_size, config.heal_seq_len), generator=generator)
    batch = ids.to(device)

    def passes() -> AbstractContextManager[None]:
        return torch.autocast(device.type, dtype=torch.bfloat16) if autocast else nullcontext()

    def forward() -> None:
        with torch.no_grad(), passes():
            model(input_ids=batch, use_cache=False)

    def timed(work: Callable[[], None]) -> float:
        work()  # warm-up
        tick = time.perf_counter()
        work()
        return time.perf_counter() - tick

    with calibration_mode(model):
        teacher_forward = timed(forward)
    adapter = get_adapter(model)
    keep_hidden = uses_head_inputs(config.heal_loss)
    seam_layers = _seam_layers(model, adapter, config.heal_loss, kept)
    # a stand-in for the teacher's targets (the pruned model's own, of the same shapes)
    targets = teacher_targets(model, ids, config.heal_batch_size, False, autocast, keep_hidden, seam_layers)
    gram = centred_logit_gram(model.get_output_embeddings().weight) if keep_hidden else None
    choice = _choose(model, adapter, config.heal_trainable, list(kept), num_layers, list(compensated))
    streamed = streaming.streams(model)
    with calibration_mode(model, grad=True, freeze_parameters=True):
        chosen = _Trainable(model, choice, config.heal_lora_rank, config.seed)
        start = chosen.state()
        try:
            optimizer = torch.optim.AdamW(chosen.parameters, lr=0.0, weight_decay=0.0)

            def step() -> None:
                optimizer.zero_grad(set_to_none=True)
                distillation_loss(model, batch, config.heal_loss, targets, gram, seam_layers, passes).backward()
                torch.nn.utils.clip_grad_norm_(chosen.parameters, MAX_GRAD_NORM)
                optimizer.step()

            forward_seconds = timed(forward)
            step_seconds = 3 * forward_seconds if streamed else timed(step)
        finally:
            chosen.restore(start)
    return HealCosts(
        forward_seconds=forward_seconds,
        step_seconds=step_seconds,
        teacher_seconds=teacher_forward * num_layers / max(1, len(kept)),
        check_seconds=forward_seconds * -(-config.heal_validation_sequences // config.heal_batch_size),
    )


def choose_heal_tokens(
    model: PreTrainedModel,
    config: GradMAPConfig,
    budget_seconds: float,
    kept: Sequence[int],
    num_layers: int,
    compensated: Sequence[int] = (),
    generation_seconds_per_sequence: float = 0.0,
) -> tuple[int, HealCosts]:
    """`heal_tokens="auto"`: the tokens whose heal fits in `budget_seconds`, from [`measure_heal_costs`] (the
    measurement's own seconds count against the budget).

    Args:
        model (`PreTrainedModel`): The pruned model.
        config ([`GradMAPConfig`]): Its `heal_*` settings are read.
        budget_seconds (`float`): The heal's time.
        kept (`Sequence[int]`), num_layers (`int`), compensated (`Sequence[int]`): As in [`heal`].
        generation_seconds_per_sequence (`float`, defaults to 0): Seconds per sequence of the dense model's own text,
            for `generated` in `heal_dataset`.

    Returns:
        `tuple[int, HealCosts]`: the tokens (whole `heal_seq_len` sequences, at least one batch) and the costs.
    """
    started = time.perf_counter()
    costs = measure_heal_costs(model, config, kept, num_layers, compensated)
    costs.generation_seconds = generation_seconds_per_sequence
    share = (1.0 if corpus_part(config.heal_dataset) is None else 0.5) if is_generated(config.heal_dataset) else 0.0
    remaining = budget_seconds - (time.perf_counter() - started)
    return costs.sequences_within(remaining, config, share) * config.heal_seq_len, costs


@dataclass
class HealText:
    """The heal stage's sequences and where they came from.

    Attributes:
        train_ids (`torch.LongTensor` of shape `(N, T)`): The training sequences, in the order they are trained on.
        validation_ids (`torch.LongTensor` of shape `(M, T)`): The held-out sequences.
        source (`str`): What they are (the dataset's name or a description).
        generation_seconds (`float`): The seconds spent on the dense model's own text (reading its cache, or
            generating it, and the teacher's targets on the corpus part of a mix); 0 for corpus text. They count in the
            heal stage's time.
        train_targets ([`TeacherTargets`], *optional*), validation_targets ([`TeacherTargets`], *optional*): The
            dense model's targets on the sequences, where they came with its text (kept while it wrote): the heal
            then makes no teacher pass.
    """

    train_ids: torch.LongTensor
    validation_ids: torch.LongTensor
    source: str = ""
    generation_seconds: float = 0.0
    train_targets: TeacherTargets | None = None
    validation_targets: TeacherTargets | None = None


def _generate(
    teacher: Callable[[], AbstractContextManager[nn.Module]],
    tokenizer: PreTrainedTokenizerBase,
    config: GradMAPConfig,
    num_sequences: int,
    cache: str | os.PathLike | None,
    progress_bar: bool,
    prompt_data: CalibrationData = None,
    kept: Sequence[int] | None = None,
) -> GeneratedText:
    """`num_sequences` of the dense model's own text as `config` says: prompts from the first tokens of `prompt_data`'s
    documents (text; `config.dataset` by default) or sequences (token ids), or with `heal_prompts="chat"` from the
    chat template's user turn ([`~optimum_gradmap.generation.chat_prompt`]); `heal_temperature`, seed `seed + 2`.
    The targets kept while it writes hold what `heal_loss` reads (the seams' outputs where `kept` is given)."""
    settings = GenerationSettings(
        config.heal_seq_len,
        config.heal_temperature,
        config.seed + 2,
        keep_hidden=uses_head_inputs(config.heal_loss),
        keep_layers=tuple(_seam_indices(config.heal_loss, kept)),
    )
    start_token = start_token_of(tokenizer)
    if config.heal_prompts == "chat":  # every sequence from the chat template's user turn
        prompt = chat_prompt(tokenizer)
        settings = dataclasses.replace(settings, prompt_tokens=prompt.numel())
        documents, start_token = [prompt], None
    else:
        data = config.dataset if prompt_data is None else prompt_data
        if is_text_data(data):
            documents = tokenize_documents(text_documents(data, config.text_column), tokenizer)
        else:
            documents = list(prepare_calibration_data(data, tokenizer, 0, config.seq_len, config.seed, "", config.text_column))
    return generate_sequences(
        teacher,
        documents,
        start_token,
        num_sequences,
        settings,
        cache,
        autocast=config.heal_autocast,
        progress_bar=progress_bar,
    )


def generation_seconds_per_sequence(
    teacher: Callable[[], AbstractContextManager[nn.Module]],
    tokenizer: PreTrainedTokenizerBase,
    config: GradMAPConfig,
    cache: str | os.PathLike | None = None,
    prompt_data: CalibrationData = None,
    kept: Sequence[int] | None = None,
) -> float:
    """What a sequence of the dense model's own text costs, for `heal_tokens="auto"`: its first batch is generated
    (or read from the cache, which records what it cost) and kept in the cache for the heal (`kept` as in
    [`heal_sequences`])."""
    first = _generate(teacher, tokenizer, config, GENERATION_BATCH_SIZE, cache, False, prompt_data, kept)
    return first.seconds_per_sequence


def heal_sequences(
    data: CalibrationData,
    tokenizer: PreTrainedTokenizerBase | None,
    config: GradMAPConfig,
    teacher: Callable[[], AbstractContextManager[nn.Module]] | None = None,
    cache: str | os.PathLike | None = None,
    progress_bar: bool = True,
    prompt_data: CalibrationData = None,
    kept: Sequence[int] | None = None,
) -> HealText:
    """The training and held-out sequences of a heal run as `config` says: `heal_tokens` worth of `heal_seq_len`-token
    windows of `data` (or `config.heal_dataset`) and `heal_validation_sequences` held out, shuffled with seed
    `seed + 2` ([`~optimum_gradmap.data.prepare_heal_data`]).

    With `generated` in `config.heal_dataset` (and no `data`), the dense model writes the text itself
    ([`~optimum_gradmap.generation`]): from the first tokens of the calibration documents (`prompt_data`, the
    calibration text or token ids Stage 1 read; `config.dataset` by default), at
    `config.heal_temperature`, seed `seed + 2`. Joined to corpus names (`generated+offline:web_text`), half the
    training and half the held-out sequences (rounded up) are generated and the rest are corpus windows, shuffled
    together.

    Args:
        data: The heal text in any form calibration data takes, or `None` for `config.heal_dataset`.
        tokenizer (`PreTrainedTokenizerBase`, *optional*): Needed for text.
        config ([`GradMAPConfig`]): Its `heal_*` settings, `seed`, `dataset` and `text_column` are read.
        teacher (`Callable`, *optional*): Returns a context manager that gives the dense model for its block; needed
            for the dense model's own text.
        cache (`str` or `os.PathLike`, *optional*): The file that caches the dense model's own text
            ([`~optimum_gradmap.generation.generate_sequences`]).
        progress_bar (`bool`, defaults to `True`): Show a progress bar while the dense model writes.
        prompt_data (*optional*): The calibration data whose documents' (or sequences') first tokens prompt the dense
            model; defaults to `config.dataset`.
        kept (`Sequence[int]`, *optional*): The original indices of the pruned model's layers: with
            `heal_loss="kl_hidden_mse"` the dense model keeps its seams' outputs with its targets (without it, the
            heal runs the dense model over the text again for them).

    Returns:
        [`HealText`].

    Raises:
        InvalidInputError: for too little text, or the dense model's own text without a teacher or a tokenizer.
    """
    num_train = -(-config.heal_tokens // config.heal_seq_len)
    num_validation = config.heal_validation_sequences
    if data is not None or not is_generated(config.heal_dataset):
        train_ids, validation_ids = prepare_heal_data(
            config.heal_dataset if data is None else data,
            tokenizer,
            num_train,
            num_validation,
            config.heal_seq_len,
            config.seed + 2,
            config.text_column,
        )
        source = describe_calibration_data(data, config.heal_dataset, config.text_column)
        return HealText(train_ids, validation_ids, source)
    if teacher is None or tokenizer is None:
        raise InvalidInputError(
            f"heal_dataset={config.heal_dataset!r}: the dense model writes the heal text, and it needs the dense model "
            "and its tokenizer here."
        )
    corpus = corpus_part(config.heal_dataset)
    generated_train = num_train if corpus is None else -(-num_train // 2)
    generated_validation = num_validation if corpus is None else -(-num_validation // 2)
    count = generated_validation + generated_train
    generated = _generate(teacher, tokenizer, config, count, cache, progress_bar, prompt_data, kept)
    seconds = generated.seconds
    train_ids, validation_ids = generated.input_ids[generated_validation:], generated.input_ids[:generated_validation]
    train_targets = generated.targets.rows(slice(generated_validation, None))
    validation_targets = generated.targets.rows(slice(0, generated_validation))
    validation_targets.hidden = validation_targets.layer_states = None  # the held-out check is the KL
    prompts = describe_calibration_data(prompt_data, config.dataset, config.text_column)
    if config.heal_prompts == "chat":
        prompts = "its chat template's user turn"
    source = f"{GENERATED} (the dense model's own text, temperature {config.heal_temperature:g}, prompts from {prompts})"
    if corpus is not None:
        corpus_train, corpus_validation = prepare_heal_data(
            corpus,
            tokenizer,
            num_train - generated_train,
            num_validation - generated_validation,
            config.heal_seq_len,
            config.seed + 2,
            config.text_column,
        )
        tick = time.perf_counter()  # the corpus windows' targets, from the teacher (the generated ones have theirs)
        autocast = config.heal_autocast
        with teacher() as dense_model:
            autocast = uses_bfloat16_autocast(autocast, dense_model)
            # the corpus part's targets keep what the generated text's do
            layers = get_adapter(dense_model).layers_at(dense_model, _seam_indices(config.heal_loss, kept))
            corpus_targets = teacher_targets(
                dense_model,
                corpus_train,
                config.heal_batch_size,
                progress_bar,
                autocast,
                uses_head_inputs(config.heal_loss),
                layers,
            )
            corpus_validation_targets = teacher_targets(dense_model, corpus_validation, config.heal_batch_size, False, autocast)
            del dense_model, layers
        seconds += time.perf_counter() - tick
        order = torch.randperm(
            train_ids.shape[0] + corpus_train.shape[0], generator=torch.Generator().manual_seed(config.seed + 2)
        )
        train_ids = torch.cat([train_ids, corpus_train])[order]
        train_targets = TeacherTargets.concatenate([train_targets, corpus_targets]).rows(order)
        validation_ids = torch.cat([validation_ids, corpus_validation])
        validation_targets = TeacherTargets.concatenate([validation_targets, corpus_validation_targets])
        source += f" and {corpus}, equal parts"
    return HealText(train_ids, validation_ids, source, seconds, train_targets, validation_targets)


@dataclass
class HealResult:
    """What the heal stage did.

    Attributes:
        trainable (`str`): What was trained (`heal_trainable`).
        num_trainable_parameters (`int`): How many parameters were trained (LoRA's adapters for `lora`).
        dataset (`str`): The text it was trained on.
        train_sha256 (`str`), validation_sha256 (`str`): The SHA-256 of the training and held-out token ids.
        budget_tokens (`int`): The tokens of the training sequences, all of which an uninterrupted run trains on: the
            budget (`heal_tokens`) rounded up to whole `heal_seq_len`-token sequences.
        trained_tokens (`int`): The tokens trained on (fewer after an interruption).
        steps (`int`), num_steps (`int`): Steps taken, of those planned.
        learning_rate (`float`), batch_size (`int`), seq_len (`int`): The settings.
        loss (`str`): What was minimised (`heal_loss`).
        autocast (`bool`): Whether the passes ran under bfloat16 autocast.
        teacher_seconds (`float`): The teacher's pass over every sequence.
        seconds (`float`): The whole stage, teacher included.
        kl_curve (`list[list[float]]`): `[tokens trained, held-out KL]` at each check, the start included.
        start_kl (`float`), best_kl (`float`): The held-out KL before training and of the state kept.
        best_tokens (`int`): The tokens trained when the state kept was reached (0: the start).
        interrupted (`bool`): Whether training was stopped by Ctrl-C (the best state so far was kept).
        generation_seconds (`float`): The seconds spent on the dense model's own text (`generated` in
            `heal_dataset`), included in `seconds`.
        budget_seconds (`float`, *optional*): With `heal_tokens="auto"`, the time the heal was given (a share
            `AUTO_TIME_SHARE` of Stage 1's); `budget_tokens` is then the number it chose.
        stopped_at_budget (`bool`): Whether training stopped before its last step because the time was up (the best
            state so far was kept).
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
    loss: str = "kl"
    autocast: bool = False
    teacher_seconds: float = 0.0
    seconds: float = 0.0
    kl_curve: list[list[float]] = field(default_factory=list)
    start_kl: float = math.nan
    best_kl: float = math.nan
    best_tokens: int = 0
    interrupted: bool = False
    generation_seconds: float = 0.0
    budget_seconds: float | None = None
    stopped_at_budget: bool = False

    def to_dict(self) -> dict[str, Any]:
        """The result, JSON-serialisable."""
        return asdict(self)

    def summary(self) -> str:
        """One line: what was trained, on what, and the held-out KL before and after."""
        stopped = " (interrupted: the best state so far was kept)" if self.interrupted else ""
        if self.stopped_at_budget:
            stopped = " (stopped when its time was up: the best state so far was kept)"
        if self.budget_seconds is not None:
            stopped += f" (heal_tokens='auto' chose {self.budget_tokens:,} tokens for {self.budget_seconds:.0f} s)"
        kept = "" if self.best_tokens else " (no state beat the start: the model is as it came)"
        loss = "" if self.loss == "kl" else f" with heal_loss={self.loss!r}"
        return (
            f"Healed {self.trainable} ({self.num_trainable_parameters:,} parameters){loss} on {self.trained_tokens:,} tokens of "
            f"{self.dataset}{stopped}: held-out KL from the dense model {self.start_kl:.4f} -> {self.best_kl:.4f}{kept} "
            f"in {self.seconds:.0f} s."
        )


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


def _seam_layers(model: nn.Module, adapter: DecoderAdapter, loss: str, kept: Sequence[int]) -> list[nn.Module]:
    """The pruned model's seam layers ([`_seams`]) where `loss` matches their outputs, none otherwise."""
    if not uses_layer_states(loss):
        return []
    return adapter.layers_at(model, _seams(kept))


def _seam_indices(loss: str, kept: Sequence[int] | None) -> list[int]:
    """The original indices of the seam layers ([`_seams`]), whose outputs the dense model keeps where `loss` matches
    them; none otherwise, or without `kept`."""
    if not uses_layer_states(loss) or kept is None:
        return []
    return [kept[position] for position in _seams(kept)]


def _seams(kept: Sequence[int]) -> list[int]:
    """The positions, among the kept layers, of those directly after a run of removed ones (whose outputs
    `heal_loss="kl_hidden_mse"` matches to the dense model's outputs of the same original layers)."""
    kept_set = set(kept)
    return [position for position, index in enumerate(kept) if index > 0 and index - 1 not in kept_set]


def _no_seam_refusal(kept: Sequence[int]) -> str:
    return (
        f"heal_loss='kl_hidden_mse' matches the hidden states after each kept layer that directly follows a removed "
        f"run, and the kept layers {list(kept)} leave none (only the last layers are removed): heal with "
        "heal_loss='kl', which already compares the last hidden states through the logits."
    )


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
    _check_no_peft_adapters(model)
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
    offloaded = {
        id(parameter)
        for module in model.modules()
        if is_offloaded_module(module)
        for parameter in module.parameters(recurse=False)
    }
    if any(id(parameter) in offloaded for parameter in choice.parameters):
        raise InvalidInputError(_offloaded_refusal(trainable))
    low_precision = sorted({str(p.dtype) for p in choice.parameters if p.dtype in (torch.bfloat16, torch.float16)})
    if low_precision:
        raise InvalidInputError(
            f"heal_trainable={trainable!r} would train {', '.join(low_precision)} weights in place, where AdamW's small "
            "steps round away: load the model in float32 (`--dtype float32`), or heal with heal_trainable='lora' (its "
            "adapters are float32 whatever the model's dtype)."
        )
    return choice


def _streamed_loss_refusal(loss: str) -> str:
    return (
        f"heal_loss={loss!r} compares the two models' hidden states, which the layer-streamed heal (offloaded weights, or "
        "execution='layer_streamed') does not keep: heal with heal_loss='kl', or load the model on devices that hold it "
        "with execution='in_memory'."
    )


def _offloaded_refusal(trainable: str) -> str:
    return (
        f"heal_trainable={trainable!r} trains the model's own weights, and Accelerate offloaded some of them to the CPU "
        "or disk, where no gradient can accumulate (each forward pass brings a new copy): heal an offloaded model with "
        "heal_trainable='lora' (its adapters live in memory and merge into the weights where they live), or load the "
        "model on devices that hold it."
    )


def _check_no_peft_adapters(model: nn.Module) -> None:
    """Refuses a model that carries PEFT adapters: the heal stage adds its own and merges them."""
    if hasattr(model, "peft_config"):
        raise InvalidInputError(
            "The model carries PEFT adapters already: merge them first (`merge_and_unload`), then heal the plain model."
        )


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
        self.model, self.lora, self.lora_layers = model, None, []
        if choice.lora_targets:
            from peft import LoraConfig
            from peft.tuners.lora import LoraLayer, LoraModel

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
                # the wrapped layers, kept to take a merge back even after the wrappers are gone
                self.lora_layers = [module for module in model.modules() if isinstance(module, LoraLayer)]
                # PEFT puts the adapters where the base layer's weight is, in its dtype: on the "meta" device, without
                # values, for a weight Accelerate offloaded. They are drawn again as PEFT draws them (A as nn.Linear's
                # default, B zero), in float32 whatever the model's dtype (AdamW's steps and the merged update keep
                # their bits), on the CPU with `seed`, then put where the base layer computes.
                torch.manual_seed(seed)
                for layer in self.lora_layers:
                    adapters = (layer.lora_A[LORA_ADAPTER], layer.lora_B[LORA_ADAPTER])
                    for linear in adapters:
                        linear.weight = nn.Parameter(torch.empty(linear.weight.shape, dtype=torch.float32))
                    layer.reset_lora_parameters(LORA_ADAPTER, True)
                    for linear in adapters:
                        linear.to(execution_device(layer.get_base_layer()))
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
        """Removes the LoRA adapters, merged into the weights (`merge`) or dropped; nothing to do for the others. The
        merge comes first, layer by layer, and the unwrapping after it, so that [`restore`] can take back a merge an
        error cut short. A weight Accelerate offloaded is merged one map at a time and written where it lives (the CPU
        copy, or the offload folder for a weight on disk, never the model's own files: [`materialized`])."""
        if self.lora is not None:
            if merge:
                for layer in self.lora_layers:
                    with materialized(layer.get_base_layer(), write_back=True):  # PEFT merges through `.data`
                        layer.merge(adapter_names=[LORA_ADAPTER])
            self._unwrap()
            if hasattr(self.model, "peft_config"):
                del self.model.peft_config

    def _unwrap(self) -> None:
        """Puts each wrapped map's base layer back in its place: what PEFT's `unload` does, without its `onload_layer`,
        which would keep an offloaded layer's weights in memory as its hook's new weights map."""
        from peft.tuners.lora import LoraLayer

        wrapped = [(name, module) for name, module in self.model.named_modules() if isinstance(module, LoraLayer)]
        for name, module in wrapped:
            parent, _, child = name.rpartition(".")
            setattr(self.model.get_submodule(parent), child, module.get_base_layer())

    def restore(self, start_state: Sequence[torch.Tensor]) -> None:
        """Puts the model back as it came, after an error at any point (a merge cut short included): the update of
        the layers merged already is subtracted back (exact up to rounding), `start_state` is loaded, and LoRA's
        wrappers are removed.

        Args:
            start_state (`Sequence[torch.Tensor]`): [`state`] before training.
        """
        for layer in self.lora_layers:
            if layer.merged:
                with materialized(layer.get_base_layer(), write_back=True):
                    layer.unmerge()
        self.load(start_state)
        self.finish(merge=False)


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
    loss: str = "kl",
    lora_rank: int = 8,
    autocast: bool = True,
    kept: Sequence[int] | None = None,
    num_layers: int | None = None,
    compensated: Sequence[int] = (),
    dataset: str = "",
    checkpoint: str | os.PathLike | None = None,
    progress_bar: bool = True,
    seed: int = 0,
    deadline: float | None = None,
    spent_seconds: float = 0.0,
    targets: tuple[TeacherTargets, TeacherTargets] | None = None,
) -> HealResult:
    """Distils the teacher into `model` (in place; see the module docstring).

    Under [`~optimum_gradmap.streaming.execution_mode`] `"layer_streamed"`, or `"auto"` (the default) on a model
    whose weights Accelerate offloaded to the CPU or disk, each training step runs layer-streamed
    ([`~optimum_gradmap.streaming.streamed_backward`]): the same gradients, with one decoder layer's weights in memory
    at a time. [`heal_as_configured`] enters the mode `GradMAPConfig.execution` names.

    Args:
        model (`PreTrainedModel`): The pruned model.
        adapter (`DecoderAdapter`): Its family's adapter.
        teacher (`Callable`): Returns a context manager that gives the dense model for its block
            ([`LayerSnapshot.dense_model`], or `contextlib.nullcontext(dense_model)`).
        train_ids (`torch.LongTensor` of shape `(N, T)`): The training sequences, in the order they are trained on.
        validation_ids (`torch.LongTensor` of shape `(M, T)`): The held-out sequences.
        trainable (`str`, defaults to `"lora"`): What is trained, among `HEAL_TRAINABLE_CHOICES`.
        loss (`str`, defaults to `"kl"`): What is minimised, among `HEAL_LOSS_CHOICES` (`GradMAPConfig.heal_loss`;
            the held-out check is the KL whatever it is).
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
            an interrupted run with the same sequences and settings resumes. Missing folders on its path are created.
        progress_bar (`bool`, defaults to `True`): Show progress bars.
        seed (`int`, defaults to 0): The seed of LoRA's initialisation (the same on every process).
        deadline (`float`, *optional*): A `time.perf_counter()` value. After `REFIT_AFTER_STEPS` steps, and at every
            check after them, the schedule's length is fitted to the time left (so that its decay ends by it; the
            later fits time the steps after the first ones), and no training step starts
            that would end, with a last held-out check, after it (the state with the lowest held-out KL so far is kept,
            `stopped_at_budget`). Under `torch.distributed` the main process's clock decides for every process.
        spent_seconds (`float`, defaults to 0): Seconds spent on the heal before this call (the dense model's text,
            an `auto` budget's measurement), added to `seconds`.
        targets (`tuple[TeacherTargets, TeacherTargets]`, *optional*): The teacher's targets on `train_ids` and
            `validation_ids`, made already (kept while the dense model wrote the text): no teacher pass is made,
            unless `loss` needs the teacher's head inputs and they lack them.

    Returns:
        [`HealResult`]. The model holds the trained weights with the lowest held-out KL (the start's if none was
        lower), as plain weights.

    Raises:
        InvalidInputError: for an unknown `trainable`, nothing of that kind to train, full weights in bfloat16 or
            float16, weights to train that Accelerate offloaded, a batch smaller than the number of processes,
            `check_every` below 1, no held-out sequence, a checkpoint path that cannot be written or a checkpoint file
            from another run, before the teacher runs. Any other error once training was set up, in the merge of
            LoRA's adapters included, leaves the model as it was before the call, without LoRA's wrappers (the layers
            merged before the error get their update subtracted back, exact up to rounding); Ctrl-C during the
            training steps keeps the best state so far (`interrupted`; under `torch.distributed` every process stops
            after the same step), before them it propagates.
    """
    if trainable not in HEAL_TRAINABLE_CHOICES:
        raise InvalidInputError(f"`heal_trainable` must be one of {HEAL_TRAINABLE_CHOICES}, got {trainable!r}.")
    if loss not in HEAL_LOSS_CHOICES:
        raise InvalidInputError(f"`heal_loss` must be one of {HEAL_LOSS_CHOICES}, got {loss!r}.")
    if reads_hidden_states(loss) and streaming.streams(model):
        raise InvalidInputError(_streamed_loss_refusal(loss))
    if batch_size < distributed.world_size():
        raise InvalidInputError(
            f"heal_batch_size={batch_size} cannot be shared by {distributed.world_size()} processes: every process takes "
            "at least one sequence of each step. Use a batch at least as large as the number of processes."
        )
    if check_every < 1:
        raise InvalidInputError(
            f"heal_check_every={check_every}: the held-out KL is measured every `heal_check_every` steps, which must be "
            "at least 1. Use a positive number of steps (e.g. 25)."
        )
    if validation_ids.shape[0] == 0 or validation_ids.shape[1] < 2:
        raise InvalidInputError(
            f"The heal got {validation_ids.shape[0]} held-out sequence(s) of {validation_ids.shape[1]} token(s): their KL "
            "to the dense model chooses the state it keeps, so it needs at least one sequence of 2 tokens or more. Hold "
            "out some sequences (heal_validation_sequences >= 1, heal_seq_len >= 2)."
        )
    distributed.on_main_process(lambda: check_heal_checkpoint(checkpoint))  # the main process alone writes it
    started = time.perf_counter() - spent_seconds
    kept = list(range(adapter.num_layers(model))) if kept is None else list(kept)
    num_layers = num_layers if num_layers is not None else kept[-1] + 1
    if uses_layer_states(loss) and not _seams(kept):
        raise InvalidInputError(_no_seam_refusal(kept))
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
        loss=loss,
    )
    fingerprint = _fingerprint_before_pruning(
        result.train_sha256, result.validation_sha256, trainable, learning_rate, batch_size, lora_rank, num_layers, loss
    )
    fingerprint.update(kept=kept, compensated=list(compensated))  # what Stage 1 and 2 made
    if checkpoint is not None:  # the model the run started from (Stage 1 and 2 as they were): only a resume compares it
        fingerprint["weights"] = weights_digest(model)
    resumed = _load_checkpoint(checkpoint, fingerprint)  # a stale file is refused before the teacher runs
    my_rows = [row for step in range(num_steps) for row in _batch_rows(step, batch_size, num_train)]
    my_validation, _ = distributed.shard_any(validation_ids)
    device = input_device(model)
    result.autocast = uses_bfloat16_autocast(autocast, model)
    keep_hidden = uses_head_inputs(loss)
    seam_layers = _seam_layers(model, adapter, loss, kept)
    seam_states = None if targets is None else targets[0].layer_states
    if targets is not None and (
        (keep_hidden and targets[0].hidden is None)
        or (seam_layers and (seam_states is None or seam_states.shape[-2] != len(seam_layers)))
    ):
        logger.info(
            f"Heal: heal_loss={loss!r} needs the dense model's hidden states, which its text's targets lack: the dense "
            "model runs over the text again to keep them."
        )
        targets = None
    if targets is not None:  # kept while the dense model wrote its text: this process's rows
        _, validation_start = distributed.shard_any(validation_ids)
        validation_rows = slice(validation_start, validation_start + my_validation.shape[0])
        targets, validation_targets = targets[0].rows(my_rows), targets[1].rows(validation_rows)
        validation_targets.hidden = validation_targets.layer_states = None  # the held-out check is the KL
    else:
        targets, validation_targets = _teacher_pass(
            teacher,
            train_ids[my_rows],
            my_validation,
            batch_size,
            progress_bar,
            result.autocast,
            keep_hidden,
            _seam_indices(loss, kept),
            adapter,
        )
    gram = centred_logit_gram(model.get_output_embeddings().weight) if keep_hidden else None
    result.teacher_seconds = time.perf_counter() - started - spent_seconds
    position = {row: index for index, row in enumerate(my_rows)}

    def passes() -> AbstractContextManager[None]:
        return torch.autocast(device.type, dtype=torch.bfloat16) if result.autocast else nullcontext()

    def held_out_kl() -> float:
        count = validation_ids.shape[0] * (validation_ids.shape[1] - 1)
        return _held_out_kl(model, my_validation, validation_targets, batch_size, passes, count)

    chosen = None
    with calibration_mode(model, grad=True, freeze_parameters=True):
        try:
            chosen = _Trainable(model, choice, lora_rank, seed)
            start_state = best_state = chosen.state()  # before anything else can fail: an error restores it
            result.num_trainable_parameters = chosen.num_parameters()
            # layer-streamed (offloaded weights, or `execution="layer_streamed"`): one layer's weights at a time
            streamed = DecoderGradient(model, adapter, train_ids) if streaming.streams(model) else None
            optimizer = torch.optim.AdamW(chosen.parameters, lr=learning_rate, weight_decay=0.0)
            # the schedule's length: with a deadline, fitted to the time left after the first steps
            schedule = [num_steps]
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda done: _learning_rate_factor(done + 1, schedule[0]))
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
                tick = time.perf_counter()
                result.start_kl = result.best_kl = held_out_kl()
                result.kl_curve.append([0, result.start_kl])
                check_seconds = time.perf_counter() - tick
            bar = logging.tqdm(
                total=num_steps, initial=first_step, desc=f"Heal ({trainable})", leave=False, disable=not progress_bar
            )
            result.steps = first_step
            result.trained_tokens = min(num_train, first_step * batch_size) * train_ids.shape[1]
            seconds, tokens_timed, warm_seconds = 0.0, 0, 0.0
            if resumed is not None:  # no check was timed: the first one after the resume is
                check_seconds = 0.0
            # Ctrl-C. One process: it stops training where it comes. Several: every process stops after the same step
            # (a process stopping alone would leave the others waiting in a collective): SIGINT is deferred, and an
            # interrupt travels with the step's gradients, or with the checkpoint write's outcome.
            stop = False
            try:
                with distributed.interrupts_deferred() as deferred_interrupt:
                    for step in range(first_step, num_steps):
                        taken = step - first_step
                        if taken == REFIT_AFTER_STEPS:
                            warm_seconds = seconds  # the first steps' time, left out of the later refits
                        if deadline is not None and (
                            taken == REFIT_AFTER_STEPS or (taken > REFIT_AFTER_STEPS and step % check_every == 0)
                        ):  # the first fit times the first steps, the later ones the steps since them
                            recent = taken - REFIT_AFTER_STEPS
                            step_seconds = (seconds - warm_seconds) / recent if recent else seconds / taken
                            schedule[0] = _steps_that_fit(deadline, step, num_steps, step_seconds, check_seconds, check_every)
                        if step >= schedule[0] or (
                            deadline is not None
                            and step > first_step
                            and _past(deadline, seconds / (step - first_step) + check_seconds)
                        ):
                            result.stopped_at_budget = True
                            break
                        tick = time.perf_counter()
                        rows = _batch_rows(step, batch_size, num_train)
                        global_rows = min(batch_size, num_train - step * batch_size)
                        try:  # this process's share of the step
                            optimizer.zero_grad(set_to_none=True)
                            if rows:  # a last, short batch may leave a process none
                                batch = train_ids[rows].to(device)
                                batch_targets = targets.rows([position[row] for row in rows])
                                if streamed is not None:  # the same gradients: the rows' summed per-sequence means
                                    with passes():
                                        streamed.backward(
                                            batch, _streamed_loss_gradient(streamed, batch_targets), chosen.parameters
                                        )
                                else:
                                    step_loss = distillation_loss(model, batch, loss, batch_targets, gram, seam_layers, passes)
                                    (step_loss * len(rows)).backward()
                        except KeyboardInterrupt:
                            stop = True
                        if _average_gradients(chosen.parameters, global_rows, stop or deferred_interrupt()):
                            stop = True  # on every process: this step is not taken
                            break
                        torch.nn.utils.clip_grad_norm_(chosen.parameters, MAX_GRAD_NORM)
                        optimizer.step()
                        scheduler.step()
                        result.steps = step + 1
                        result.trained_tokens = min(num_train, (step + 1) * batch_size) * train_ids.shape[1]
                        seconds += time.perf_counter() - tick
                        tokens_timed += global_rows * train_ids.shape[1]
                        if result.steps % check_every == 0 or result.steps == num_steps:
                            check_tick = time.perf_counter()
                            kl = held_out_kl()
                            check_seconds = time.perf_counter() - check_tick
                            result.kl_curve.append([result.trained_tokens, kl])
                            if kl < result.best_kl:
                                result.best_kl, result.best_tokens, best_state = kl, result.trained_tokens, chosen.state()
                            bar.set_postfix(tokens_per_s=f"{tokens_timed / seconds:.0f}", held_out_kl=f"{kl:.4f}")
                            # False on every process when Ctrl-C stopped the main process's write: all stop here
                            stop = not _save_checkpoint(checkpoint, fingerprint, chosen, optimizer, scheduler, best_state, result)
                        bar.update(1)
                        if stop:
                            break
                    if not stop:  # an interrupt after the last step's gradients
                        stop = distributed.any_process(deferred_interrupt())
                    if result.stopped_at_budget and not stop and result.kl_curve[-1][0] != result.trained_tokens:
                        kl = held_out_kl()  # the last steps' state, checked (its time was kept for it)
                        result.kl_curve.append([result.trained_tokens, kl])
                        if kl < result.best_kl:
                            result.best_kl, result.best_tokens, best_state = kl, result.trained_tokens, chosen.state()
            except KeyboardInterrupt:  # one process: Ctrl-C outside its share of a step
                stop = True
            finally:
                bar.close()
            if result.stopped_at_budget:
                logger.info(
                    f"Heal: the time was up after step {result.steps} of {num_steps}: the model keeps the state with the "
                    f"lowest held-out KL ({result.best_kl:.4f}, after {result.best_tokens} tokens)."
                )
            if stop:
                result.interrupted = True
                logger.warning(
                    f"Heal interrupted at step {result.steps} of {num_steps}: the model keeps the state with the lowest "
                    f"held-out KL so far ({result.best_kl:.4f}, after {result.best_tokens} tokens)."
                )
            chosen.load(best_state)
            chosen.finish(merge=True)  # inside the try: an error in the merge puts the start back too
        except BaseException:
            if chosen is not None:
                chosen.restore(start_state)
            raise
    result.seconds = time.perf_counter() - started
    logger.info(result.summary())
    return result


def _steps_that_fit(
    deadline: float, done: int, num_steps: int, step_seconds: float, check_seconds: float, check_every: int
) -> int:
    """The number of steps (at most `num_steps`) whose training ends by `deadline`, `done` of them taken, each of
    `step_seconds` with a held-out check of `check_seconds` every `check_every` and one at the end (the main process's
    clock decides, so that every process agrees)."""

    def fit() -> int:
        left = deadline - time.perf_counter() - check_seconds
        per_step = step_seconds + check_seconds / check_every
        return min(num_steps, done + max(0, math.floor(left / per_step)))

    return distributed.on_main_process(fit)


def _past(deadline: float, seconds_needed: float) -> bool:
    """Whether work of `seconds_needed` started now would end after `deadline` (the main process's clock decides, so
    that every process stops after the same step)."""
    return distributed.on_main_process(lambda: time.perf_counter() + seconds_needed > deadline)


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
    deadline: float | None = None,
    spent_seconds: float = 0.0,
    targets: tuple[TeacherTargets, TeacherTargets] | None = None,
) -> HealResult:
    """[`heal`] with the `heal_*` settings of `config`, on given sequences ([`heal_stage`] prepares them).

    Args:
        model, teacher, train_ids, validation_ids, kept, num_layers, compensated, dataset, checkpoint, progress_bar,
            deadline, spent_seconds, targets: As in [`heal`].
        config ([`GradMAPConfig`]): Its `heal_trainable`, `heal_lr`, `heal_batch_size`, `heal_check_every`,
            `heal_lora_rank`, `heal_loss`, `heal_autocast`, `execution` (whether the training steps run layer-streamed, see
            [`heal`]) and `seed` (LoRA's initialisation) are read.

    Returns:
        [`HealResult`].
    """
    with streaming.execution_mode(config.execution):
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
            loss=config.heal_loss,
            lora_rank=config.heal_lora_rank,
            autocast=config.heal_autocast,
            kept=kept,
            num_layers=num_layers,
            compensated=compensated,
            dataset=dataset,
            checkpoint=checkpoint,
            progress_bar=progress_bar,
            seed=config.seed,
            deadline=deadline,
            spent_seconds=spent_seconds,
            targets=targets,
        )


def heal_stage(
    model: PreTrainedModel,
    teacher: Callable[[], AbstractContextManager[nn.Module]],
    config: GradMAPConfig,
    tokenizer: PreTrainedTokenizerBase | None,
    kept: Sequence[int],
    num_layers: int,
    compensated: Sequence[int],
    data: CalibrationData = None,
    text: HealText | None = None,
    stage1_seconds: float | None = None,
    checkpoint: str | os.PathLike | None = None,
    text_cache: str | os.PathLike | None = None,
    progress_bar: bool = True,
    check_ids: Callable[[torch.LongTensor], None] | None = None,
    prompt_data: CalibrationData = None,
) -> HealResult:
    """The heal stage as `config` says, from its text to the merged weights (the pruner's, the CLI's and the
    benchmarks' one call): the budget (`heal_tokens`, or `"auto"`: [`choose_heal_tokens`] for a share
    `AUTO_TIME_SHARE` of `stage1_seconds`, the text included, with a deadline), the text ([`heal_sequences`], the
    dense model's own where `heal_dataset` says `generated`), then [`heal`].

    Args:
        model, teacher, kept, num_layers, compensated, checkpoint, progress_bar: As in [`heal`].
        config ([`GradMAPConfig`]): Its `heal_*` settings, `seed`, `dataset`, `text_column` and `execution` are read.
        tokenizer (`PreTrainedTokenizerBase`, *optional*): For text.
        data (*optional*): The heal text (any form calibration data takes); defaults to `config.heal_dataset`.
        text ([`HealText`], *optional*): Sequences prepared already (for a number of tokens): used as they are.
        stage1_seconds (`float`, *optional*): Stage 1's measured time, the unit of `heal_tokens="auto"`.
        text_cache (`str` or `os.PathLike`, *optional*): The cache file of the dense model's own text.
        check_ids (`Callable`, *optional*): Called on each set of sequences prepared here (the pruner's token-id
            check).
        prompt_data (*optional*): The calibration data that prompts the dense model's own text ([`heal_sequences`]).

    Returns:
        [`HealResult`], with the text's seconds in `generation_seconds` and `seconds`, and for `"auto"` the time given
        in `budget_seconds` and the tokens chosen in `budget_tokens`.

    Raises:
        InvalidInputError: for `heal_tokens="auto"` without Stage 1's time, and what [`heal_sequences`] and [`heal`]
            refuse.
    """
    started = time.perf_counter()
    budget = None
    generated_before = 0.0
    if config.heal_tokens == "auto":
        if stage1_seconds is None or not stage1_seconds > 0:
            raise InvalidInputError(
                "heal_tokens='auto' spends about Stage 1's measured time on the heal, and this run has no Stage 1 time "
                "(layers given, or a report without timings): give a number of tokens (`heal_tokens`)."
            )
        budget = AUTO_TIME_SHARE * stage1_seconds
        rate = 0.0
        if data is None and is_generated(config.heal_dataset):
            rate = generation_seconds_per_sequence(teacher, tokenizer, config, text_cache, prompt_data, kept)
            generated_before = time.perf_counter() - started
        remaining = budget - (time.perf_counter() - started)
        tokens, costs = choose_heal_tokens(model, config, remaining, kept, num_layers, compensated, rate)
        logger.info(f"Heal: heal_tokens='auto' chose {tokens:,} tokens for {budget:.0f} s ({costs}).")
        config = dataclasses.replace(config, heal_tokens=tokens)
        text = None
    if text is None:
        text = heal_sequences(data, tokenizer, config, teacher, text_cache, progress_bar, prompt_data, kept)
        for ids in (text.train_ids, text.validation_ids):
            if check_ids is not None:
                check_ids(ids)
    result = heal_as_configured(
        model,
        teacher,
        text.train_ids,
        text.validation_ids,
        config,
        kept,
        num_layers,
        compensated,
        text.source,
        checkpoint,
        progress_bar,
        deadline=started + budget if budget is not None else None,
        spent_seconds=time.perf_counter() - started,
        targets=(text.train_targets, text.validation_targets) if text.train_targets is not None else None,
    )
    result.generation_seconds = generated_before + text.generation_seconds
    result.budget_seconds = budget
    return result


def check_heal_checkpoint(path: str | os.PathLike | None) -> None:
    """Refuses, before anything runs, a heal checkpoint file that could not be written at the first held-out check.
    Folders on its path that do not exist yet are fine: the first save creates them.

    Args:
        path (`str` or `os.PathLike`, *optional*): The heal checkpoint file; `None` (no checkpoint) passes.

    Raises:
        InvalidInputError: for a path that is a folder, that lies under a file, or whose nearest existing folder is not
            writable.
    """
    if path is None:
        return
    target = os.path.abspath(os.fspath(path))
    if os.path.isdir(target):
        raise InvalidInputError(
            f"The heal checkpoint {path} is a folder: give a file path for the heal's state, e.g. "
            f"{os.path.join(os.fspath(path), 'heal.pt')}."
        )
    existing = os.path.dirname(target)
    while not os.path.exists(existing):  # the nearest existing folder: the missing ones are created in it
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise InvalidInputError(
            f"The heal checkpoint {path} cannot be written: {existing} is a file, not a folder. Give a path in a folder."
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise InvalidInputError(
            f"The heal checkpoint {path} cannot be written: {existing} is not writable. Give a path in a folder you can write to."
        )


def _streamed_loss_gradient(streamed: DecoderGradient, targets: TeacherTargets) -> Callable[[torch.Tensor], torch.Tensor]:
    """The heal loss's gradient at the final hidden states of a layer-streamed step: the summed per-sequence mean top-K
    KL, through the head in memory by autograd, or through an offloaded head a slice of the vocabulary at a time."""
    if streamed.sliced_head is not None:
        return partial(
            vocab_sliced_top_k_kl_gradient,
            targets=targets,
            compute_logits=streamed.compute_logits,
            head=streamed.sliced_head,
            vocab_size=streamed.vocab_size,
        )
    return partial(top_k_kl_gradient, targets=targets, compute_logits=streamed.compute_logits, vocab_size=streamed.vocab_size)


def _teacher_pass(
    teacher: Callable[[], AbstractContextManager[nn.Module]],
    train_ids: torch.LongTensor,
    validation_ids: torch.LongTensor,
    batch_size: int,
    progress_bar: bool,
    autocast: bool,
    keep_hidden: bool = False,
    layer_indices: Sequence[int] = (),
    adapter: DecoderAdapter | None = None,
) -> tuple[TeacherTargets, TeacherTargets]:
    """The teacher's targets on the training and the held-out sequences (with, on the training ones, its head inputs
    where `keep_hidden`, and the outputs of its layers `layer_indices`, found by `adapter`). The teacher is bound here
    only, so that no reference to it outlives its block: a teacher loaded for the pass is freed before training
    starts."""
    with teacher() as dense_model:
        layers = adapter.layers_at(dense_model, layer_indices)
        train_targets = teacher_targets(dense_model, train_ids, batch_size, progress_bar, autocast, keep_hidden, layers)
        del layers
        validation_targets = teacher_targets(dense_model, validation_ids, batch_size, progress_bar, autocast)
        del dense_model  # before the context's cleanup runs: a teacher it loaded is freed there, not at a later collection
    return train_targets, validation_targets


def _held_out_kl(
    model: nn.Module,
    input_ids: torch.LongTensor,
    targets: TeacherTargets,
    batch_size: int,
    passes: Callable[[], AbstractContextManager[None]],
    num_positions: int,
) -> float:
    """The mean top-K KL of `model` over the held-out positions of every process (`num_positions` in all). The sum
    stays on the device and is read once, not once per batch."""
    device = input_device(model)
    total = None
    with torch.no_grad():
        for start in range(0, input_ids.shape[0], batch_size):
            batch = input_ids[start : start + batch_size].to(device)
            with passes():
                logits = model(input_ids=batch, use_cache=False).logits[:, :-1]
            part = top_k_kl(logits, targets.rows(slice(start, start + batch_size))).double().sum()
            total = part if total is None else total + part.to(total.device)
    if total is None:  # a process with no held-out sequence of its own (torchrun)
        total = torch.zeros((), dtype=torch.float64, device=device)
    return float(distributed.all_reduce_sum(total) / num_positions)


def _average_gradients(parameters: Sequence[nn.Parameter], global_rows: int, stop: bool = False) -> bool:
    """Turns each process's gradient of its rows' summed loss into the gradient of the mean over the global batch, and
    tells every process whether one of them was interrupted.

    Under `torch.distributed` the gradients travel flattened, in buckets of at most `GRADIENT_BUCKET_BYTES` of one
    dtype and device, one all-reduce each (LoRA on a 30-layer model trains 420 tensors: one all-reduce each would
    cost 420 latencies per step), and `stop` rides in the first bucket. Each gradient gets the same sums as an
    all-reduce of its own.

    Args:
        parameters (`Sequence[nn.Parameter]`): The trained parameters; a missing gradient counts zero.
        global_rows (`int`): The rows of the global batch.
        stop (`bool`, defaults to `False`): Whether this process was interrupted during its share of the step.

    Returns:
        `bool`: Whether any process was interrupted (every process gets the same answer).
    """
    gradients = []
    for parameter in parameters:
        if parameter.grad is None:
            parameter.grad = torch.zeros_like(parameter)
        gradients.append(parameter.grad)
    if not distributed.is_distributed():
        for gradient in gradients:
            gradient.div_(global_rows)
        return stop
    buckets = _gradient_buckets(gradients)
    if not buckets:
        return distributed.any_process(stop)
    interrupted = False
    for index, bucket in enumerate(buckets):
        flat = _flatten_dense_tensors(bucket)
        if index == 0:
            flat = torch.cat([flat, flat.new_full((1,), float(stop))])
        total = distributed.all_reduce_sum(flat)
        if index == 0:
            interrupted, total = bool(total[-1] > 0), total[:-1]
        total.div_(global_rows)
        for gradient, averaged in zip(bucket, _unflatten_dense_tensors(total, bucket)):
            gradient.copy_(averaged)
    return interrupted


def _gradient_buckets(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`tensors` in order, cut into runs of one dtype and device of at most `GRADIENT_BUCKET_BYTES` (a larger tensor
    alone)."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if (
            not buckets
            or (tensor.dtype, tensor.device) != (buckets[-1][0].dtype, buckets[-1][0].device)
            or size + nbytes > GRADIENT_BUCKET_BYTES
        ):
            buckets.append([])
            size = 0
        buckets[-1].append(tensor)
        size += nbytes
    return buckets


def _with_default_loss(fingerprint: dict[str, Any]) -> dict[str, Any]:
    """A saved fingerprint, with the loss of the checkpoints written before `heal_loss` existed (the KL) where it has
    none: they resume."""
    return {"loss": "kl", **fingerprint}


def _load_checkpoint(path: str | os.PathLike | None, fingerprint: dict[str, Any]) -> dict[str, Any] | None:
    """The state an interrupted run with this `fingerprint` saved in `path` (`None` without a file). The main process
    reads it and sends it to the others, which need not see the file (nodes without a shared file system): every
    process resumes from the same state."""
    if path is None:
        return None
    saved = distributed.on_main_process(
        lambda: torch.load(path, map_location="cpu", weights_only=True) if os.path.isfile(path) else None
    )
    if saved is None:
        return None
    saved["fingerprint"] = _with_default_loss(saved.get("fingerprint") or {})
    if saved["fingerprint"] != fingerprint:
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
) -> bool:
    """Saves the state in `path` (by the main process). Returns `False` on every process when Ctrl-C stopped the main
    process's write (the last complete file stays): the processes stop after this step together, rather than the main
    process alone. Another error raises on every process ([`distributed.on_main_process`])."""
    if path is None:
        return True

    def write(temporary: str) -> None:
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

    def save() -> bool:
        temporary = f"{os.fspath(path)}.tmp"
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)  # check_heal_checkpoint: it can be created
        try:
            write(temporary)
            os.replace(temporary, path)
        except BaseException as error:  # no half-written file left behind
            if os.path.exists(temporary):
                os.remove(temporary)
            if isinstance(error, KeyboardInterrupt):
                return False
            raise
        return True

    return distributed.on_main_process(save)
