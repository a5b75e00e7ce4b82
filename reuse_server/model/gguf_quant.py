"""GGUF tensors into the int4/int8 layout of quant_weights, without a detour through fp32.

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the K-quants Q4_K, Q5_K, Q6_K are a code per weight and an affine map per
block (or sub-block) of inputs: their codes and scales are read out of the blocks as they are, and s * q + m
gives back exactly what `gguf.quants.dequantize` gives. A source with more bits than the target (Q5_*, Q8_0,
Q5_K, Q6_K into int4) and every other type (F32, F16, BF16, Q2_K, Q3_K, the IQ types) is dequantized by gguf
and quantized to the target with gguf's quantizers (`quantize`, which also quantizes a dense checkpoint's
weights at load)."""

from __future__ import annotations

import numpy as np
import torch

from .quant_weights import QUANT_GROUP, QuantizedWeight, narrowest_scales

# Code width of each type read as it is, and the narrowest of our kinds that holds its codes.
_SOURCE_BITS = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q4_K": 4, "Q5_K": 5, "Q6_K": 6, "Q8_0": 8}


def source_bits(qtype) -> int | None:
    """Bits per code of a GGUF type that loads as it is, or None (F32, F16, other quantizations)."""
    return _SOURCE_BITS.get(qtype.name)


def exact_kind(qtype) -> str | None:
    """The narrowest kind that holds this GGUF type's weights exactly, where one does."""
    bits = source_bits(qtype)
    if bits is not None:
        return "int4" if bits <= 4 else "int8"
    return {"BF16": "bf16", "F32": "fp32"}.get(qtype.name)


def load_tensor(data: np.ndarray, qtype, shape: tuple[int, int], kind: str) -> QuantizedWeight:
    """A GGUF tensor's raw data (as GGUFReader gives it) with torch shape [N, K], in `kind`."""
    import gguf

    bits = source_bits(qtype)
    if kind != "bf16" and bits is not None and bits <= {"int4": 4, "int8": 8}[kind]:
        return from_gguf_blocks(np.asarray(data), qtype, shape, kind)
    dense = gguf.quants.dequantize(data, qtype).reshape(shape)
    return quantize(torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32)), kind)


def quantize(weight: torch.Tensor, kind: str, group: int = QUANT_GROUP) -> QuantizedWeight:
    """A dense [N, K] weight in the given kind, with gguf's quantizers: int4 as Q4_1 (scale and minimum per
    group), int8 as Q8_0 (scale per group); K is zero-padded to whole groups for the quantizer."""
    if kind == "bf16":
        return QuantizedWeight("bf16", weight.detach().to(torch.bfloat16).contiguous(), None, None, weight.shape[1])
    import gguf

    if group != QUANT_GROUP:
        raise ValueError(f"quantizing at load uses gguf's blocks of {QUANT_GROUP} inputs")
    qtype = {"int4": gguf.GGMLQuantizationType.Q4_1, "int8": gguf.GGMLQuantizationType.Q8_0}[kind]
    n, k = weight.shape
    dense = weight.detach().float().cpu().numpy()
    pad = -k % group
    if pad:
        dense = np.pad(dense, ((0, 0), (0, pad)))
    blocks = gguf.quants.quantize(np.ascontiguousarray(dense), qtype)
    q = from_gguf_blocks(blocks, qtype, (n, k + pad), kind)
    if pad:  # drop the padding's codes; its groups keep their scales
        q = QuantizedWeight(q.kind, q.codes[:, :k].contiguous(), q.scales, q.mins, q.group)
    return q


def from_gguf_blocks(data: np.ndarray, qtype, shape: tuple[int, int], kind: str) -> QuantizedWeight:
    """Codes and scales read out of the blocks of a tensor [N, K] of one of the types in _SOURCE_BITS."""
    import gguf

    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = np.ascontiguousarray(data).view(np.uint8).reshape(-1, type_size)
    codes, scales, mins, group = _READERS[qtype.name](blocks, block_size)
    n, k = shape
    codes = torch.from_numpy(np.ascontiguousarray(codes.reshape(n, k)))
    codes = codes.to(torch.uint8) if kind == "int4" else codes.to(torch.int8)
    as_scales = lambda a: narrowest_scales(torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32).reshape(n, -1)))  # noqa: E731
    return QuantizedWeight(kind, codes, as_scales(scales), None if mins is None else as_scales(mins), group)


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[blocks, 16] bytes -> [blocks, 32] codes: the low nibbles are elements 0..15, the high ones 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int16)


def _q4_0(blocks, _):
    d = _f16(blocks[:, :2])
    return _nibbles(blocks[:, 2:]), d, -8 * d, 32  # d * (q - 8) == d * q + (-8 d), both exact


def _q4_1(blocks, _):
    return _nibbles(blocks[:, 4:]), _f16(blocks[:, :2]), _f16(blocks[:, 2:4]), 32


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """[blocks, 4] bytes, little-endian bit i the fifth bit of element i -> [blocks, 32] of 0 or 16."""
    return (np.unpackbits(qh, axis=-1, bitorder="little").astype(np.int16) << 4)


def _q5_0(blocks, _):
    d = _f16(blocks[:, :2])
    return (_nibbles(blocks[:, 6:]) | _high_bits(blocks[:, 2:6])) - 16, d, None, 32  # d * (q - 16)


def _q5_1(blocks, _):
    return _nibbles(blocks[:, 8:]) | _high_bits(blocks[:, 4:8]), _f16(blocks[:, :2]), _f16(blocks[:, 2:4]), 32


def _q8_0(blocks, _):
    return blocks[:, 2:].view(np.int8).astype(np.int16), _f16(blocks[:, :2]), None, 32


def _k_scales(blocks):
    """Q4_K/Q5_K: per super-block of 256, eight sub-blocks of 32 with scale d * sc and minimum -dmin * m."""
    import gguf

    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    sc, m = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16])
    return d * sc.astype(np.float32), -(dmin * m.astype(np.float32))


def _q4_k(blocks, _):
    scales, mins = _k_scales(blocks)
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (qs & 0x0F).reshape(-1, 256).astype(np.int16), scales, mins, 32


def _q5_k(blocks, _):
    scales, mins = _k_scales(blocks)
    qh = blocks[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    ql = blocks[:, 48:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (ql & 0x0F).reshape(-1, 8, 32) | ((qh & 1) << 4).reshape(-1, 8, 32)
    return q.reshape(-1, 256).astype(np.int16), scales, mins, 32


def _q6_k(blocks, _):
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    sc, d = blocks[:, 192:208].view(np.int8).astype(np.float32), _f16(blocks[:, 208:210])
    low = (ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    high = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 0x03
    q = low.reshape(-1, 8, 32) | (high.reshape(-1, 8, 32) << 4)
    return q.reshape(-1, 256).astype(np.int16) - 32, d * sc, None, 16


_READERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}
