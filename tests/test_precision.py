"""Decisions on bfloat16 passes (`precision="auto"`): each choice whose margin lies within the bound is recomputed
in float32 and made as float32 makes it; outside the bound, the bfloat16 values decide."""

from __future__ import annotations

import copy

import pytest
import torch

from optimum_gradmap import GradMAPConfig, GradMAPPruner, ImportanceMetric, precision
from optimum_gradmap.errors import InvalidInputError
from optimum_gradmap.precision import LOSS_BOUND, SCORE_BOUND, Precision, settled_lowest

from .conftest import tiny_model


@pytest.fixture
def bfloat16_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stage 1 and Stage 2 run under bfloat16 autocast on any CPU (emulated where it is not native)."""
    monkeypatch.setattr(precision, "bfloat16_passes_available", lambda device: True)


def test_settled_lowest_leaves_open_only_what_the_bound_cannot_order():
    values = {"a": 1.0, "b": 1.03, "c": 2.0}
    assert settled_lowest(values, 1, 0.05) == ([], ["a", "b"])  # 1.0 / 0.95 > 1.03 / 1.05: either may be lowest
    assert settled_lowest(values, 1, 0.01) == (["a"], [])  # 1.0 / 0.99 < 1.03 / 1.01
    assert settled_lowest(values, 2, 0.05) == (["a", "b"], [])  # c is far from both
    certain, undecided = settled_lowest({"a": 1.0, "b": 2.0, "c": 2.05, "d": 5.0}, 2, 0.05)
    assert certain == ["a"] and undecided == ["b", "c"]
    assert settled_lowest(values, 3, 0.5) == (["a", "b", "c"], [])  # every candidate is chosen


def test_a_near_tie_is_decided_by_the_float32_values():
    asked = []

    def exact(candidates):
        asked.append(list(candidates))
        return {"a": 1.02, "b": 1.01}  # float32 reverses the bfloat16 order, within the bound

    passes = Precision(torch.bfloat16)
    chosen, values = passes.lowest({"a": 1.0, "b": 1.01, "c": 3.0}, 1, SCORE_BOUND, exact, "round")
    assert chosen == ["b"] and asked == [["a", "b"]] and values["a"] == 1.02
    assert passes.log.decisions == 1 and [event["candidates"] for event in passes.log.recomputed] == [["a", "b"]]
    assert passes.log.seconds >= 0 and passes.log.as_dict()["recompute_seconds"] == passes.log.seconds

    clear = Precision(torch.bfloat16)
    chosen, _ = clear.lowest({"a": 1.0, "b": 1.5}, 1, SCORE_BOUND, exact, "round")
    assert chosen == ["a"] and len(asked) == 1 and clear.log.recomputed == []  # the margin decides: nothing recomputed

    model_dtype = Precision()  # float32 passes: no decision is checked, nothing recomputed
    assert model_dtype.lowest({"a": 1.0, "b": 1.001}, 1, SCORE_BOUND, exact, "round")[0] == ["a"]
    assert model_dtype.log.decisions == 0 and len(asked) == 1


def test_the_recomputation_runs_in_float32():
    seen = []

    def exact(candidates):
        seen.append(torch.is_autocast_enabled("cpu"))
        return {key: 1.0 for key in candidates}

    passes = Precision(torch.bfloat16)
    with passes.passes():
        assert torch.is_autocast_enabled("cpu")
        passes.lowest({"a": 1.0, "b": 1.0}, 1, LOSS_BOUND, exact, "round")
    assert seen == [False]


class _NearTie(ImportanceMetric):
    """Scores that put layer 2 just below layer 3 under bfloat16 autocast and just above it in float32 (a margin of
    1%, within the bound), with every other layer far above both."""

    name = "near_tie"
    mean_over_samples = False
    iterative = True
    precision_bound = SCORE_BOUND

    def __init__(self):
        self.passes = []

    def score(self, model, adapter, input_ids, batch_size, progress_bar=True, description="Scoring layers"):
        autocast = torch.is_autocast_enabled("cpu")
        self.passes.append(autocast)
        scores = [10.0 + index for index in range(adapter.num_layers(model))]
        scores[2], scores[3] = (1.0, 1.01) if autocast else (1.01, 1.0)
        return scores


@pytest.mark.usefixtures("bfloat16_passes")
def test_stage1_removes_the_layer_float32_removes_on_a_near_tie():
    ids = torch.randint(3, 200, (4, 16))
    metric = _NearTie()
    pruner = GradMAPPruner(GradMAPConfig(num_layers_to_prune=1, importance=metric, compensation=False), progress_bar=False)
    result = pruner.prune(tiny_model("llama", num_layers=6), ids)
    assert result.removed_layers == [3]  # float32's choice, not bfloat16's layer 2
    assert metric.passes == [True, False]  # one bfloat16 pass, then one float32 pass for the near tie
    assert result.precision["computed_in"] == "bfloat16 autocast"
    assert result.precision["decisions"] == 1 and result.precision["recomputed"][0]["candidates"] == ["2", "3"]
    assert result.timings["float32_recompute"] == result.precision["recompute_seconds"]
    assert result.scores[0][3] == 1.0 and result.scores[0][2] == 1.01  # the round records the float32 scores


@pytest.mark.usefixtures("bfloat16_passes")
def test_float32_precision_computes_in_float32_throughout():
    ids = torch.randint(3, 200, (4, 16))
    metric = _NearTie()
    config = GradMAPConfig(num_layers_to_prune=1, importance=metric, compensation=False, precision="float32")
    result = GradMAPPruner(config, progress_bar=False).prune(tiny_model("llama", num_layers=6), ids)
    assert result.removed_layers == [3] and metric.passes == [False]
    assert result.precision == {
        "computed_in": "model dtype",
        "decisions": 0,
        "recomputed": [],
        "recompute_seconds": 0,
        "within_bound": [],
        "float32": [],
    }
    assert "float32_recompute" not in result.timings


def test_without_native_bfloat16_nothing_changes():
    """The suite's default (conftest): no native bfloat16, so `auto` computes in float32, as before."""
    model = tiny_model("llama", num_layers=6)
    assert Precision.for_model("auto", model) == Precision()
    metric = _NearTie()
    config = GradMAPConfig(num_layers_to_prune=1, importance=metric, compensation=False)
    result = GradMAPPruner(config, progress_bar=False).prune(model, torch.randint(3, 200, (4, 16)))
    assert metric.passes == [False] and result.precision["computed_in"] == "model dtype"


@pytest.mark.usefixtures("bfloat16_passes")
def test_bfloat16_weights_compute_in_their_own_dtype():
    model = tiny_model("llama", num_layers=4).to(torch.bfloat16)
    assert Precision.for_model("auto", model).low is None  # no float32 weights to recompute with


@pytest.mark.usefixtures("bfloat16_passes")
@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_both_stages_in_bfloat16_decide_as_float32(family, device, monkeypatch):
    """GradMAP's score and the next-token choice of Stage 2 on bfloat16 passes: the same removed and fitted layers as
    float32's, the checkpoint's weights still float32. On a CPU, GradMAP's Stage 1 scores in float32 (its bfloat16
    passes do not pay for their recomputations there) and says so; where they do (a GPU, here played by the CPU),
    its rounds are decided in bfloat16 too."""
    from optimum_gradmap.importance.metrics import GradMAPImportance

    if device == "cuda":
        monkeypatch.setattr(GradMAPImportance, "bfloat16_devices", ("cuda", "cpu"))
    ids = torch.randint(3, 200, (16, 24))
    dense = tiny_model(family, num_layers=6)
    results = {}
    for setting in ("auto", "float32"):
        model = copy.deepcopy(dense)
        config = GradMAPConfig(num_layers_to_prune=2, precision=setting, num_samples=16, seq_len=24)
        results[setting] = GradMAPPruner(config, progress_bar=False).prune(model, ids)
        assert model.dtype == torch.float32
    auto, exact = results["auto"], results["float32"]
    assert auto.precision["computed_in"] == "bfloat16 autocast"
    if device == "cuda":
        assert auto.precision["decisions"] >= 3 and auto.precision["float32"] == []
    else:  # Stage 2's decisions only
        assert auto.precision["decisions"] >= 1 and auto.precision["float32"] == [
            "Stage 1 (gradmap): bfloat16 does not pay for its recomputations here"
        ]
    assert auto.removed_layers == exact.removed_layers
    assert auto.compensated_layers == exact.compensated_layers


def test_precision_names_are_checked():
    with pytest.raises(InvalidInputError, match="precision"):
        GradMAPConfig(pruning_ratio=0.25, precision="bfloat16")


def test_the_passes_see_weights_changed_between_them():
    """Stage 2 folds W' into a weight between two passes: bfloat16 passes must compute with the new weight, not a
    cached cast of the old one (autocast caches casts of weights that require a gradient)."""
    layer = torch.nn.Linear(8, 8)
    inputs = torch.randn(4, 8)
    with Precision(torch.bfloat16).passes():
        before = layer(inputs)
        with torch.no_grad():
            layer.weight.mul_(2)
        after = layer(inputs)
    assert before.dtype == torch.bfloat16
    assert not torch.allclose(before, after)


@pytest.mark.usefixtures("bfloat16_passes")
def test_the_report_and_card_say_how_the_passes_computed(tmp_path):
    from optimum_gradmap import load_report
    from optimum_gradmap.report.summary import format_report

    config = GradMAPConfig(num_layers_to_prune=1, importance=_NearTie(), compensation=False)
    result = GradMAPPruner(config, progress_bar=False).prune(tiny_model("llama", num_layers=6), torch.randint(3, 200, (4, 16)))
    result.save_pretrained(tmp_path)
    report = load_report(tmp_path)
    assert report["precision"]["recomputed"][0]["candidates"] == ["2", "3"]
    expected = "bfloat16 autocast; 1 of 1 decisions lay within the bound and were recomputed in float32"
    assert expected in format_report(report)
    assert f"Passes: {expected}" in (tmp_path / "README.md").read_text()
