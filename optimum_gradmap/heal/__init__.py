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
([`LayerSnapshot.dense_model`]); a checkpoint healed later takes its teacher as a separate model. The teacher runs once,
before training, over every training and held-out sequence, and keeps its top-K next-token targets
([`~optimum_gradmap.distillation`]). No reference to the teacher outlives its pass, so a teacher loaded on its own
(the `heal` command's) is freed before training, which holds the student, its optimizer state and these targets; and
any part of the student may be trained, the layers the teacher shares included.

**Loss.** The forward KL divergence KL(p_dense || p_pruned) over the teacher's top-K tokens and "any other token"
([`~optimum_gradmap.objectives.top_k_kl`], which says what it bounds), or another `heal_loss`
([`~optimum_gradmap.heal.loss`]). Unlike the cross-entropy to the renormalised top-K (`refinement_steps`), the KL also
penalises a student that moves mass out of the top-K. Forward KL (the teacher's distribution weighs the errors) is
Minitron's and LinearPatch's choice: the student must cover what the dense model predicts. The held-out KL reported
beside it is the same quantity.

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
on an AVX512-BF16 CPU (measured at commit 5634094).

**Offloaded models.** On a model whose weights Accelerate offloaded to the CPU or disk (`GradMAPConfig.execution`
`"auto"`), or always under `"layer_streamed"`, each training step runs layer-streamed
([`~optimum_gradmap.streaming.streamed_backward`]): one decoder layer's weights in memory at a time, the loss gradient
at the final hidden states formed through an offloaded head a slice of the vocabulary at a time
([`~optimum_gradmap.objectives.vocab_sliced_top_k_kl_gradient`]). The gradients are those of the in-memory step. LoRA's
adapters live in memory, on the device each map computes on, and the merge writes each merged weight where it lives
([`~optimum_gradmap.weights.materialized`]: the CPU copy, or the offload folder, never the model's own files). The
other choices would train offloaded weights, which accumulate no gradient: they are refused. The teacher's pass and
the held-out KL are forward passes, which Accelerate's hooks already run one module at a time.

**Modules**, one per concept: `settings`, `checks`, `text` (with `generation`), `cost` (with `budget`, for
`heal_tokens="auto"`), `trainable`, `loss`, `loop`, `state`, `stage` (the entry), `result` and `quantized`. The
pipeline's heal step ([`optimum_gradmap.pipeline.heal`]) runs it on a pruned result.
"""

from ..distributed import GRADIENT_BUCKET_BYTES
from .budget import choose_heal_tokens, measure_heal_costs
from .checks import (
    check_generation_prompts,
    check_heal_arguments,
    check_heal_checkpoint,
    check_heal_checkpoint_origin,
    check_heal_dataset_name,
    check_heal_settings,
)
from .cost import AUTO_TIME_SHARE, HealCosts, HealCounts
from .loop import FINAL_LR_FRACTION, MAX_GRAD_NORM, REFIT_AFTER_STEPS, WARMUP_FRACTION, heal
from .result import HealResult
from .settings import (
    DEFAULT_LEARNING_RATES,
    HEAL_LOSS_CHOICES,
    HEAL_SETTINGS,
    HEAL_TRAINABLE_CHOICES,
    HealSettings,
    PlannedPruning,
    PrunedLayout,
)
from .stage import heal_stage, prepare_heal_text
from .text import HealText, generation_seconds_per_sequence, heal_sequences
from .trainable import LORA_ADAPTER, changed_parameters, heal_backup

__all__ = [
    "AUTO_TIME_SHARE",
    "DEFAULT_LEARNING_RATES",
    "FINAL_LR_FRACTION",
    "GRADIENT_BUCKET_BYTES",
    "HEAL_LOSS_CHOICES",
    "HEAL_SETTINGS",
    "HEAL_TRAINABLE_CHOICES",
    "LORA_ADAPTER",
    "MAX_GRAD_NORM",
    "REFIT_AFTER_STEPS",
    "WARMUP_FRACTION",
    "HealCosts",
    "HealCounts",
    "HealResult",
    "HealSettings",
    "HealText",
    "PlannedPruning",
    "PrunedLayout",
    "check_generation_prompts",
    "check_heal_arguments",
    "check_heal_checkpoint",
    "check_heal_checkpoint_origin",
    "check_heal_dataset_name",
    "changed_parameters",
    "check_heal_settings",
    "choose_heal_tokens",
    "generation_seconds_per_sequence",
    "heal",
    "heal_backup",
    "heal_sequences",
    "heal_stage",
    "measure_heal_costs",
    "prepare_heal_text",
]
