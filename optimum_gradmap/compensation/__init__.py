# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Stage 2 of GradMAP: the projection compensation matrix (paper Eq. 10-15).

After layers are removed, the mean hidden state drifts away from the original model's. For each
kept layer i the drift is (Eq. 10)

    delta_i = || E_x[H_i(x)] - E_x[H'_i(x)] ||_2

with H_i the output of layer i in the original model and H'_i in the pruned one, on the same
calibration tokens. For the layer(s) with the largest drift (the paper's placement, `compensation_target=
"max_drift"`; the default, `"span_end"`, fits the kept layer before each run of removed layers to the dense
output at the run's end) a d x d matrix W' is learned so that the pruned layer's output matches the original
one (Eq. 12-14):

    min_W'  MSE(W' Y + X_F, X_O)  +  lambda || W' - I ||_F^2

with Y = W_down X_down the MLP's output (bias included), X_F the residual stream entering the MLP
and X_O the original model's output of that layer, over all calibration tokens. The paper calls
the first term the mean squared error; like `torch.nn.MSELoss` it is the mean over all M = tokens x d
elements, which sets the strength of lambda (measured: this reading, not a per-sequence sum,
makes Stage 2 help on SmolLM2; docs/benchmarks/stage2.md). W' is then folded into the down projection,
W_down <- W' W_down and b_down <- W' b_down, so the pruned model costs nothing extra at inference (Eq. 15).

The modules, in the order Stage 2 uses them:

- [`activations`]: the calibration passes (mean hidden states, dense outputs, and per batch what a fit needs,
  with the tokens that carry massive activations left out on request);
- [`statistics`]: the sufficient statistics A = sum y y^T, C = sum r y^T, sum ||r||^2 of the objective, and
  the per-token rows of the fits that need more;
- [`solvers`]: the closed form, Adam, and the one cross-validation routine that chooses lambda;
- [`rotation`]: the Hadamard rotation of LinearPatch's form of W';
- [`cosine`]: ReplaceMe's cosine objective;
- [`through_norm`]: the fit where a norm follows the MLP (Gemma2/3, OLMo2), with the norm in the loop;
- [`fit`]: learning W' for one layer; [`folding`]: folding it into its down projection(s) (Eq. 15);
- [`next_token`]: lambda chosen by the next-token loss on held-out calibration sequences;
- [`refinement`]: the matrices refined together by distillation from the dense model's next-token distribution;
- [`targets`]: which kept layers to fit, and to which dense hidden state;
- [`each_round`]: the fit between Stage 1 removals ([`compensate_run`]);
- [`stage2`]: all the fits in forward order, with rollback ([`compensate`]), and the refusals of settings a family
  cannot run; [`settings`]: its frozen settings ([`Stage2Settings`]); [`result`]: what it did ([`CompensationResult`]).

The pipeline's Stage 2 step ([`optimum_gradmap.pipeline.stage2`]) reads its text and checks it before Stage 1, and
runs [`compensate`] on the pruned result.
"""

from .activations import (
    OUTLIER_NORM_FACTOR,
    CompensationBatch,
    FitData,
    for_each_compensation_batch,
    hidden_state_means,
    hidden_state_means_and_outputs,
    median_token_norm,
    outlier_token_weights,
    outlier_tokens,
    record_layer_outputs,
)
from .cosine import cosine_distance, learn_cosine
from .each_round import RunCompensation, compensate_run
from .fit import check_auto_lambda_data, learn_compensation
from .folding import apply_compensation, down_projection_backup
from .next_token import (
    check_next_token_selection,
    chooses_by_next_token_loss,
    held_out_next_token_loss,
    learn_by_next_token_loss,
    next_token_selection_runs,
    resolve_selection,
)
from .refinement import TOP_K, check_refinement_data, dense_top_k, refine
from .result import CompensationResult
from .rotation import hadamard_matrix, rotation
from .settings import MIN_TOKENS_PER_HIDDEN_UNIT, STAGE2_SETTINGS, Stage2Settings
from .solvers import (
    AUTO_NUM_FOLDS,
    AUTO_RIDGE_GRID,
    CompensationFit,
    RidgeChoice,
    adam_minimize,
    choose_ridge,
    closed_form_at_strength,
    cross_validate_ridge,
    lambda_for_strength,
    relative_ridge,
    ridge_solutions,
    solve_adam,
    solve_closed_form,
)
from .stage2 import check_stage2_settings, compensate
from .statistics import (
    CompensationRows,
    CompensationStatistics,
    collect_rows,
    compensation_statistics,
    summed_over_processes,
)
from .targets import check_num_compensated_layers, compensation_targets
from .through_norm import NormContribution, choose_ridge_through_norm, fit_through_norm

__all__ = [
    "OUTLIER_NORM_FACTOR",
    "CompensationBatch",
    "CompensationRows",
    "FitData",
    "collect_rows",
    "cosine_distance",
    "hadamard_matrix",
    "learn_cosine",
    "check_next_token_selection",
    "chooses_by_next_token_loss",
    "held_out_next_token_loss",
    "learn_by_next_token_loss",
    "next_token_selection_runs",
    "resolve_selection",
    "outlier_token_weights",
    "outlier_tokens",
    "check_stage2_settings",
    "rotation",
    "TOP_K",
    "check_refinement_data",
    "dense_top_k",
    "refine",
    "AUTO_NUM_FOLDS",
    "AUTO_RIDGE_GRID",
    "MIN_TOKENS_PER_HIDDEN_UNIT",
    "STAGE2_SETTINGS",
    "Stage2Settings",
    "CompensationFit",
    "CompensationResult",
    "CompensationStatistics",
    "NormContribution",
    "RidgeChoice",
    "RunCompensation",
    "adam_minimize",
    "apply_compensation",
    "check_auto_lambda_data",
    "check_num_compensated_layers",
    "choose_ridge",
    "choose_ridge_through_norm",
    "compensate",
    "compensate_run",
    "compensation_statistics",
    "compensation_targets",
    "cross_validate_ridge",
    "down_projection_backup",
    "fit_through_norm",
    "for_each_compensation_batch",
    "hidden_state_means",
    "hidden_state_means_and_outputs",
    "median_token_norm",
    "closed_form_at_strength",
    "lambda_for_strength",
    "learn_compensation",
    "record_layer_outputs",
    "relative_ridge",
    "ridge_solutions",
    "solve_adam",
    "solve_closed_form",
    "summed_over_processes",
]
