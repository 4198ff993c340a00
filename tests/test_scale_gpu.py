"""`benchmarks/scale_gpu.py` counts Stage 1's FLOPs from the config alone: the count must be what the library's Stage 1
runs (checked with the FLOPs `torch.utils.flop_counter` counts, on a tiny model), and the peak FLOP/s its MFU divides by
must be the right device's."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry
from transformers import AutoModelForCausalLM, LlamaConfig

from optimum_gradmap import GradMAPConfig, GradMAPPruner

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))  # the script imports `provenance` and `scale` as sibling modules

import scale_gpu  # noqa: E402
from scale import architecture_config  # noqa: E402


class MatrixProductFlops(TorchDispatchMode):
    """Sums the FLOPs `torch.utils.flop_counter` counts for each matrix product (`FlopCounterMode` itself tracks
    modules with hooks that `torch.autograd.grad`, which Stage 1 calls, does not support)."""

    def __init__(self):
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func._overloadpacket in flop_registry:
            self.total += flop_registry[func._overloadpacket](*args, **kwargs, out_val=out)
        return out


def tiny_llama(num_layers: int = 4) -> torch.nn.Module:
    """A float32 Llama small enough to count on the CPU, with eager attention (its products are plain matmuls)."""
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def test_stage1_flops_are_what_stage1_runs():
    seq_len = 32  # q, o, gate, up and down take the Gram form (gate and up share their input's), k and v the other
    model = tiny_llama()
    ids = torch.randint(0, 96, (4, seq_len), generator=torch.Generator().manual_seed(0))
    shape = scale_gpu.DecoderShape.from_config(model.config)
    forms = {name: scale_gpu.uses_gram_form(seq_len, d_in, d_out) for name, d_in, d_out, _ in shape.linear_maps()}
    assert [name for name, gram in forms.items() if not gram] == ["k_proj", "v_proj"]
    pruner = GradMAPPruner(GradMAPConfig(pruning_ratio=0.5, num_samples=4, seq_len=seq_len, batch_size=2), progress_bar=False)
    with MatrixProductFlops() as counter:
        result = pruner.select_layers(model, ids)
    assert len(result.removed_layers) == 2
    rounds = scale_gpu.stage1_round_flops(shape, 2, 4, seq_len)
    # the Gram products are elementwise (the counter counts matrix products only): left out of the comparison
    elementwise = sum(scale_gpu.gradient_round_flops(shape, layers, 4, seq_len)["gram_products"] for layers in (4, 3))
    counted = counter.total
    # what is left: the rotary embedding's tiny outer product, one per forward pass
    assert sum(rounds) - elementwise == pytest.approx(counted, rel=2e-3)
    assert scale_gpu.stage1_flops(shape, 0.5, 4, seq_len) == sum(rounds)


def test_round_flops_of_llama_3_1_8b():
    """The docstring's figures: 0.51 PFLOP in the first round at 128 x 128, 3.6 PFLOP for the 8 rounds, and about
    2 x 2 x (the kept layers' linear weights + head) per token."""
    shape = scale_gpu.DecoderShape.from_config(architecture_config("llama-3.1-8b"))
    assert shape.layer_linear_parameters() == 218_103_808
    first = scale_gpu.gradient_round_flops(shape, 32, 128, 128)
    tokens = 128 * 128
    assert first["forward"] == 2 * 218_103_808 * 32 * tokens + 4 * 128**2 * 4096 * 32 * 128
    assert first["head"] == 4 * 128256 * 4096 * 128 * 127
    # the backward computes input gradients only (frozen parameters): about one forward's worth
    assert first["total"] == pytest.approx(2 * 2 * (32 * 218_103_808 + 128256 * 4096) * tokens, rel=0.05)
    assert first["total"] == pytest.approx(0.505e15, rel=0.01)
    assert scale_gpu.stage1_flops(shape, 0.25, 128, 128) == pytest.approx(3.63e15, rel=0.01)
    assert scale_gpu.layers_to_remove(32, 0.25) == 8 and scale_gpu.layers_to_remove(2, 0.25) == 1


@pytest.mark.parametrize(
    "name, peak",
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A100 80GB PCIe", 312e12),
        ("NVIDIA A40", 149.7e12),
        ("NVIDIA L40S", 362e12),
        ("NVIDIA GeForce RTX 4090", None),
        (None, None),
    ],
)
def test_peak_flops_by_device_name(name, peak):
    assert scale_gpu.peak_bf16_flops(name)[0] == peak


def test_paper_figure_is_a_marked_copy():
    implied = scale_gpu.paper_implied()
    assert scale_gpu.PAPER["stage1_seconds"] == 123.42
    assert scale_gpu.PAPER["devices_peak_bf16_flops_per_second"] == 2 * 149.7e12
    assert implied["flops_per_second"] == pytest.approx(implied["stage1_flops"] / 123.42)
    assert implied["share_of_one_a40s_peak"] == pytest.approx(2 * implied["share_of_two_a40s_peak"])
    assert scale_gpu.device_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
