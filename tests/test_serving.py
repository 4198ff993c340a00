"""`verify_serving`: the whole path (worker script in another Python, JSON request and response, comparison)
with a stand-in `vllm` package that computes with transformers. The real vLLM runs in
tests/integration/check_vllm_serving.py, which `.ci/run` runs in vLLM's own environment."""

from __future__ import annotations

import os
import stat
import sys
import textwrap

import pytest
import torch

from optimum_gradmap import GradMAPPruner
from optimum_gradmap.errors import InvalidInputError
from optimum_gradmap.serving import (
    ServingMismatchError,
    compare_outputs,
    find_vllm_python,
    reference_outputs,
    run_vllm,
    verify_serving,
)

from .conftest import random_ids, small_config, tiny_model

# A stand-in for vLLM's API as vllm_worker.py uses it: LLM(model=..., ...).generate(prompts, params), with the
# greedy tokens and log-probabilities computed by transformers, optionally with a perturbation of the logits.
FAKE_VLLM = """
import os
import torch
from transformers import AutoModelForCausalLM

__version__ = "0.0-fake"


class SamplingParams:
    def __init__(self, max_tokens, **kwargs):
        self.max_tokens = max_tokens


class _Logprob:
    def __init__(self, value):
        self.logprob = value


class _Completion:
    def __init__(self, tokens, logprobs):
        self.token_ids, self.logprobs = tokens, logprobs


class _Output:
    def __init__(self, prompt_logprobs, completion):
        self.prompt_logprobs, self.outputs = prompt_logprobs, [completion]


class LLM:
    def __init__(self, model, dtype, **kwargs):
        assert dtype == "float32" and kwargs["skip_tokenizer_init"]
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        self.shift = float(os.environ.get("FAKE_VLLM_LOGIT_SHIFT", "0"))

    def _logprobs(self, ids):
        logits = self.model(torch.tensor([ids]), use_cache=False).logits[0]
        logits += self.shift * torch.linspace(-1, 1, logits.shape[-1])  # a served model unlike the checkpoint
        return torch.log_softmax(logits, dim=-1)

    @torch.no_grad()
    def generate(self, prompts, params, use_tqdm=False):
        outputs = []
        for prompt in prompts:
            ids = list(prompt["prompt_token_ids"])
            table = self._logprobs(ids)
            prompt_logprobs = [None] + [{t: _Logprob(float(table[i, t]))} for i, t in enumerate(ids[1:])]
            tokens, logprobs = [], []
            for _ in range(params.max_tokens):
                token = int(table[-1].argmax())
                tokens.append(token)
                logprobs.append({token: _Logprob(float(table[-1, token]))})
                ids.append(token)
                table = self._logprobs(ids)
            outputs.append(_Output(prompt_logprobs, _Completion(tokens, logprobs)))
        return outputs
"""


@pytest.fixture
def fake_vllm_python(tmp_path):
    """An executable that runs this Python with the stand-in `vllm` package importable."""
    package = tmp_path / "fake_site" / "vllm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(FAKE_VLLM)
    (package / "inputs.py").write_text("def TokensPrompt(prompt_token_ids):\n    return {'prompt_token_ids': prompt_token_ids}\n")
    launcher = tmp_path / "python"
    launcher.write_text(
        textwrap.dedent(f"""\
        #!/bin/sh
        PYTHONPATH={tmp_path / "fake_site"} exec {sys.executable} "$@"
        """)
    )
    launcher.chmod(launcher.stat().st_mode | stat.S_IEXEC)
    return str(launcher)


def _pruned_checkpoint(folder, model_type="gemma3_text"):
    model = tiny_model(model_type, num_layers=6)
    pruner = GradMAPPruner(small_config(protected_layers=[0, 5]), progress_bar=False)
    result = pruner.prune(model, random_ids(8, 16))
    pruner.save_pretrained(folder)
    return result


def test_reference_outputs_are_greedy_decoding_and_the_log_probabilities_of_the_model():
    model = tiny_model("llama", num_layers=3)
    prompt = random_ids(1, 7, seed=3)[0].tolist()
    [output] = reference_outputs(model, [prompt], max_new_tokens=5)
    full = prompt + output["tokens"]
    with torch.no_grad():  # one pass over prompt and continuation gives every figure again
        logprobs = torch.log_softmax(model(torch.tensor([full])).logits[0], dim=-1)
    assert output["tokens"] == logprobs[6:11].argmax(dim=-1).tolist()
    assert output["prompt_logprobs"] == pytest.approx([logprobs[i, full[i + 1]].item() for i in range(6)], abs=1e-5)
    assert output["token_logprobs"] == pytest.approx(
        [logprobs[6 + i, t].item() for i, t in enumerate(output["tokens"])], abs=1e-5
    )


def test_compare_outputs_finds_the_first_different_token_and_the_largest_log_probability_gap():
    ours = {"tokens": [5, 6, 7], "token_logprobs": [-0.1, -0.2, -0.3], "prompt_logprobs": [-1.0, -2.0]}
    same = {"tokens": [5, 6, 7], "token_logprobs": [-0.1, -0.2005, -0.3], "prompt_logprobs": [-1.0, -2.001]}
    other = {"tokens": [5, 9, 7], "token_logprobs": [-0.15, -9.0, -9.0], "prompt_logprobs": [-1.0, -2.0]}
    [match], [mismatch] = compare_outputs([[1, 2, 3]], [ours], [same]), compare_outputs([[1, 2, 3]], [ours], [other])
    assert match.first_mismatch is None
    assert match.prompt_logprob_difference == pytest.approx(1e-3) and match.token_logprob_difference == pytest.approx(5e-4)
    assert mismatch.first_mismatch == 1
    assert mismatch.token_logprob_difference == pytest.approx(0.05)  # only steps before the first different token


def test_verify_serving_runs_the_worker_in_another_python_and_matches(tmp_path, fake_vllm_python):
    result = _pruned_checkpoint(tmp_path / "ckpt")
    check = verify_serving(tmp_path / "ckpt", vllm_python=fake_vllm_python, max_new_tokens=4)
    assert check.engine == "vLLM 0.0-fake" and len(check.prompts) == 4
    assert all(len(prompt.served_tokens) == 4 for prompt in check.prompts)
    assert check.matched and check.max_logprob_difference < 1e-5, check.summary()
    check.raise_for_mismatch()
    # against the model still in memory too
    assert verify_serving(tmp_path / "ckpt", fake_vllm_python, max_new_tokens=4, reference_model=result.model).matched


def test_verify_serving_reports_a_served_model_that_differs(tmp_path, fake_vllm_python, monkeypatch):
    _pruned_checkpoint(tmp_path / "ckpt")
    monkeypatch.setenv("FAKE_VLLM_LOGIT_SHIFT", "0.05")
    check = verify_serving(tmp_path / "ckpt", vllm_python=fake_vllm_python, max_new_tokens=4)
    assert not check.matched and check.max_logprob_difference > 1e-3
    with pytest.raises(ServingMismatchError, match="MISMATCH"):
        check.raise_for_mismatch()


def test_run_vllm_sets_the_variables_it_is_given_for_vllms_process_only(tmp_path, fake_vllm_python):
    _pruned_checkpoint(tmp_path / "ckpt")
    prompts = [[5, 6, 7, 8]]
    plain = run_vllm(tmp_path / "ckpt", prompts, 2, fake_vllm_python)["results"][0]["prompt_logprobs"]
    shifted = run_vllm(tmp_path / "ckpt", prompts, 2, fake_vllm_python, environment={"FAKE_VLLM_LOGIT_SHIFT": "0.5"})
    assert "FAKE_VLLM_LOGIT_SHIFT" not in os.environ
    assert max(abs(a - b) for a, b in zip(plain, shifted["results"][0]["prompt_logprobs"])) > 1e-3


def test_verify_serving_catches_a_stale_config_against_the_model_in_memory(tmp_path, fake_vllm_python):
    """Both engines read the stale config the same way; only the pruned model itself tells the difference."""
    import json

    from optimum_gradmap import InvalidCheckpointError

    result = _pruned_checkpoint(tmp_path / "ckpt")
    config_path = tmp_path / "ckpt" / "config.json"
    config = json.loads(config_path.read_text())
    config["layer_types"] = result.dense_layer_config["layer_types"][: config["num_hidden_layers"]]
    assert config["layer_types"] != result.model.config.layer_types
    config_path.write_text(json.dumps(config))
    with pytest.raises(InvalidCheckpointError, match="layer_types=.* is stale"):
        verify_serving(tmp_path / "ckpt", fake_vllm_python)
    prompts = [random_ids(1, 20, seed=1)[0].tolist()]  # longer than the sliding window (8)
    check = verify_serving(tmp_path / "ckpt", fake_vllm_python, prompts, 4, reference_model=result.model, validate=False)
    assert not check.matched


def test_a_missing_vllm_is_a_set_up_error_that_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.delenv("OPTIMUM_GRADMAP_VLLM_PYTHON", raising=False)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(InvalidInputError, match="own.*--vllm-python"):
        find_vllm_python()
    with pytest.raises(InvalidInputError, match="not a Python executable"):
        find_vllm_python(str(tmp_path / "nowhere" / "python"))
    monkeypatch.setenv("OPTIMUM_GRADMAP_VLLM_PYTHON", sys.executable)
    assert find_vllm_python() == os.path.abspath(sys.executable)
    assert os.access(find_vllm_python(), os.X_OK)
    # a relative path (`.venv-vllm/bin/python`, as .ci/run gives it) becomes absolute: vLLM runs in another folder
    link = tmp_path / "env" / "bin" / "python"
    link.parent.mkdir(parents=True)
    link.symlink_to(sys.executable)
    monkeypatch.chdir(tmp_path)
    assert find_vllm_python("env/bin/python") == str(link)  # absolute, and the link itself, not its target


def test_vllm_failing_to_load_reports_its_own_error(tmp_path, fake_vllm_python):
    _pruned_checkpoint(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(RuntimeError, match="vLLM could not serve"):
        verify_serving(tmp_path / "ckpt", fake_vllm_python, [[1, 2, 3]], validate=False, reference_model=tiny_model("llama", 2))


def test_the_verify_serving_command_prints_the_verdict_and_sets_the_exit_code(tmp_path, fake_vllm_python, capsys, monkeypatch):
    import json

    from optimum_gradmap.cli import main

    _pruned_checkpoint(tmp_path / "ckpt")
    arguments = ["verify-serving", str(tmp_path / "ckpt"), "--vllm-python", fake_vllm_python, "--max-new-tokens", "3", "-q"]
    assert main([*arguments, "--output", str(tmp_path / "check.json")]) == 0
    assert capsys.readouterr().out.startswith("MATCH")
    assert json.loads((tmp_path / "check.json").read_text())["matched"] is True
    monkeypatch.setenv("FAKE_VLLM_LOGIT_SHIFT", "0.05")
    assert main(arguments) == 1 and "MISMATCH" in capsys.readouterr().out
    assert main(["verify-serving", str(tmp_path / "nothing"), "-q"]) == 2
    assert "is not a folder" in capsys.readouterr().err
    monkeypatch.delenv("OPTIMUM_GRADMAP_VLLM_PYTHON", raising=False)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    assert main(["verify-serving", str(tmp_path / "ckpt"), "-q"]) == 2
    assert "vLLM is not installed" in capsys.readouterr().err
