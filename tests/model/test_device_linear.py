"""The products off the CPU's fp32 path (CUDA's, checked here in bf16 on the CPU): bf16 weights dense in the
compute dtype, int8 with a scale per output through torch's `_weight_int8pack_mm`, the rest dequantized."""
import pytest
import torch
import torch.nn.functional as F

from reuse_server.model.quant_linear import (DenseLinear, DequantLinear, QuantizedLinear, TorchInt8Linear,
                                             device_linear)
from reuse_server.model.gguf_quant import quantize
from reuse_server.model.quant_weights import QuantizedWeight

SEED = 5


def _weight(n=96, k=128):
    print("seed", SEED)
    return torch.randn(n, k, generator=torch.Generator().manual_seed(SEED)) * 0.05


def _per_output_int8(w: torch.Tensor) -> QuantizedWeight:
    scales = w.abs().amax(dim=1, keepdim=True) / 127
    codes = torch.round(w / scales).clamp(-127, 127).to(torch.int8)
    return QuantizedWeight("int8", codes, scales.half().float(), None, w.shape[1])


def test_bf16_weights_are_one_dense_matrix_whose_product_is_torchs_bf16_product():
    w = _weight()
    layer = device_linear(quantize(w, "bf16"), None, torch.device("cpu"), torch.bfloat16)
    assert isinstance(layer, DenseLinear)
    held = layer.weight.data_ptr()
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(SEED + 1)).bfloat16()
    y = layer(x)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, F.linear(x, w.bfloat16()))  # torch's bf16 product of the bf16 matrix
    layer(x)
    assert layer.weight.data_ptr() == held  # converted once, when packed, not per call


def test_int8_with_a_scale_per_output_runs_torchs_int8_kernel():
    w = _weight()
    q = _per_output_int8(w)
    layer = device_linear(q, None, torch.device("cpu"), torch.float32)
    assert isinstance(layer, TorchInt8Linear)
    x = torch.randn(7, 128, generator=torch.Generator().manual_seed(SEED + 2))
    torch.testing.assert_close(layer(x), QuantizedLinear(q)(x), rtol=1e-5, atol=1e-5)


def test_group_wise_int8_is_dequantized_per_call():
    q = quantize(_weight(), "int8")  # GGUF's Q8_0: a scale per 32 inputs, which torch's int8 kernel cannot take
    assert not TorchInt8Linear.takes(q)
    layer = device_linear(q, None, torch.device("cpu"), torch.bfloat16)
    assert type(layer) is DequantLinear
    with pytest.raises(ValueError, match="does not take"):
        TorchInt8Linear(q)


def test_a_bf16_engine_on_the_cpu_packs_bf16_weights_dense(tiny_llama_path):
    from reuse_server.model.loader import load_model

    model, _ = load_model(tiny_llama_path, dtype=torch.bfloat16, weight_dtype="bf16")
    model.pack_for_cpu()
    attn = model.layers[0].self_attn
    assert isinstance(attn.qkv_proj, DenseLinear) and isinstance(attn.o_proj, DenseLinear)
    assert isinstance(model.layers[0].mlp.down_proj, DenseLinear)
