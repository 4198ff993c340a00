"""Calibration data, the offline Wikipedia split, and the perplexity protocol."""

import math

import pytest
import torch

from optimum_gradmap import perplexity
from optimum_gradmap.data import load_text, prepare_calibration_data, sample_sequences, wikipedia_documents
from optimum_gradmap.evaluation import evaluation_segments, load_evaluation_segments

from .conftest import random_ids, tiny_model


def test_offline_wikipedia_is_split_by_document_without_overlap():
    calibration = wikipedia_documents("calibration")
    evaluation = wikipedia_documents("evaluation")
    assert (len(calibration), len(evaluation)) == (2115, 234)  # 2,349 articles, every tenth held out
    assert not set(calibration) & set(evaluation)
    assert all(len(doc) > 0 and "<doc" not in doc and "</doc>" not in doc for doc in calibration + evaluation)


def test_sampled_windows_are_reproducible_and_lie_in_the_stream():
    stream = torch.arange(1000)
    first = sample_sequences(stream, num_samples=16, seq_len=32, seed=3)
    assert torch.equal(first, sample_sequences(stream, num_samples=16, seq_len=32, seed=3))
    assert not torch.equal(first, sample_sequences(stream, num_samples=16, seq_len=32, seed=4))
    assert all(torch.equal(row, torch.arange(int(row[0]), int(row[0]) + 32)) for row in first)


def test_dataset_name_gives_the_configured_number_of_sequences(byte_tokenizer):
    ids = prepare_calibration_data("wikipedia", byte_tokenizer, num_samples=5, seq_len=20, seed=0, default_dataset="wikipedia")
    assert tuple(ids.shape) == (5, 20)
    default = prepare_calibration_data(None, byte_tokenizer, num_samples=5, seq_len=20, seed=0, default_dataset="wikipedia")
    assert torch.equal(ids, default)


def test_unknown_and_unreachable_datasets_say_what_to_use_instead(monkeypatch):
    with pytest.raises(ValueError, match="Unknown dataset 'wikitext3'. Available: wikipedia, web_text, wikitext2, c4, ptb"):
        load_text("wikitext3", "calibration")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises((ImportError, ConnectionError), match="wikipedia"):
        load_text("wikitext2", "evaluation")


def test_text_needs_a_tokenizer_and_enough_tokens(byte_tokenizer):
    with pytest.raises(ValueError, match="needs a tokenizer"):
        prepare_calibration_data(["some text"], None, 4, 8, 0, "wikipedia")
    with pytest.raises(ValueError, match="fewer than one sequence of seq_len=64"):
        prepare_calibration_data(["too short"], byte_tokenizer, 4, 64, 0, "wikipedia")


def test_perplexity_matches_a_hand_computation():
    model = tiny_model("llama", num_layers=3)
    segments = evaluation_segments(random_ids(1, 200).view(-1), seq_len=32)
    assert tuple(segments.shape) == (6, 32)  # the incomplete tail is dropped
    with torch.no_grad():
        losses = [model(segment.unsqueeze(0), labels=segment.unsqueeze(0)).loss.item() for segment in segments]
    expected = math.exp(sum(losses) / len(losses))  # equal-length segments: mean of per-segment mean NLL
    assert perplexity(model, segments, batch_size=4, progress_bar=False) == pytest.approx(expected, rel=1e-5)


def test_evaluate_names_dataset_protocol_and_counts_and_round_trips_through_json(byte_tokenizer, tmp_path):
    import json

    from optimum_gradmap.evaluation import EvaluationResult, evaluate

    model = tiny_model("llama")
    result = evaluate(model, byte_tokenizer, ("wikipedia",), seq_len=32, max_segments=3, progress_bar=False)
    (entry,) = result.perplexities
    segments = load_evaluation_segments("wikipedia", byte_tokenizer, seq_len=32, max_segments=3)
    assert entry.perplexity == perplexity(model, segments, progress_bar=False)
    assert (entry.dataset, entry.seq_len, entry.num_segments, entry.num_predicted_tokens) == ("wikipedia", 32, 3, 93)
    assert entry.protocol == "non-overlapping 32-token segments"
    result.to_json(tmp_path / "evaluation.json")
    assert EvaluationResult.from_dict(json.loads((tmp_path / "evaluation.json").read_text())) == result
