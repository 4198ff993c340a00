"""vLLM's speed on one checkpoint, for benchmarks/deploy.py: time to first token and decode throughput at batch 1 and
16. Run with the Python of a vLLM environment (it imports nothing from this repository but the standalone
optimum_gradmap/vllm_worker.py, for its AMX request):

    .venv-vllm/bin/python benchmarks/vllm_speed.py CHECKPOINT --dtype bfloat16 --output speed.json

Prompts are fixed random token ids (no tokenizer), `--prompt-length` tokens each; every generation is greedy and
ignores end-of-sequence tokens, so each sequence decodes exactly `--new-tokens`. Time to first token: the median over
`--repeats` runs of one prompt generating one token. Decode throughput at batch B: B prompts generating `--new-tokens`
each, (B x (new tokens - 1)) / (time - the same batch's time to first token), median over the repeats. One warm-up run
of each shape first. The engine runs eager (`enforce_eager`), in one process, with a 2 GiB KV cache.
"""

import argparse
import json
import os
import random
import statistics
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompt-length", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "optimum_gradmap"))
    from vllm_worker import request_amx

    request_amx()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    llm = LLM(
        model=args.checkpoint,
        dtype=args.dtype,
        enforce_eager=True,
        max_model_len=args.prompt_length + args.new_tokens + 8,
        seed=0,
        skip_tokenizer_init=True,
        generation_config="vllm",
        gpu_memory_utilization=0.3,
    )
    load_seconds = time.perf_counter() - started
    vocab = llm.llm_engine.model_config.get_vocab_size()
    generator = random.Random(0)
    prompts = [
        TokensPrompt(prompt_token_ids=[generator.randrange(vocab) for _ in range(args.prompt_length)])
        for _ in range(max(args.batch_sizes))
    ]

    def timed(batch: int, tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False)
        start = time.perf_counter()
        llm.generate(prompts[:batch], params, use_tqdm=False)
        return time.perf_counter() - start

    results = {"vllm_version": vllm.__version__, "dtype": args.dtype, "load_seconds": load_seconds}
    for batch in args.batch_sizes:
        timed(batch, 1), timed(batch, args.new_tokens)  # warm-up
        first = statistics.median(timed(batch, 1) for _ in range(args.repeats))
        whole = statistics.median(timed(batch, args.new_tokens) for _ in range(args.repeats))
        results[f"batch{batch}"] = {
            "ttft_ms": 1000 * first,
            "decode_tokens_per_second": batch * (args.new_tokens - 1) / max(whole - first, 1e-9),
            "seconds": whole,
        }
    with open(args.output, "w", encoding="utf-8") as file:
        json.dump(results, file, indent=1)


if __name__ == "__main__":  # vLLM may start its engine in a spawned process, which re-imports this file
    main()
