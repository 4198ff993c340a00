"""Pruning to a budget: the calibration-loss curve, the stop at a loss budget or a parameter target, and
cutting one run's curve at a smaller K."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

from optimum_gradmap import GradMAPPruner, remove_layers
from optimum_gradmap.cli import main
from optimum_gradmap.errors import InvalidInputError
from optimum_gradmap.objectives import mean_next_token_loss
from optimum_gradmap.report import CURVE_PICTURE, REPORT_NAME, format_report, load_report

from .conftest import random_ids, small_config, tiny_model


def _independent_curve(model: torch.nn.Module, ids: torch.LongTensor, removed: list[int]) -> list[float]:
    """The calibration loss of the dense model without the first k removed layers, for every k, each from a fresh copy."""
    curve = []
    for count in range(1, len(removed) + 1):
        pruned = copy.deepcopy(model)
        remove_layers(pruned, removed[:count])
        curve.append(mean_next_token_loss(pruned, ids, batch_size=4, progress_bar=False))
    return curve


@pytest.mark.parametrize("importance", ["gradmap", "sleb", "block_influence"])
def test_the_curve_is_the_calibration_loss_after_each_removal(importance):
    """Measured by an extra pass (GradMAP, Block Influence) or taken from SLEB's own scores: either way the loss
    of the dense model without the first k layers removed."""
    model, ids = tiny_model("llama", num_layers=6), random_ids(8, 16)
    dense = copy.deepcopy(model)
    config = small_config(importance=importance, num_layers_to_prune=4, loss_curve=True, compensation=False)
    result = GradMAPPruner(config, progress_bar=False).prune(model, ids)
    assert len(result.loss_curve) == len(result.removed_layers) == 4
    assert result.dense_loss == pytest.approx(mean_next_token_loss(dense, ids, batch_size=4, progress_bar=False), rel=1e-5)
    assert result.loss_curve == pytest.approx(_independent_curve(dense, ids, result.removed_layers), rel=1e-5)
    assert result.stopped is None


def _budget_that_stops_early(dense_loss: float, curve: list[float]) -> tuple[int, float]:
    """The first k >= 1 whose loss exceeds every earlier one, and a budget between the two, which stops Stage 1
    after k removals."""
    stop = next(k for k in range(1, len(curve)) if curve[k] > max([dense_loss, *curve[:k]]))
    return stop, (max([dense_loss, *curve[:stop]]) + curve[stop]) / 2 / dense_loss - 1


@pytest.mark.parametrize("importance", ["gradmap", "sleb"])
def test_a_loss_budget_stops_before_the_first_removal_that_breaks_it(importance):
    """Constructed case: the budget lies between the loss after the second removal and the loss after the
    third, so Stage 1 removes exactly two layers and names the third as refused."""
    model, ids = tiny_model("llama", num_layers=6), random_ids(8, 16)
    config = small_config(importance=importance, num_layers_to_prune=4, loss_curve=True, compensation=False)
    full = GradMAPPruner(config, progress_bar=False).prune(copy.deepcopy(model), ids)
    dense_loss, curve = full.dense_loss, full.loss_curve
    stop, allowed = _budget_that_stops_early(dense_loss, curve)
    budget = small_config(importance=importance, num_layers_to_prune=None, max_loss_increase=allowed, compensation=False)
    result = GradMAPPruner(budget, progress_bar=False).prune(model, ids)
    assert result.removed_layers == full.removed_layers[:stop]
    assert result.num_layers_to_prune == stop == len(result.loss_curve)
    assert result.rejected == {"layer": full.removed_layers[stop], "loss": pytest.approx(curve[stop], rel=1e-6)}
    assert "above the budget" in result.stopped
    assert len(get_layers(model)) == 6 - stop  # the refused removal was put back


def get_layers(model):
    from optimum_gradmap.adapters import get_adapter

    return get_adapter(model).get_layers(model)


def test_a_parameter_target_removes_layers_until_the_model_is_small_enough():
    model, ids = tiny_model("llama", num_layers=6), random_ids(8, 16)
    per_layer = sum(parameter.numel() for parameter in get_layers(model)[0].parameters())
    target = model.num_parameters() - 3 * per_layer
    result = GradMAPPruner(small_config(num_layers_to_prune=None, target_num_parameters=target), progress_bar=False).prune(
        model, ids
    )
    assert result.num_layers_to_prune == 3
    assert model.num_parameters() == target
    assert "the target" in result.stopped
    with_a_maximum = small_config(num_layers_to_prune=2, target_num_parameters=target, compensation=False)
    assert GradMAPPruner(with_a_maximum, progress_bar=False).prune(tiny_model("llama", 6), ids).num_layers_to_prune == 2


def test_a_parameter_target_the_maximum_k_cannot_reach_is_warned_about_with_what_was_reached(caplog):
    import logging

    model, ids = tiny_model("llama", num_layers=6), random_ids(8, 16)
    per_layer = sum(parameter.numel() for parameter in get_layers(model)[0].parameters())
    target = model.num_parameters() - 3 * per_layer
    library = logging.getLogger("optimum_gradmap")
    handled = not library.propagate  # the command line (an earlier test) stops it propagating to caplog's root handler
    if handled:
        library.addHandler(caplog.handler)
    try:
        with caplog.at_level("WARNING", logger="optimum_gradmap"):
            config = small_config(num_layers_to_prune=2, target_num_parameters=target, compensation=False)
            result = GradMAPPruner(config, progress_bar=False).prune(model, ids)
            (warning,) = [record.getMessage() for record in caplog.records if record.levelname == "WARNING"]
            caplog.clear()
            reachable = small_config(num_layers_to_prune=3, target_num_parameters=target, compensation=False)
            GradMAPPruner(reachable, progress_bar=False).prune(tiny_model("llama", 6), ids)
            assert [record for record in caplog.records if record.levelname == "WARNING"] == []
    finally:
        if handled:
            library.removeHandler(caplog.handler)
    assert result.num_layers_to_prune == 2 and model.num_parameters() == target + per_layer
    assert f"{target + per_layer:,} parameters" in warning and f"target_num_parameters={target:,}" in warning
    assert "2 layers, the most allowed" in warning and "num_layers_to_prune" in warning


@pytest.mark.parametrize("importance", ["gradmap", "sleb"])
def test_cutting_a_run_at_k_gives_the_layers_and_the_model_of_a_run_with_k(importance):
    ids = random_ids(8, 16)
    long_run = GradMAPPruner(small_config(importance=importance, num_layers_to_prune=4, loss_curve=True), progress_bar=False)
    model = tiny_model("llama", num_layers=6)
    result = long_run.select_layers(model, ids)
    long_run.compensate(result)  # fitted for K = 4, undone by the cut
    long_run.cut(result, 2)
    long_run.compensate(result)

    short = tiny_model("llama", num_layers=6)
    expected = GradMAPPruner(small_config(importance=importance, num_layers_to_prune=2), progress_bar=False).prune(short, ids)
    assert result.removed_layers == expected.removed_layers
    assert result.kept_layers == expected.kept_layers
    assert result.compensated_layers == expected.compensated_layers
    assert result.loss_curve == pytest.approx(_independent_curve(tiny_model("llama", 6), ids, expected.removed_layers))
    for ours, theirs in zip(model.state_dict().values(), short.state_dict().values()):
        torch.testing.assert_close(ours, theirs)
    with pytest.raises(InvalidInputError, match="between 1 and the 2 removals made"):
        long_run.cut(result, 3)


def test_the_curve_round_trips_through_the_report_and_is_drawn_and_printed(tmp_path, byte_tokenizer):
    model, ids = tiny_model("llama", num_layers=6), random_ids(8, 16)
    curve_config = small_config(num_layers_to_prune=4, loss_curve=True, compensation=False)
    full = GradMAPPruner(curve_config, progress_bar=False).prune(copy.deepcopy(model), ids)
    dense_loss = full.dense_loss
    _, allowed = _budget_that_stops_early(dense_loss, full.loss_curve)
    config = small_config(num_layers_to_prune=None, max_loss_increase=allowed, compensation=False)
    pruner = GradMAPPruner(config, progress_bar=False)
    result = pruner.prune(model, ids)
    pruner.save_pretrained(tmp_path, tokenizer=byte_tokenizer)
    report = load_report(tmp_path)
    assert report == json.loads(json.dumps(report))
    assert report["dense_loss"] == pytest.approx(dense_loss, rel=1e-5)
    assert report["loss_curve"] == result.loss_curve
    assert report["stopped"] == result.stopped and report["rejected"] == result.rejected
    assert report["gradmap_config"]["max_loss_increase"] == allowed
    pytest.importorskip("matplotlib")
    assert os.path.getsize(tmp_path / CURVE_PICTURE) > 1000
    text = format_report(report)
    assert f"calibration loss:    dense {dense_loss:.4f}" in text
    assert f"refused (layer {result.rejected['layer']:>2})" in text and "stage 1 stopped:     removing layer" in text


def test_the_cli_prunes_to_a_budget_and_cuts_an_earlier_run(tiny_checkpoint, tmp_path, capsys):
    common = ["--dataset", "offline:wikipedia", "--num-samples", "8", "--seq-len", "16", "--batch-size", "4", "-q"]
    assert (
        main(
            ["prune", tiny_checkpoint, "--num-layers-to-prune", "4", "--loss-curve", "--output", str(tmp_path / "curve"), *common]
        )
        == 0
    )
    long_run = load_report(tmp_path / "curve")
    printed = capsys.readouterr().out
    assert f"4 removed (layer {long_run['removed_layers'][3]:>2})" in printed

    cut = ["prune", tiny_checkpoint, "--cut-from", str(tmp_path / "curve"), "--num-layers-to-prune"]
    assert main([*cut, "2", "--output", str(tmp_path / "cut"), *common]) == 0
    assert load_report(tmp_path / "cut")["removed_layers"] == long_run["removed_layers"][:2]
    assert main(["prune", tiny_checkpoint, "--num-layers-to-prune", "2", "--output", str(tmp_path / "k2"), *common]) == 0
    assert load_report(tmp_path / "k2")["removed_layers"] == long_run["removed_layers"][:2]

    assert main(["prune", tiny_checkpoint, "--max-loss-increase", "1e-7", "--output", str(tmp_path / "budget"), *common]) == 0
    printed = capsys.readouterr().out
    assert "Stage 1 stopped: removing layer" in printed and "above the budget of +1e-05%" in printed
    assert main([*cut, "5", "--output", str(tmp_path / "bad"), *common]) == 2
    assert "between 1 and the 4 layers" in capsys.readouterr().err
    assert main([*cut, "2", "--compensate-each-round", "--output", str(tmp_path / "bad"), *common]) == 2
    assert "a run with --compensate-each-round (this one or the one it cuts) cannot be cut" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "bad") and os.path.isfile(tmp_path / "curve" / REPORT_NAME)


def test_a_budget_no_removal_fits_leaves_the_model_whole_and_says_why():
    model, ids = tiny_model("llama", num_layers=6), random_ids(8, 16)
    dense = copy.deepcopy(model)
    result = GradMAPPruner(small_config(num_layers_to_prune=None, max_loss_increase=1e-9), progress_bar=False).prune(model, ids)
    assert result.removed_layers == [] and result.loss_curve == [] and result.compensated_layers == []
    assert result.rejected["layer"] in range(6) and "above the budget" in result.stopped
    for ours, theirs in zip(model.state_dict().values(), dense.state_dict().values()):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
