# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""Runs a checkpoint in vLLM and writes what it computed, for [`optimum_gradmap.serving.verify_serving`].

This file is executed by path with the Python of an environment that has vLLM (vLLM pins its own
transformers, often not ours), so it imports nothing from optimum_gradmap and nothing but vLLM (with its torch)
and the standard library:

    /path/to/vllm-env/bin/python optimum_gradmap/vllm_worker.py request.json response.json

The request (JSON) holds `model` (the checkpoint folder), `prompts` (lists of token ids: no
tokenizer is involved, so both engines see the same tokens), `max_new_tokens`, `max_model_len` and optionally
`dtype` (default `float32`; vLLM's CPU kernels for quantized weights take `bfloat16` activations only).
The response holds, per prompt, the greedy tokens (`ignore_eos`, so exactly `max_new_tokens` of
them), the log-probability of each generated token, and the log-probability of each prompt token
after the first, in the request's dtype (eager mode, the model's generation config
ignored), plus the vLLM version and the seconds each part took.
"""

import json
import os
import sys
import time


def request_amx() -> None:
    """Asks Linux for the AMX tile registers, which a process must request before it uses them. vLLM's CPU kernel for
    INT4 weights with bfloat16 activations (`cpu_gemm_wna16` on AMX) uses them without asking, so it dies of an illegal
    instruction unless another library in the process asked first: seen with vLLM 0.32 on a tiny Llama quantized to
    W4A16 (SIGILL at its first `tilezero`), while larger models, whose bfloat16 layers run oneDNN's AMX kernels first,
    were served."""
    import torch

    if getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)():
        torch.cpu._init_amx()


def main(request_path: str, response_path: str) -> None:
    with open(request_path, encoding="utf-8") as file:
        request = json.load(file)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    start = time.perf_counter()
    request_amx()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=request["model"],
        dtype=request.get("dtype", "float32"),
        enforce_eager=True,
        max_model_len=request["max_model_len"],
        seed=0,
        skip_tokenizer_init=True,
        generation_config="vllm",
        gpu_memory_utilization=request.get("memory_fraction", 0.3),
    )
    loaded = time.perf_counter()
    params = SamplingParams(
        temperature=0.0,
        max_tokens=request["max_new_tokens"],
        ignore_eos=True,
        logprobs=0,
        prompt_logprobs=0,
        detokenize=False,
    )
    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]], params, use_tqdm=False)
    generated = time.perf_counter()
    results = []
    for prompt_ids, output in zip(request["prompts"], outputs):
        completion = output.outputs[0]
        tokens = list(completion.token_ids)
        results.append(
            {
                "tokens": tokens,
                "token_logprobs": [step[token].logprob for step, token in zip(completion.logprobs, tokens)],
                "prompt_logprobs": [step[token].logprob for step, token in zip(output.prompt_logprobs[1:], prompt_ids[1:])],
            }
        )
    with open(response_path, "w", encoding="utf-8") as file:
        json.dump(
            {
                "vllm_version": vllm.__version__,
                "results": results,
                "seconds": {"load": loaded - start, "generate": generated - loaded},
            },
            file,
        )


if __name__ == "__main__":  # vLLM may start its engine in a spawned process, which re-imports this file
    main(sys.argv[1], sys.argv[2])
