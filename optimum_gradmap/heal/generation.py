# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""The teacher's own text: heal sequences the dense model writes itself (`heal_dataset="generated"`).

Distilling a model on text its teacher generated keeps the teacher's output distribution better than distilling on
corpus text: LLM-QAT (Liu et al., 2023, Sec. 2.1) trains its quantized student on the full-precision model's own
samples, and self-data distillation of a layer-pruned Llama-3.1-8B kept 91.2% of its accuracy against 81.7% with
plain fine-tuning (Thangarasa et al., 2024, arXiv 2410.09982). The KL loss of the heal is an expectation over
contexts: on the teacher's samples, those contexts are the ones the dense model itself produces.

**Prompts.** Each sequence starts from the first `PROMPT_TOKENS` tokens of a calibration document (the documents
shuffled with the seed, cycled when there are fewer documents than sequences), and one sequence in `BOS_EVERY`
starts from the beginning-of-sequence token alone (the end-of-sequence token for a tokenizer without one), so that
part of the text is what the model writes unprompted.

**Sampling.** Plain ancestral sampling from the teacher's next-token distribution at `temperature` (no top-k or
top-p truncation: at 1.0 the contexts follow the teacher's own distribution, which is what the KL objective weighs;
a lower temperature gives more fluent, less varied text; each draw inverts the cumulative distribution,
[`draw_tokens`]), with the KV cache, `GENERATION_BATCH_SIZE` sequences at a time, until each sequence has `seq_len`
tokens; an end-of-sequence token does not stop a sequence (the model goes on to a new text, as in a packed corpus
window). Every batch draws from its own generator, seeded from the seed and the
batch's index, so the first N sequences are the same whatever the number asked for: a cache of more sequences serves
a smaller request, and a larger request extends it.

**Cache.** The sequences are saved in a file (`torch.save`) with their fingerprint: a digest of the teacher's
weights, the prompts, the settings and the seed. A rerun or a resume with the same fingerprint reads them instead of
generating again; a file with another fingerprint is replaced. The `heal` and `prune` commands keep the file beside
their output; without a file the Python API keeps one per fingerprint in the user cache
(`$OPTIMUM_GRADMAP_CACHE/heal_text`, see [`~optimum_gradmap.assets.cache_dir`]).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedTokenizerBase
from transformers.utils import logging

from .. import distillation, distributed
from ..adapters import get_adapter
from ..distillation import layer_outputs, targets_from_logits, the_layer_outputs
from ..errors import InvalidInputError
from ..objectives import TeacherTargets
from ..passes import calibration_mode, input_device
from ..precision import uses_bfloat16_autocast
from ..weights import weights_digest

logger = logging.get_logger(__name__)

# The name of the teacher's own text in `heal_dataset` (alone, or joined to corpus names by "+": equal parts).
GENERATED = "generated"
# Tokens of a calibration document that start a generated sequence.
PROMPT_TOKENS = 8
# One generated sequence in this many starts from the beginning-of-sequence token alone.
BOS_EVERY = 8
# Sequences sampled together (one KV cache): part of the fingerprint, since it decides each sequence's draws. Each
# step reads every weight once for the whole batch: on SmolLM2-135M (2 CPU cores, bfloat16 autocast as the heal runs,
# measured at commit a75d692) 64 rows wrote 498 tokens a second against 444 for 32 (506 for 128, whose last batch
# wastes more of a time budget); the KV cache of 64 sequences of 128 tokens is about 1 GB for a Llama-3-8B in bfloat16.
GENERATION_BATCH_SIZE = 64
# Changes with any change to how the sequences are drawn: part of the fingerprint.
GENERATION_VERSION = 3  # 2: the targets are kept with the sequences; 3: tokens drawn by `draw_tokens`


@dataclass
class GenerationSettings:
    """How the teacher's text is drawn (everything but the teacher and the prompts' documents): all of it but `autocast`
    is part of the cache's fingerprint.

    Attributes:
        seq_len (`int`): Tokens per sequence, the prompt included.
        temperature (`float`): The sampling temperature.
        seed (`int`): The seed of the prompts' shuffle and of every batch's generator.
        prompt_tokens (`int`): Tokens of a document that start a sequence.
        bos_every (`int`): One sequence in this many starts from the beginning-of-sequence token alone.
        batch_size (`int`): Sequences sampled together.
        keep_layers (`tuple[int, ...]`): The teacher's layers (their indices) whose outputs are kept at every position
            too (`TeacherTargets.layer_states`, for `heal_loss="kl_hidden_mse"`).
        start_token (`int`, *optional*): The token an unprompted sequence starts from ([`start_token_of`]); without
            one, every sequence starts from a document's prompt.
        autocast (`bool`): Sample under bfloat16 autocast where the hardware computes bfloat16 natively and the
            teacher is float32 (the heal's `heal_autocast` rule).
    """

    seq_len: int
    temperature: float = 1.0
    seed: int = 0
    prompt_tokens: int = PROMPT_TOKENS
    bos_every: int = BOS_EVERY
    batch_size: int = GENERATION_BATCH_SIZE
    keep_layers: tuple[int, ...] = ()
    start_token: int | None = None
    autocast: bool = False


def is_generated(heal_dataset: Any) -> bool:
    """Whether a `heal_dataset` name asks for the teacher's own text (`"generated"`, alone or in a `+` mixture)."""
    return isinstance(heal_dataset, str) and GENERATED in heal_dataset.split("+")


def corpus_part(heal_dataset: str) -> str | None:
    """The corpus names of a `heal_dataset` with `"generated"` in it, joined by `+` (`None` for the teacher's text
    alone)."""
    names = [name for name in heal_dataset.split("+") if name != GENERATED]
    return "+".join(names) or None


def prompt_starts(documents: Sequence[torch.LongTensor], settings: GenerationSettings) -> list[torch.LongTensor]:
    """The distinct prompts, in the order sequences take them (cycled): the first `prompt_tokens` tokens of each
    document long enough (shuffled with the seed). Sequence `j` takes `[start_token]` when `j % bos_every ==
    bos_every - 1`, else the next document prompt ([`sequence_prompt`]).

    Raises:
        InvalidInputError: when no document has `prompt_tokens` tokens and there is no start token.
    """
    long_enough = [document[: settings.prompt_tokens] for document in documents if document.numel() >= settings.prompt_tokens]
    order = torch.randperm(len(long_enough), generator=torch.Generator().manual_seed(settings.seed)).tolist()
    prompts = [long_enough[index] for index in order]
    if not prompts and settings.start_token is None:
        raise InvalidInputError(
            f"The teacher's text needs prompts: no calibration document has {settings.prompt_tokens} tokens and the "
            "tokenizer has no beginning- or end-of-sequence token. Give longer calibration text (`dataset`)."
        )
    return prompts


def sequence_prompt(index: int, prompts: Sequence[torch.LongTensor], settings: GenerationSettings) -> torch.LongTensor:
    """The prompt of generated sequence `index`: `[start_token]` for one in `bos_every` (every one without document
    prompts), else the next document prompt, cycled."""
    start_token = settings.start_token
    from_start = start_token is not None and (not prompts or index % settings.bos_every == settings.bos_every - 1)
    if from_start:
        return torch.tensor([start_token], dtype=torch.long)
    document_index = index - (index // settings.bos_every if start_token is not None else 0)
    return prompts[document_index % len(prompts)]


def draw_tokens(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> torch.LongTensor:
    """Draws one token per row from `softmax(logits / temperature)` by inverting its cumulative distribution: a
    uniform draw per row, scaled to the row's total, and the first token whose cumulative probability passes it (a
    token of probability 0 is never drawn). The same distribution as `torch.multinomial`, which is slow on a large
    vocabulary on the CPU (with it, SmolLM2-135M wrote 375 tokens a second, 32 sequences at a time on 2 cores under
    bfloat16 autocast, against 444 with this, measured at commit a75d692); its draws differ from
    `multinomial`'s (`GENERATION_VERSION` 3).

    Args:
        logits (`torch.Tensor` of shape `(rows, vocab)`): Next-token logits, on the CPU.
        temperature (`float`): The sampling temperature (> 0).
        generator (`torch.Generator`): The draws' generator (on the CPU).

    Returns:
        `torch.LongTensor` of shape `(rows,)`.
    """
    cumulative = torch.softmax(logits / temperature, dim=-1).double().cumsum(dim=-1)
    uniform = torch.rand(logits.shape[0], 1, generator=generator, dtype=torch.float64) * cumulative[:, -1:]
    return torch.searchsorted(cumulative, uniform, right=True).squeeze(1).clamp_(max=logits.shape[-1] - 1)


@torch.no_grad()
def sample_batch(
    model: nn.Module,
    prompts: Sequence[torch.LongTensor],
    seq_len: int,
    temperature: float,
    generator: torch.Generator,
    autocast: bool = False,
    layers: Sequence[nn.Module] = (),
) -> tuple[torch.LongTensor, TeacherTargets]:
    """Samples one batch of sequences of `seq_len` tokens, each starting with its prompt (prompts may differ in
    length: a row takes its prompt's token where it has one, and its sample elsewhere; every step feeds one token
    per row to the KV cache), and keeps the model's heal targets at every position
    ([`~optimum_gradmap.distillation.targets_from_logits`]): the logits it samples from are the teacher's, so the
    heal needs no second pass of the teacher over its own text.

    Args:
        model (`nn.Module`): The causal LM.
        prompts (`Sequence[torch.LongTensor]`): One prompt per row, each 1 to `seq_len` tokens.
        seq_len (`int`): Tokens per sequence.
        temperature (`float`): The sampling temperature (> 0).
        generator (`torch.Generator`): The draws' generator (on the CPU).
        autocast (`bool`, defaults to `False`): Run the passes under bfloat16 autocast.
        layers (`Sequence[nn.Module]`, defaults to `()`): Decoder layers of `model`, in the order they run, whose outputs
            are kept too (`TeacherTargets.layer_states`).

    Returns:
        `tuple[torch.LongTensor, TeacherTargets]`: the sequences `(len(prompts), seq_len)` and the targets at their
        first `seq_len - 1` positions, on the CPU.
    """
    device = input_device(model)
    rows = len(prompts)
    sequences = torch.zeros(rows, seq_len, dtype=torch.long)
    forced = torch.zeros(rows, seq_len, dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        sequences[row, : prompt.numel()] = prompt
        forced[row, : prompt.numel()] = True
    # One cache, filled in place by the layers; its keyword is `cache` from transformers 5.24 (`past_key_values`
    # before, still accepted there with a warning).
    cache_keyword = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache = {cache_keyword: DynamicCache(config=model.config)}
    passes = torch.autocast(device.type, dtype=torch.bfloat16) if autocast else nullcontext()
    targets: list[TeacherTargets] = []
    with passes, layer_outputs(layers) as outputs:
        for position in range(seq_len - 1):
            output = model(input_ids=sequences[:, position : position + 1].to(device), use_cache=True, **cache)
            targets.append(targets_from_logits(output.logits[:, -1:]))
            if layers:
                targets[-1].layer_states = the_layer_outputs(outputs, len(layers))[:, -1:].to(torch.bfloat16).cpu()
            drawn = draw_tokens(output.logits[:, -1].float().cpu(), temperature, generator)
            column = position + 1
            sequences[:, column] = torch.where(forced[:, column], sequences[:, column], drawn)
    return sequences, TeacherTargets.concatenate(targets, dim=1)


def fingerprint(teacher: nn.Module, prompts: Sequence[torch.LongTensor], settings: GenerationSettings) -> dict[str, Any]:
    """What decides the generated sequences: the teacher's weights (a digest), the prompts, the settings (but
    `autocast`) and the seed. The number of sequences is left out: the first N are the same whatever the number asked
    for."""
    prompt_bytes = json.dumps([prompt.tolist() for prompt in prompts]).encode()
    return {
        "version": GENERATION_VERSION,
        "teacher_weights": weights_digest(teacher),
        "prompts_sha256": hashlib.sha256(prompt_bytes).hexdigest(),
        "top_k": distillation.TOP_K,
        # `keep_layers` only where set: the caches written before it existed stay valid
        **{
            key: list(value) if isinstance(value, tuple) else value
            for key, value in asdict(settings).items()
            if key != "autocast" and (key != "keep_layers" or value)
        },
    }


@dataclass
class GeneratedText:
    """The dense model's own text.

    Attributes:
        input_ids (`torch.LongTensor` of shape `(N, seq_len)`): The sequences.
        seconds (`float`): Spent by this call (reading the cache, generating what it lacked).
        seconds_per_sequence (`float`): The generation's seconds per sequence where it ran (this call's, else the
            cache's record of it): what more sequences would cost.
        from_cache (`int`): Sequences read from the cache.
        targets ([`~optimum_gradmap.objectives.TeacherTargets`], *optional*): The dense model's heal targets on the
            sequences, kept while it wrote them.
    """

    input_ids: torch.LongTensor
    seconds: float
    seconds_per_sequence: float
    from_cache: int = 0
    targets: TeacherTargets | None = None


def _read_cache(path: str | os.PathLike, expected: dict[str, Any]) -> dict[str, Any] | None:
    if not os.path.isfile(path):
        return None
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # a half-written or foreign file: generated again and replaced
        logger.warning(f"The teacher's text cache {path} cannot be read ({type(error).__name__}): generating again.")
        return None
    if not isinstance(saved, dict) or saved.get("fingerprint") != expected:
        logger.info(f"The teacher's text cache {path} comes from other settings or another teacher: generating again.")
        return None
    return saved


def _write_cache(
    path: str | os.PathLike,
    expected: dict[str, Any],
    input_ids: torch.LongTensor,
    targets: TeacherTargets,
    seconds_per_sequence: float,
) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    temporary = f"{os.fspath(path)}.tmp"
    try:
        payload = {
            "fingerprint": expected,
            "input_ids": input_ids,
            "targets": [targets.indices, targets.log_probs, targets.rest_log_prob],
            "seconds_per_sequence": seconds_per_sequence,
        }
        if targets.layer_states is not None:
            payload["layer_states"] = targets.layer_states
        torch.save(payload, temporary)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def start_token_of(tokenizer: PreTrainedTokenizerBase | None) -> int | None:
    """The token a sequence written unprompted starts from: the tokenizer's beginning-of-sequence token, else its
    end-of-sequence token (GPT-2's documents are separated by it), else `None`."""
    if tokenizer is None:
        return None
    for token in (tokenizer.bos_token_id, tokenizer.eos_token_id):
        if token is not None:
            return int(token)
    return None


def generate_sequences(
    teacher: Callable[[], AbstractContextManager[nn.Module]],
    documents: Sequence[torch.LongTensor],
    num_sequences: int,
    settings: GenerationSettings,
    cache: str | os.PathLike | None = None,
    progress_bar: bool = True,
) -> GeneratedText:
    """The teacher's own text: `num_sequences` sequences it samples from the prompts (see the module docstring), read
    from `cache` when it holds them for the same fingerprint (a cache with fewer is extended). Under
    `torch.distributed` the main process alone reads, writes and extends the cache, and sends the text to the others
    (which need not see the file): one process generates, the others wait for it.

    Args:
        teacher (`Callable`): Returns a context manager that gives the dense model for its block.
        documents (`Sequence[torch.LongTensor]`): Tokenized calibration documents, whose first tokens are the prompts.
        num_sequences (`int`): Sequences wanted.
        settings ([`GenerationSettings`]): How they are drawn.
        cache (`str` or `os.PathLike`, *optional*): The cache file (created, extended or replaced here); defaults to
            a file named by the fingerprint in the user cache.
        progress_bar (`bool`, defaults to `True`): Show a progress bar.

    Returns:
        [`GeneratedText`].

    Raises:
        InvalidInputError: for a temperature that is not a finite number > 0, a `seq_len` below 2, no prompt, or a
            prompt longer than `seq_len`, before the teacher runs.
    """
    if not (isinstance(settings.temperature, (int, float)) and 0 < settings.temperature < float("inf")):
        raise InvalidInputError(f"The generation temperature must be a finite number > 0, got {settings.temperature!r}.")
    if settings.seq_len < 2:
        raise InvalidInputError(f"Generated sequences need at least 2 tokens, got seq_len={settings.seq_len}.")
    prompts = prompt_starts(documents, settings)
    longest = max([prompt.numel() for prompt in prompts] + [1 if settings.start_token is not None else 0])
    if longest > settings.seq_len:
        raise InvalidInputError(
            f"The dense model's prompts have up to {longest} tokens, more than the {settings.seq_len} of a generated "
            f"sequence (`heal_seq_len`): use sequences longer than the prompts, or shorter prompts."
        )
    return distributed.on_main_process(lambda: _generate_or_read(teacher, prompts, num_sequences, settings, cache, progress_bar))


def _generate_or_read(
    teacher: Callable[[], AbstractContextManager[nn.Module]],
    prompts: Sequence[torch.LongTensor],
    num_sequences: int,
    settings: GenerationSettings,
    cache: str | os.PathLike | None,
    progress_bar: bool,
) -> GeneratedText:
    """[`generate_sequences`] on one process: the cache's sequences, and those it lacks generated and saved in it."""
    started = time.perf_counter()
    with teacher() as model:
        expected = fingerprint(model, prompts, settings)
        if cache is None:
            from ..assets import cache_dir  # the assets module loads only where a cache folder is needed

            name = hashlib.sha256(json.dumps(expected, sort_keys=True).encode()).hexdigest()[:16]
            cache = os.path.join(cache_dir(), "heal_text", f"{name}.pt")
        autocast = uses_bfloat16_autocast(settings.autocast, model)
        saved = _read_cache(cache, expected) or {}
        have = saved.get("input_ids", torch.zeros(0, settings.seq_len, dtype=torch.long))
        have_targets = [TeacherTargets(*saved["targets"], layer_states=saved.get("layer_states"))] if saved else []
        seconds_per_sequence = float(saved.get("seconds_per_sequence", 0.0))
        from_cache = min(num_sequences, have.shape[0])
        if have.shape[0] < num_sequences:
            first_batch = have.shape[0] // settings.batch_size  # a cache always holds whole batches
            last_batch = -(-num_sequences // settings.batch_size)
            tick = time.perf_counter()
            batches, targets = _sample_batches(model, prompts, settings, range(first_batch, last_batch), autocast, progress_bar)
            seconds_per_sequence = (time.perf_counter() - tick) / ((last_batch - first_batch) * settings.batch_size)
            have = torch.cat([have[: first_batch * settings.batch_size], *batches])
            have_targets += targets
            _write_cache(cache, expected, have, TeacherTargets.concatenate(have_targets), seconds_per_sequence)
        del model
    targets = TeacherTargets.concatenate(have_targets).rows(slice(0, num_sequences))
    return GeneratedText(have[:num_sequences], time.perf_counter() - started, seconds_per_sequence, from_cache, targets)


def _sample_batches(
    model: nn.Module,
    prompts: Sequence[torch.LongTensor],
    settings: GenerationSettings,
    batches: range,
    autocast: bool,
    progress_bar: bool,
) -> tuple[list[torch.LongTensor], list[TeacherTargets]]:
    """The generation batches `batches` (each drawn from its own generator, seeded from the seed and its index), with
    the targets kept while the model wrote them (under bfloat16 autocast where `autocast`)."""
    layers = get_adapter(model).layers_at(model, settings.keep_layers)
    sequences, targets = [], []
    with calibration_mode(model):
        for batch in logging.tqdm(batches, desc="Heal: the dense model writes its text", leave=False, disable=not progress_bar):
            indices = range(batch * settings.batch_size, (batch + 1) * settings.batch_size)
            generator = torch.Generator().manual_seed(settings.seed * 1_000_003 + batch)
            batch_prompts = [sequence_prompt(index, prompts, settings) for index in indices]
            batch_sequences, batch_targets = sample_batch(
                model, batch_prompts, settings.seq_len, settings.temperature, generator, autocast, layers
            )
            sequences.append(batch_sequences)
            targets.append(batch_targets)
    return sequences, targets
