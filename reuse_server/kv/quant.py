"""The KV pool's storage formats as arithmetic: which torch dtype holds each KV dtype, how the 8-bit formats
choose their fp32 scales, and quantize/dequantize. No state: the pool (kv_pool.py) decides where values and
scales live, this module only converts.

- fp32, fp16, bf16: plain casts (round to nearest even).
- fp8_e4m3 (float8_e4m3fn, largest finite 448): one scale per block and KV head, over the block's tokens
  and the head's dimensions. The scale is a power of two, the smallest with amax <= 448 * scale. A power of
  two because a block's scale changes as decode appends tokens to it (kv_pool rewrites the block at the new
  scale): re-expressing an e4m3 value at a scale 2^k larger only shifts its exponent, which is exact unless
  the value falls below the format's normal range, so the tokens already in a block lose nothing when a
  later, larger token raises the block's scale; and rounding the scale up costs e4m3, a floating-point
  format, only the bottom of its range, not its relative precision.
- int8: one scale per token and KV head, symmetric: scale = amax / 127, stored = round(x / scale)."""
from __future__ import annotations

import torch

from reuse_server.kv import layout as kv_layout

FP8_MAX = 448.0
INT8_MAX = 127.0
FP8 = torch.float8_e4m3fn


def storage_dtype(kv_dtype: "torch.dtype | str") -> torch.dtype:
    """The torch dtype a KV dtype is stored in: a torch dtype as given, or a name of kv_layout.KV_DTYPES
    ('fp8_e4m3', 'int8', 'bf16', ...; 'auto' is fp32 here, the builder resolves it against the weights)."""
    if isinstance(kv_dtype, torch.dtype):
        spec(kv_dtype)  # one of the supported ones
        return kv_dtype
    return getattr(torch, kv_layout.kv_dtype(kv_dtype).torch_name)


def pool_dtype(name: str, weights: torch.dtype) -> torch.dtype:
    """The pool's storage dtype for a --kv-dtype name; 'auto' stores K/V in the weights' dtype."""
    return weights if name == "auto" else storage_dtype(name)


def spec(dtype: torch.dtype) -> kv_layout.KVDType:
    """kv_layout's description of a storage dtype (element bytes, what a scale covers)."""
    return kv_layout.kv_dtype(str(dtype).removeprefix("torch."))


def scale_per(dtype: torch.dtype) -> str | None:
    """None (plain), 'block' (fp8) or 'token' (int8)."""
    return spec(dtype).scale_per


def _safe(scale: torch.Tensor) -> torch.Tensor:
    """Divisor for quantizing: an all-zero group has scale 0 and quantizes to zeros."""
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def fp8_scale(amax: torch.Tensor) -> torch.Tensor:
    """The smallest power of two s with amax <= 448 * s (0 where amax is 0)."""
    # on the float32 bits: adding all-ones to the mantissa carries into the exponent unless the mantissa is
    # zero (already a power of two); then clearing the mantissa leaves the power of two at or above
    bits = (amax.float() / FP8_MAX).view(torch.int32)
    return ((bits + 0x7FFFFF) & 0x7F800000).view(torch.float32)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale in float8_e4m3fn (scale broadcast against x), saturated at +-448."""
    return (x.float() / _safe(scale)).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def int8_scale(amax: torch.Tensor) -> torch.Tensor:
    return amax / INT8_MAX


def quantize_int8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.round(x.float() / _safe(scale)).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)


def fp8_to_float(stored: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn -> float32, through fp16: e4m3's bits shifted into an fp16's sign, exponent and top
    mantissa bits are the same number times 2^-8, and fp16 widens in vector instructions (torch's own fp8
    conversion is element by element, several times slower)."""
    bits = stored.view(torch.int8).to(torch.int16)  # sign-extended: bit 15 is the sign
    half = ((bits << 7) & -0x8000) | ((bits & 0x7F) << 7)
    return half.view(torch.float16).float().mul_(256.0)


# |value| of each e4m3 code without its sign bit (0..127), for a block's largest magnitude from its bytes:
# e4m3 orders like its bit patterns, so the largest |value| has the largest (code & 0x7f).
_FP8_MAGNITUDES = torch.arange(128, dtype=torch.uint8).view(FP8).float().nan_to_num_(nan=FP8_MAX)


def fp8_magnitude(codes: torch.Tensor) -> torch.Tensor:
    """The |value| (before the scale) of e4m3 codes with their sign bit cleared, as float32."""
    return _FP8_MAGNITUDES.to(codes.device)[codes.long()]


def dequantize(stored: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """stored * scale (scale already broadcastable against stored; None for the plain formats) in `dtype`."""
    if scale is None:
        return stored.to(dtype)
    wide = fp8_to_float(stored) if stored.dtype == FP8 else stored.float()
    return wide.mul_(scale).to(dtype)


def quantize_tokens(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token formats (plain, int8) of x [..., heads, dim]: (stored, scales [..., heads] or None)."""
    if dtype == torch.int8:
        scale = int8_scale(x.float().abs().amax(-1))
        return quantize_int8(x, scale[..., None]), scale
    if scale_per(dtype) is not None:
        raise ValueError(f"{dtype} is not a per-token format")
    return x.to(dtype), None


def quantize_blocks(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Whole blocks x [..., block_size, heads, dim] in any format: (stored, scales) with scales [..., heads]
    for fp8, [..., block_size, heads] for int8, None for the plain formats."""
    if dtype == FP8:
        scale = fp8_scale(x.float().abs().amax(dim=(-3, -1)))
        return quantize_fp8(x, scale[..., None, :, None]), scale
    return quantize_tokens(x, dtype)


def dequantize_blocks(stored: torch.Tensor, scale: torch.Tensor | None,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The inverse of quantize_blocks: stored [..., block_size, heads, dim] with its scales."""
    if scale is None:
        return stored.to(dtype)
    if stored.dtype == FP8:
        return dequantize(stored, scale[..., None, :, None], dtype)
    return dequantize(stored, scale[..., None], dtype)
