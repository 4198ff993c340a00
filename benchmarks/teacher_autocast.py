"""Heal (issue 56): what bfloat16 autocast changes in the teacher's targets, on real held-out text.

    python benchmarks/teacher_autocast.py --model smollm2-135m --sequences 32

Runs the dense model over the first `--sequences` 128-token windows of held-out Wikipedia and of the held-out web
pages, once in float32 and once under bfloat16 autocast (the log-softmax in float32 both times, as the heal stage's
teacher does), and reports the next-token KL divergence from the float32 distribution to the autocast one (mean per
token), the share of positions whose most likely token differs, and both passes' seconds. Writes
benchmarks/results/teacher_autocast-<model>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from accuracy import RESULTS
from provenance import finish, provenance

from optimum_gradmap.assets import load_model
from optimum_gradmap.data import load_text, tokenize_text
from optimum_gradmap.precision import has_native_bfloat16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    if not has_native_bfloat16(torch.device("cpu")):
        raise SystemExit("this CPU has no native bfloat16: the heal stage would not autocast here")
    model, tokenizer = load_model(args.model)
    model.eval()
    record = {"model": args.model, "sequences_per_text": args.sequences, "rows": []}
    for dataset in ("offline:wikipedia", "offline:web_text"):
        ids = tokenize_text(load_text(dataset, "evaluation"), tokenizer).flatten()
        windows = ids[: args.sequences * 128].view(-1, 128)
        started = provenance()
        kl_sum, changed, count, seconds = 0.0, 0, 0, {"float32": 0.0, "autocast": 0.0}
        with torch.no_grad():
            for start in range(0, windows.shape[0], args.batch_size):
                batch = windows[start : start + args.batch_size]
                tick = time.perf_counter()
                exact = torch.log_softmax(model(input_ids=batch, use_cache=False).logits[:, :-1].float(), -1)
                seconds["float32"] += time.perf_counter() - tick
                tick = time.perf_counter()
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    logits = model(input_ids=batch, use_cache=False).logits[:, :-1]
                fast = torch.log_softmax(logits.float(), -1)
                seconds["autocast"] += time.perf_counter() - tick
                kl_sum += float((exact.exp() * (exact - fast)).sum(-1).double().sum())
                changed += int((exact.argmax(-1) != fast.argmax(-1)).sum())
                count += exact.shape[0] * exact.shape[1]
        row = {
            "dataset": dataset,
            "kl_float32_to_autocast": kl_sum / count,
            "argmax_changed": changed / count,
            "seconds": seconds,
            "positions": count,
        }
        print(json.dumps(row))
        record["rows"].append({**row, "provenance": finish(started)})
    with open(os.path.join(RESULTS, f"teacher_autocast-{args.model}.json"), "w", encoding="utf-8") as file:
        json.dump(record, file, indent=1)


if __name__ == "__main__":
    main()
