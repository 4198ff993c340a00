# Copyright 2026 The optimum-gradmap authors.
# Licensed under the Apache License, Version 2.0.
"""The quantization step, after pruning and the heal: llm-compressor (the vLLM project's library) quantizes the model
to a compressed-tensors checkpoint that vLLM serves and transformers loads. Optional: `pip install
'optimum-gradmap[quantize]'`.

- [`schemes`]: the schemes (`w8a8`, `w4a16`, `fp8`), their llm-compressor recipes, and the step's settings;
- [`checks`]: what is refused before any work;
- [`stage`]: [`quantize_model`] and its [`QuantizationResult`].

```python
config = GradMAPConfig(pruning_ratio=0.25, quantization="w8a8")   # prune, Stage 2, then quantize
result = GradMAPPruner(config, model=model, tokenizer=tokenizer).prune()
result.save_pretrained("out/smollm2-gradmap-w8a8")                 # compressed-tensors
```

or `optimum-gradmap quantize CHECKPOINT --scheme w8a8 --output OUT` for a checkpoint saved earlier.
"""

from .checks import INSTALL_HINT, check_linear_maps, check_quantization, hardware_problem, require_llmcompressor, scheme_named
from .schemes import SCHEMES, QuantizationScheme, QuantizationSettings
from .stage import QuantizationResult, head_names, quantize_model

__all__ = [
    "INSTALL_HINT",
    "SCHEMES",
    "QuantizationResult",
    "QuantizationScheme",
    "QuantizationSettings",
    "check_linear_maps",
    "check_quantization",
    "hardware_problem",
    "head_names",
    "quantize_model",
    "require_llmcompressor",
    "scheme_named",
]
