"""Linear layers on int8/int4/bf16 weights (model/quant_linear.py, cpu_quant.cpp) compute x W^T + b with W the
exact dequantized weights, stay within each type's quantization bound of the fp32 weights they came from, and
give a row the same bits whatever other rows share its call (prefix reuse stays exact)."""

import pytest
import torch
import torch.nn.functional as F

from reuse_server.model.quant_linear import NativeQuantLinear, QuantizedEmbedding, QuantizedLinear, TorchInt4Linear
from reuse_server.model.gguf_quant import quantize
from reuse_server.model.quant_weights import QuantizedWeight, from_tensors, stack, to_tensors

KINDS = ("int4", "int8", "bf16")


pytestmark = pytest.mark.usefixtures("kernels_built")


def weights(n, k, seed, kind):
    gen = torch.Generator().manual_seed(seed)
    dense = torch.randn(n, k, generator=gen) * 0.1
    dense[:, ::7] += 0.3  # groups with uneven ranges
    return dense, quantize(dense, kind)


def step_bound(q: QuantizedWeight, dense: torch.Tensor) -> torch.Tensor:
    """Per weight, how far the stored value may be from the fp32 one: one step of the group's grid (gguf's
    quantizers round to the nearest step; the fp16 scale and minimum shift the grid by far less than a step),
    for bf16 one unit in the 8th bit."""
    if q.kind == "bf16":
        return dense.abs() * 2.0**-8
    return q.scales.float().repeat_interleave(q.group, dim=1)[:, :dense.shape[1]]


# rows: the direct kernel's 6-row tiles (1, 5, 6, 7), its last row count (24), the buffered path (25 on),
# more than one buffered block (193); in_features: whole groups of 32, a partial last group, fewer than a group.
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 24, 25, 193])
@pytest.mark.parametrize("out_features,in_features", [(64, 64), (130, 100), (7, 33), (96, 20)])
def test_native_quant_linear_computes_the_dequantized_product(kind, rows, out_features, in_features):
    seed = rows * 1000 + out_features + in_features
    print("seed", seed)
    dense, q = weights(out_features, in_features, seed, kind)
    gen = torch.Generator().manual_seed(seed + 1)
    bias = torch.randn(out_features, generator=gen)
    x = torch.randn(rows, in_features + 9, generator=gen)[:, 4:4 + in_features]  # a strided view
    layer = NativeQuantLinear(q, bias)
    out = layer(x)
    exact = F.linear(x.double(), q.dequantize().double(), bias.double())
    assert out.shape == (rows, out_features) and out.dtype == torch.float32
    assert torch.allclose(out.double(), exact, rtol=1e-5, atol=1e-4)
    # against the fp32 weights it was quantized from: within the type's bound, summed over the inputs
    reference = F.linear(x.double(), dense.double(), bias.double())
    bound = x.double().abs() @ step_bound(q, dense).double().T + 1e-4
    assert ((out.double() - reference).abs() <= bound).all()


@pytest.mark.parametrize("kind", KINDS)
def test_a_row_gets_the_same_bits_whatever_shares_its_call(kind):
    """A warm request computes only its new tokens: their rows must equal what the cold prefill computed."""
    dense, q = weights(200, 96, 3, kind)
    layer = NativeQuantLinear(q, torch.randn(200))
    x = torch.randn(420, 96, generator=torch.Generator().manual_seed(4))
    together = layer(x)
    for start, end in [(0, 1), (5, 6), (1, 9), (7, 24), (24, 49), (100, 300), (299, 300), (10, 420)]:
        assert torch.equal(layer(x[start:end]), together[start:end]), (start, end)


@pytest.mark.parametrize("kind", KINDS + ("fp32",))
def test_the_threads_sharing_a_call_never_change_its_bits(kind):
    """Few-row calls share their panels between the calling thread and helpers that join when they are
    running (cpu_tasks.h): whoever computes a panel, and however many threads the call asks for, the output is
    the one thread's, bit for bit; calls from several Python threads at once (ctypes releases the GIL: the
    second caller runs alone) too."""
    from concurrent.futures import ThreadPoolExecutor

    from reuse_server.model.cpu_linear import NativeLinear

    dense, q = weights(64 * 40 + 5, 96, 8, "int4" if kind == "fp32" else kind)
    bias = torch.randn(64 * 40 + 5)
    layer = NativeLinear(dense, bias) if kind == "fp32" else NativeQuantLinear(q, bias)
    inputs = [torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)) for rows in (1, 2, 6, 8, 24)]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [layer(x) for x in inputs]
        for n in (2, 3, 4):
            torch.set_num_threads(n)
            for _ in range(20):
                assert all(torch.equal(layer(x), y) for x, y in zip(inputs, alone)), n
        torch.set_num_threads(2)
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda i: layer(inputs[i % len(inputs)]), range(400)))
        assert all(torch.equal(r, alone[i % len(inputs)]) for i, r in enumerate(results))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_int4_and_int8_holding_q4_codes_equal_fp32_bit_for_bit(kind):
    """Weights on a Q4_1 grid, held as 4-bit codes or as the same codes in int8 (how a Q4 GGUF loads into
    either), give the fp32 kernel's own bits on the dequantized weights: the kernels add in the same order."""
    from reuse_server.model.cpu_linear import NativeLinear

    _, q = weights(130, 96, 5, "int4")
    if kind == "int8":
        q = QuantizedWeight("int8", q.codes.to(torch.int8), q.scales, q.mins, q.group)
    x = torch.randn(17, 96, generator=torch.Generator().manual_seed(6))
    for rows in (x[:1], x[:6], x):
        assert torch.equal(NativeQuantLinear(q)(rows), NativeLinear(q.dequantize())(rows))


@pytest.mark.parametrize("kind", KINDS)
def test_stacked_layers_give_each_output_side_by_side(kind):
    parts = [weights(n, 64, 10 + n, kind)[1] for n in (48, 16, 16)]
    biases = [torch.randn(48), None, torch.randn(16)]
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(7))
    out = NativeQuantLinear.stacked(parts, biases)(x)
    ref = torch.cat([F.linear(x.double(), p.dequantize().double(), None if b is None else b.double())
                     for p, b in zip(parts, biases)], -1)
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_embedding_rows_read_from_the_packed_head_are_the_dequantized_rows(kind):
    """A tied model keeps its table once, in the head's panels; lookups must return the exact rows."""
    _, q = weights(200, 70, 8, kind)
    head = NativeQuantLinear(q)
    embedding = QuantizedEmbedding(q)
    ids = torch.tensor([[0, 31, 32, 63], [64, 100, 199, 5]])
    expected = q.dequantize()[ids]
    assert torch.equal(embedding(ids), expected)
    embedding.read_from(head)
    assert torch.equal(embedding(ids), expected)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("in_features", [64, 33])
def test_the_stored_layout_reads_back_unchanged(kind, in_features):
    _, q = weights(10, in_features, 9, kind)
    tensors, layout = to_tensors("w", q)
    back = from_tensors("w", layout, tensors)
    assert torch.equal(back.dequantize(), q.dequantize()) and back.codes.dtype == q.codes.dtype


def test_stacking_promotes_scales_that_fp16_cannot_hold():
    _, a = weights(8, 32, 1, "int4")
    b = QuantizedWeight("int4", a.codes, a.scales.float() * (1 + 2.0**-20), a.mins, a.group)
    merged = stack([a, b])
    assert merged.scales.dtype == torch.float32
    assert torch.equal(merged.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))


def test_native_quant_linear_refuses_what_it_cannot_compute():
    layer = NativeQuantLinear(weights(8, 32, 0, "int4")[1])
    with pytest.raises(ValueError, match="fp32 CPU input"):
        layer(torch.randn(3, 31))
    with pytest.raises(ValueError, match="fp32 CPU input"):
        layer(torch.randn(3, 32, dtype=torch.float64))


def test_reference_layer_is_the_dequantized_product():
    _, q = weights(20, 64, 2, "int8")
    x = torch.randn(3, 64)
    assert torch.allclose(QuantizedLinear(q)(x), F.linear(x, q.dequantize()), rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"), reason="no torch int4 CPU kernel")
def test_torch_int4_kernel_computes_the_same_product():
    """torch's own int4 kernel (the start-up candidate) on our layout: the zero m + 8 s is rounded once."""
    dense, q = weights(64, 128, 11, "int4")
    assert TorchInt4Linear.takes(q)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(12))
    out = TorchInt4Linear(q, torch.ones(64))(x)
    assert torch.allclose(out.double(), F.linear(x.double(), q.dequantize().double()) + 1, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("activations", ["fp32", "int8"])
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_rows_with_fp32_scales_round_the_product_then_the_sum(kind, activations):
    """fp32 scales (a table whose scales fp16 does not hold) make code * scale inexact, so a lookup that fused
    it with the minimum into one FMA would differ from dequantize_rows in the last bit."""
    gen = torch.Generator().manual_seed(11)
    n, k, group = 130, 96, 32
    codes = (torch.randint(-128, 128, (n, k), generator=gen).to(torch.int8) if kind == "int8"
             else torch.randint(0, 16, (n, k), generator=gen).to(torch.uint8))
    scales = torch.rand(n, k // group, generator=gen) * 0.01 + 1e-3
    mins = -torch.rand(n, k // group, generator=gen) * 0.1
    q = QuantizedWeight(kind, codes, scales, mins, group)
    ids = torch.tensor([0, 63, 64, 129, 7, 7])
    assert torch.equal(NativeQuantLinear(q, None, activations).rows(ids), q.dequantize()[ids])
    with pytest.raises(IndexError):
        NativeQuantLinear(q, None, activations).rows(torch.tensor([n]))
