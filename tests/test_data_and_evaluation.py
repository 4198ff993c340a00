"""Calibration data, the offline Wikipedia split, and the perplexity protocol."""

import json
import math

import pytest
import torch

from optimum_gradmap import GradMAPConfig, perplexity
from optimum_gradmap.assets import wikipedia_documents
from optimum_gradmap.data import load_text, prepare_calibration_data, sample_windows
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
    first = sample_windows([stream], num_samples=16, seq_len=32, seed=3)
    assert torch.equal(first, sample_windows([stream], num_samples=16, seq_len=32, seed=3))
    assert not torch.equal(first, sample_windows([stream], num_samples=16, seq_len=32, seed=4))
    assert all(torch.equal(row, torch.arange(int(row[0]), int(row[0]) + 32)) for row in first)


def test_dataset_name_gives_the_configured_number_of_sequences(byte_tokenizer):
    name = "offline:wikipedia"
    ids = prepare_calibration_data(name, byte_tokenizer, num_samples=5, seq_len=20, seed=0, default_dataset=name)
    assert tuple(ids.shape) == (5, 20)
    default = prepare_calibration_data(None, byte_tokenizer, num_samples=5, seq_len=20, seed=0, default_dataset=name)
    assert torch.equal(ids, default)


def test_unknown_and_unreachable_datasets_say_what_to_use_instead(monkeypatch):
    with pytest.raises(
        ValueError, match="Unknown calibration dataset 'wikitext3'. Available: wikipedia, wikitext2, c4, offline:wikipedia"
    ):
        load_text("wikitext3", "calibration")
    with pytest.raises(ValueError, match="Unknown calibration dataset 'wikitext3'"):
        load_text("offline:wikipedia+wikitext3", "calibration")  # every part of a mixture is checked
    with pytest.raises(ValueError, match="Unknown evaluation dataset 'ptb'. Available: wikipedia, wikitext2, c4"):
        load_text("ptb", "evaluation")
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConnectionError, match="dataset='offline:wikipedia'"):
        load_text("wikitext2", "evaluation")


def test_text_needs_a_tokenizer_and_enough_tokens(byte_tokenizer):
    with pytest.raises(ValueError, match="needs a tokenizer"):
        prepare_calibration_data(["some text"], None, 4, 8, 0, "wikipedia")
    with pytest.raises(ValueError, match="fewer than one sequence of seq_len=64"):
        prepare_calibration_data(["too short"], byte_tokenizer, 4, 64, 0, "wikipedia")


def test_perplexity_matches_a_hand_computation():
    model = tiny_model("llama", num_layers=3)
    segments = evaluation_segments(random_ids(1, 200).view(-1), segment_length=32)
    assert tuple(segments.shape) == (6, 32)  # the incomplete tail is dropped
    with torch.no_grad():
        losses = [model(segment.unsqueeze(0), labels=segment.unsqueeze(0)).loss.item() for segment in segments]
    expected = math.exp(sum(losses) / len(losses))  # equal-length segments: mean of per-segment mean NLL
    assert perplexity(model, segments, batch_size=4, progress_bar=False) == pytest.approx(expected, rel=1e-5)


def test_evaluate_names_dataset_protocol_and_counts_and_round_trips_through_json(byte_tokenizer, tmp_path):
    import json

    from optimum_gradmap.evaluation import EvaluationResult, evaluate

    model = tiny_model("llama")
    result = evaluate(model, byte_tokenizer, ("offline:wikipedia",), segment_length=32, max_segments=3, progress_bar=False)
    (entry,) = result.perplexities
    segments = load_evaluation_segments("offline:wikipedia", byte_tokenizer, segment_length=32, max_segments=3)
    assert entry.perplexity == perplexity(model, segments, progress_bar=False)
    assert (entry.dataset, entry.segment_length, entry.num_segments, entry.num_predicted_tokens) == (
        "offline:wikipedia",
        32,
        3,
        93,
    )
    assert entry.protocol == "non-overlapping 32-token segments"
    result.to_json(tmp_path / "evaluation.json")
    assert EvaluationResult.from_dict(json.loads((tmp_path / "evaluation.json").read_text())) == result


# ------------------------------------------------------------------------- the Hub path, without the Hub
WIKIPEDIA_SCHEMA_ROWS = [
    {"id": str(index), "url": f"https://en.wikipedia.org/wiki?curid={index}", "title": f"Article {index}", "text": text}
    for index, text in enumerate(
        [
            "Anarchism is a political philosophy. " * 6,
            "Short.",  # shorter than one window: contributes none
            "Autism is a neurodevelopmental condition. " * 6,
            "Albedo is the fraction of sunlight that is diffusely reflected. " * 6,
            "This article comes after the first three and is never read for calibration. " * 6,
        ]
    )
]


@pytest.fixture
def recorded_load_dataset(monkeypatch):
    """Replaces `datasets.load_dataset` by a recorder that serves local data of the Hub datasets' schemas."""
    import datasets

    calls = []

    def load_dataset(path, name=None, split=None, streaming=False, data_files=None, **kwargs):
        calls.append({"path": path, "name": name, "split": split, "streaming": streaming, "data_files": data_files, **kwargs})
        if path == "wikimedia/wikipedia":
            return datasets.IterableDataset.from_generator(lambda: iter(WIKIPEDIA_SCHEMA_ROWS))
        if path == "Salesforce/wikitext":
            return datasets.Dataset.from_dict({"text": ["", " = Valkyria = ", "", f" The {split} split . " * 8, ""]})
        if path == "allenai/c4":
            texts = [f"A {split} web page number {index} about pruning layers. " * 4 for index in range(5)]
            return datasets.IterableDataset.from_generator(
                lambda: iter({"text": text, "timestamp": "2019", "url": "u"} for text in texts)
            )
        raise AssertionError(f"unexpected dataset {path}")

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return calls


def test_default_calibration_streams_the_first_wikipedia_articles_and_keeps_windows_inside_one(
    recorded_load_dataset, byte_tokenizer, monkeypatch
):
    from optimum_gradmap import data

    monkeypatch.setattr(data, "WIKIPEDIA_CALIBRATION_ARTICLES", 4)
    ids = prepare_calibration_data(None, byte_tokenizer, num_samples=64, seq_len=40, seed=0, default_dataset="wikipedia")
    assert recorded_load_dataset == [
        {"path": "wikimedia/wikipedia", "name": "20231101.en", "split": "train", "streaming": True, "data_files": None}
    ]
    articles = [byte_tokenizer(row["text"], add_special_tokens=False)["input_ids"] for row in WIKIPEDIA_SCHEMA_ROWS]
    windows = [
        {tuple(article[start : start + 40]) for start in range(len(article) - 39)} for article in articles[:4]
    ]  # the first four articles only
    found = [next(i for i, inside in enumerate(windows) if tuple(row.tolist()) in inside) for row in ids]
    assert set(found) == {0, 2, 3}  # every window lies inside one article; the short one gives none
    evaluation = data.load_documents("wikipedia", "evaluation")
    assert evaluation == [WIKIPEDIA_SCHEMA_ROWS[4]["text"]]  # the articles after the calibration ones


def test_wikitext2_and_c4_use_the_ids_of_optimums_gptq(recorded_load_dataset):
    from optimum_gradmap.data import load_documents

    (wikitext,) = load_documents("wikitext2", "calibration")
    assert "The train split" in wikitext and wikitext.startswith("\n\n = Valkyria = ")  # rows joined, as before
    c4 = load_documents("c4", "calibration")
    assert len(c4) == 5 and c4[0].startswith("A train web page number 0")  # documents kept apart
    (c4_evaluation,) = load_documents("c4", "evaluation")
    assert c4_evaluation.count("validation web page") == 5 * 4
    load_documents("wikitext2", "evaluation")
    assert [(call["path"], call["name"], call["split"], call["data_files"]) for call in recorded_load_dataset] == [
        ("Salesforce/wikitext", "wikitext-2-raw-v1", "train", None),
        ("allenai/c4", None, "train", {"train": "en/c4-train.00000-of-01024.json.gz"}),
        ("allenai/c4", None, "validation", {"validation": "en/c4-validation.00000-of-00008.json.gz"}),
        ("Salesforce/wikitext", "wikitext-2-raw-v1", "test", None),
    ]


def test_an_unreachable_hub_names_the_offline_option(monkeypatch, byte_tokenizer):
    import datasets

    def unreachable(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'wikimedia/wikipedia' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    model = tiny_model("llama", num_layers=4)
    from optimum_gradmap import GradMAPConfig, GradMAPPruner

    with pytest.raises(ConnectionError, match=r"Could not load dataset 'wikipedia'.*dataset='offline:wikipedia'"):
        GradMAPPruner(GradMAPConfig(num_layers_to_prune=1), tokenizer=byte_tokenizer, progress_bar=False).prune(model)
    assert len(model.model.layers) == 4


@pytest.mark.parametrize("error", [MemoryError("simulated"), KeyError("simulated bug")])
def test_an_error_that_is_not_the_hubs_is_raised_as_it_is(monkeypatch, error):
    import datasets

    from optimum_gradmap.data import load_documents

    def failing(*args, **kwargs):
        raise error

    monkeypatch.setattr(datasets, "load_dataset", failing)
    with pytest.raises(type(error), match="simulated"):
        load_documents("wikitext2", "calibration")


def test_evaluation_results_are_written_atomically(tmp_path, monkeypatch):
    """A failed write leaves the file that was there: the result is written beside it, then renamed."""
    from optimum_gradmap.evaluation import EvaluationResult

    path = tmp_path / "evaluation.json"
    path.write_text("the earlier result")
    opened = []
    real_open = open

    def recording_open(file, mode="r", *args, **kwargs):
        opened.append((str(file), mode))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr("builtins.open", recording_open)
    EvaluationResult(model="m").to_json(str(path))
    assert not [mode for file, mode in opened if file == str(path) and "w" in mode]  # never opened for writing in place
    assert json.loads(path.read_text())["model"] == "m"

    def disk_full(*args):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr("os.replace", disk_full)
    with pytest.raises(OSError, match="simulated"):
        EvaluationResult(model="other").to_json(str(path))
    assert json.loads(path.read_text())["model"] == "m" and [p.name for p in tmp_path.iterdir()] == ["evaluation.json"]


def test_a_datasets_dataset_is_calibration_data_with_its_text_column(byte_tokenizer):
    import datasets

    from optimum_gradmap import GradMAPConfig, GradMAPPruner

    rows = {"body": ["Layer pruning removes whole decoder layers. " * 3, "tiny", "Stage 2 repairs the removal. " * 3]}
    dataset = datasets.Dataset.from_dict(rows)
    config = GradMAPConfig(num_layers_to_prune=1, num_samples=6, seq_len=24, batch_size=3, text_column="body")
    result = GradMAPPruner(config, tokenizer=byte_tokenizer, progress_bar=False).prune(tiny_model("llama", num_layers=4), dataset)
    documents = [byte_tokenizer(text, add_special_tokens=False)["input_ids"] for text in rows["body"]]
    inside = [{tuple(doc[i : i + 24]) for i in range(len(doc) - 23)} for doc in documents]
    assert all(any(tuple(row.tolist()) in windows for windows in inside) for row in result.calibration_ids)
    assert result.calibration_source == "a datasets.Dataset (3 rows, column 'body')"
    with pytest.raises(ValueError, match="no column 'text' \\(its columns: body\\).*text_column"):
        prepare_calibration_data(dataset, byte_tokenizer, 4, 8, 0, "wikipedia", text_column="text")


def test_windows_are_drawn_uniformly_over_positions_inside_documents():
    documents = [torch.arange(0, 10), torch.arange(100, 103), torch.arange(200, 230)]
    windows = sample_windows(documents, num_samples=4000, seq_len=5, seed=0)
    firsts = windows[:, 0]
    assert all(torch.equal(row, torch.arange(int(row[0]), int(row[0]) + 5)) for row in windows)  # never across documents
    assert not ((firsts >= 100) & (firsts < 200)).any()  # a document shorter than a window gives none
    # 6 positions in the first document, 26 in the third: drawn in that proportion
    share = (firsts < 100).double().mean().item()
    assert share == pytest.approx(6 / 32, abs=0.02)
    with pytest.raises(ValueError, match="The longest calibration document has 30 tokens, fewer than one sequence"):
        sample_windows(documents, 2, 31, 0)


def test_a_mixture_draws_equal_parts_each_as_its_dataset_alone_would(monkeypatch, byte_tokenizer):
    from optimum_gradmap import data
    from optimum_gradmap.data import TextDataset

    first = TextDataset("first", "test", data.SPLITS, lambda split: ["alpha beta gamma delta " * 40], True)
    second = TextDataset("second", "test", data.SPLITS, lambda split: ["one two three four five " * 9, "six seven " * 30], False)
    monkeypatch.setitem(data.DATASETS, "first", first)
    monkeypatch.setitem(data.DATASETS, "second", second)
    monkeypatch.setattr(data, "CALIBRATION_DATASETS", (*data.CALIBRATION_DATASETS, "first", "second"))
    mixed = prepare_calibration_data(
        "first+second", byte_tokenizer, num_samples=5, seq_len=12, seed=3, default_dataset="wikipedia"
    )
    alone_first = prepare_calibration_data(
        "first", byte_tokenizer, num_samples=3, seq_len=12, seed=3, default_dataset="wikipedia"
    )
    alone_second = prepare_calibration_data(
        "second", byte_tokenizer, num_samples=2, seq_len=12, seed=3, default_dataset="wikipedia"
    )
    assert torch.equal(mixed, torch.cat([alone_first, alone_second]))
    assert GradMAPConfig(num_layers_to_prune=1, dataset="first+second").dataset == "first+second"
