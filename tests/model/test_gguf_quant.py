"""GGUF tensors load into the int4/int8 layout with exactly the values gguf's own dequantization gives
(model/gguf_quant.py): small GGUF files written and quantized with gguf's writer and quantizers, read back with
its reader."""

import numpy as np
import pytest
import torch

import gguf
from gguf import GGMLQuantizationType as T

from reuse_server.model.gguf_quant import exact_kind, load_tensor
from reuse_server.model.quant_linear import NativeQuantLinear

SHAPE = (48, 96)  # [out, in]: three blocks of 32 per row; the K-quants use 256-wide rows below


def write_gguf(path, tensors: dict[str, tuple[np.ndarray, T | None]]):
    writer = gguf.GGUFWriter(str(path), arch="llama")
    for name, (data, qtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {t.name: t for t in gguf.GGUFReader(str(path)).tensors}


def torch_shape(tensor) -> tuple[int, int]:
    return int(tensor.shape[1]), int(tensor.shape[0])  # GGUF lists the innermost dimension first


def random_k_blocks(qtype: T, rows: int, seed: int) -> np.ndarray:
    """K-quant blocks of random codes and scales (gguf-py has no K-quant quantizer), their fp16 super-block
    scales set to ordinary values."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, type_size), dtype=np.uint8)
    d = rng.uniform(1e-3, 2e-2, size=(rows, 2)).astype(np.float16).view(np.uint8)
    if qtype == T.Q6_K:  # ql, qh, scales, then d
        blocks[:, -2:] = d[:, :2]
    else:  # d, dmin first
        blocks[:, 0:4] = d
    return blocks


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0])
@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_q4_q5_q8_tensors_load_to_ggufs_own_values(tmp_path, qtype, kind):
    seed = int(qtype) * 10 + len(kind)
    print("seed", seed)
    dense = np.random.default_rng(seed).standard_normal(SHAPE).astype(np.float32) * 0.05
    tensor = write_gguf(tmp_path / "m.gguf", {"w": (gguf.quants.quantize(dense, qtype), qtype)})["w"]
    expected = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(SHAPE))
    q = load_tensor(tensor.data, tensor.tensor_type, torch_shape(tensor), kind)
    assert q.kind == kind and q.shape == SHAPE
    if qtype in (T.Q5_0, T.Q5_1, T.Q8_0) and kind == "int4":
        # 5- and 8-bit codes do not fit 4 bits: dequantized, then quantized again (Q4_1 steps of its groups)
        step = q.scales.float().repeat_interleave(32, dim=1)
        assert ((q.dequantize() - expected).abs() <= step).all()
    else:  # read as they are: the codes and the block scales, bit for bit
        assert torch.equal(q.dequantize(), expected)
        assert q.group == 32 and q.scales.dtype == torch.float16
    # and the kernel serves those values
    x = torch.randn(3, SHAPE[1], generator=torch.Generator().manual_seed(seed))
    assert torch.allclose(NativeQuantLinear(q)(x).double(), x.double() @ q.dequantize().double().T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qtype,kind,group", [(T.Q4_K, "int4", 32), (T.Q4_K, "int8", 32), (T.Q5_K, "int8", 32),
                                              (T.Q6_K, "int8", 16)])
def test_k_quant_tensors_load_to_ggufs_own_values(tmp_path, qtype, kind, group):
    seed = int(qtype)
    print("seed", seed)
    rows = 8
    blocks = random_k_blocks(qtype, rows, seed)  # one 256-wide super-block per row
    tensor = write_gguf(tmp_path / "k.gguf", {"w": (blocks, qtype)})["w"]
    assert torch_shape(tensor) == (rows, 256)
    expected = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(rows, 256))
    q = load_tensor(tensor.data, tensor.tensor_type, (rows, 256), kind)
    assert q.group == group and torch.equal(q.dequantize(), expected)


def test_a_k_quant_with_more_bits_than_int4_is_quantized_again(tmp_path):
    tensor = write_gguf(tmp_path / "k.gguf", {"w": (random_k_blocks(T.Q6_K, 4, 1), T.Q6_K)})["w"]
    expected = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(4, 256))
    q = load_tensor(tensor.data, tensor.tensor_type, (4, 256), "int4")
    assert q.kind == "int4" and q.group == 32
    assert ((q.dequantize() - expected).abs() <= q.scales.float().repeat_interleave(32, dim=1)).all()


def test_float_tensors_are_quantized_at_load(tmp_path):
    dense = np.random.default_rng(3).standard_normal(SHAPE).astype(np.float32)
    tensor = write_gguf(tmp_path / "f.gguf", {"w": (dense.astype(np.float16), None)})["w"]
    assert tensor.tensor_type == T.F16
    q = load_tensor(tensor.data, tensor.tensor_type, SHAPE, "int8")
    step = q.scales.float().repeat_interleave(32, dim=1)
    assert ((q.dequantize() - torch.from_numpy(dense.astype(np.float16).astype(np.float32))).abs() <= step).all()
    bf16 = load_tensor(tensor.data, tensor.tensor_type, SHAPE, "bf16")
    assert torch.equal(bf16.dequantize(), torch.from_numpy(dense.astype(np.float16).astype(np.float32)).bfloat16().float())


def test_exact_kinds():
    types = (T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_0, T.Q5_1, T.Q5_K, T.Q6_K, T.Q8_0, T.BF16, T.F32, T.F16, T.Q3_K)
    assert [exact_kind(t) for t in types] == \
        ["int4", "int4", "int4", "int8", "int8", "int8", "int8", "int8", "bf16", "fp32", None, None]
