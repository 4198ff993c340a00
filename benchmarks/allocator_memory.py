# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""What a Stage 1 scoring pass costs in resident memory, and what its tensors take (issue 64,
`planning.HOST_ALLOCATOR_OVERHEAD`): SmolLM2-135M in float32, GradMAP's scoring pass
(`gradient_importance`) over every layer on one 8 x 128 batch, twice, the process's anonymous resident memory
polled every 5 ms, in a child process with glibc's default allocator and in one with a fixed mmap threshold
(`MALLOC_MMAP_THRESHOLD_=131072`, which returns every large block when it is freed: its rise is the live tensors).

    python benchmarks/allocator_memory.py

Saves benchmarks/results/allocator_memory-smollm2-135m.json (each setting's rise over the loaded model, during
and after each pass, GiB) and prints it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
RESULT = os.path.join(HERE, "results", "allocator_memory-smollm2-135m.json")
SETTINGS = {"glibc default": {}, "MALLOC_MMAP_THRESHOLD_=131072": {"MALLOC_MMAP_THRESHOLD_": "131072"}}

CHILD = r"""
import gc, json, re, threading, time
import torch
from optimum_gradmap.adapters import get_adapter
from optimum_gradmap.assets import get_model_path
from optimum_gradmap.importance.gradient import gradient_importance
from transformers import AutoModelForCausalLM

def anonymous():
    return int(re.search(r"RssAnon:\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024

torch.manual_seed(0)
model = AutoModelForCausalLM.from_pretrained(get_model_path("smollm2-135m"), dtype=torch.float32)
ids = torch.randint(0, model.config.vocab_size, (8, 128))
layers = list(get_adapter(model).get_layers(model))
passes = []
gc.collect()
base = anonymous()
for _ in range(2):
    peak, stop = [anonymous()], []
    def poll():
        while not stop:
            peak[0] = max(peak[0], anonymous())
            time.sleep(0.005)
    thread = threading.Thread(target=poll)
    thread.start()
    gradient_importance(model, layers, ids, batch_size=8, progress_bar=False)
    stop.append(True)
    thread.join()
    gc.collect()
    passes.append({"peak_rise_gib": (peak[0] - base) / 2**30, "after_gib": (anonymous() - base) / 2**30})
print(json.dumps(passes))
"""


def main() -> None:
    sys.path.insert(0, HERE)
    from provenance import finish, provenance

    record = {"model": "smollm2-135m", "dtype": "float32", "batch": "8 x 128", "provenance": provenance(), "settings": {}}
    for name, environment in SETTINGS.items():
        output = subprocess.run(
            [sys.executable, "-c", CHILD], env={**os.environ, **environment}, capture_output=True, text=True, check=True
        ).stdout
        record["settings"][name] = json.loads(output.strip().splitlines()[-1])
    default, fixed = (record["settings"][name][0]["peak_rise_gib"] for name in SETTINGS)
    record["resident_over_live"] = default / fixed
    record["provenance"] = finish(record["provenance"])
    with open(RESULT, "w") as file:
        json.dump(record, file, indent=1)
    print(json.dumps({key: value for key, value in record.items() if key != "provenance"}, indent=1))


if __name__ == "__main__":
    main()
