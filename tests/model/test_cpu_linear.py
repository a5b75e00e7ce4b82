"""Linear layers on packed weights (what the engine serves on the CPU: the native kernel, oneDNN) compute what
F.linear does."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from reuse_server.model import load_model
from reuse_server.model.cpu_linear import NativeLinear, PackedLinear, onednn_linear_available

pytestmark = [pytest.mark.skipif(not onednn_linear_available(), reason="this torch build has no oneDNN"),
              pytest.mark.usefixtures("kernels_built")]


@pytest.mark.parametrize("cls", [NativeLinear, PackedLinear])
@pytest.mark.parametrize("rows", [0, 1, 5, 6, 8, 17, 300])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("out_features", [96, 64, 7, 130])
def test_packed_linear_equals_f_linear(cls, rows, bias, out_features):
    """Row counts around the native kernel's 6-row tiles, output widths around its 64-column panels."""
    gen = torch.Generator().manual_seed(rows * 2 + bias)
    weight = torch.randn(out_features, 40, generator=gen)
    b = torch.randn(out_features, generator=gen) if bias else None
    x = torch.randn(rows, 64, generator=gen)[:, 5:45]  # a non-contiguous view, as a sliced activation is
    out = cls(weight, b)(x)
    ref = F.linear(x.double(), weight.double(), None if b is None else b.double())
    assert out.shape == (rows, out_features) and out.dtype == torch.float32
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-4)


def test_native_linear_refuses_what_it_cannot_compute():
    layer = NativeLinear(torch.randn(8, 4))
    with pytest.raises(ValueError, match="fp32 CPU input"):
        layer(torch.randn(3, 5))
    with pytest.raises(ValueError, match="fp32 CPU input"):
        layer(torch.randn(3, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="fp32 CPU weights"):
        NativeLinear(torch.randn(8, 4).bfloat16())


@pytest.mark.parametrize("cls", [NativeLinear, PackedLinear])
@pytest.mark.parametrize("biases", [(False, False, False), (True, True, True), (True, False, True)])
def test_stacked_linears_give_each_output_side_by_side(cls, biases):
    """q/k/v packed as one product (Qwen2's carry biases): the output is the three F.linear outputs concatenated."""
    gen = torch.Generator().manual_seed(sum(biases))
    linears = [torch.nn.Linear(40, out, bias=b) for out, b in zip((48, 16, 16), biases)]
    for lin in linears:
        torch.nn.init.normal_(lin.weight, generator=gen)
        if lin.bias is not None:
            torch.nn.init.normal_(lin.bias, generator=gen)
    x = torch.randn(17, 40, generator=gen)
    out = cls.stacked(linears)(x)
    ref = torch.cat([F.linear(x.double(), lin.weight.double(), None if lin.bias is None else lin.bias.double())
                     for lin in linears], -1)
    assert out.shape == (17, 80)
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="no oneDNN bf16 on this CPU")
def test_packed_linear_bf16():
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(64, 32, generator=gen).bfloat16()
    x = torch.randn(5, 32, generator=gen).bfloat16()
    out = PackedLinear(weight)(x)
    assert out.dtype == torch.bfloat16
    assert torch.allclose(out.float(), F.linear(x.float(), weight.float()), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("kind,cls", [("native", NativeLinear), ("onednn", PackedLinear)])
def test_pack_for_cpu_replaces_every_linear_once(tiny_llama_path, kind, cls):
    model, config = load_model(tiny_llama_path)
    dense = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert dense == 7 * config.num_layers + (0 if config.tie_word_embeddings else 1)
    assert model.pack_for_cpu(kind) == 7 * config.num_layers + 1  # + the output head
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    packed = [m for m in model.modules() if isinstance(m, (NativeLinear, PackedLinear))]
    assert packed and all(isinstance(m, cls) for m in packed)
    assert model.pack_for_cpu(kind) == 0  # idempotent


def test_native_packing_leaves_bf16_to_onednn(tiny_llama_path):
    model, _ = load_model(tiny_llama_path, dtype=torch.bfloat16)
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert model.pack_for_cpu("native") == 0
        return
    assert model.pack_for_cpu("native") > 0
    assert not any(isinstance(m, NativeLinear) for m in model.modules())


def test_pack_for_cpu_skips_fp16(tiny_llama_path):
    model, _ = load_model(tiny_llama_path, dtype=torch.float16)
    assert model.pack_for_cpu() == 0
    assert any(isinstance(m, torch.nn.Linear) for m in model.modules())


def test_engine_cpu_matmul_setting_chooses_the_path_and_both_agree(tiny_llama_path):
    from reuse_server.engine.config import EngineConfig
    from reuse_server.engine.builder import build_engine
    from reuse_server.engine.sampling_params import SamplingParams

    outputs = {}
    expected = {"native": NativeLinear, "onednn": PackedLinear, "torch": torch.nn.Linear}
    for setting, cls in expected.items():
        engine = build_engine(EngineConfig(model=str(tiny_llama_path), num_gpu_blocks=64, cpu_matmul=setting))
        linears = [m for m in engine.model.modules() if isinstance(m, tuple(expected.values()))]
        assert linears and all(isinstance(m, cls) for m in linears)
        engine.add_request("r", list(range(3, 40)), SamplingParams(max_tokens=8, temperature=0.0, logprobs=1))
        tokens, logprobs = [], []
        while engine.has_work():
            for out in engine.step():
                tokens += out.new_token_ids
                logprobs += [lp.logprob for lp in out.logprobs or []]
        outputs[setting] = tokens, logprobs
    for setting in ("native", "onednn"):
        assert outputs[setting][0] == outputs["torch"][0]
        assert outputs[setting][1] == pytest.approx(outputs["torch"][1], abs=1e-4)


@pytest.mark.parametrize("rows", [1, 17, 300])
def test_native_norm_and_gating_equal_torch(rows):
    """RMSNorm and SiLU(gate) * up through the native ops (what a native-packed model runs) against torch."""
    from reuse_server.model import cpu_ops

    ops = cpu_ops.load()
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 200, generator=gen)[:, 3:197]  # a strided view; 194 columns: a partial vector at the end
    weight = torch.randn(194, generator=gen)
    ref = F.rms_norm(x.double(), (194,), weight.double(), 1e-5)
    assert torch.allclose(ops.rms_norm(x, weight, 1e-5).double(), ref, rtol=1e-5, atol=1e-5)
    gate_up = torch.randn(rows, 2 * 130, generator=gen) * 6
    gate, up = gate_up.double().chunk(2, -1)
    assert torch.allclose(ops.silu_mul(gate_up).double(), F.silu(gate) * up, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 17, 300])
def test_native_gelu_gating_equals_torch(rows):
    """GELU(gate) * up with the tanh approximation (Gemma's GeGLU) through the native op against torch's, in fp64:
    random values, a partial vector at the end, and the ends where tanh saturates or the cube overflows."""
    from reuse_server.model import cpu_ops

    ops = cpu_ops.load()
    gen = torch.Generator().manual_seed(rows)
    gate_up = torch.randn(rows, 2 * 130, generator=gen) * 4
    gate_up[0, :8] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 30.0, -30.0, 1e13, -1e13])
    gate, up = gate_up.double().chunk(2, -1)
    ref = F.gelu(gate, approximate="tanh") * up
    assert torch.allclose(ops.gelu_mul(gate_up).double(), ref, rtol=1e-5, atol=1e-5)
    special = torch.tensor([[float("inf"), float("-inf"), float("nan"), 1.0, 1.0, 1.0]])  # gates, then ups
    assert torch.equal(ops.gelu_mul(special).isnan(), torch.tensor([[False, True, True]]))  # as torch: -inf * 0
    assert ops.gelu_mul(special)[0, 0] == F.gelu(special[0, :1], approximate="tanh")[0] == float("inf")


@pytest.mark.parametrize("tokens", [1, 9, 130])
def test_native_rope_is_torch_bit_for_bit(tokens):
    """RoPE through the native op (what the forward runs on the CPU) gives apply_rotary's values exactly, on the
    strided q/k view a packed q/k/v product leaves, so greedy decoding and prefix reuse are unchanged."""
    from reuse_server.model import cpu_ops
    from reuse_server.model.rope import apply_rotary

    ops = cpu_ops.load()
    gen = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, 15 * 64, generator=gen) * 4
    qk = qkv[:, :12 * 64].view(tokens, 12, 64)  # token stride 960: the q/k part of a packed product
    cos, sin = torch.randn(tokens, 64, generator=gen), torch.randn(tokens, 64, generator=gen)
    out = ops.rope(qk, cos, sin)
    if out is None and "avx512f" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("the native RoPE needs AVX-512 (torch's ops run instead)")
    assert torch.equal(out.view(torch.int32), apply_rotary(qk, cos, sin).contiguous().view(torch.int32))


@pytest.mark.parametrize("cols", [1, 16, 49152, 49157])
def test_native_argmax_picks_what_torch_picks(cols):
    """Greedy sampling's argmax through the native op: torch's index on ties (the first), on NaN (the first
    NaN), on -inf everywhere, on a strided view, with the largest value in the vector part and in the tail."""
    from reuse_server.model import cpu_ops

    ops = cpu_ops.load()
    gen = torch.Generator().manual_seed(cols)
    x = torch.randn(9, cols + 3, generator=gen)[:, 1:cols + 1]
    x[1] = float("-inf")
    x[2, cols // 2:] = 5.0  # ties: the first wins
    x[3, cols - 1] = 1e9  # in the tail of a row that is not a whole number of vectors
    x[4, cols // 3] = float("nan")
    x[4, cols - 1] = float("nan")
    x[5] = 0.0
    x[5, cols // 2] = -0.0  # equal to +0: the first zero wins
    x[6, 0] = float("inf")
    assert ops.argmax(x) == x.argmax(-1).tolist()
